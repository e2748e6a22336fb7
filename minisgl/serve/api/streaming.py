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
        # A client that leaves cancels this task wherever it waits. A watcher, not a wait on
        # both per event: that made a task and a wait set for every token sent.
        task, left = asyncio.current_task(), False

        def leave(watcher: asyncio.Future) -> None:
            nonlocal left
            if not watcher.cancelled() and task is not None:
                left = True
                task.cancel()

        gone = asyncio.ensure_future(_wait_disconnect(receive))
        gone.add_done_callback(leave)
        try:
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as e:  # the engine failed mid-stream: say so, then end (a cancel passes by)
                error = {"error": {"message": str(e), "type": "server_error", "code": getattr(e, "status", 500)}}
                await send({"type": "http.response.body", "body": sse(error) + SSE_DONE, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()  # ours: the client left, which ends the response, not the server
        finally:
            gone.remove_done_callback(leave)
            gone.cancel()
            self.on_close()
            with contextlib.suppress(Exception):
                await self.events.aclose()
