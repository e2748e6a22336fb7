"""Architecture registry: config.json's ``architectures`` entry -> model class (imported when
asked for, so the processes that only read configs never load torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.checkpoint.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    from torch import nn


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    """Mistral, Qwen2 and Qwen3 are Llama with switches that ModelConfig derives from the
    architecture: one class serves them all; the hybrids (Qwen3-Next, Qwen3.5) are another."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {config.architecture!r}")
    if config.is_hybrid:
        from minisgl.device.models.qwen3_next import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM
    from minisgl.device.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
