"""Tokenizer process: text in, token ids to the scheduler; token ids back, text to the API.

Requests arrive from the API as text, token ids or chat messages (rendered with the checkpoint's
chat template). Length checks that need the token count happen here, so the API can answer 4xx
before anything is queued. Outputs from the scheduler are detokenized incrementally per request;
a matched stop string ends the request here and tells the scheduler to stop it.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from minisgl.serve.parsers.reasoning import CLOSE as THINK_CLOSE
from minisgl.serve.parsers.reasoning import OPEN as THINK_OPEN
from minisgl.serve.tokenizer import load_tokenizer
from minisgl.serve.tokenizer.chat import detect_tool_parser, encode_chat, fit_chat
from minisgl.serve.tokenizer.completion import detect_completion_template, fim_prompt
from minisgl.serve.tokenizer.detokenizer import StopRegexTooSlow, TextStream, decode_ids
from minisgl.utils import context_overflow, init_logging, keep_torch_out
from minisgl.wire.control import ControlReply, ControlReq
from minisgl.wire.ipc import Addresses, Receiver, Sender, become_child
from minisgl.wire.requests import (
    AbortReq,
    EngineInfo,
    GenerateBatch,
    GenerateReq,
    ReqUpdate,
    TextReply,
    TextReq,
    TokenBatch,
    TokenizedBatch,
    TokenizedReq,
    TokenLogprob,
    TokenOut,
    ToTokenizer,
    UpdateBatch,
)

logger = logging.getLogger(__name__)

# A text longer than this many characters per token of the context cannot fit it: refused
# before tokenizing, so one huge prompt cannot stall everyone else's requests.
MAX_CHARS_PER_TOKEN = 32


class RequestState:
    """What the tokenizer process remembers about one running request."""

    def __init__(self, req: GenerateReq, prompt_ids: list[int], tokenizer: Any, stream_interval: int = 1):
        self.rid = req.rid
        self.interval = req.sampling.stream_interval or stream_interval  # tokens per update sent
        self.held: ReqUpdate | None = None
        self.prompt_tokens = len(prompt_ids)
        opts = req.options
        self.prompt_ids = prompt_ids if opts.logprob_start >= 0 else []
        self.unsent_prompt = prompt_ids if opts.prompt_ids else []  # goes out with the first update
        self.logprob_start = opts.logprob_start
        self.top_logprobs = opts.top_logprobs
        self.logprob_ids = opts.logprob_ids if opts.logprobs else []
        self.tokenizer = tokenizer
        self.text = None
        if tokenizer is not None:
            self.text = TextStream.of(tokenizer, req.sampling)

    def _token_text(self, token: int) -> str:
        return decode_ids(self.tokenizer, [token], skip_special_tokens=False) if self.tokenizer is not None else ""

    def _logprob(
        self,
        token: int,
        logprob: float | None,
        top_ids: list[int],
        top_logprobs: list[float],
        id_logprobs: list[float] | None = None,
    ) -> TokenLogprob:
        """One position's logprob entry: its token, top tokens and requested ids with their texts."""
        top = [(t, self._token_text(t), p) for t, p in zip(top_ids, top_logprobs)]
        ids = [(t, self._token_text(t), p) for t, p in zip(self.logprob_ids, id_logprobs or [])]
        return TokenLogprob(token, self._token_text(token), logprob, top, ids)

    def update(self, out: TokenOut) -> ReqUpdate:
        """Turn the scheduler's new tokens into an update; a matched stop string finishes it."""
        final = out.finish_reason is not None
        upd = ReqUpdate(
            self.rid,
            token_ids=out.tokens,
            finish_reason=out.finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=out.cached_tokens,
            routed_experts=out.routed_experts,
            hidden_states=out.hidden_states,
            prompt_ids=self.unsent_prompt,
            host_cached_tokens=out.host_cached_tokens,
            entropy=out.entropy,
            spec=out.spec,
        )
        self.unsent_prompt = []
        if self.text is not None:
            upd.text = self.text.add(out.tokens, final)
            if self.text.stopped:
                upd.finish_reason, upd.matched = "stop", self.text.stops.matched
        if self.top_logprobs >= 0:
            for i, (token, lp) in enumerate(zip(out.tokens, out.logprobs)):
                tops = (out.top_ids[i], out.top_logprobs[i]) if self.top_logprobs > 0 else ([], [])
                upd.logprobs.append(self._logprob(token, lp, *tops, out.id_logprobs[i] if out.id_logprobs else None))
        if self.prompt_ids and (out.input_logprobs or out.input_start):
            upd.input_logprobs = self._prompt_logprobs(out)
        return upd

    def coalesce(self, upd: ReqUpdate) -> ReqUpdate | None:
        """Hold updates back until ``interval`` tokens are out (SGLang's stream interval); the
        first (the request was accepted) and the last go at once."""
        if self.held is not None:
            upd = self.held.then(upd)
        if upd.finish_reason is None and 0 < len(upd.token_ids) < self.interval:
            self.held = upd
            return None
        self.held = None
        return upd

    def _prompt_logprobs(self, out: TokenOut) -> list[TokenLogprob]:
        """The prompt's tokens from logprob_start on (position 0 has no logprob: None)."""
        ids, first = self.prompt_ids, out.input_start
        entries = [self._logprob(ids[0], None, [], [])] if self.logprob_start == 0 else []
        for k, lp in enumerate(out.input_logprobs):
            tops = (out.input_top_ids[k], out.input_top_logprobs[k]) if out.input_top_ids else ([], [])
            entries.append(
                self._logprob(ids[first + k], lp, *tops, out.input_id_logprobs[k] if out.input_id_logprobs else None)
            )
        self.prompt_ids = []  # sent once
        return entries


class TokenizerProcess:
    def __init__(
        self,
        addrs: Addresses,
        tokenizer_path: str | None,
        chat_template: str | None = None,
        stream_interval: int = 1,
        tool_call_parser: str | None = None,
        completion_template: str | None = None,
        skip_init: bool = False,
    ):
        ctx = zmq.Context()
        self.inbox: Receiver[ToTokenizer] = Receiver(ctx, addrs.tokenizer, ToTokenizer)
        self.api = Sender(ctx, addrs.api)
        self.scheduler = Sender(ctx, addrs.scheduler)
        self.launcher = Sender(ctx, addrs.launcher)
        self.tokenizer_path = tokenizer_path
        self.chat_template = chat_template
        self.stream_interval = stream_interval
        self.tool_call_parser = tool_call_parser
        self.completion_template = completion_template  # (else read from the tokenizer's tokens)
        self.skip_init = skip_init  # --skip-tokenizer-init: token ids in and out
        self.tokenizer: Any = None
        self.think_marker_ids: list[list[int]] = []  # <think> and </think> in the tokenizer's ids
        self.info: EngineInfo | None = None
        self.reqs: dict[str, RequestState] = {}

    def run(self) -> None:
        while True:
            msg = self.inbox.recv()
            if isinstance(msg, GenerateBatch):
                self._on_generate(msg.reqs)
            elif isinstance(msg, TokenBatch):
                self._on_tokens(msg)
            elif isinstance(msg, AbortReq):
                self._on_abort(msg)
            elif isinstance(msg, ControlReq):
                self.scheduler.send(msg)
            elif isinstance(msg, TextReq):
                self.api.send(self._texts(msg))
            elif isinstance(msg, ControlReply):
                self.api.send(msg)
            elif isinstance(msg, EngineInfo):
                if not self.skip_init:
                    self.tokenizer = load_tokenizer(self.tokenizer_path or msg.model_path, self.chat_template)
                    if self.tokenizer is not None:  # (the thinking markers, encoded once)
                        self.think_marker_ids = [
                            self.tokenizer.encode(m, add_special_tokens=False) for m in (THINK_OPEN, THINK_CLOSE)
                        ]
                parser = self.tool_call_parser or detect_tool_parser(self.tokenizer)
                if parser is not None and self.tokenizer is not None:
                    logger.info(
                        "tool calls are read in the %s format%s",
                        parser,
                        "" if self.tool_call_parser else " (from the chat template; --tool-call-parser sets it)",
                    )
                if self.completion_template is None:
                    self.completion_template = detect_completion_template(self.tokenizer)
                self.info = msgspec.structs.replace(msg, tool_call_parser=parser)
                self.launcher.send(self.info)

    @property
    def _no_tokenizer(self) -> str:
        """Why there is no tokenizer to use."""
        return "the server runs with --skip-tokenizer-init" if self.skip_init else "this model has no tokenizer"

    def _check_chars(self, chars: int) -> None:
        """Refuse text no prompt could fit before tokenizing it: a huge body would hold up every
        stream behind this process."""
        assert self.info is not None
        if chars > MAX_CHARS_PER_TOKEN * self.info.context_len:
            raise ValueError(
                f"the prompt has {chars} characters, more than the context length of "
                f"{self.info.context_len} tokens can hold"
            )

    def _texts(self, req: TextReq) -> TextReply:
        """/tokenize and /detokenize, answered here without the scheduler."""
        if self.tokenizer is None:
            return TextReply(req.cid, error=self._no_tokenizer)
        try:
            for text in req.texts or []:
                self._check_chars(len(text))
        except ValueError as e:
            return TextReply(req.cid, error=str(e))
        try:
            if req.texts is not None:
                special = req.special_tokens
                return TextReply(req.cid, ids=[self.tokenizer.encode(t, add_special_tokens=special) for t in req.texts])
            vocab = len(self.tokenizer)
            for ids in req.ids or []:
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    return TextReply(req.cid, error=f"token id {bad} is not in the tokenizer's vocabulary of {vocab}")
            skip = not req.special_tokens
            texts = [self.tokenizer.decode(ids, skip_special_tokens=skip) for ids in req.ids or []]
            return TextReply(req.cid, texts=texts)
        except Exception as e:  # a tokenizer's own failure answers this request, never ends the process
            return TextReply(req.cid, error=f"the tokenizer failed: {type(e).__name__}: {e}")

    # ---- requests in ---------------------------------------------------------------------------

    def _encode(self, req: GenerateReq) -> list[int]:
        if req.input_ids is not None:
            return req.input_ids
        assert self.info is not None
        chars = len(req.text or "") + len(req.suffix or "") + sum(len(m.content) for m in req.messages or [])
        chars += len(msgspec.json.encode(req.tools)) if req.tools else 0
        self._check_chars(chars)
        if self.tokenizer is None:
            raise ValueError(f"{self._no_tokenizer}: send input_ids instead of text")
        if req.messages is not None:
            if not self.tokenizer.chat_template:
                raise ValueError("this model has no chat template; use /v1/completions or /generate")
            messages = [msgspec.structs.asdict(m) for m in req.messages]

            def encode(kept: list[dict[str, Any]]) -> list[int]:
                return encode_chat(
                    self.tokenizer, kept, req.tools, req.chat_template_kwargs, continue_final=req.continue_final
                )

            if not req.truncate:
                return encode(messages)
            return fit_chat(messages, encode, lambda n: self._length_error(req, n) is None)
        text = req.text
        if req.suffix:  # ("": none, as SGLang reads it)
            if self.completion_template is None:
                raise ValueError(
                    "suffix: this model's tokenizer has no fill-in-the-middle tokens known here; "
                    "--completion-template names the format"
                )
            text = fim_prompt(self.completion_template, text, req.suffix)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _think_markers(self) -> list[list[int]]:
        """The ids of the reasoning models' open and close markers (a thinking budget forces the
        close one)."""
        if self.tokenizer is None:
            raise ValueError(f"max_thinking_tokens and require_reasoning: {self._no_tokenizer} (the markers are text)")
        return self.think_marker_ids

    def _prediction(self, req: GenerateReq) -> list[int]:
        """The predicted output's tokens: a draft source when the scheduler speculates (none
        without a tokenizer, or past what a context holds)."""
        assert self.info is not None
        if not req.options.prediction or self.tokenizer is None or not self.info.speculative:
            return []
        text = req.options.prediction[: self.info.context_len * MAX_CHARS_PER_TOKEN]
        return self.tokenizer.encode(text, add_special_tokens=False)[: self.info.context_len]

    def _length_error(self, req: GenerateReq, n: int) -> str | None:
        """Why a prompt of n tokens cannot run with this request's max_new_tokens (None: it can;
        under ``fill_context`` the answer takes what the context leaves)."""
        assert self.info is not None
        limit = self.info.context_len
        if n == 0:
            return "the prompt is empty"
        if n >= limit:
            return context_overflow(limit, n)
        if not req.fill_context and n + req.sampling.max_new_tokens > limit:
            return context_overflow(limit, n, req.sampling.max_new_tokens)
        return None

    def _check_length(self, req: GenerateReq, n: int) -> None:
        error = self._length_error(req, n)
        if error is not None:
            raise ValueError(error)
        if req.fill_context:  # what the context leaves, within what the KV pool can hold
            assert self.info is not None
            pool = self.info.num_pages * self.info.page_size
            req.sampling.max_new_tokens = max(1, min(self.info.context_len, pool) - n)

    def _on_generate(self, reqs: list[GenerateReq]) -> None:
        """Tokenize one HTTP request's sequences; the accepted ones go on to the scheduler together."""
        accepted, refused = [], []
        for req in reqs:
            try:
                ids = self._encode(req)
                self._check_length(req, len(ids))
                # The options' token-id forms; the predicted text itself goes no further.
                options = msgspec.structs.replace(
                    req.options,
                    prediction=None,
                    prediction_ids=self._prediction(req),
                    think_markers=self._think_markers() if req.options.thinks else [],
                )
            except ValueError as e:
                refused.append(ReqUpdate(req.rid, error=str(e)))
                continue
            except Exception as e:  # a tokenizer or template failure must not take the process down
                logger.exception("could not tokenize request %s", req.rid)
                refused.append(ReqUpdate(req.rid, error=f"tokenization failed: {e}"))
                continue
            self.reqs[req.rid] = RequestState(req, ids, self.tokenizer, self.stream_interval)
            accepted.append(TokenizedReq(req.rid, ids, req.sampling, options))
        if refused:
            self.api.send(UpdateBatch(refused))
        if accepted:
            self.scheduler.send(TokenizedBatch(accepted))

    def _on_abort(self, msg: AbortReq) -> None:
        self.scheduler.send(msg)
        if self.reqs.pop(msg.rid, None) is not None:
            self.api.send(UpdateBatch([ReqUpdate(msg.rid, finish_reason=msg.reason)]))

    # ---- tokens out ----------------------------------------------------------------------------

    def _on_tokens(self, batch: TokenBatch) -> None:
        updates = []
        for out in batch.items:
            state = self.reqs.get(out.rid)
            if state is None:  # ended here already (stop string, abort); late tokens are dropped
                continue
            if out.error is not None:
                del self.reqs[out.rid]
                updates.append(ReqUpdate(out.rid, error=out.error))
                continue
            try:
                upd = state.update(out)
            except StopRegexTooSlow as e:  # ended here: the scheduler stops it too
                del self.reqs[out.rid]
                self.scheduler.send(AbortReq(out.rid, "abort"))
                updates.append(ReqUpdate(out.rid, error=str(e)))
                continue
            if upd.finish_reason is not None:
                del self.reqs[out.rid]
                if out.finish_reason is None:  # a stop string: the scheduler still runs it
                    self.scheduler.send(AbortReq(out.rid, "stop"))
            upd = state.coalesce(upd)
            if upd is not None:
                updates.append(upd)
        if updates:
            self.api.send(UpdateBatch(updates))


def run_tokenizer(
    addrs: Addresses,
    tokenizer_path: str | None,
    log_level: str,
    chat_template: str | None = None,
    stream_interval: int = 1,
    tool_call_parser: str | None = None,
    completion_template: str | None = None,
    skip_init: bool = False,
) -> None:
    """Process entry point (spawned by the launcher)."""
    become_child()
    keep_torch_out()
    init_logging(log_level)
    TokenizerProcess(
        addrs, tokenizer_path, chat_template, stream_interval, tool_call_parser, completion_template, skip_init
    ).run()
