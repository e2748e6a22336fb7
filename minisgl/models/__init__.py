"""Architecture registry: config.json's ``architectures`` entry -> model class."""

from __future__ import annotations

from torch import nn

from minisgl.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with switches that ModelConfig derives from the architecture.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    if config.architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {config.architecture!r}")
    return MODEL_REGISTRY[config.architecture]
