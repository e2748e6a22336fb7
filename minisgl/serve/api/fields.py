"""Which request fields the server honours, accepts as inert, or refuses: SGLang's and OpenAI's.

Real clients send fields this server has no use for (the smg router sends ``log_metrics`` and
``return_bytes``, the openai client ``user``), so refusing every unknown field breaks them.
Dropping one that changes the result, though, returns wrong answers without a word (lm-eval
scored a wrong accuracy when ``echo`` was dropped). Each schema below sorts a body's fields into:

- implemented: the fields of the route's Struct (``api.protocol``; a field added there is
  implemented), and ``implemented`` for a nested object's;
- ``inert``: accepted whatever the value (routing hints, logging switches, cache salts);
- ``default_only``: accepted at their default (or null), refused by name otherwise, because
  another value would change the result and is not implemented yet;
- anything else: ignored with one warning per field name, as vLLM does.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("minisgl.serve.api")
_warned: set[str] = set()
# The fields of the request being read that no schema knows (the API's middleware names them in
# a response header; --strict-request-fields refuses them).
IGNORED: ContextVar[list[str] | None] = ContextVar("ignored_fields", default=None)


class UnsupportedField(ValueError):
    """A field whose value would change results in a way this server does not implement yet."""

    def __init__(self, path: str, value: Any, why: str):
        super().__init__(f"{path}={value!r} is not supported yet{': ' + why if why else ''}")
        self.param = path


@dataclass
class Schema:
    name: str
    implemented: set[str] = field(default_factory=set)  # beyond the fields of the route's Struct
    inert: set[str] = field(default_factory=set)
    default_only: dict[str, Any] = field(default_factory=dict)  # field -> its default (a tuple: any of them)
    why: dict[str, str] = field(default_factory=dict)  # field -> what refusing it means
    nested: dict[str, Schema] = field(default_factory=dict)  # object fields sorted by their own schema

    def sort(self, body: dict[str, Any], prefix: str = "", known: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The implemented fields of ``body`` (``known``: the fields of the route's Struct, and
        ``implemented``; nested objects sorted in turn); refuses or warns about the rest as the
        schema says."""
        kept: dict[str, Any] = {}
        for key, value in body.items():
            path = f"{prefix}{key}"
            if key in self.implemented or key in known:
                kept[key] = self._nested(key, value, path)
            elif key in self.inert:
                continue
            elif key in self.default_only:
                if not _is_default(value, self.default_only[key]):
                    raise UnsupportedField(path, value, self.why.get(key, ""))
            else:
                ignored = IGNORED.get()
                if ignored is not None:
                    ignored.append(path)
                if path not in _warned:
                    _warned.add(path)
                    logger.warning("ignoring the request field %r: no %s field has that name", path, self.name)
        return kept

    def _nested(self, key: str, value: Any, path: str) -> Any:
        schema = self.nested.get(key)
        if schema is None:
            return value
        if isinstance(value, dict):
            return schema.sort(value, f"{path}.")
        if isinstance(value, list):
            return [schema.sort(v, f"{path}[{i}].") if isinstance(v, dict) else v for i, v in enumerate(value)]
        return value


def _is_default(value: Any, default: Any) -> bool:
    """null, the default, one of several defaults, or an empty list, object or (where the default
    is null) string: SGLang's own benchmarks send ``"lora_path": ""`` for no adapter."""
    if value is None or value == default or (isinstance(value, (list, dict)) and not value):
        return True
    if default is None and value == "":
        return True
    return isinstance(default, tuple) and value in default


LEGACY_FUNCTIONS = "the legacy functions API is not supported; use tools and tool_choice"
MULTIMODAL = "this server serves text-only models"
CUSTOM_PROCESSOR = (
    "request code is never run; SGLang's thinking-budget processors are served on /generate and chat completions"
)

SAMPLING = Schema(
    "SGLang sampling_params",
    implemented={
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "logit_bias",
        "seed",
        "sampling_seed",
        "n",
        "min_new_tokens",
        "stream_interval",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "stop_regex",
        "custom_params",
    },
)

GENERATE = Schema(
    "SGLang /generate",
    inert={
        "model",
        "session_id",  # SGLang: a session's identity for routing and metrics; the prompt is unchanged
        "kv_router_hint",
        "encoder_urls",
        "log_metrics",
        "background",
        "return_bytes",
        "custom_labels",
        "external_trace_header",
        "received_time",
        "conversation_id",
        "priority",
        "routing_key",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "stream_options",
    },
    default_only={
        "input_embeds": None,
        "image_data": None,
        "video_data": None,
        "audio_data": None,
        "use_audio_in_video": False,
        "return_indexer_topk": False,
        "modalities": None,
        "session_params": None,
        "lora_id": None,
        "positional_embed_overrides": None,
        "bootstrap_host": None,
        "bootstrap_port": None,
        "bootstrap_room": None,
        "bootstrap_pair_key": None,
        "decode_tp_size": None,
        "need_wait_for_mm_inputs": None,
        "num_items_assigned": None,
        "max_dynamic_patch": None,
        "min_dynamic_patch": None,
        "image_max_dynamic_patch": None,
        "video_max_dynamic_patch": None,
        "multi_item_delimiter_indices": None,
        "mm_hashes": None,
        "mm_content_hashes": None,
        "video_config": None,
        "images_config": None,
        "return_sampling_mask": False,
        "return_flat_raw_top_logprobs": False,
        "return_flat_raw_top_logprobs_b64": False,
    },
    why={
        "input_embeds": MULTIMODAL,
        "image_data": MULTIMODAL,
        "video_data": MULTIMODAL,
        "audio_data": MULTIMODAL,
        "mm_hashes": MULTIMODAL,
        "mm_content_hashes": MULTIMODAL,
        "video_config": MULTIMODAL,
        "images_config": MULTIMODAL,
    },
    nested={"sampling_params": SAMPLING},
)

STREAM_OPTIONS = Schema("OpenAI stream_options", implemented={"include_usage", "continuous_usage_stats"})

_OPENAI_COMMON = dict(
    inert={
        "session_id",
        "ngram_corpus_id",  # SGLang: an n-gram corpus for drafting; drafts change no token
        "custom_labels",
        "custom_params",  # (read only by custom logit processors, refused on these routes)
        "disagg_prefill_dp_rank",
        "store",
        "metadata",
        "service_tier",
        "priority",
        "data_parallel_rank",
        "routed_dp_rank",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "stream_reasoning",
        "separate_reasoning",
        "return_text_in_logprobs",
    },
    default_only={"session_params": None, "custom_logit_processor": None, "images_config": None},
    why={"images_config": MULTIMODAL, "custom_logit_processor": CUSTOM_PROCESSOR},
)

COMPLETION = Schema(
    "OpenAI completions",
    inert=_OPENAI_COMMON["inert"],
    default_only=_OPENAI_COMMON["default_only"],
    why=_OPENAI_COMMON["why"],
    nested={"stream_options": STREAM_OPTIONS},
)

MESSAGE = Schema(
    "OpenAI chat message",
    implemented={"role", "content", "name", "tool_calls", "tool_call_id"},
    inert={"reasoning_content", "refusal"},
    default_only={"function_call": None, "audio": None},
    why={"function_call": LEGACY_FUNCTIONS},
)

CHAT = Schema(
    "OpenAI chat completions",
    # task: DeepSeek-V4's quick-instruction token, which SGLang's other templates ignore too
    inert=(_OPENAI_COMMON["inert"] - {"separate_reasoning", "stream_reasoning", "custom_params"})
    | {"modalities", "task"},
    default_only={
        **{k: v for k, v in _OPENAI_COMMON["default_only"].items() if k != "custom_logit_processor"},
        "functions": None,
        "function_call": None,
        "audio": None,
        "web_search_options": None,
        "max_dynamic_patch": None,
        "min_dynamic_patch": None,
        "use_audio_in_video": False,
        "return_sampling_mask": False,
        "return_spec_tokens_details": False,
    },
    why={
        **_OPENAI_COMMON["why"],
        "functions": LEGACY_FUNCTIONS,
        "function_call": LEGACY_FUNCTIONS,
        "max_dynamic_patch": MULTIMODAL,
        "min_dynamic_patch": MULTIMODAL,
        "use_audio_in_video": MULTIMODAL,
    },
    nested={"stream_options": STREAM_OPTIONS, "messages": MESSAGE},
)

RESPONSES = Schema(
    "OpenAI responses",
    inert={
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "context_management",
        "stream_options",
        "extra_key",
        "rid",
        "request_id",
        "priority",
        "max_tool_calls",  # OpenAI's bound on calls to its built-in tools: function tools only here
    },
    default_only={
        "conversation": None,
        "prompt": None,
        "stop_regex": None,
    },
    why={
        "conversation": "conversations are not supported; continue with previous_response_id",
        "prompt": "stored prompt templates are not supported",
    },
)

TOKENIZE = Schema("SGLang tokenize")
DETOKENIZE = Schema("SGLang detokenize")

SCORE = Schema(
    "SGLang score",
    inert={"rid", "user"},
)
