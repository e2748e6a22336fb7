"""EngineClient: the API process's side of the pipeline (asyncio).

It sends requests to the tokenizer process and routes the updates coming back to one queue per
request. ``open`` waits for the first update, so a request the engine refuses becomes an
exception (and a 4xx) before any response bytes are sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from minisgl.ipc import Addresses, AsyncReceiver, Sender
from minisgl.messages import AbortReq, ControlReply, ControlReq, GenerateReq, ReqUpdate, ToApi, UpdateBatch

logger = logging.getLogger(__name__)


class EngineError(ValueError):
    """The engine refused a request; the message names the problem."""


class RequestStream:
    """Updates of one accepted request, ending with the one that has a finish_reason."""

    def __init__(self, client: EngineClient, rid: str, queue: asyncio.Queue[ReqUpdate]):
        self.client, self.rid, self._queue = client, rid, queue
        self.finished = False

    def __aiter__(self) -> AsyncIterator[ReqUpdate]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[ReqUpdate]:
        while not self.finished:
            upd = await self._queue.get()
            if upd.error is not None:
                self.finished = True
                raise EngineError(upd.error)
            self.finished = upd.finish_reason is not None
            yield upd

    def abort(self) -> None:
        """Stop the request if it is still running (client gone, or asked to)."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.rid)


class EngineClient:
    def __init__(self, addrs: Addresses):
        self.addrs = addrs
        self._sender = Sender(zmq.Context.instance(), addrs.tokenizer)
        self._queues: dict[str, asyncio.Queue[ReqUpdate]] = {}
        self._replies: dict[int, asyncio.Future[ControlReply]] = {}
        self._cids = itertools.count()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        receiver: AsyncReceiver[ToApi] = AsyncReceiver(zmq.asyncio.Context.instance(), self.addrs.api, ToApi)
        self._task = asyncio.create_task(self._route(receiver))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _route(self, receiver: AsyncReceiver[ToApi]) -> None:
        while True:
            msg = await receiver.recv()
            if isinstance(msg, UpdateBatch):
                for upd in msg.items:
                    queue = self._queues.get(upd.rid)
                    if queue is None:
                        continue
                    if upd.error is not None or upd.finish_reason is not None:
                        del self._queues[upd.rid]
                    queue.put_nowait(upd)
            else:
                fut = self._replies.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    @property
    def active_rids(self) -> list[str]:
        return list(self._queues)

    async def open(self, req: GenerateReq) -> tuple[RequestStream, ReqUpdate]:
        """Submit a request and wait until the engine accepts it; returns the stream and the
        acceptance update. Raises EngineError with the engine's reason if it is refused."""
        if req.rid in self._queues:
            raise EngineError(f"request id {req.rid!r} is already in use")
        queue: asyncio.Queue[ReqUpdate] = asyncio.Queue()
        self._queues[req.rid] = queue
        self._sender.send(req)
        stream = RequestStream(self, req.rid, queue)
        try:
            first = await anext(aiter(stream))
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream, first

    def abort(self, rid: str) -> None:
        self._sender.send(AbortReq(rid))

    async def control(self, op: str, timeout: float = 30.0) -> ControlReply:
        cid = next(self._cids)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        self._sender.send(ControlReq(cid, op))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(cid, None)
