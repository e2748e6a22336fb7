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
)


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

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

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
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")
        rope["rope_type"] = rope_type
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        num_heads = raw["num_attention_heads"]
        return cls(
            **_moe_fields(arch, raw),
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            rope_scaling=None if rope_type == "default" else rope,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=raw.get("quantization_config"),
        )

    @classmethod
    def from_path(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config.json not found in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(raw)
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


def _moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The expert fields as each family spells them: Mixtral's experts are ``intermediate_size``
    wide and always renormalized; transformers 5 re-saves Qwen3-MoE's ``num_experts`` as
    ``num_local_experts``."""
    fields: dict[str, Any] = {}
    if "qkv_bias" in raw:
        fields["qkv_bias_field"] = bool(raw["qkv_bias"])
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return fields
    fields["num_experts"] = raw.get("num_experts") or raw["num_local_experts"]
    fields["num_experts_per_tok"] = raw["num_experts_per_tok"]
    if arch == "MixtralForCausalLM":
        fields["moe_intermediate_size"] = raw["intermediate_size"]
        fields["norm_topk_prob"] = True
        return fields
    fields["moe_intermediate_size"] = raw["moe_intermediate_size"]
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", False))
    fields["decoder_sparse_step"] = raw.get("decoder_sparse_step", 1) or 1
    fields["mlp_only_layers"] = list(raw.get("mlp_only_layers") or [])
    if arch == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = raw.get("shared_expert_intermediate_size", 0)
    return fields
