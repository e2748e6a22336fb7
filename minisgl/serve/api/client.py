"""EngineClient: the API process's side of the pipeline (asyncio).

It sends requests to the tokenizer process and routes the updates coming back to one queue per
request. ``open`` waits for each request's first update, so a request the engine refuses becomes
an exception (and a 4xx) before any response bytes are sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from minisgl.wire.control import ControlReply, ControlReq
from minisgl.wire.ipc import Addresses, AsyncReceiver, Sender
from minisgl.wire.requests import (
    AbortReq,
    GenerateBatch,
    GenerateReq,
    ReqUpdate,
    TextReply,
    TextReq,
    ToApi,
    UpdateBatch,
)
from minisgl.wire.steps import ProfileReq

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"


class EngineError(ValueError):
    """The engine refused a request; the message names the problem. ``status`` is the HTTP
    code: 400 for a refused request, 503 when the server is going away."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class RequestStream:
    """Updates of one accepted request, ending with the one that has a finish_reason.

    ``rid`` is the client's name for it; ``uid`` the engine's id, never reused, so a name used
    again later can never receive an earlier request's tokens."""

    def __init__(self, client: EngineClient, rid: str, uid: str, queue: asyncio.Queue[ReqUpdate]):
        self.client, self.rid, self.uid, self._queue = client, rid, uid, queue
        self.finished = False
        self._held: ReqUpdate | None = None  # an error taken while joining, given out next

    def __aiter__(self) -> AsyncIterator[ReqUpdate]:
        return self._iter()

    async def _next(self) -> ReqUpdate:
        """The next update, joined with those queued behind it: when the API falls behind the
        engine, a stream sends one event for all its new tokens instead of one per step (as
        SGLang's tokenizer manager does), so the API's work per step stops growing with the
        tokens it is behind."""
        if self._held is not None:
            upd, self._held = self._held, None
            return upd
        upd = await self._queue.get()
        while upd.error is None and upd.finish_reason is None and not self._queue.empty():
            later = self._queue.get_nowait()
            if later.error is not None:  # the tokens before it go out first, as they would have
                self._held = later
                break
            upd = upd.then(later)
        return upd

    async def _iter(self) -> AsyncIterator[ReqUpdate]:
        while not self.finished:
            upd = await self._next()
            if upd.error is not None:
                self.finished = True
                raise EngineError(upd.error, 503 if upd.error == SHUTTING_DOWN else 400)
            self.finished = upd.finish_reason is not None
            yield upd

    def abort(self) -> None:
        """Stop the request if it is still running (client gone, or asked to)."""
        if not self.finished:
            self.finished = True
            self.client.abort_uid(self.uid)


class EngineClient:
    def __init__(self, addrs: Addresses):
        self.addrs = addrs
        self._sender = Sender(zmq.Context.instance(), addrs.tokenizer)
        self._queues: dict[str, asyncio.Queue[ReqUpdate]] = {}  # by uid
        self._uids: dict[str, str] = {}  # client rid -> uid, while running
        self._names: dict[str, str] = {}  # uid -> client rid
        self._next_uid = itertools.count()
        self._replies: dict[int, asyncio.Future[ControlReply | TextReply]] = {}
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
                        self._forget(upd.rid)
                    queue.put_nowait(upd)
            else:
                fut = self._replies.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _forget(self, uid: str) -> None:
        self._queues.pop(uid, None)
        name = self._names.pop(uid, None)
        if name is not None:
            self._uids.pop(name, None)

    def fail_all(self) -> None:
        """End every running request with an error (the server is shutting down), so streams
        close with an error event instead of a cut connection; a control call waiting for its
        reply (a /get_server_info in flight) answers 503 the same way, not a 500."""
        for cid, fut in list(self._replies.items()):
            if not fut.done():
                fut.set_exception(EngineError(SHUTTING_DOWN, 503))
            self._replies.pop(cid, None)
        for uid in list(self._queues):
            self._queues[uid].put_nowait(ReqUpdate(uid, error=SHUTTING_DOWN))
            self.abort_uid(uid)
            self._forget(uid)

    @property
    def active_rids(self) -> list[str]:
        return list(self._uids)

    async def open(self, reqs: list[GenerateReq]) -> list[tuple[RequestStream, ReqUpdate]]:
        """Submit the sequences of one request in one message (so they start in one step) and
        wait until the engine accepts each: per sequence, its stream and acceptance update. If
        any is refused, the others are aborted and the first refusal (an EngineError naming the
        problem) is raised."""
        names = [r.rid for r in reqs]
        taken = next((n for i, n in enumerate(names) if n in self._uids or n in names[:i]), None)
        if taken is not None:
            raise EngineError(f"request id {taken!r} is already in use")
        uids = [str(next(self._next_uid)) for _ in reqs]
        try:
            payload = self._sender.encode(
                GenerateBatch([msgspec.structs.replace(r, rid=uid) for r, uid in zip(reqs, uids)])
            )
        except (OverflowError, TypeError, ValueError) as e:  # e.g. an integer msgpack cannot carry
            raise EngineError(f"the request cannot be encoded: {e}") from None
        streams = []
        for req, uid in zip(reqs, uids):
            queue: asyncio.Queue[ReqUpdate] = asyncio.Queue()
            self._queues[uid], self._uids[req.rid], self._names[uid] = queue, uid, req.rid
            streams.append(RequestStream(self, req.rid, uid, queue))
        try:
            self._sender.send_encoded(payload)
            firsts = await asyncio.gather(*(anext(aiter(s)) for s in streams), return_exceptions=True)
        except asyncio.CancelledError:
            for stream in streams:
                stream.abort()
            raise
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            for stream, first in zip(streams, firsts):
                stream.abort()  # an accepted one stops; a refused one is already finished
                if isinstance(first, BaseException):
                    self._forget(stream.uid)
            raise failure
        return list(zip(streams, firsts))

    def abort(self, rid: str) -> None:
        """Abort the running request the client named ``rid`` (no-op if there is none)."""
        uid = self._uids.get(rid)
        if uid is not None:
            self.abort_uid(uid)

    def abort_uid(self, uid: str) -> None:
        self._sender.send(AbortReq(uid))

    async def control(
        self, op: str, timeout: float = 30.0, profile: ProfileReq | None = None, **fields: Any
    ) -> ControlReply:
        """The scheduler's reply to ``op`` (``fields``: the rest of its ControlReq); a 503 naming
        it when none comes within ``timeout`` (a scheduler stuck in a step, or a worker that
        stopped)."""
        cid = next(self._cids)
        stuck = f"the scheduler did not answer {op!r} within {timeout:g} s (it may be stuck in a model step)"
        return await self._ask(cid, ControlReq(cid, op, profile, **fields), timeout, stuck)

    async def texts(
        self, texts: list[str] | None = None, ids: list[list[int]] | None = None, special_tokens: bool = True
    ) -> TextReply:
        """The tokenizer process's token ids of ``texts`` or texts of ``ids`` (/tokenize, /detokenize)."""
        cid = next(self._cids)
        req = TextReq(cid, texts, ids, special_tokens)
        return await self._ask(cid, req, 30.0, "the tokenizer did not answer within 30 s")

    async def _ask(self, cid: int, msg: ControlReq | TextReq, timeout: float, stuck: str) -> Any:
        """Send ``msg`` and wait for the reply carrying its ``cid``; a 503 saying ``stuck`` after ``timeout``."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        self._sender.send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineError(stuck, status=503) from None
        finally:
            self._replies.pop(cid, None)
