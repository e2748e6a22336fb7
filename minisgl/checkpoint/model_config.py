"""ModelConfig: the parts of a Hugging Face config.json that the engine needs, read without transformers.

Reading the JSON ourselves keeps checkpoints written by transformers 4 (``rope_theta`` and
``rope_scaling``) and transformers 5 (``rope_parameters``) working the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the tokenizer and scheduler read configs too, and never load torch)
    from minisgl.device.layers.fp8_scheme import Fp8Scheme

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    # Hybrids: Gated DeltaNet layers with a gated full-attention layer every few (``layer_types``).
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# Multimodal checkpoints whose language model serves as the text-only architecture (their
# config.json nests it under ``text_config``; image inputs are refused by name at the API).
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None  # as the checkpoint's config.json has it
    quant: Fp8Scheme | None = None  # the linear layers' scheme, set by the loader from the above and the flags
    # Mixture of experts (0 experts: a dense model). Which layers are sparse follows Qwen2-MoE's
    # rule: every ``decoder_sparse_step``-th layer, except those in ``mlp_only_layers``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    qkv_bias_field: bool | None = None  # transformers 5 writes Qwen2's hard-coded q/k/v biases out
    # Hybrid models: each layer's kind ("linear_attention": Gated DeltaNet, "full_attention"),
    # the DeltaNet heads and the causal conv's width, and the rotary share of a head.
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    text_only: bool = False  # a multimodal checkpoint served as its language model

    @property
    def is_hybrid(self) -> bool:
        return self.architecture in HYBRID_ARCHITECTURES

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep KV (all but the Gated DeltaNet ones): the KV pool's layers."""
        return [i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] != "linear_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """The Gated DeltaNet layers: the state pool's layers."""
        return [i for i in range(self.num_layers) if self.layer_types and self.layer_types[i] == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *HYBRID_ARCHITECTURES)

    @property
    def qkv_bias(self) -> bool:
        # Qwen2 (and Qwen2-MoE) hard-code biases on q/k/v; the others follow attention_bias.
        if self.qkv_bias_field is not None:
            return self.qkv_bias_field
        return self.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or self.attention_bias

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        text_only = next((TEXT_MODEL_OF[a] for a in archs if a in TEXT_MODEL_OF), None)
        if text_only is not None:  # the language model's fields, under the text architecture
            raw = {**raw["text_config"], "architectures": [text_only]}
            archs = raw["architectures"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        num_heads = raw["num_attention_heads"]
        return cls(
            **_moe_fields(arch, raw),
            **_hybrid_fields(arch, raw),
            **_rope_fields(raw),
            architecture=arch,
            text_only=text_only is not None,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 0)
            if arch in HYBRID_ARCHITECTURES
            else raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=raw.get("quantization_config"),
        )

    @classmethod
    def from_path(cls, model_dir: str | Path, overrides: dict | None = None) -> "ModelConfig":
        """``model_dir``'s config.json with ``overrides`` merged in (--json-model-override-args)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config.json not found in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(merged(raw, overrides or {}))
        except KeyError as e:
            raise ValueError(f"{path} lacks the required field {e.args[0]!r}") from e

    def context_limit(self, requested: int | None) -> int:
        """The longest sequence we will serve: the model's limit, or the user's if smaller."""
        limit = self.max_position_embeddings
        if self.sliding_window and self.sliding_window < limit:
            # Full attention equals sliding-window attention only within the window.
            logger.warning("sliding_window=%d: capping the context to it", self.sliding_window)
            limit = self.sliding_window
        if requested is not None:
            if requested > limit:
                raise ValueError(f"--context-length {requested} exceeds the model's limit {limit}")
            limit = requested
        return limit


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The rotary embedding's fields, from rope_parameters (transformers 5) or rope_scaling."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    # Qwen3.5's multimodal rotary: for text every section reads the same position, which is the
    # plain rotary of these frequencies.
    rope.pop("mrope_section", None), rope.pop("mrope_interleaved", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")
    rope["rope_type"] = rope_type
    scaling = None if rope_type == "default" else rope
    return {"rope_theta": theta, "partial_rotary_factor": partial, "rope_scaling": scaling}


def _moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The expert fields as each family spells them: Mixtral's experts are ``intermediate_size``
    wide and always renormalized; transformers 5 re-saves Qwen3-MoE's ``num_experts`` as
    ``num_local_experts``."""
    fields: dict[str, Any] = {}
    if "qkv_bias" in raw:
        fields["qkv_bias_field"] = bool(raw["qkv_bias"])
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", *HYBRID_ARCHITECTURES):
        return fields
    if arch in HYBRID_ARCHITECTURES and not raw.get("num_experts"):
        return fields  # Qwen3.5 dense
    fields["num_experts"] = raw.get("num_experts") or raw["num_local_experts"]
    fields["num_experts_per_tok"] = raw["num_experts_per_tok"]
    if arch == "MixtralForCausalLM":
        fields["moe_intermediate_size"] = raw["intermediate_size"]
        fields["norm_topk_prob"] = True
        return fields
    fields["moe_intermediate_size"] = raw["moe_intermediate_size"]
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", arch in HYBRID_ARCHITECTURES))
    fields["decoder_sparse_step"] = raw.get("decoder_sparse_step", 1) or 1
    fields["mlp_only_layers"] = list(raw.get("mlp_only_layers") or [])
    if arch in ("Qwen2MoeForCausalLM", *HYBRID_ARCHITECTURES):
        fields["shared_expert_intermediate_size"] = raw.get("shared_expert_intermediate_size", 0)
    return fields


def _hybrid_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet fields; ``layer_types`` from the config, or (older Qwen3-Next
    configs) one full-attention layer every ``full_attention_interval``."""
    if arch not in HYBRID_ARCHITECTURES:
        return {}
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        every = raw.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must name linear_attention or full_attention for each of the {layers} layers")
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    return {
        "layer_types": list(types),
        **{n: raw[n] for n in names},
        "linear_conv_kernel_dim": raw.get("linear_conv_kernel_dim", 4),
    }


def merged(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides``' keys set; an object meeting an object merges key by key (so
    ``{"text_config": {"num_hidden_layers": 8}}`` changes one field of a nested config)."""
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out
