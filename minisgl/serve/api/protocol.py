"""Request bodies of the HTTP API as msgspec Structs, and their translation to GenerateReq.

A body is parsed, its fields sorted by the route's schema (``api.fields``: implemented, inert,
refused unless default, or unknown and ignored with a warning), and the implemented ones
converted to the route's Struct, which gives the type errors for free ("Expected `int`, got
`str` - at `$.max_tokens`"); range checks that msgspec cannot express live in ``check`` and in
SamplingParams.validate.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

import msgspec

from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import Schema, UnsupportedField
from minisgl.serve.parsers.tool_calls import required_schema
from minisgl.wire.options import RequestOptions
from minisgl.wire.requests import ChatMessage
from minisgl.wire.sampling import Int32, Int64, SamplingParams

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_IDS = 4096  # token_ids_logprob entries per prompt
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# A name the server keeps and echoes in answers (an adapter's, a weight version): bounded, so one
# request cannot make every later answer carry megabytes.
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def decode(body: bytes, kind: type, schema: Schema | None = None) -> Any:
    """``body`` as a ``kind``; with a ``schema``, only the fields it implements reach ``kind``."""
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        if _SURROGATE.search(body):  # msgspec calls a lone surrogate escape "truncated"
            raise BadRequest("malformed JSON: a \\u escape is a lone UTF-16 surrogate (not a character)") from None
        try:  # (msgspec 0.23 reports bad UTF-8 as a DecodeError, older ones as UnicodeDecodeError)
            body.decode()
        except UnicodeDecodeError as bad:
            where = f"{bad.reason} at byte {bad.start}"
            raise BadRequest(f"malformed JSON: a string is not valid UTF-8 ({where})") from None
        raise BadRequest(f"malformed JSON: {e}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(raw).__name__}")
    try:
        known = frozenset(kind.__struct_encode_fields__)
        return msgspec.convert(schema.sort(raw, known=known) if schema else raw, type=kind)
    except UnsupportedField as e:
        raise BadRequest(str(e), param=e.param) from None
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}", param=_error_path(str(e))) from None


def _error_path(message: str) -> str | None:
    """The field a msgspec error names ("... - at `$.sampling_params.temperature`"; a missing
    one: "Object missing required field `prompt`", under the object's path if it has one)."""
    at = message.rfind("at `$.")
    where = message[at + len("at `$.") :].rstrip("`") if at >= 0 else None
    missing = re.match(r"Object missing required field `([^`]+)`", message)
    if missing is None:
        return where
    return f"{where}.{missing.group(1)}" if where else missing.group(1)


class SamplingIn(SamplingParams, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params: SamplingParams plus the fields the API itself handles."""

    n: Int32 = 1
    sampling_seed: Int64 | None = None
    custom_params: dict[str, Any] | None = None  # read by SGLang's thinking-budget processor (thinking_budget)

    def params(self, choice: int = 0) -> SamplingParams:
        """Choice ``choice``'s parameters (a given seed is offset so the n choices differ)."""
        fields = {f: getattr(self, f) for f in SamplingParams.__struct_fields__}
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        fields["seed"] = None if seed is None else seed + choice
        params = SamplingParams(**fields)
        _validate(params)
        return params


def per_prompt(value: Any, name: str, count: int, default: Any) -> list[Any]:
    """A field given once for every prompt or as a list of one per prompt, as a list."""
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadRequest(f"{name} has {len(value)} entries for {count} prompts", param=name)
    return value


def cache_keys(extra_key: Any, cache_salt: Any, count: int) -> list[str | None]:
    """Each prompt's cache isolation key from SGLang's extra_key and cache_salt (each one for all
    or one per prompt): either isolates; given both, the pair does."""
    return [
        "\x00".join(k for k in (key, salt) if k) or None
        for key, salt in zip(
            per_prompt(extra_key, "extra_key", count, None), per_prompt(cache_salt, "cache_salt", count, None)
        )
    ]


class GenerateItem(msgspec.Struct):
    """One sequence of a /generate request, after batching and n are expanded."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    options: RequestOptions


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's native /generate: one prompt or a batch (``text`` or ``input_ids`` a list of
    them), one ``sampling_params`` or one per prompt, each prompt sampled ``n`` times."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: SamplingIn | list[SamplingIn] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    top_logprobs_num: Int32 | list[Int32] | None = None
    logprob_start_len: Int32 | list[Int32] | None = None
    token_ids_logprob: list[Any] | None = None  # ids, or a list of ids per prompt
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    extra_key: str | list[str] | None = None  # SGLang's cache isolation key (the OpenAI routes' cache_salt)
    cache_salt: str | list[str] | None = None  # SGLang's other one: prefixes shared only when both match
    return_prompt_token_ids: bool = False  # the prompt's token ids beside the output's (prompt_token_ids)
    return_entropy: bool = False  # each output token's distribution's entropy (output_token_entropy)
    max_thinking_tokens: Int32 | None = None  # a reasoning model's thinking budget (--reasoning-parser)
    require_reasoning: bool = False  # the output starts with thinking; a grammar applies after it
    custom_logit_processor: str | None = None  # SGLang's thinking-budget ones only (api/logit_processors.py)
    return_routed_experts: bool = False  # MoE: each position's experts (--enable-return-routed-experts)
    routed_experts_start_len: Int32 = 0  # from this position on (0: the whole prompt too)
    return_hidden_states: bool | list[bool] = False  # (--enable-return-hidden-states)
    lora_path: str | list[str | None] | None = None  # a loaded LoRA adapter's name, or one per prompt
    no_logs: bool = False

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (self.input_ids is not None and not all(map(_is_token, self.input_ids)))

    def _prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text or input_ids", param="text")
        if self.text is not None:
            prompts = [self.text] if isinstance(self.text, str) else list(self.text)
        elif self.input_ids and all(map(_is_token, self.input_ids)):
            prompts = [self.input_ids]
        elif self.input_ids and all(isinstance(x, list) and x and all(map(_is_token, x)) for x in self.input_ids):
            prompts = list(self.input_ids)
        else:
            raise BadRequest(
                f"input_ids must be a non-empty list of token ids in [0, {MAX_TOKEN_ID}] or a list of such lists",
                param="input_ids",
            )
        if not prompts:
            raise BadRequest("the batch is empty", param="text")
        return prompts

    def items(self, max_sequences: int | None = None) -> list[GenerateItem]:
        """The sequences to run, prompt by prompt, each prompt's n samples together; refused
        before any is built when there are more than ``max_sequences``."""
        prompts = self._prompts()
        count = len(prompts)
        sampling = per_prompt(self.sampling_params, "sampling_params", count, SamplingIn())
        if len({s.n for s in sampling}) > 1:
            raise BadRequest("every sampling_params of a batch must have the same n", param="sampling_params.n")
        n = sampling[0].n
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {n}", param="sampling_params.n")
        check_sequences(count * n, max_sequences)
        options = self._options(count, sampling)
        rids = self._rids(count * n, not self.is_batch and n == 1)
        return [
            GenerateItem(
                rids[i * n + j],
                prompt if isinstance(prompt, str) else None,
                None if isinstance(prompt, str) else prompt,
                sampling[i].params(j),
                msgspec.structs.replace(options[i]),  # (each sample its own)
            )
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]

    def _options(self, count: int, sampling: list[SamplingIn]) -> list[RequestOptions]:
        """Each prompt's request options, checked: a field that changes what a request returns
        or how it runs goes here (``RequestOptions``)."""
        want = per_prompt(self.return_logprob, "return_logprob", count, False)
        tops = per_prompt(self.top_logprobs_num, "top_logprobs_num", count, 0)
        starts = per_prompt(self.logprob_start_len, "logprob_start_len", count, -1)
        ids = self._logprob_ids(count)
        keys = cache_keys(self.extra_key, self.cache_salt, count)
        hidden = per_prompt(self.return_hidden_states, "return_hidden_states", count, False)
        loras = [name or None for name in per_prompt(self.lora_path, "lora_path", count, None)]  # "": none
        if self.routed_experts_start_len < 0:
            raise BadRequest("routed_experts_start_len must be >= 0", param="routed_experts_start_len")
        budgets = self._think_budgets(sampling)
        out = []
        for i in range(count):
            if not 0 <= tops[i] <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
            start = -1 if starts[i] is None or not want[i] else starts[i]
            if start < -1:
                raise BadRequest(
                    f"logprob_start_len must be -1 (outputs only) or >= 0, got {start}", param="logprob_start_len"
                )
            out.append(
                RequestOptions(
                    top_logprobs=tops[i] if want[i] else -1,
                    logprob_start=start,
                    logprob_ids=ids[i] if want[i] else [],
                    text_in_logprobs=self.return_text_in_logprobs,
                    entropy=self.return_entropy,
                    prompt_ids=self.return_prompt_token_ids,
                    routed_start=self.routed_experts_start_len if self.return_routed_experts else -1,
                    hidden_states=hidden[i],
                    cache_salt=keys[i],
                    lora=loras[i],
                    think_budget=budgets[i],
                    require_reasoning=self.require_reasoning,
                    no_logs=self.no_logs,
                )
            )
        return out

    def _think_budgets(self, sampling: list[SamplingIn]) -> list[int]:
        """Each prompt's thinking budget (-1: none): max_thinking_tokens, or the
        ``custom_params.thinking_budget`` of SGLang's thinking-budget logit processor (an unset,
        negative or non-integer one is no budget, as that processor reads it)."""
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise BadRequest("max_thinking_tokens must be >= 0", param="max_thinking_tokens")
        if self.custom_logit_processor is None:
            return [-1 if self.max_thinking_tokens is None else self.max_thinking_tokens] * len(sampling)
        from minisgl.serve.api.logit_processors import thinking_budget

        budgets = [thinking_budget(self.custom_logit_processor, s.custom_params) for s in sampling]
        if self.max_thinking_tokens is not None:
            raise BadRequest(
                "give max_thinking_tokens or a thinking-budget custom_logit_processor, not both",
                param="custom_logit_processor",
            )
        return budgets

    @property
    def thinking_budget_asked(self) -> str | None:
        """The field that asks for a thinking budget or the thinking first, if one does."""
        if self.max_thinking_tokens is not None:
            return "max_thinking_tokens"
        if self.require_reasoning:
            return "require_reasoning"
        return "custom_logit_processor" if self.custom_logit_processor is not None else None

    def _logprob_ids(self, count: int) -> list[list[int]]:
        """token_ids_logprob per prompt: one list for every prompt, or one list per prompt."""
        value = self.token_ids_logprob
        if not value:
            return [[]] * count
        per_prompt = value if isinstance(value[0], list) else [value] * count
        if not all(isinstance(ids, list) and all(map(_is_token, ids)) for ids in per_prompt):
            raise BadRequest(
                f"token_ids_logprob must be token ids in [0, {MAX_TOKEN_ID}] or a list of such lists",
                param="token_ids_logprob",
            )
        if len(per_prompt) != count:
            raise BadRequest(
                f"token_ids_logprob has {len(per_prompt)} lists for {count} prompts", param="token_ids_logprob"
            )
        if any(len(ids) > MAX_LOGPROB_IDS for ids in per_prompt):
            raise BadRequest(f"token_ids_logprob may name at most {MAX_LOGPROB_IDS} ids", param="token_ids_logprob")
        return [list(ids) for ids in per_prompt]

    def _rids(self, total: int, single: bool) -> list[str]:
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(total)]
        if isinstance(self.rid, str):
            return [self.rid] if single else [f"{self.rid}-{k}" for k in range(total)]
        if len(self.rid) != total:
            raise BadRequest(f"rid has {len(self.rid)} entries for {total} sequences", param="rid")
        return list(self.rid)


def check_sequences(total: int, limit: int | None) -> None:
    """Refuse a request for more sequences (prompts x n) than one request may run."""
    if limit is not None and total > limit:
        raise BadRequest(
            f"the request asks for {total} sequences (prompts x n); at most {limit} (--max-sequences-per-request)",
            param="n",
        )


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # every chunk carries the usage so far


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's response_format: text, a JSON object, or JSON following a schema; or SGLang's
    structural tag (xgrammar's ``format``, or the older ``structures`` with ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    at_least_one: bool | None = None

    def constraint(self) -> tuple[str, str] | None:
        """(SamplingParams field, text) of the constraint it asks for (None: text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.type == "structural_tag":
            if (self.format is None) == (self.structures is None):
                raise BadRequest(
                    "response_format of type structural_tag needs a format or structures", param="response_format"
                )
            given = {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}
            return "structural_tag", json.dumps(given)
        if self.json_schema is None:
            raise BadRequest("response_format of type json_schema needs a json_schema", param="response_format")
        schema = self.json_schema.schema
        return "json_schema", json.dumps(schema if schema is not None else {})


class _OpenAIBase(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/completions and /v1/chat/completions, plus SGLang's extras."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's
    return_hidden_states: bool = False  # SGLang's: each choice's last hidden state (--enable-return-hidden-states)
    lora_path: str | list[str | None] | None = None  # SGLang's: a loaded adapter's name (one per prompt)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Int64 | None = None
    user: str | None = None
    cache_salt: str | list[str] | None = None  # cached prefixes are shared only among requests with the same salt
    extra_key: str | list[str] | None = None  # SGLang's other isolation key (both: the pair isolates)
    top_k: Int32 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    min_tokens: Int32 = 0
    response_format: ResponseFormat | None = None
    json_schema: str | None = None  # SGLang's extensions: constrain the output directly
    regex: str | None = None
    ebnf: str | None = None
    # Token in, token out (SGLang's and vLLM's): each choice's token_ids and prompt_token_ids.
    return_token_ids: bool = False
    # SGLang's: the routed experts (of the first choice, as SGLang answers) and where the cached
    # prompt tokens came from, both in the response's ``sglext``.
    return_routed_experts: bool = False
    routed_experts_start_len: Int32 = 0
    return_cached_tokens_details: bool = False
    rid: str | list[str] | None = None  # SGLang's: the request's id (one per prompt), for /abort_request

    def _check_common(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if not 0.0 <= self.temperature <= 2.0:
            raise BadRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if self.routed_experts_start_len < 0:
            raise BadRequest("routed_experts_start_len must be >= 0", param="routed_experts_start_len")

    def sampling(self, max_tokens: int | None, choice: int) -> SamplingParams:
        """Choice ``choice``'s parameters (a given seed is offset so the n choices differ)."""
        params = SamplingParams(
            max_new_tokens=max_tokens or 0,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop,
            stop_regex=self.stop_regex,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.no_stop_trim,
            logit_bias=self.logit_bias,
            min_new_tokens=min(self.min_tokens, max_tokens) if max_tokens else self.min_tokens,
            json_schema=self.json_schema,
            regex=self.regex,
            ebnf=self.ebnf,
        )
        constraint = self.response_format.constraint() if self.response_format is not None else None
        if constraint is not None:
            if params.grammar is not None:
                raise BadRequest(f"response_format and {params.grammar[0]} cannot be combined", param="response_format")
            setattr(params, *constraint)
        _validate(params)
        return params

    def sequence_ids(self, prefix: str, prompts: int) -> tuple[str, list[str]]:
        """(the response's id, each sequence's: prompts x n, prompt-major). A given ``rid`` is
        the id (``rid-k`` for each of several sequences; a list gives each prompt its own, as
        SGLang takes them), so /abort_request finds the request by it; else ``prefix-<hex>``."""
        if self.rid is None:
            cid = f"{prefix}-{uuid.uuid4().hex}"
            return cid, [f"{cid}-{k}" for k in range(prompts * self.n)]
        if isinstance(self.rid, str):
            total = prompts * self.n
            return self.rid, [self.rid] if total == 1 else [f"{self.rid}-{k}" for k in range(total)]
        if len(self.rid) != prompts or not all(self.rid):
            raise BadRequest(f"rid has {len(self.rid)} entries for {prompts} prompts", param="rid")
        ids = [r if self.n == 1 else f"{r}-{j}" for r in self.rid for j in range(self.n)]
        return self.rid[0], ids

    @property
    def routed_start(self) -> int:
        """The first position whose routed experts come back (-1: none asked)."""
        return self.routed_experts_start_len if self.return_routed_experts else -1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_OpenAIBase, kw_only=True):
    prompt: Any  # a string, a list of strings, a list of token ids, or a list of those lists
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    best_of: Int32 | None = None
    echo: bool = False  # the prompt (and, with logprobs, its logprobs) before the completion
    suffix: str | None = None  # the text after the completion: the model fills the hole between (FIM)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(_is_token(t) for t in p):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in p):
            return list(p)
        raise BadRequest(
            "prompt must be a non-empty string, list of strings, list of token ids, or list of token-id lists",
            param="prompt",
        )

    def check(self) -> None:
        self._check_common(self.max_tokens if not (self.echo and self.max_tokens == 0) else None)
        if self.best_of not in (None, self.n):
            raise BadRequest(f"best_of={self.best_of} is not supported yet: only best_of equal to n", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        if self.suffix:
            if self.echo:
                raise BadRequest("suffix and echo cannot be combined", param="suffix")
            if not all(isinstance(p, str) for p in self.prompts()):
                raise BadRequest("suffix needs text prompts (the hole is filled between texts)", param="suffix")

    @property
    def top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text, as OpenAI sends it


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    """A call in an assistant message of the history."""

    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"
    index: int | None = None  # sent back by clients that echo streamed calls


def parts_text(content: str | list[ContentPart] | None, param: str) -> str:
    """Message content as text: a string, or text parts joined (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise BadRequest(f"{param} content of type {part.type!r} is not supported; only text", param=param)
        texts.append(part.text)
    return "".join(texts)


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's predicted output: text the answer will largely repeat (a file being edited).
    No result depends on it; with speculative decoding on, its tokens are drafts."""

    content: str | list[ContentPart]
    type: Literal["content"] = "content"


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def flat(self) -> ChatMessage:
        calls = None
        if self.tool_calls:
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments or "{}"},
                }
                for c in self.tool_calls
            ]
        return ChatMessage(self.role, parts_text(self.content, "messages"), calls, self.tool_call_id, self.name)


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """tool_choice naming the function to call."""

    function: NamedFunction
    type: Literal["function"] = "function"


class ToolPlan(msgspec.Struct):
    """What a chat request's tools mean for its run: the definitions the template shows, the
    format its answer is read in, and the grammar forcing a call (required or named)."""

    tools: list[dict[str, Any]] | None = None
    fmt: str | None = None  # a ToolCallParser format; None: the answer is plain content
    name: str | None = None  # the named function
    schema: str | None = None  # JSON schema text the answer is constrained to


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TRUE_WORDS = ("1", "true", "yes", "y", "on")


def _check_effort(effort: Any, param: str) -> None:
    """A reasoning effort: one of OpenAI's (and SGLang's) words, or SGLang's number in [0, 0.99]."""
    if isinstance(effort, bool) or not (
        effort in Effort.__args__ or (isinstance(effort, (int, float)) and 0.0 <= effort <= 0.99)
    ):
        raise BadRequest(f"{param} must be one of {', '.join(Effort.__args__)} or a number in [0, 0.99]", param=param)


class ChatCompletionRequest(_OpenAIBase, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: a template variable for templates that take it (gpt-oss's); as in SGLang, any
    # effort but "none" also turns thinking on (thinking, enable_thinking), "none" off. SGLang
    # also takes a number in [0, 0.99].
    reasoning_effort: Effort | float | None = None
    reasoning: dict[str, Any] | None = None  # SGLang's: {"effort", "enabled"} (the effort wins over reasoning_effort)
    separate_reasoning: bool = True  # SGLang: reasoning_content apart from content (with --reasoning-parser)
    stream_reasoning: bool = True  # SGLang: false sends the reasoning whole once it ends
    prediction: Prediction | None = None
    # SGLang's and vLLM's: the last message (an assistant's start) is continued, not answered
    continue_final_message: bool = False
    return_prompt_token_ids: bool = False  # SGLang's: each choice's prompt_token_ids
    return_meta_info: bool = False  # SGLang's: each choice's /generate meta_info (logprobs with logprobs)
    input_ids: list[Any] | None = None  # SGLang's: the rendered prompt's ids, used instead of the template's
    # SGLang's thinking-budget logit processor and its custom_params.thinking_budget (api/logit_processors.py)
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None

    def think_budget(self) -> int:
        """The thinking budget a thinking-budget logit processor asks for (-1: none)."""
        if self.custom_logit_processor is None:
            return -1
        from minisgl.serve.api.logit_processors import thinking_budget

        return thinking_budget(self.custom_logit_processor, self.custom_params)

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with the reasoning effort and whether to think among them when
        the request gives them (chat_template_kwargs' own values win)."""
        effort, thinking = self.reasoning_effort, None
        if self.reasoning is not None:
            given = self.reasoning.get("effort", self.reasoning.get("reasoning_effort"))
            effort = given if given is not None else effort
            enabled = self.reasoning.get("enabled", self.reasoning.get("enable"))
            if enabled is True or (isinstance(enabled, str) and enabled.strip().lower() in TRUE_WORDS):
                thinking = True
        if effort is not None:
            _check_effort(
                effort, "reasoning.effort" if self.reasoning and "effort" in self.reasoning else "reasoning_effort"
            )
            thinking = effort != "none"
        kwargs = dict(self.chat_template_kwargs or {})
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        if thinking is not None:  # Qwen3's and GLM's templates read enable_thinking, DeepSeek's and Kimi's thinking
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("enable_thinking", thinking)
        return kwargs or None

    def tool_plan(self, parser: str | None) -> ToolPlan:
        """How this request's tools run, given the server's tool-call format (None: unknown)."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none" or not self.tools:
            if choice not in ("none", "auto"):
                raise BadRequest("tool_choice needs tools", param="tool_choice")
            return ToolPlan()
        tools = [msgspec.to_builtins(t) for t in self.tools]
        constrained = (self.response_format is not None and self.response_format.type != "text") or any(
            (self.json_schema, self.regex, self.ebnf)
        )
        if choice != "auto" and constrained:
            raise BadRequest(
                "a forced tool_choice cannot be combined with another output constraint", param="tool_choice"
            )
        if choice == "auto":
            if parser is None:
                raise BadRequest(
                    "tools with tool_choice 'auto' need the server started with --tool-call-parser "
                    "(this chat template's format is not known)",
                    param="tools",
                )
            return ToolPlan(tools, parser)
        if choice == "required":
            return ToolPlan(tools, "array", schema=json.dumps(required_schema(tools, self.parallel_tool_calls)))
        wanted = next((t for t in tools if t["function"]["name"] == choice.function.name), None)
        if wanted is None:
            raise BadRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
            )
        params = wanted["function"].get("parameters") or {"type": "object"}
        return ToolPlan(tools, "named", choice.function.name, json.dumps(params))

    def check(self) -> None:
        self._check_common(self.max_new_tokens)
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")
        if self.input_ids is not None and not (self.input_ids and all(map(_is_token, self.input_ids))):
            raise BadRequest(
                f"input_ids must be a non-empty list of token ids in [0, {MAX_TOKEN_ID}]", param="input_ids"
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    @property
    def wants_prompt_ids(self) -> bool:
        return self.return_prompt_token_ids or self.return_token_ids


class ProfileRequest(msgspec.Struct):
    """/start_profile's body (SGLang's fields; an empty body takes the defaults). Only the
    trace's shape depends on them, never a result."""

    output_dir: str | None = None  # inside --profile-dir (relative: to it); default: --profile-dir itself
    num_steps: Int32 | None = None  # stop after this many model steps (default: at /stop_profile)
    activities: list[str] | None = None  # CPU, GPU (default both)
    profile_prefix: str | None = None
    start_step: Int32 | None = None  # accepted; tracing starts with the next step
    profile_by_stage: bool = False  # accepted; prefill and decode share one trace
    merge_profiles: bool = False  # accepted; one trace per rank
    with_stack: bool | None = None
    record_shapes: bool | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /tokenize: one text or a list of them."""

    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None

    def texts(self, max_sequences: int | None) -> list[str]:
        texts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        check_sequences(len(texts), max_sequences)
        return texts


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /detokenize: one list of token ids or a list of them."""

    tokens: list[Any]
    skip_special_tokens: bool = True
    model: str | None = None

    @property
    def is_batch(self) -> bool:
        return bool(self.tokens) and isinstance(self.tokens[0], list)

    def ids(self, max_sequences: int | None) -> list[list[int]]:
        lists = self.tokens if self.is_batch else [self.tokens]
        if not all(isinstance(ids, list) and all(map(_is_token, ids)) for ids in lists):
            raise BadRequest(
                f"tokens must be a list of token ids in [0, {MAX_TOKEN_ID}] or a list of such lists", param="tokens"
            )
        check_sequences(len(lists), max_sequences)
        return lists


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /v1/score: how likely each label token is to follow query + item (or item + query
    with ``item_first``), for each item; text and token ids, not mixed."""

    query: str | list[int] | None = None
    items: str | list[Any] | None = None  # texts, token id lists, or one of either
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False  # normalize over the label tokens (else each one's probability)
    item_first: bool = False
    model: str | None = None

    def prompts(self, max_sequences: int) -> list[str | list[int]]:
        """Each item's prompt (query and item joined), checked for shape and count."""
        if self.query is None or self.items is None:
            raise BadRequest("query and items are required", param="query" if self.query is None else "items")
        items: list = [self.items] if isinstance(self.items, str) or _is_ids(self.items) else list(self.items)
        if not items:
            raise BadRequest("items is empty", param="items")
        check_sequences(len(items), max_sequences)
        text = isinstance(self.query, str)
        if any(isinstance(it, str) != text or (not text and not _is_ids(it)) for it in items):
            raise BadRequest("query and items must all be text or all token id lists", param="items")
        if not text and not _is_ids(self.query):
            raise BadRequest("query must be text or a list of token ids", param="query")
        if not self.label_token_ids or not all(_is_token(t) for t in self.label_token_ids):
            raise BadRequest("label_token_ids must be a non-empty list of token ids", param="label_token_ids")
        return [it + self.query if self.item_first else self.query + it for it in items]


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(_is_token(t) for t in x)


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    rid: str | None = None
    abort_all: bool = False


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID


def _validate(params: SamplingParams) -> None:
    try:
        params.validate()
    except ValueError as e:
        raise BadRequest(str(e), param=str(e).split(" ", 1)[0]) from None
