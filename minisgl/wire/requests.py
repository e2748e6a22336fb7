"""Requests and their outputs between the API, tokenizer and scheduler processes."""

from __future__ import annotations

from typing import Any

import msgspec

from minisgl.wire.control import ControlReply, ControlReq
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams


class ChatMessage(msgspec.Struct):
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls: {"type", "function": {name, arguments}}
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None


class GenerateReq(msgspec.Struct):
    """One sequence to generate: exactly one of text, input_ids or messages (rendered by the chat
    template), with what it asks for beyond sampling (``options``)."""

    rid: str
    sampling: SamplingParams
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    fill_context: bool = False  # max_new_tokens becomes whatever context the prompt leaves
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking, ...)
    continue_final: bool = False  # continue_final_message: the last message is left open and continued
    truncate: bool = False  # the Responses API's truncation "auto": the oldest messages dropped to fit
    suffix: str | None = None  # completions' suffix: the text after the hole a fill-in-the-middle prompt fills


class GenerateBatch(msgspec.Struct, tag=True):
    """API -> tokenizer: the sequences of one HTTP request (prompts x n), sent as one message and
    passed on as one ``TokenizedBatch``, so the scheduler sees them all at once and prefills them
    in one step rather than one per step as they trickle in."""

    reqs: list[GenerateReq]


class TokenizedReq(msgspec.Struct):
    """One sequence, tokenized."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions


class TokenizedBatch(msgspec.Struct, tag=True):
    """Tokenizer -> scheduler: the accepted sequences of one ``GenerateBatch``."""

    reqs: list[TokenizedReq]


class AbortReq(msgspec.Struct, tag=True):
    """Ends a request wherever it is. reason "stop" comes from a matched stop string."""

    rid: str
    reason: str = "abort"


class TextReq(msgspec.Struct, tag=True):
    """API -> tokenizer, answered there by TextReply (SGLang's /tokenize and /detokenize): token
    ids of ``texts`` (``special_tokens``: add the template's BOS and the like), or the texts of
    ``ids`` (``special_tokens``: keep them in the text)."""

    cid: int
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    special_tokens: bool = True


class TextReply(msgspec.Struct, tag=True):
    cid: int
    ids: list[list[int]] = []
    texts: list[str] = []
    error: str | None = None  # why the tokenizer could not answer (no tokenizer, an id it lacks)


class TokenOut(msgspec.Struct, array_like=True):
    """New tokens of one request since the last message. The first message after admission has
    no tokens (it tells the API the request was accepted); ``error`` means it was refused."""

    rid: str
    tokens: list[int] = []
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    finish_reason: str | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, those the host tier supplied
    error: str | None = None
    # With the first token of a request that asked for prompt logprobs: positions
    # input_start.. of the prompt, each its logprob given the tokens before it.
    input_start: int = 0
    input_logprobs: list[float] = []
    input_top_ids: list[list[int]] = []
    input_top_logprobs: list[list[float]] = []
    id_logprobs: list[list[float]] = []  # per token, the logprobs of the request's logprob_ids
    input_id_logprobs: list[list[float]] = []
    entropy: list[float] = []  # per token, its distribution's entropy (requests that ask)
    # With the last message, if asked: int32 [positions, layers, k] expert ids of every position
    # the model computed for it (prompt and outputs but the last); float32 [positions, hidden]
    # last hidden states of every position.
    routed_experts: bytes = b""
    hidden_states: bytes = b""
    # (a server that speculates) the request's verify steps, draft tokens and accepted ones so far
    spec: list[int] = []


class TokenBatch(msgspec.Struct, tag=True):
    """Scheduler -> tokenizer: one step's outputs."""

    items: list[TokenOut]


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    text: str
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: list[tuple[int, str, float]] = []
    ids: list[tuple[int, str, float]] = []  # the request's token_ids_logprob, in its order


class ReqUpdate(msgspec.Struct, array_like=True):
    """Tokenizer -> API: what one request produced since its last update, detokenized."""

    rid: str
    text: str = ""  # new text, safe to show (complete characters, no part of a stop string)
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    matched: str | None = None  # the stop string that finished it (finish_reason "stop")
    input_logprobs: list[TokenLogprob] = []  # the prompt's, from its logprob_start on (once)
    routed_experts: bytes = b""  # with the last update (``TokenOut.routed_experts``)
    hidden_states: bytes = b""  # with the last update (``TokenOut.hidden_states``)
    prompt_ids: list[int] = []  # with the first update, when the request asked (``GenerateReq.prompt_ids``)
    host_cached_tokens: int = 0  # of cached_tokens, those the host tier supplied
    entropy: list[float] = []  # per new token, when the request asked (``GenerateReq.entropy``)
    spec: list[int] = []  # ``TokenOut.spec``: the totals so far

    def then(self, later: ReqUpdate) -> ReqUpdate:
        """One update saying what this one and then ``later`` said (updates held back or queued
        are sent as one)."""
        return ReqUpdate(
            self.rid,
            self.text + later.text,
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            later.finish_reason,
            later.prompt_tokens or self.prompt_tokens,
            later.cached_tokens,
            later.error,
            later.matched,
            self.input_logprobs + later.input_logprobs,
            later.routed_experts or self.routed_experts,
            later.hidden_states or self.hidden_states,
            self.prompt_ids or later.prompt_ids,
            later.host_cached_tokens,
            self.entropy + later.entropy,
            later.spec or self.spec,
        )


class UpdateBatch(msgspec.Struct, tag=True):
    items: list[ReqUpdate]


class EngineInfo(msgspec.Struct, tag=True):
    """Sent once along the start-up chain (worker -> scheduler -> tokenizer -> launcher)."""

    model_path: str
    num_pages: int
    page_size: int
    context_len: int
    vocab_size: int
    max_running_requests: int = 0
    eos_ids: list[int] = []
    tool_call_parser: str | None = None  # the format of tool calls in answers (flag, or read from the template)
    kv_cache_dtype: str = ""  # the pool's element type, e.g. bfloat16 or float8_e4m3fn
    kv_bytes_per_token: int = 0  # K and V of one token over all layers (this rank's heads)
    quantization: str | None = None  # where the fp8 linear weights came from (online, or the checkpoint format)
    num_host_pages: int = 0  # the hierarchical cache's host pool (0: off)
    storage_fingerprint: str = ""  # what the KV bytes mean (model, layout, dtype): the disk tier's folder
    weight_version: str = "default"  # of the weights serving now (--weight-version, then each update's)
    device: str = "cpu"  # the workers' device type (the scheduler itself never loads torch)
    hidden_size: int = 0  # of the model's hidden states (rows of return_hidden_states)
    speculative: bool = False  # the scheduler drafts tokens (a request's predicted output is a draft source)
    lora_adapters: dict[str, str] = {}  # loaded LoRA adapters, name -> path (--lora-paths)
    # Hybrid models: rows of the state pool for prefix-cache snapshots, from ``state_snapshot_row``
    # on (0 of them: not a hybrid model), and one request's state in bytes (all its linear layers).
    state_snapshots: int = 0
    state_snapshot_row: int = 0
    state_bytes_per_request: int = 0

    @property
    def snapshot_rows(self) -> list[int] | None:
        """The state-pool rows a hybrid model's prefix cache keeps snapshots in (None: not hybrid)."""
        if not self.state_bytes_per_request:
            return None
        return list(range(self.state_snapshot_row, self.state_snapshot_row + self.state_snapshots))


ToTokenizer = GenerateBatch | AbortReq | ControlReq | ControlReply | TextReq | TokenBatch | EngineInfo


ToScheduler = TokenizedBatch | AbortReq | ControlReq


ToApi = UpdateBatch | ControlReply | TextReply
