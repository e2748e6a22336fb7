"""What every route shares: a request in flight (``Run``), reading bodies, starting runs and
collecting or streaming them, and the JSON error shape."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from minisgl.config.args import ServerArgs
from minisgl.serve.api.client import EngineClient, RequestStream
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import IGNORED, Schema
from minisgl.serve.api.metrics import Metrics, RequestTimer
from minisgl.serve.api.protocol import check_sequences, decode
from minisgl.serve.api.streaming import EventStream
from minisgl.serve.parsers.reasoning import starts_in_reasoning
from minisgl.utils import hidden_state_rows
from minisgl.wire.options import RequestOptions
from minisgl.wire.requests import EngineInfo, GenerateReq, ReqUpdate, TokenLogprob

logger = logging.getLogger("minisgl.serve.api")


def _logprob_entry(logprob: float | None, token: int, text: str, with_text: bool) -> list[Any]:
    return [logprob, token, text if with_text else None]


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_busy_error"}.get(
        status, "invalid_request_error"
    )
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status, headers=headers
    )


class Run:
    """One request in flight: what it produced so far, and its latency bookkeeping."""

    def __init__(
        self,
        stream: RequestStream,
        first: ReqUpdate,
        options: RequestOptions,
        metrics: Metrics,
        timer: RequestTimer,
        log: bool = False,
    ):
        self.stream, self.metrics, self.timer = stream, metrics, timer
        self.rid, self.options = stream.rid, options
        self.log = log and not options.no_logs  # (SGLang's no_logs)
        self.text, self.token_ids, self.logprobs = "", [], []
        self.input_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.matched: str | None = None  # the stop string that finished it
        self.prompt_tokens = self.cached_tokens = self.host_cached_tokens = 0
        self.prompt_ids: list[int] = []  # with the first update, when the request asked for them
        self.entropy: list[float] = []  # each output token's distribution's, when asked
        self.routed_experts = b""  # with the last update, when the request asked for them
        self.hidden_states = b""  # likewise
        self.spec: list[int] = []  # (a server that speculates) verify steps, drafted, accepted
        self.e2e_latency = 0.0
        self._first: ReqUpdate | None = first

    def apply(self, upd: ReqUpdate) -> None:
        """Add an update to the totals (text, tokens, logprobs, finish)."""
        self.text += upd.text
        self.token_ids += upd.token_ids
        self.logprobs += upd.logprobs
        self.entropy += upd.entropy
        self.input_logprobs += upd.input_logprobs
        self.prompt_tokens, self.cached_tokens = upd.prompt_tokens or self.prompt_tokens, upd.cached_tokens
        self.host_cached_tokens = upd.host_cached_tokens
        if upd.prompt_ids:
            self.prompt_ids = upd.prompt_ids
        self.timer.tokens_arrived(len(upd.token_ids))
        if upd.matched is not None:
            self.matched = upd.matched
        if upd.routed_experts:
            self.routed_experts = upd.routed_experts
        if upd.hidden_states:
            self.hidden_states = upd.hidden_states
        self.spec = upd.spec or self.spec
        if upd.finish_reason is not None:
            self.finish_reason = upd.finish_reason
            self.e2e_latency = self.timer.finished(upd.finish_reason, self.prompt_tokens, self.cached_tokens)
            if self.log:  # --log-requests
                logger.info(
                    "request %s: %s after %d prompt tokens (%d cached) and %d generated, %.3f s",
                    self.rid,
                    upd.finish_reason,
                    self.prompt_tokens,
                    self.cached_tokens,
                    len(self.token_ids),
                    self.e2e_latency,
                )

    def finish_info(self) -> dict[str, Any] | None:
        """SGLang's meta_info finish_reason: what stopped it ("matched" stop string or token id)."""
        if self.finish_reason is None:
            return None
        if self.finish_reason == "stop":
            matched = self.matched if self.matched is not None else (self.token_ids[-1] if self.token_ids else None)
            return {"type": "stop", "matched": matched}
        if self.finish_reason == "length":
            return {"type": "length", "length": len(self.token_ids)}
        return {"type": self.finish_reason}

    @property
    def matched_stop(self) -> int | str | None:
        """SGLang's ``matched_stop`` of OpenAI choices: the stop string or token id that ended the
        request, None when something else did."""
        info = self.finish_info()
        return info.get("matched") if info else None

    async def arrivals(self) -> AsyncIterator[ReqUpdate]:
        """Each update as it arrives (the acceptance one first), not yet applied to the totals."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for upd in self.stream:
            yield upd

    async def updates(self) -> AsyncIterator[ReqUpdate]:
        """Each update, applied to the totals before it is yielded."""
        async for upd in self.arrivals():
            self.apply(upd)
            yield upd

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def abort(self) -> None:
        if not self.stream.finished:
            self.stream.abort()
            self.apply(ReqUpdate(self.rid, finish_reason="abort"))


async def read_body(
    request: Request, kind: type, args: ServerArgs, schema: Schema | None = None, allow_empty: bool = False
) -> Any:
    """The request body decoded as ``kind`` (fields sorted by ``schema``; with ``allow_empty``, an
    empty body is ``{}``, as clients post to routes whose fields all have defaults): 413 past
    ``--max-request-bytes`` (read no further), 408 when it does not arrive in time."""
    limit = args.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused at once, before waiting for the body
        raise BadRequest(
            f"Payload Too Large: the request body has {declared} bytes, more than {limit} (--max-request-bytes)",
            status=413,
        )

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(
                    f"Payload Too Large: the request body has more than {limit} bytes (--max-request-bytes)", status=413
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(receive(), args.request_body_timeout)
    except asyncio.TimeoutError:
        raise BadRequest(
            f"the request body did not arrive within {args.request_body_timeout:g} s", status=408
        ) from None
    out = decode(body if body.strip() or not allow_empty else b"{}", kind, schema)
    ignored = IGNORED.get()
    if args.strict_request_fields and ignored:
        raise BadRequest(f"unknown request fields: {', '.join(ignored)} (--strict-request-fields)", param=ignored[0])
    return out


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def merge(runs: list[Run]) -> AsyncIterator[tuple[int, ReqUpdate]]:
    """Updates of several runs as they arrive, tagged with the run's index; a run's failure
    is raised here (after the updates that came before it). Each is applied to its run's
    totals as it is yielded, not as it arrives, so a reader of the totals sees them as of that
    update even when later ones are queued. Updates of one run that queued while the reader was
    busy come out joined, as one run's own stream joins them."""
    if len(runs) == 1:  # the common case needs no task or queue between the run and its reader
        async for upd in runs[0].arrivals():
            runs[0].apply(upd)
            yield 0, upd
        return
    queue: asyncio.Queue[tuple[int, ReqUpdate | Exception | None]] = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
        try:
            async for upd in run.arrivals():
                queue.put_nowait((i, upd))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            pending: dict[int, ReqUpdate] = {}  # each run's updates joined, in order of arrival
            failure = None
            for i, upd in arrived:
                if isinstance(upd, Exception):
                    failure = upd
                    break
                if upd is None:
                    left -= 1
                else:
                    pending[i] = pending[i].then(upd) if i in pending else upd
            for i, upd in pending.items():
                runs[i].apply(upd)
                yield i, upd
            if failure is not None:
                raise failure
    finally:
        for t in tasks:
            t.cancel()


class ApiBase:
    """State and plumbing of the routes (native and OpenAI route classes extend it)."""

    def __init__(self, client: EngineClient, info: EngineInfo, args: ServerArgs, pids: dict[str, int]):
        self.client, self.info, self.args, self.pids = client, info, args, pids
        self.metrics = Metrics(args.model_name)
        self.created = int(time.time())
        self.generation = uuid.uuid4().hex  # tells a router this process from a restarted one
        self.weight_version = info.weight_version  # stamped on every output (updates change it)
        self.adapters = dict(info.lora_adapters)  # loaded LoRA adapters, name -> path (as the scheduler says)

    # ---- starting and finishing requests --------------------------------------------------------

    async def _start(self, reqs: list[GenerateReq]) -> list[Run]:
        """Submit all requests; if the engine refuses any, abort the rest and raise. Refused
        whole when they are more than one request may run, or the queue is full."""
        args = self.args
        check_sequences(len(reqs), args.max_sequences_per_request)
        for req in reqs:
            for name, stops in (("stop", req.sampling.stop_strings), ("stop_regex", req.sampling.stop_regexes)):
                if len(stops) > args.max_stop_strings or any(len(s) > args.max_stop_length for s in stops):
                    raise BadRequest(
                        f"{name} takes at most {args.max_stop_strings} strings of at most "
                        f"{args.max_stop_length} characters (--max-stop-strings, --max-stop-length)",
                        param=name,
                    )
        limit = self.args.max_queued_requests
        if limit is not None:
            capacity = limit + self.info.max_running_requests
            if len(reqs) > capacity:  # never fits, however long the client waits: not a 503
                raise BadRequest(
                    f"{len(reqs)} sequences exceed what the server can ever hold ({self.info.max_running_requests} "
                    f"running + {limit} queued: --max-running-requests, --max-queued-requests)",
                    param="n",
                )
            if len(self.client.active_rids) + len(reqs) > capacity:
                raise BadRequest(f"the server is at capacity ({limit} queued requests); retry later", status=503)
        results = await self.client.open(reqs)
        return [
            Run(stream, first, req.options, self.metrics, RequestTimer(self.metrics), self.args.log_requests)
            for req, (stream, first) in zip(reqs, results)
        ]

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

    def meta_info(self, run: Run) -> dict[str, Any]:
        """SGLang's ``meta_info`` of a run (/generate's, and a chat choice's with return_meta_info):
        counts, finish, latency, and what its options asked for: logprobs (with each entry's token
        text, token_ids_logprob's), the routed experts, the hidden states, each output token's
        entropy."""
        opts, with_text = run.options, run.options.text_in_logprobs
        meta: dict[str, Any] = {
            "id": run.rid,
            "prompt_tokens": run.prompt_tokens,
            "completion_tokens": len(run.token_ids),
            "cached_tokens": run.cached_tokens,
            "finish_reason": run.finish_info(),
            "e2e_latency": run.e2e_latency,
            "weight_version": self.weight_version,
        }
        if opts.logprobs:
            for kind, lps in (("input", run.input_logprobs), ("output", run.logprobs)):
                meta[f"{kind}_token_logprobs"] = [
                    _logprob_entry(lp.logprob, lp.token_id, lp.text, with_text) for lp in lps
                ]
                meta[f"{kind}_top_logprobs"] = [
                    None if lp.logprob is None else [_logprob_entry(p, t, s, with_text) for t, s, p in lp.top]
                    for lp in lps
                ]
                if opts.logprob_ids:
                    meta[f"{kind}_token_ids_logprobs"] = [
                        None if lp.logprob is None else [_logprob_entry(p, t, s, with_text) for t, s, p in lp.ids]
                        for lp in lps
                    ]
        verify_ct, drafted, accepted = run.spec or (0, 0, 0)
        if verify_ct > 0:  # (SGLang leaves them out before a request's first verify step)
            meta.update(
                spec_verify_ct=verify_ct, spec_draft_token_num=drafted, spec_accept_token_num=accepted,
                spec_accept_rate=accepted / drafted if drafted else 0.0,
                spec_accept_length=len(run.token_ids) / verify_ct,
            )  # fmt: skip
        if opts.routed_start >= 0:
            meta["routed_experts"] = base64.b64encode(run.routed_experts).decode()
        if opts.entropy:
            meta["output_token_entropy"] = run.entropy
        if opts.hidden_states and run.hidden_states:  # (with the last update)
            meta["hidden_states"] = hidden_state_rows(run.hidden_states, self.info.hidden_size, run.prompt_tokens)
        return meta

    def _think_open(self, asked: str | None) -> bool:
        """Whether a request's output starts inside thinking (the reasoning parser's models always
        start there); BadRequest naming ``asked``, the field asking for a thinking budget, when no
        --reasoning-parser names the markers."""
        parser = self.args.reasoning_parser
        if asked is not None and parser is None:
            raise BadRequest(
                f"{asked} needs a server started with --reasoning-parser (it names the thinking markers)",
                param=asked,
            )
        return parser is not None and starts_in_reasoning(parser)

    def _adapter(self, model: str, lora_path: str | None) -> str | None:
        """The LoRA adapter an OpenAI request names: ``lora_path``, a ``model`` of
        ``<served model>:<adapter>`` (SGLang's), or a ``model`` that is an adapter's name (vLLM's).
        An unknown adapter is a 400 (the scheduler refuses it too, should it go meanwhile)."""
        base, sep, suffix = model.rpartition(":")
        named = lora_path or None  # ("": none, as SGLang's benchmark client sends)
        if named is None and sep and base in (self.args.model_name, self.args.model, "default"):
            named = suffix
        elif named is None and model in self.adapters:
            named = model
        if named is not None and named not in self.adapters:
            field = "lora_path" if lora_path else "model"
            loaded = ", ".join(sorted(self.adapters)) or "none; LoRA needs --enable-lora or --lora-paths"
            raise BadRequest(f"{field}: no LoRA adapter named {named!r} is loaded (loaded: {loaded})", param=field)
        return named

    def _check_model(self, model: str, always: bool = False) -> None:
        """Requests may name any model, as SGLang serves them; with --check-model-name (as vLLM)
        only the served name, the model path and "default" (``always``: a catalog lookup)."""
        if not (always or self.args.check_model_name):
            return
        if model not in (self.args.model_name, self.args.model, "default") and self._adapter(model, None) is None:
            raise BadRequest(
                f"model {model!r} does not exist; this server serves {self.args.model_name!r}",
                status=404,
                param="model",
            )
