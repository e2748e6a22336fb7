"""SGLang's native routes: /generate (single or batched, streamed per index), health, server
and model info, metrics, cache flush and abort."""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import minisgl
from minisgl.serve.api.base import ApiBase, error_response, merge, read_body
from minisgl.serve.api.client import EngineError
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import DETOKENIZE, GENERATE, SCORE, TOKENIZE
from minisgl.serve.api.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    ProfileRequest,
    ScoreRequest,
    TokenizeRequest,
)
from minisgl.serve.api.streaming import SSE_DONE, sse
from minisgl.wire.options import RequestOptions
from minisgl.wire.requests import GenerateReq
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ProfileReq

# Monitoring (/get_server_info, /metrics, /v1/loads) waits this long for fresh stats from the
# scheduler, then answers from the last ones it gave, with their age: a busy engine must never
# fail a scrape. Only with none yet (and a scheduler that never answers) is the answer a 503.
STATS_WAIT_S = 1.0
STATS_TIMEOUT_S = 30.0


def plain_name(part: str) -> bool:
    """A file name a client may choose: printable, no separator, not hidden, not ``..``, at most
    255 bytes (a NUL or a control character would fail, or mislead, the worker's open)."""
    return (
        part.isprintable()
        and "/" not in part
        and "\\" not in part
        and not part.startswith(".")
        and len(part.encode()) <= 255
    )


# meta_info's lists with one entry per output token: cut like the ids under --stream-output
PER_TOKEN_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs", "output_token_entropy")


def only_new(out: dict[str, Any], text: str, sent: int) -> dict[str, Any]:
    """--stream-output (SGLang's disjoint segments): an event's new ``text`` and its ids and
    per-token lists past the ``sent`` tokens streamed before."""
    out["text"], out["output_ids"] = text, out["output_ids"][sent:]
    meta = out["meta_info"]
    for key in PER_TOKEN_LISTS:
        if key in meta:
            meta[key] = meta[key][sent:]
    return out


class NativeRoutes(ApiBase):
    _snapshot: tuple[dict[str, Any], float] | None = None  # the last stats and when they came
    _stats_task: asyncio.Future | None = None

    async def generate(self, request: Request) -> Response:
        body: GenerateRequest = await read_body(request, GenerateRequest, self.args, GENERATE)
        items = body.items(self.args.max_sequences_per_request)  # counted before any is built
        think_open = self._think_open(body.thinking_budget_asked)
        runs = await self._start(
            [
                GenerateReq(
                    it.rid,
                    it.sampling,
                    msgspec.structs.replace(it.options, think_open=True) if think_open else it.options,
                    text=it.text,
                    input_ids=it.input_ids,
                )
                for it in items
            ]
        )
        batch = len(items) > 1 or body.is_batch

        def result(i: int) -> dict[str, Any]:
            run = runs[i]
            out = {"text": run.text, "output_ids": run.token_ids, "meta_info": self.meta_info(run)}
            if run.options.prompt_ids:
                out["prompt_token_ids"] = run.prompt_ids
            return {**out, "index": i} if batch else out

        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            return JSONResponse([result(i) for i in range(len(runs))] if batch else result(0))

        sent = [0] * len(runs)  # output tokens each run has streamed (--stream-output)

        async def events() -> AsyncIterator[bytes]:
            async for i, upd in merge(runs):
                if upd.token_ids or upd.finish_reason is not None:
                    out = result(i)
                    if self.args.stream_output:
                        out = only_new(out, upd.text, sent[i])
                        sent[i] = len(runs[i].token_ids)
                    yield sse(out)
            yield SSE_DONE

        return self._stream(runs, events())

    async def tokenize(self, request: Request) -> Response:
        """SGLang's /tokenize (/v1/tokenize): each text's token ids, counted, beside the context length."""
        body: TokenizeRequest = await read_body(request, TokenizeRequest, self.args, TOKENIZE)
        texts = body.texts(self.args.max_sequences_per_request)
        reply = await self.client.texts(texts=texts, special_tokens=body.add_special_tokens)
        if reply.error is not None:
            raise BadRequest(reply.error, param="prompt")
        one = isinstance(body.prompt, str)
        return JSONResponse(
            {
                "tokens": reply.ids[0] if one else reply.ids,
                "count": len(reply.ids[0]) if one else [len(ids) for ids in reply.ids],
                "max_model_len": self.info.context_len,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """SGLang's /detokenize (/v1/detokenize): the text of each list of token ids."""
        body: DetokenizeRequest = await read_body(request, DetokenizeRequest, self.args, DETOKENIZE)
        if not body.tokens:
            return JSONResponse({"text": ""})  # (as SGLang answers an empty list)
        ids = body.ids(self.args.max_sequences_per_request)
        reply = await self.client.texts(ids=ids, special_tokens=not body.skip_special_tokens)
        if reply.error is not None:
            raise BadRequest(reply.error, param="tokens")
        return JSONResponse({"text": reply.texts if body.is_batch else reply.texts[0]})

    async def score(self, request: Request) -> Response:
        """SGLang's /v1/score (reward models, rerankers, classification by label tokens): one
        greedy step per item, reading the label tokens' log-probabilities after its prompt."""
        body: ScoreRequest = await read_body(request, ScoreRequest, self.args, SCORE)
        prompts = body.prompts(self.args.max_sequences_per_request)
        labels = list(body.label_token_ids or [])
        if any(t >= self.info.vocab_size for t in labels):
            raise BadRequest(
                f"label_token_ids must be below the vocabulary size {self.info.vocab_size}", param="label_token_ids"
            )
        base = f"score-{uuid.uuid4().hex}"
        reqs = [
            GenerateReq(
                f"{base}-{i}",
                SamplingParams(max_new_tokens=1, temperature=0.0),
                RequestOptions(top_logprobs=0, logprob_ids=labels),
                text=p if isinstance(p, str) else None,
                input_ids=None if isinstance(p, str) else p,
            )
            for i, p in enumerate(prompts)
        ]
        runs = await self._start(reqs)
        if not await self._collect(runs, request):
            return Response(status_code=499)
        scores = []
        for run in runs:
            logprobs = [lp for _, _, lp in run.logprobs[0].ids]
            probs = [math.exp(lp) for lp in logprobs]
            if body.apply_softmax:
                total = sum(probs)
                probs = [p / total for p in probs] if total > 0 else [1.0 / len(probs)] * len(probs)
            scores.append(probs)
        prompt_tokens = sum(r.prompt_tokens for r in runs)
        return JSONResponse(
            {
                "scores": scores,
                "model": self.args.model_name,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
                "object": "scoring",
            }
        )

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        req = GenerateReq(
            f"health-{uuid.uuid4().hex}", SamplingParams(max_new_tokens=1, temperature=0.0), input_ids=[0]
        )
        try:
            runs = await asyncio.wait_for(self._start([req]), 20)
            await asyncio.wait_for(runs[0].wait(), 20)
        except (asyncio.TimeoutError, EngineError) as e:
            return error_response(503, f"the engine did not generate: {e or 'timed out'}")
        return JSONResponse({"status": "ok"})

    async def _fetch_stats(self) -> None:
        reply = await self.client.control("stats", timeout=STATS_TIMEOUT_S)
        self._snapshot = (dict(reply.data), time.monotonic())

    async def _stats(self) -> dict[str, Any]:
        """The scheduler's stats, fresh if it answers within ``STATS_WAIT_S``, else the last
        snapshot; ``stats_age_s`` says how old they are. One request for them is out at a time."""
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self._fetch_stats())
        task = self._stats_task
        await asyncio.wait({task}, timeout=STATS_WAIT_S)
        if task.done() and task.exception() is not None and self._snapshot is None:
            raise task.exception()
        if self._snapshot is None:
            raise EngineError(f"the scheduler gave no stats within {STATS_WAIT_S:g} s and none before", status=503)
        data, at = self._snapshot
        return {**data, "stats_age_s": round(time.monotonic() - at, 3)}

    async def loads(self, request: Request) -> Response:
        """SGLang's /v1/loads, which the smg router polls for its load policies: one entry per
        data-parallel rank (one here), stamped with this server's generation."""
        stats = await self._stats()
        page, total = self.info.page_size, int(stats.get("total_pages", 0))
        used = total - int(stats.get("free_pages", 0)) - int(stats.get("evictable_pages", 0))
        running, waiting = int(stats.get("running_requests", 0)), int(stats.get("queued_requests", 0))
        load = {
            "dp_rank": 0,
            "worker_generation": self.generation,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used * page,
            "max_total_num_tokens": total * page,
            "token_usage": stats.get("kv_usage", 0.0),
            "cache_hit_rate": stats.get("cache_hit_rate", 0.0),
            "max_running_requests": self.info.max_running_requests,
            "utilization": running / max(self.info.max_running_requests, 1),
        }
        return JSONResponse(
            {"timestamp": time.time(), "version": minisgl.__version__, "dp_rank_count": 1, "loads": [load]}
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": minisgl.__version__})

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.info.model_path,
                "tokenizer_path": self.args.tokenizer or self.info.model_path,
                "served_model_name": self.args.model_name,
                "is_generation": True,
                "context_length": self.info.context_len,
                "vocab_size": self.info.vocab_size,
            }
        )

    async def server_info(self, request: Request) -> Response:
        server_args = {k: v for k, v in asdict(self.args).items() if k != "api_key"}
        server_args["max_running_requests"] = self.info.max_running_requests  # as derived, if not given
        # SGLang's shape: the server args at the top level (model_path its name for --model), then
        # what the engine measured; ours under their own keys too.
        return JSONResponse(
            {
                **server_args,
                "model_path": self.args.model,
                "pp_size": 1,  # (no pipeline or expert parallelism: SGLang's clients compare these)
                "ep_size": 1,
                "max_total_num_tokens": self.info.num_pages * self.info.page_size,
                "kv_cache_dtype": self.info.kv_cache_dtype,
                **self._state_pool_info(),
                "version": minisgl.__version__,
                "server_args": server_args,
                "engine": msgspec.to_builtins(self.info),
                "scheduler": await self._stats(),
                "active_requests": len(self.client.active_rids),
                "processes": self.pids,
            }
        )

    def _state_pool_info(self) -> dict[str, int]:
        """A hybrid model's state pool: one request's recurrent state, the prefix cache's
        snapshots and what they take (none for other models)."""
        info = self.info
        if not info.state_bytes_per_request:
            return {}
        return {
            "mamba_state_bytes_per_request": info.state_bytes_per_request,
            "mamba_state_slots": info.max_running_requests,
            "mamba_snapshot_slots": info.state_snapshots,
            "mamba_snapshot_bytes": info.state_snapshots * info.state_bytes_per_request,
        }

    async def metrics_route(self, request: Request) -> Response:
        """Prometheus text, or OpenMetrics when the scraper asks for it (Accept)."""
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        body, media_type = self.metrics.render(await self._stats(), openmetrics)
        return Response(body, media_type=media_type)

    async def flush_cache(self, request: Request) -> Response:
        reply = await self.client.control("flush_cache")
        if not reply.ok:  # (SGLang answers 400 too; RL clients poll until it succeeds)
            return error_response(400, str(reply.data.get("error", "flush refused")))
        return JSONResponse({"success": True})

    def _profile_dir(self) -> str:
        """Where traces go; profiling is off (403) without --profile-dir or SGLang's variable."""
        root = self.args.profile_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR")
        if not root:
            raise BadRequest(
                "profiling is off: start the server with --profile-dir (or SGLANG_TORCH_PROFILER_DIR)", status=403
            )
        return root

    async def start_profile(self, request: Request) -> Response:
        """SGLang's /start_profile: every worker records a torch profiler trace (Chrome format,
        one per rank, plus a table of the kernels by time) until /stop_profile or num_steps."""
        body: ProfileRequest = await read_body(request, ProfileRequest, self.args, allow_empty=True)
        activities = [a.upper().replace("CUDA", "GPU") for a in body.activities or ["CPU", "GPU"]]
        unknown = sorted(set(activities) - {"CPU", "GPU"})
        if unknown:
            return error_response(400, f"activities: unknown {unknown} (CPU, GPU)", param="activities")
        if body.num_steps is not None and body.num_steps < 1:
            return error_response(400, f"num_steps must be >= 1, got {body.num_steps}", param="num_steps")
        root = self._profile_dir()
        # Traces go under that directory: a client's output_dir must resolve inside it, and every
        # part of it and the prefix be plain names (a client could write anywhere the server may).
        for param, parts in (
            ("output_dir", (body.output_dir or "").split(os.sep)),
            ("profile_prefix", [body.profile_prefix or ""]),
        ):
            if any(p and not plain_name(p) for p in parts):
                value = getattr(body, param)
                return error_response(400, f"{param} must be made of plain names, got {value!r}", param=param)
        root = os.path.realpath(root)
        output_dir = os.path.realpath(os.path.join(root, body.output_dir or ""))
        if os.path.commonpath([root, output_dir]) != root:
            return error_response(
                400,
                f"output_dir must be inside the server's profile directory {root} (--profile-dir)",
                param="output_dir",
            )
        prefix = f"{body.profile_prefix}-" if body.profile_prefix else ""
        profile = ProfileReq(
            True, os.path.join(output_dir, f"{prefix}minisgl-{int(time.time())}"), body.num_steps or 0, activities
        )
        await self.client.control("profile", profile=profile)
        return Response(f"Start profiling (traces go to {profile.output_dir}).\n")

    async def stop_profile(self, request: Request) -> Response:
        self._profile_dir()
        await self.client.control("profile", profile=ProfileReq(False))
        return Response("Stop profiling. This will take some time.\n")

    async def abort_request(self, request: Request) -> Response:
        body: AbortRequest = await read_body(request, AbortRequest, self.args)
        active = self.client.active_rids
        if body.abort_all:
            # Another client's ids are not this caller's to see: abort_all answers a count.
            for rid in active:
                self.client.abort(rid)
            return JSONResponse({"aborted_count": len(active)})
        if body.rid is None:
            raise BadRequest("give rid or abort_all: true", param="rid")
        # An OpenAI request runs as "<id>-<choice>"; its id aborts its own choices (only: a
        # prefix such as "chatcmpl" names nobody). An id that runs nothing (it finished, or never
        # came) is answered as SGLang does, 200, with nothing aborted (verl aborts finished ids).
        targets = [r for r in active if r == body.rid or _choice_of(r, body.rid)]
        for rid in targets:
            self.client.abort(rid)
        return JSONResponse({"aborted": targets})


def _choice_of(rid: str, request_id: str) -> bool:
    base, _, choice = rid.rpartition("-")
    return base == request_id and choice.isdigit()
