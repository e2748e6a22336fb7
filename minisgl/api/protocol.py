"""Request bodies of the HTTP API as msgspec Structs, and their translation to GenerateReq.

Decoding with msgspec gives the type errors for free ("Expected `int`, got `str` - at
`$.max_tokens`"); range checks that msgspec cannot express live in ``check`` and in
SamplingParams.validate. Unknown fields are refused, so a typo never silently does nothing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from minisgl.messages import ChatMessage
from minisgl.sampling import SamplingParams
from minisgl.sampling.params import Int32, Int64

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_BODY_BYTES = 64 << 20
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
MAX_SEQUENCES = 256  # prompts x n in one request: more would crowd out everyone else's requests
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadRequest(ValueError):
    """A client error; ``status`` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def decode(body: bytes, kind: type) -> Any:
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body has {len(body)} bytes; at most {MAX_BODY_BYTES} are accepted", status=413)
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        if _SURROGATE.search(body):  # msgspec calls a lone surrogate escape "truncated"
            raise BadRequest("malformed JSON: a \\u escape is a lone UTF-16 surrogate (not a character)") from None
        raise BadRequest(f"malformed JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise BadRequest(f"malformed JSON: a string is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's native /generate."""

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Int32 = 0
    rid: str | None = None

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text or input_ids", param="text")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
        _validate(self.sampling_params)

    @property
    def top_logprobs(self) -> int:
        return self.top_logprobs_num if self.return_logprob else -1


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Int64 | None = None
    user: str | None = None
    top_k: Int32 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def _check_common(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if not 0.0 <= self.temperature <= 2.0:
            raise BadRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")

    def sampling(self, max_tokens: int | None, choice: int) -> SamplingParams:
        """Choice ``choice``'s parameters (a given seed is offset so the n choices differ)."""
        params = SamplingParams(
            max_new_tokens=max_tokens or 0, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            seed=None if self.seed is None else self.seed + choice, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )
        _validate(params)
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIBase, kw_only=True):
    prompt: Any  # a string, a list of strings, a list of token ids, or a list of those lists
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool = False

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
        raise BadRequest("prompt must be a non-empty string, list of strings, list of token ids, "
                         "or list of token-id lists", param="prompt")

    def check(self) -> None:
        self._check_common(self.max_tokens)
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")

    @property
    def top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def flat(self) -> ChatMessage:
        if self.content is None or isinstance(self.content, str):
            return ChatMessage(self.role, self.content or "")
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"message content of type {part.type!r} is not supported; only text",
                                 param="messages")
            texts.append(part.text)
        return ChatMessage(self.role, "".join(texts))


class ChatCompletionRequest(_OpenAIBase, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None

    def check(self) -> None:
        self._check_common(self.max_new_tokens)
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")
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
    if params.stop_token_ids is not None and any(t < 0 for t in params.stop_token_ids):
        raise BadRequest("stop_token_ids must be >= 0", param="stop_token_ids")
