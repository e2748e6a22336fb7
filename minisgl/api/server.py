"""The HTTP API (Starlette, served by uvicorn in the launcher process).

SGLang's native ``/generate`` and the OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions``, plus health, info, metrics and cache control. Each route decodes its
body (4xx naming the bad field), turns it into GenerateReq messages, and either streams updates
as server-sent events or collects them into one JSON response. A client that goes away aborts
its requests, so their KV pages go back to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from minisgl.api.client import EngineClient, EngineError, RequestStream
from minisgl.api.metrics import Metrics, RequestTimer
from minisgl.api.protocol import (
    MAX_SEQUENCES, AbortRequest, BadRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest, decode,
)
from minisgl.api.streaming import SSE_DONE, EventStream, sse
from minisgl.args import ServerArgs
from minisgl.messages import EngineInfo, GenerateReq, ReqUpdate, TokenLogprob
from minisgl.sampling import SamplingParams

OPEN_PATHS = {"/health"}  # reachable without the API key (liveness probes)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_busy_error"}.get(
        status, "invalid_request_error")
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


class Run:
    """One request in flight: what it produced so far, and its latency bookkeeping."""

    def __init__(self, stream: RequestStream, first: ReqUpdate, metrics: Metrics, timer: RequestTimer):
        self.stream, self.metrics, self.timer = stream, metrics, timer
        self.rid = stream.rid
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason: str | None = None
        self.prompt_tokens = self.cached_tokens = 0
        self.e2e_latency = 0.0
        self._first: ReqUpdate | None = first

    def _apply(self, upd: ReqUpdate) -> None:
        self.text += upd.text
        self.token_ids += upd.token_ids
        self.logprobs += upd.logprobs
        self.prompt_tokens, self.cached_tokens = upd.prompt_tokens or self.prompt_tokens, upd.cached_tokens
        self.timer.tokens_arrived(len(upd.token_ids))
        if upd.finish_reason is not None:
            self.finish_reason = upd.finish_reason
            self.e2e_latency = self.timer.finished(upd.finish_reason, self.prompt_tokens, self.cached_tokens)

    async def updates(self) -> AsyncIterator[ReqUpdate]:
        """Each update, applied to the totals before it is yielded (the acceptance one first)."""
        if self._first is not None:
            first, self._first = self._first, None
            self._apply(first)
            yield first
        async for upd in self.stream:
            self._apply(upd)
            yield upd

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def abort(self) -> None:
        if not self.stream.finished:
            self.stream.abort()
            self._apply(ReqUpdate(self.rid, finish_reason="abort"))


BODY_TIMEOUT_S = 30.0  # a client that sends its body slower than this holds a connection for nothing


async def _read(request: Request, kind: type) -> Any:
    """The request body decoded as ``kind``; 408 when it does not arrive in time."""
    try:
        body = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise BadRequest(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s", status=408) from None
    return decode(body, kind)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _merge(runs: list[Run]) -> AsyncIterator[tuple[int, ReqUpdate]]:
    """Updates of several runs as they arrive, tagged with the run's index; a run's failure
    is raised here."""
    queue: asyncio.Queue[tuple[int, ReqUpdate | Exception | None]] = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
        try:
            async for upd in run.updates():
                queue.put_nowait((i, upd))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, upd = await queue.get()
            if isinstance(upd, Exception):
                raise upd
            if upd is None:
                left -= 1
            else:
                yield i, upd
    finally:
        for t in tasks:
            t.cancel()


def _openai_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
        "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for _, t, p in lp.top],
    }


def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.text)
    return {
        "tokens": [lp.text for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t: p for _, t, p in lp.top} for lp in lps], "text_offset": offsets,
    }


def _usage(runs: list[Run]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in runs)
    completion = sum(len(r.token_ids) for r in runs)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in runs)},
    }


class Api:
    def __init__(self, client: EngineClient, info: EngineInfo, args: ServerArgs, pids: dict[str, int]):
        self.client, self.info, self.args, self.pids = client, info, args, pids
        self.metrics = Metrics()
        self.created = int(time.time())

    # ---- starting and finishing requests --------------------------------------------------------

    async def _start(self, reqs: list[GenerateReq]) -> list[Run]:
        """Submit all requests; if the engine refuses any, abort the rest and raise. Refused
        whole when they are more than one request may run, or the queue is full."""
        if len(reqs) > MAX_SEQUENCES:
            raise BadRequest(f"the request asks for {len(reqs)} sequences (prompts x n); at most {MAX_SEQUENCES}",
                             param="n")
        limit = self.args.max_queued_requests
        if limit is not None and len(self.client.active_rids) + len(reqs) > limit + self.info.max_running_requests:
            raise BadRequest(f"the server is at capacity ({limit} queued requests); retry later", status=503)
        pending = [asyncio.ensure_future(self.client.open(r)) for r in reqs]
        results = await asyncio.gather(*pending, return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            for res in results:
                if not isinstance(res, BaseException):
                    res[0].abort()
            raise errors[0]
        return [Run(stream, first, self.metrics, RequestTimer(self.metrics)) for stream, first in results]

    async def _collect(self, runs: list[Run], request: Request) -> bool:
        """Wait for every run to finish; False (and all aborted) if the client left first."""
        task = asyncio.ensure_future(asyncio.gather(*(r.wait() for r in runs)))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                task.cancel()
                task.add_done_callback(_retrieve)  # its outcome no longer matters; do not log it
                for r in runs:
                    r.abort()
                return False

    def _stream(self, runs: list[Run], events: AsyncIterator[bytes]) -> EventStream:
        def close() -> None:
            for r in runs:
                r.abort()

        return EventStream(events, close)

    def _check_model(self, model: str) -> None:
        if model not in (self.args.model_name, self.args.model):
            raise BadRequest(f"model {model!r} does not exist; this server serves {self.args.model_name!r}",
                             status=404, param="model")

    # ---- /generate ------------------------------------------------------------------------------

    def _generate_body(self, run: Run, top_logprobs: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": run.rid, "prompt_tokens": run.prompt_tokens, "completion_tokens": len(run.token_ids),
            "cached_tokens": run.cached_tokens,
            "finish_reason": None if run.finish_reason is None else {"type": run.finish_reason},
            "e2e_latency": run.e2e_latency,
        }
        if top_logprobs >= 0:
            meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, lp.text] for lp in run.logprobs]
        if top_logprobs > 0:
            meta["output_top_logprobs"] = [[[p, t, s] for t, s, p in lp.top] for lp in run.logprobs]
        return {"text": run.text, "output_ids": run.token_ids, "meta_info": meta}

    async def generate(self, request: Request) -> Response:
        body: GenerateRequest = await _read(request, GenerateRequest)
        body.check()
        req = GenerateReq(body.rid or uuid.uuid4().hex, body.sampling_params, text=body.text,
                          input_ids=body.input_ids, top_logprobs=body.top_logprobs)
        (run,) = await self._start([req])
        if not body.stream:
            await self._collect([run], request)
            return JSONResponse(self._generate_body(run, body.top_logprobs))

        async def events() -> AsyncIterator[bytes]:
            async for upd in run.updates():
                if upd.token_ids or upd.finish_reason is not None:
                    yield sse(self._generate_body(run, body.top_logprobs))
            yield SSE_DONE

        return self._stream([run], events())

    # ---- OpenAI ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await _read(request, CompletionRequest)
        self._check_model(body.model)
        body.check()
        cid, prompts = f"cmpl-{uuid.uuid4().hex}", body.prompts()
        reqs = [
            GenerateReq(f"{cid}-{i * body.n + j}", body.sampling(body.max_tokens, j),
                        text=p if isinstance(p, str) else None, input_ids=None if isinstance(p, str) else p,
                        top_logprobs=body.top_logprobs, fill_context=body.max_tokens is None)
            for i, p in enumerate(prompts) for j in range(body.n)
        ]
        runs = await self._start(reqs)
        head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": body.model}
        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            choices = [
                {"index": i, "text": r.text, "finish_reason": r.finish_reason,
                 "logprobs": _completion_logprobs(r.logprobs, 0) if body.logprobs is not None else None}
                for i, r in enumerate(runs)
            ]
            return JSONResponse({**head, "choices": choices, "usage": _usage(runs)})

        async def events() -> AsyncIterator[bytes]:
            offsets = [0] * len(runs)
            async for i, upd in _merge(runs):
                if not (upd.text or upd.finish_reason):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _completion_logprobs(upd.logprobs, offsets[i])
                offsets[i] += len(upd.text)
                choice = {"index": i, "text": upd.text, "logprobs": logprobs, "finish_reason": upd.finish_reason}
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(runs)})
            yield SSE_DONE

        return self._stream(runs, events())

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await _read(request, ChatCompletionRequest)
        self._check_model(body.model)
        body.check()
        messages = [m.flat() for m in body.messages]
        cid, max_new = f"chatcmpl-{uuid.uuid4().hex}", body.max_new_tokens
        reqs = [
            GenerateReq(f"{cid}-{j}", body.sampling(max_new, j), messages=messages,
                        top_logprobs=body.num_top_logprobs, fill_context=max_new is None)
            for j in range(body.n)
        ]
        runs = await self._start(reqs)
        head = {"id": cid, "created": int(time.time()), "model": body.model}
        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            choices = [
                {"index": i, "message": {"role": "assistant", "content": r.text},
                 "logprobs": {"content": [_openai_logprob(lp) for lp in r.logprobs]} if body.logprobs else None,
                 "finish_reason": r.finish_reason}
                for i, r in enumerate(runs)
            ]
            return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage(runs)})

        head["object"] = "chat.completion.chunk"

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(runs)):
                delta = {"role": "assistant", "content": ""}
                yield sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]})
            async for i, upd in _merge(runs):
                if not (upd.text or upd.finish_reason):
                    continue
                logprobs = {"content": [_openai_logprob(lp) for lp in upd.logprobs]} if body.logprobs else None
                delta = {"content": upd.text} if upd.text else {}
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": upd.finish_reason}
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(runs)})
            yield SSE_DONE

        return self._stream(runs, events())

    async def models(self, request: Request) -> Response:
        card = {"id": self.args.model_name, "object": "model", "created": self.created, "owned_by": "minisgl",
                "root": self.args.model, "max_model_len": self.info.context_len}
        return JSONResponse({"object": "list", "data": [card]})

    # ---- health, info, metrics, control ---------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        req = GenerateReq(f"health-{uuid.uuid4().hex}", SamplingParams(max_new_tokens=1, temperature=0.0),
                          input_ids=[0])
        try:
            runs = await asyncio.wait_for(self._start([req]), 20)
            await asyncio.wait_for(runs[0].wait(), 20)
        except (asyncio.TimeoutError, EngineError) as e:
            return error_response(503, f"the engine did not generate: {e or 'timed out'}")
        return JSONResponse({"status": "ok"})

    async def _stats(self) -> dict[str, Any]:
        reply = await self.client.control("stats")
        return dict(reply.data)

    async def model_info(self, request: Request) -> Response:
        return JSONResponse({
            "model_path": self.info.model_path, "tokenizer_path": self.args.tokenizer or self.info.model_path,
            "served_model_name": self.args.model_name, "is_generation": True,
            "context_length": self.info.context_len, "vocab_size": self.info.vocab_size,
        })

    async def server_info(self, request: Request) -> Response:
        server_args = {k: v for k, v in asdict(self.args).items() if k != "api_key"}
        return JSONResponse({
            "server_args": server_args, "engine": msgspec.to_builtins(self.info),
            "scheduler": await self._stats(), "active_requests": len(self.client.active_rids),
            "processes": self.pids,
        })

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(await self._stats()), media_type="text/plain; version=0.0.4")

    async def flush_cache(self, request: Request) -> Response:
        reply = await self.client.control("flush_cache")
        if not reply.ok:
            return error_response(409, str(reply.data.get("error", "flush refused")))
        return JSONResponse({"success": True})

    async def abort_request(self, request: Request) -> Response:
        body: AbortRequest = await _read(request, AbortRequest)
        active = self.client.active_rids
        if body.abort_all:
            targets = active
        elif body.rid is None:
            raise BadRequest("give rid or abort_all: true", param="rid")
        else:
            # An OpenAI request runs as "<id>-<choice>"; its id aborts its own choices (only: a
            # prefix such as "chatcmpl" names nobody).
            targets = [r for r in active if r == body.rid or _choice_of(r, body.rid)]
            if not targets:
                raise BadRequest(f"no running request has id {body.rid!r}", status=404, param="rid")
        for rid in targets:
            self.client.abort(rid)
        return JSONResponse({"aborted": targets})


def _choice_of(rid: str, request_id: str) -> bool:
    base, _, choice = rid.rpartition("-")
    return base == request_id and choice.isdigit()


def _with_errors(api: Api, handler: Callable) -> Callable:
    """Turn the client-facing exceptions into 4xx responses and count them."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except BadRequest as e:
            api.metrics.errors.labels(str(e.status)).inc()
            return error_response(e.status, str(e), e.param)
        except EngineError as e:
            api.metrics.errors.labels(str(e.status)).inc()
            return error_response(e.status, str(e))

    return endpoint


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but the liveness probe."""

    def __init__(self, app: Callable, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def create_app(client: EngineClient, info: EngineInfo, args: ServerArgs, pids: dict[str, int]) -> Callable:
    """The ASGI app; ``pids`` (process name -> pid) is reported by /get_server_info."""
    api = Api(client, info, args, pids)
    routes = [
        ("/generate", api.generate, ["POST"]),
        ("/v1/completions", api.completions, ["POST"]),
        ("/v1/chat/completions", api.chat_completions, ["POST"]),
        ("/v1/models", api.models, ["GET"]),
        ("/health", api.health, ["GET"]),
        ("/health_generate", api.health_generate, ["GET"]),
        ("/get_model_info", api.model_info, ["GET"]),
        ("/get_server_info", api.server_info, ["GET"]),
        ("/metrics", api.metrics_route, ["GET"]),
        ("/flush_cache", api.flush_cache, ["POST"]),
        ("/abort_request", api.abort_request, ["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        yield
        await client.stop()

    app = Starlette(routes=[Route(p, _with_errors(api, h), methods=m) for p, h, m in routes], lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    return ApiKeyMiddleware(app, args.api_key) if args.api_key else app
