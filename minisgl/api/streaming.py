"""EventStream: a server-sent-events response that notices a client leaving.

uvicorn drops writes to a closed connection silently, so a stream that only writes would keep a
gone client's request running until it finished. This response also listens for the ASGI
``http.disconnect`` message and, either way the stream ends, runs ``on_close`` (which aborts
whatever is still running).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


def sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def _wait_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            while True:
                nxt = asyncio.ensure_future(anext(self.events))
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the client left while we waited for the next event
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await nxt
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                except Exception as e:  # the engine failed the request mid-stream: say so, then end
                    chunk = (
                        sse({"error": {"message": str(e), "type": "server_error", "code": getattr(e, "status", 500)}})
                        + SSE_DONE
                    )
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if gone.done():
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            self.on_close()
            with contextlib.suppress(Exception):
                await self.events.aclose()
