"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.serve.api.base import ApiBase, Run, merge, read_body
from minisgl.serve.api.fields import CHAT, COMPLETION
from minisgl.serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    cache_keys,
    check_sequences,
    parts_text,
    per_prompt,
)
from minisgl.serve.api.streaming import SSE_DONE, sse
from minisgl.serve.parsers.chat_output import ChatOutput
from minisgl.utils import last_hidden_state
from minisgl.wire.options import RequestOptions
from minisgl.wire.requests import GenerateReq, ReqUpdate, TokenLogprob


def _openai_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.text,
        "logprob": lp.logprob,
        "bytes": list(lp.text.encode()),
        "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for _, t, p in lp.top],
    }


def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.text)
    return {
        "tokens": [lp.text for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [None if lp.logprob is None else {t: p for _, t, p in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _token_ids(prompt: bool, output: bool, run: Run) -> dict[str, Any]:
    """A finished choice's ``prompt_token_ids`` and ``token_ids``, where asked."""
    out: dict[str, Any] = {"prompt_token_ids": run.prompt_ids} if prompt else {}
    if output:
        out["token_ids"] = run.token_ids
    return out


class _StreamedIds:
    """Token ids in streamed chunks (vLLM's way): each chunk's new ``token_ids``, and the
    choice's ``prompt_token_ids`` with its first chunk."""

    def __init__(self, runs: list[Run], prompt: bool, output: bool):
        self.runs, self.output = runs, output
        self.unsent = [prompt] * len(runs)  # choices whose prompt ids are still to go

    def chunk(self, i: int, upd: ReqUpdate) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.unsent[i]:
            out["prompt_token_ids"], self.unsent[i] = self.runs[i].prompt_ids, False
        if self.output:
            out["token_ids"] = upd.token_ids
        return out


def _echo(prompt: str | list[int], prompt_logprobs: list[TokenLogprob]) -> str:
    """The prompt as echo shows it: its text, or a token-id prompt's tokens' texts."""
    return prompt if isinstance(prompt, str) else "".join(lp.text for lp in prompt_logprobs)


def _usage(runs: list[Run], n: int = 1) -> dict[str, Any]:
    """Usage of ``runs``, n choices per prompt: each prompt counts once, as OpenAI counts it, and
    so do its cached tokens: what the cache held before the request (the least any of its
    samples found; the others also reuse the pages the first one computed)."""
    prompt = sum(r.prompt_tokens for r in runs[::n])
    cached = sum(min(r.cached_tokens for r in runs[i : i + n]) for i in range(0, len(runs), n))
    completion = sum(len(r.token_ids) for r in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _chunks(
    runs: list[Run],
    head: dict[str, Any],
    body: Any,
    choice: Callable[[int, ReqUpdate], dict[str, Any]],
    sglext: Callable[[], dict[str, Any] | None],
) -> AsyncIterator[bytes]:
    """The SSE chunks of a streamed completion: one per update that carries tokens, text or an
    end (``choice`` makes its choice), usage in each (continuous_usage_stats), SGLang's
    ``sglext`` once all are done (when asked), usage at the end (include_usage), then [DONE]."""
    async for i, upd in merge(runs):
        if not (upd.token_ids or upd.text or upd.finish_reason):
            continue
        chunk = {**head, "choices": [choice(i, upd)]}
        if body.continuous_usage:
            chunk["usage"] = _usage(runs, body.n)
        yield sse(chunk)
    ext = sglext()
    if ext is not None:
        yield sse({**head, "choices": [], "sglext": ext})
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(runs, body.n)})
    yield SSE_DONE


class OpenAIRoutes(ApiBase):
    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await read_body(request, CompletionRequest, self.args, COMPLETION)
        self._check_model(body.model)
        body.check()
        prompts = body.prompts()
        check_sequences(len(prompts) * body.n, self.args.max_sequences_per_request)  # before any is built
        cid, ids = body.sequence_ids("cmpl", len(prompts))
        runs = await self._start(self._completion_reqs(body, prompts, ids))
        head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": body.model}
        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            choices = [self._completion_choice(body, prompts[i // body.n], i, r) for i, r in enumerate(runs)]
            return self._response(body, runs, {**head, "choices": choices})

        offsets, echoed = [0] * len(runs), [not body.echo] * len(runs)

        def choice(i: int, upd: ReqUpdate) -> dict[str, Any]:
            text, lps = upd.text, upd.logprobs
            if not echoed[i]:  # the prompt goes out with the first update (its logprobs come with it)
                text, lps = _echo(prompts[i // body.n], upd.input_logprobs) + text, upd.input_logprobs + lps
                echoed[i] = True
            logprobs = None
            if body.logprobs is not None:  # one entry per token, also while its text is held back
                logprobs = _completion_logprobs(lps, offsets[i])
            offsets[i] += len(text)
            return {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": upd.finish_reason,
                "matched_stop": runs[i].matched_stop if upd.finish_reason else None,
                **(self._hidden(body, runs[i]) if upd.finish_reason else {}),
                **ids.chunk(i, upd),
            }

        ids = _StreamedIds(runs, body.return_token_ids, body.return_token_ids)
        events = _chunks(runs, head, body, choice, lambda: self._sglext(body, runs))
        return self._stream(runs, events)

    def _completion_reqs(self, body: CompletionRequest, prompts: list, ids: list[str]) -> list[GenerateReq]:
        """One request per prompt and sample."""
        salts = cache_keys(body.extra_key, body.cache_salt, len(prompts))
        loras = [
            self._adapter(body.model, name) for name in per_prompt(body.lora_path, "lora_path", len(prompts), None)
        ]
        return [  # echo with max_tokens 0 scores the prompt and generates nothing
            GenerateReq(
                ids[i * body.n + j],
                body.sampling(body.max_tokens, j),
                RequestOptions(
                    top_logprobs=body.top_logprobs,
                    logprob_start=0 if body.echo else -1,
                    text_in_logprobs=True,
                    cache_salt=salts[i],
                    hidden_states=body.return_hidden_states,
                    lora=loras[i],
                    prompt_ids=body.return_token_ids,
                    routed_start=body.routed_start,
                ),
                text=p if isinstance(p, str) else None,
                input_ids=None if isinstance(p, str) else p,
                suffix=body.suffix,
                fill_context=body.max_tokens is None,
            )
            for i, p in enumerate(prompts)
            for j in range(body.n)
        ]

    def _completion_choice(self, body: CompletionRequest, prompt: Any, i: int, r: Run) -> dict[str, Any]:
        """A finished run as a text_completion choice (after its echoed prompt)."""
        echoed = _echo(prompt, r.input_logprobs) if body.echo else ""
        lps = (r.input_logprobs if body.echo else []) + r.logprobs
        return {
            "index": i,
            "text": echoed + r.text,
            "finish_reason": r.finish_reason,
            "matched_stop": r.matched_stop,
            "logprobs": _completion_logprobs(lps, 0) if body.logprobs is not None else None,
            **self._hidden(body, r),
            **_token_ids(body.return_token_ids, body.return_token_ids, r),
        }

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, self.args, CHAT)
        cid, ids = body.sequence_ids("chatcmpl", 1)
        runs, outputs = await self._chat_runs(body, cid, ids=ids)
        head = {"id": cid, "created": int(time.time()), "model": body.model}
        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            choices = [self._chat_choice(body, i, r, out) for i, (r, out) in enumerate(zip(runs, outputs))]
            top = {"prompt_token_ids": runs[0].prompt_ids} if body.return_token_ids else {}  # (vLLM's place)
            return self._response(body, runs, {**head, "object": "chat.completion", "choices": choices, **top})

        head["object"] = "chat.completion.chunk"

        started = [False] * len(runs)  # the role goes out with a choice's first token, not before

        def choice(i: int, upd: ReqUpdate) -> dict[str, Any]:
            logprobs = {"content": [_openai_logprob(lp) for lp in upd.logprobs]} if body.logprobs else None
            # reasoning_content is always there, null or text, as SGLang streams it (clients read
            # delta.reasoning_content without checking for it)
            delta = {"reasoning_content": None, **outputs[i].delta(upd.text, upd.finish_reason is not None)}
            if not started[i]:
                delta, started[i] = {"role": "assistant", "content": "", **delta}, True
            if upd.finish_reason:
                delta.update(self._hidden(body, runs[i]))
            return {
                "index": i,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": outputs[i].finish_reason(upd.finish_reason),
                "matched_stop": runs[i].matched_stop if upd.finish_reason else None,
                **ids.chunk(i, upd),
                **(self._chat_meta(body, runs[i]) if upd.finish_reason else {}),
            }

        ids = _StreamedIds(runs, body.wants_prompt_ids, body.return_token_ids)
        events = _chunks(runs, head, body, choice, lambda: self._sglext(body, runs))
        return self._stream(runs, events)

    def _chat_choice(self, body: ChatCompletionRequest, i: int, r: Run, out: ChatOutput) -> dict[str, Any]:
        """A finished run as a chat.completion choice."""
        return {
            "index": i,
            "message": out.message(r.text),
            "logprobs": {"content": [_openai_logprob(lp) for lp in r.logprobs]} if body.logprobs else None,
            "finish_reason": out.finish_reason(r.finish_reason),
            "matched_stop": r.matched_stop,
            **self._hidden(body, r),
            **_token_ids(body.wants_prompt_ids, body.return_token_ids, r),
            **self._chat_meta(body, r),
        }

    async def _chat_runs(
        self, body: ChatCompletionRequest, rid: str, truncate: bool = False, ids: list[str] | None = None
    ) -> tuple[list[Run], list[ChatOutput]]:
        """Start a chat request's runs (one per choice, ids ``ids`` or ``rid-j``), each with the
        reader of its answer (reasoning, content, tool calls); ``truncate``: the oldest messages
        are dropped until the prompt fits (the Responses API's truncation "auto")."""
        self._check_model(body.model)
        body.check()
        lora = self._adapter(body.model, per_prompt(body.lora_path, "lora_path", 1, None)[0])
        (salt,) = cache_keys(body.extra_key, body.cache_salt, 1)
        plan = body.tool_plan(self.info.tool_call_parser)
        messages = [m.flat() for m in body.messages]
        given = list(body.input_ids) if body.input_ids is not None else None  # the template is not run
        predicted = parts_text(body.prediction.content, "prediction") if body.prediction else None
        max_new = body.max_new_tokens
        budget = body.think_budget()
        think_open = self._think_open("custom_logit_processor" if body.custom_logit_processor is not None else None)
        reqs = []
        for j in range(body.n):
            sampling = body.sampling(max_new, j)
            sampling.json_schema = plan.schema or sampling.json_schema  # a forced call's grammar
            # (a model that always starts thinking: its grammar constrains the answer after it)
            after_thinking = think_open and sampling.grammar is not None
            reqs.append(
                GenerateReq(
                    ids[j] if ids is not None else f"{rid}-{j}",
                    sampling,
                    RequestOptions(
                        top_logprobs=body.num_top_logprobs,
                        text_in_logprobs=True,
                        cache_salt=salt,
                        prediction=predicted,
                        hidden_states=body.return_hidden_states,
                        lora=lora,
                        prompt_ids=body.wants_prompt_ids,
                        routed_start=body.routed_start,
                        think_budget=budget,
                        think_open=think_open,
                        require_reasoning=after_thinking,
                    ),
                    messages=messages if given is None else None,
                    input_ids=given,
                    fill_context=max_new is None,
                    tools=plan.tools,
                    chat_template_kwargs=body.template_kwargs(),
                    continue_final=body.continue_final_message,
                    truncate=truncate,
                )
            )
        runs = await self._start(reqs)
        reasoning = self.args.reasoning_parser if body.separate_reasoning else None
        return runs, [ChatOutput(plan, reasoning, body.stream_reasoning) for _ in runs]

    def _hidden(self, body: CompletionRequest | ChatCompletionRequest, run: Run) -> dict[str, Any]:
        """SGLang's ``hidden_states`` of a finished choice, if asked: the last hidden state, the
        one that gave its last token."""
        if not body.return_hidden_states:
            return {}
        return {"hidden_states": last_hidden_state(run.hidden_states, self.info.hidden_size)}

    def _chat_meta(self, body: ChatCompletionRequest, run: Run) -> dict[str, Any]:
        """SGLang's return_meta_info: a choice's /generate meta_info (its logprobs with logprobs,
        its routed experts with return_routed_experts)."""
        if not body.return_meta_info:
            return {}
        return {"meta_info": self.meta_info(run)}

    def _sglext(self, body: CompletionRequest | ChatCompletionRequest, runs: list[Run]) -> dict[str, Any] | None:
        """SGLang's response-level extensions, from the first choice (as SGLang answers): its
        routed experts (base64 int32 [positions, layers, k]; in meta_info instead when that is
        asked) and where its cached prompt tokens came from (device pool or host tier)."""
        ext: dict[str, Any] = {}
        first = runs[0]
        if body.return_routed_experts and not getattr(body, "return_meta_info", False):
            ext["routed_experts"] = base64.b64encode(first.routed_experts).decode()
        if body.return_cached_tokens_details:
            host = first.host_cached_tokens
            ext["cached_tokens_details"] = {"device": first.cached_tokens - host, "host": host}
        return ext or None

    def _response(self, body: CompletionRequest | ChatCompletionRequest, runs: list[Run], out: dict) -> JSONResponse:
        """A finished completion's JSON: its choices with usage, the weights' version and sglext."""
        out.update(usage=_usage(runs, body.n), metadata={"weight_version": self.weight_version})
        ext = self._sglext(body, runs)
        if ext is not None:
            out["sglext"] = ext
        return JSONResponse(out)

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.args.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "minisgl",
            "root": self.args.model_name,
            "max_model_len": self.info.context_len,
        }

    async def models(self, request: Request) -> Response:
        """The served model, then each loaded LoRA adapter (its ``parent`` the model, as vLLM lists them)."""
        cards = [self._card()]
        cards += [
            {**self._card(), "id": name, "root": path, "parent": self.args.model_name}
            for name, path in self.adapters.items()
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"], always=True)
        return JSONResponse(self._card())
