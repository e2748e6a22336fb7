"""What a model's FP8 asks for: the scheme of its linear layers (from ``--quantization`` or the
checkpoint's ``quantization_config``) and the KV cache's element type (``--kv-cache-dtype``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.config.args import KV_CACHE_DTYPES, QUANTIZATIONS


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are quantized. ``block``: input columns per weight scale and
    per activation scale (None: one scale per output channel and one per token). ``source``
    names where the weights come from, for logs: "online" or the checkpoint format."""

    block: int | None = None
    source: str = "online"


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """SGLang's ``--kv-cache-dtype`` names: auto (the model dtype), fp8_e4m3, bf16/bfloat16."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return torch.float8_e4m3fn
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {name!r} is not supported ({', '.join(KV_CACHE_DTYPES)})")


def quantization_scheme(quant_config: dict[str, Any] | None, requested: str | None) -> Fp8Scheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (compressed-tensors float 8-bit with
    dynamic per-token activations; "fp8" per tensor/channel or with 128 x 128 blocks), or the
    online one ``--quantization fp8`` asks for. Anything else is refused by name."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"--quantization {requested!r} is not supported ({', '.join(QUANTIZATIONS)})")
    if not quant_config:
        return Fp8Scheme() if requested else None
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quant_config)
    if method == "fp8":
        if quant_config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints with static activation scales are not supported (dynamic only)")
        block = quant_config.get("weight_block_size")
        if block is None:
            return Fp8Scheme(source="fp8")
        if len(block) != 2 or block[0] != block[1]:
            raise ValueError(f"fp8 weight_block_size {block} is not supported (square blocks only)")
        return Fp8Scheme(block=int(block[0]), source=f"fp8 {block[0]}x{block[1]} blocks")
    raise ValueError(f"checkpoint quantization {method!r} is not supported (fp8, compressed-tensors float8)")


def _compressed_tensors_scheme(quant_config: dict[str, Any]) -> Fp8Scheme:
    groups = list((quant_config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: one config group supported, the checkpoint has {len(groups)}")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors weights {weights.get('type')}{weights.get('num_bits')} are not supported (float 8-bit)"
        )
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(
            f"compressed-tensors weight strategy {weights.get('strategy')!r} is not supported (channel, tensor)"
        )
    if not acts or acts.get("type") != "float" or acts.get("num_bits") != 8 or not acts.get("dynamic"):
        raise ValueError("compressed-tensors: only dynamic float 8-bit input activations are supported")
    ignored = [name for name in quant_config.get("ignore", []) if "lm_head" not in name]
    if ignored:
        raise ValueError(f"compressed-tensors: layers left unquantized besides lm_head are not supported: {ignored}")
    return Fp8Scheme(source="compressed-tensors")
