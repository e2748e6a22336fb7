"""Write a tiny checkpoint in standard Hugging Face format, for tests and the CPU demo.

Random weights from a fixed seed, a byte-level BPE tokenizer trained on text that ships with
Python (stdlib docstrings), ChatML special tokens and chat template, and a generation_config.

    python scripts/make_tiny_model.py --arch llama --out checkpoints/tiny-llama
    from minisgl.device.tiny_model import make_tiny_model

``make_lora_adapter`` writes a random PEFT LoRA adapter for any checkpoint's config (a tiny one,
or a real model's shape for benchmarks).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from minisgl.checkpoint.model_config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
# Gated DeltaNet hybrids: three linear-attention layers, then one gated full-attention layer.
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS_MODULES = (
    "json",
    "collections",
    "functools",
    "itertools",
    "textwrap",
    "string",
    "re",
    "random",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "decimal",
    "pathlib",
    "argparse",
    "logging",
    "unittest",
    "dataclasses",
    "enum",
    "shutil",
    "tempfile",
    "csv",
    "calendar",
)
EXTRA_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, façade, über, smörgåsbord, déjà vu.",
    "日本語のテキスト、中文文本、한국어 텍스트。",
    "Emoji: 🙂 🚀 🌍 ✨ and symbols: ∑ ∞ ≈ ≠ → ←.",
]


def corpus() -> list[str]:
    """Docstrings of stdlib modules and their public members: text every Python install has."""
    lines: list[str] = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        docs = [mod.__doc__] + [getattr(getattr(mod, a), "__doc__", None) for a in sorted(dir(mod))]
        lines += [d for d in docs if isinstance(d, str)]
    return lines + EXTRA_TEXT * 50


def train_tokenizer(vocab_size: int, extra_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_tokens),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def model_config(arch: str, vocab_size: int, bos: int, eos: int, overrides: dict | None = None):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    common.update(overrides or {})
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        }
        return transformers.LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 32, **common}, rope_theta=1e6, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    # Mixtures of experts: 8 experts, 2 per token; Qwen2-MoE with its shared expert and unnormalized
    # top-k weights, Qwen3-MoE renormalized with a dense second layer, Mixtral with w1/w2/w3 names.
    moe = dict(num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, **moe, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{"head_dim": 32, **common}, **moe, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1],
        )  # fmt: skip
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, **moe, num_local_experts=8)
    if arch in HYBRID_ARCHS:
        return hybrid_config(arch, {"head_dim": 32, **common, "num_hidden_layers": 4})
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS + HYBRID_ARCHS}")


def hybrid_config(arch: str, common: dict):
    """Qwen3-Next (experts, a dense second layer), Qwen3.5 dense or Qwen3.5-MoE, tiny: 2 key and
    4 value heads of 16 in the DeltaNet layers, a quarter of each attention head rotated."""
    import transformers

    linear = dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **linear, **moe, mlp_only_layers=[1])
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **linear)
    return transformers.Qwen3_5MoeTextConfig(**common, **linear, **moe)


def make_tiny_model(
    arch: str,
    out: str | Path,
    seed: int = 0,
    vocab_size: int = 1024,
    max_shard_size: str | None = None,
    overrides: dict | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """``overrides`` replaces config fields, e.g. {"head_dim": 128} for FlashInfer-sized heads;
    ``extra_tokens``: special tokens the tokenizer also has (e.g. a code model's FIM tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    tokenizer = train_tokenizer(vocab_size, extra_tokens)
    bos, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = model_config(arch, len(tokenizer), bos, eos, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, bos], pad_token_id=bos)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    return out


LORA_KEY = "base_model.model.model.layers.{layer}.{block}.{module}.lora_{ab}.weight"


def lora_shapes(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """module -> (its block, in features, out features) of the modules an adapter may adapt."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": ("self_attn", h, q),
        "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv),
        "o_proj": ("self_attn", q, h),
        "gate_proj": ("mlp", h, inter),
        "up_proj": ("mlp", h, inter),
        "down_proj": ("mlp", inter, h),
    }


def make_lora_adapter(
    model_dir: str | Path,
    out: str | Path,
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    rank: int = 8,
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.1,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) for the checkpoint at
    ``model_dir``, A and B both random (PEFT starts B at zero: this one changes the outputs).
    The MLP modules are left out of a mixture of experts' sparse layers. ``alpha``: 2 * rank."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = ModelConfig.from_path(Path(model_dir))
    shapes = lora_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in modules:
            block, fan_in, fan_out = shapes[module]
            if block == "mlp" and cfg.is_moe_layer(layer):
                continue
            key = dict(layer=layer, block=block, module=module)
            tensors[LORA_KEY.format(**key, ab="A")] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[LORA_KEY.format(**key, ab="B")] = torch.randn(fan_out, rank, generator=gen) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank if alpha is None else alpha,
        "use_rslora": use_rslora,
        "target_modules": list(modules),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS + HYBRID_ARCHS, default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-shard-size", default=None, help="e.g. 200KB to write several shards")
    args = parser.parse_args()
    path = make_tiny_model(args.arch, args.out, args.seed, args.vocab_size, args.max_shard_size)
    print(f"wrote {args.arch} checkpoint to {path}")


if __name__ == "__main__":
    main()
