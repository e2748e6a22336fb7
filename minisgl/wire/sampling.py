"""SamplingParams: per-request decoding settings, with SGLang's field names."""

from __future__ import annotations

from typing import Annotated

import msgspec
import regex

# Integer fields are bounded when decoded, so no value can overflow a tensor or a message.
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024


# The output constraints, at most one per request.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """temperature 0 means greedy. top_k <= 0 (SGLang uses -1) disables top-k.

    ``seed`` makes sampling reproducible for this request whatever else shares its batch.
    """

    max_new_tokens: Int32 = 128
    min_new_tokens: Int32 = 0  # EOS and stop tokens cannot end it before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int32 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: ends the output at a match (kept in the text)
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Slow (Python) tokenizers put a space between special tokens unless told not to; fast ones,
    # which decode in Rust, never do, as in transformers.
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string at the end of the text
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> added logit
    stream_interval: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] | None = None  # tokens per streamed update
    # Structured output (at most one): the tokens must follow a JSON schema, a regex or an EBNF
    # grammar; or free text whose tagged parts follow JSON schemas (a structural tag: xgrammar's
    # JSON, or SGLang's older {"structures": [{"begin", "schema", "end"}], "triggers"}).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return _listed(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        return _listed(self.stop_regex)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output's constraint: json_schema, regex, ebnf or structural_tag
        (validate checks that at most one is given)."""
        for kind in GRAMMAR_KINDS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field that is out of range."""
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
            (
                0 <= self.min_new_tokens and (self.max_new_tokens == 0 or self.min_new_tokens <= self.max_new_tokens),
                "min_new_tokens",
                "must be in [0, max_new_tokens]",
            ),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} cannot be combined: give at most one constraint")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
            for key, bias in self.logit_bias.items():
                if not key.isdigit() or int(key) >= 2**31:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for {key}")
                if vocab_size is not None and int(key) >= vocab_size:
                    raise ValueError(f"logit_bias token {key} is outside the vocabulary [0, {vocab_size})")
        if self.stop_token_ids and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        if self.stop_token_ids and min(self.stop_token_ids) < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {min(self.stop_token_ids)}")
        # (ids past the vocabulary are accepted and never match, as SGLang's own tests expect:
        # they send one model's stop ids to every model)
        for pattern in self.stop_regexes:
            try:
                regex.compile(pattern)
            except regex.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None


def _listed(value: str | list[str] | None) -> list[str]:
    """A field that takes one string or a list of them, as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
