"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package.

A ``.gguf`` file becomes a checkpoint folder that the engine then loads like any other:
config.json from the file's metadata and the tokenizer with its chat template. The weights stay
in the file: they are dequantized tensor by tensor as the model loads (``iter_gguf_weights``; the
values the quantized file stands for, in float32, which the loader casts to the model dtype), so
the folder takes a few MB, not four bytes per weight (a 93 MB Q4_1 file is 517 MB in float32).
The folder is made once and cached under ``~/.cache/minisgl/gguf`` by a hash of the file's
content (hashed once per path, size and modification time: a restart, a copy or a touched file
finds the same folder, which records the path it was last found at), and a new conversion of a
path removes the folders of that path's earlier contents.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.utils import progress

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mixtral too: llama with experts (MixtralForCausalLM, below)
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # Hugging Face's spelling
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Experts, stacked [E, rows, cols] (the loader cuts each expert), their router and Qwen2-MoE's
    # shared expert with its sigmoid gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
CACHE_ROOT = Path(os.environ.get("MINISGL_CACHE", Path.home() / ".cache" / "minisgl")) / "gguf"


def find_gguf(model: str) -> Path | None:
    """The .gguf file ``model`` names: the file itself, or the only one in a folder that has
    no safetensors. None when ``model`` is not a GGUF checkpoint."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not any(path.glob("*.safetensors")):
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{path} holds several .gguf files ({', '.join(f.name for f in files)}); name one")
        return files[0] if files else None
    return None


def content_key(path: Path, cache_root: Path = CACHE_ROOT) -> str:
    """sha256 of the file's bytes; remembered per (path, size, mtime) in ``index.json`` so it
    is read once, not at every start."""
    stat = path.stat()
    seen = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_root / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if seen not in index:
        index = {k: v for k, v in index.items() if not k.startswith(f"{path.resolve()}:")}  # its older states
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        index[seen] = digest.hexdigest()
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f".index-{os.getpid()}.json")
        tmp.write_text(json.dumps(index))
        tmp.replace(index_path)
    return index[seen]


def converted_checkpoint(path: Path, cache_root: Path = CACHE_ROOT) -> Path:
    """The cached checkpoint folder for a .gguf file, converting it first if needed."""
    digest = content_key(path, cache_root)
    out = cache_root / f"{path.stem}-{digest[:16]}"
    if (out / "config.json").is_file() and (out / SOURCE).is_file():
        (out / "model.safetensors").unlink(missing_ok=True)  # older versions kept float32 weights here
        if gguf_source(out) != path.resolve():  # the same content found at another path
            _write_source(out, path, digest)
        return out
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache_root))
    try:
        convert(path, tmp)
        _write_source(tmp, path, digest)
        try:
            tmp.rename(out)  # atomic: another process converting the same file may have won
        except OSError:
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale(cache_root, path.resolve(), digest)
    return out


SOURCE = "source.json"  # in a converted folder: the .gguf file its weights come from


def _write_source(folder: Path, path: Path, digest: str) -> None:
    tmp = folder / f".source-{os.getpid()}.json"
    tmp.write_text(json.dumps({"path": str(path.resolve()), "sha256": digest}))
    tmp.replace(folder / SOURCE)


def gguf_source(folder: Path) -> Path | None:
    """The .gguf file whose weights a converted ``folder`` loads; None for any other folder."""
    try:
        return Path(json.loads((folder / SOURCE).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_stale(cache_root: Path, source: Path, digest: str) -> None:
    """Folders converted from earlier contents of ``source`` (the file changed since), and
    folders of its name that older versions made without saying their source."""
    for folder in cache_root.glob(f"{source.stem}-*"):
        try:
            entry = json.loads((folder / SOURCE).read_text())
        except FileNotFoundError:
            entry = {"path": str(source)}  # an older version's folder for a file of this name
        except (OSError, ValueError):
            continue
        if entry.get("path") == str(source) and entry.get("sha256") != digest:
            logger.info("removing %s, converted from an earlier version of %s", folder, source)
            shutil.rmtree(folder, ignore_errors=True)


def convert(path: Path, out: Path) -> None:
    """Write config.json and the tokenizer files of ``path`` into ``out``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = _config(reader, path)
    if not any(_hf_name(t.name) == "lm_head.weight" for t in reader.tensors):
        config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(path, out)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config(reader: Any, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")

    def meta(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path.name}: GGUF metadata lacks {arch}.{name}")
        return value

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    vocab = meta("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    experts = _field(reader, f"{arch}.expert_count", 0)
    config = {
        "architectures": ["MixtralForCausalLM" if arch == "llama" and experts else ARCHITECTURES[arch]],
        "model_type": "mixtral" if arch == "llama" and experts else MODEL_TYPES.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length", 0),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        # GPU default (--dtype auto; CPU runs fp32): quantized blocks carry f16 scales, and their
        # dequantized values survive fp16 almost whole but not bf16's 8-bit mantissa. SmolLM2 Q4_1 in
        # fp32 arithmetic with its weights rounded: 31/32 greedy answers kept in fp16, 16/32 in bf16
        # (benchmarks/bf16_sources.py).
        "max_position_embeddings": meta("context_length"),
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "tie_word_embeddings": False,
    }
    if experts:
        config |= _expert_config(reader, arch, meta, experts)
    return config


def _expert_config(reader: Any, arch: str, meta: Any, experts: int) -> dict[str, Any]:
    """The expert fields of a mixture of experts, as its Hugging Face config spells them. GGUF
    does not say which layers are dense: those without a router tensor are."""
    used = meta("expert_used_count")
    if arch == "llama":  # Mixtral: experts as wide as feed_forward_length, always renormalized
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    routed = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's unless the file says.
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(meta("block_count")) if i not in routed],
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", 0)
    return fields


def _hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    blk, layer, part = stem.split(".", 2)
    if blk != "blk" or part not in LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q and k rows with each head's two rotary halves interleaved;
    put them back in the Hugging Face order (first half, then second half, per head)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _existing_source(folder: Path) -> Path:
    """The .gguf file a converted folder reads its weights from, which must still be there."""
    path = gguf_source(folder)
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{folder} loads its weights from {path}, which is gone; pass the .gguf file again")
    return path


def iter_gguf_shapes(folder: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each tensor's Hugging Face name and shape, from the .gguf file's header."""
    import gguf

    path = _existing_source(folder)
    for t in gguf.GGUFReader(str(path)).tensors:
        name = _hf_name(t.name)
        yield name, _hf_shape(name, tuple(int(d) for d in reversed(t.shape)))


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """llama.cpp stores the shared expert's gate [1, H] as a vector."""
    return (1, *shape) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape


def iter_gguf_weights(folder: Path, primary: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """The weights of a converted ``folder``, dequantized from its .gguf file one tensor at a
    time, under Hugging Face names, as C-ordered float32 arrays (``primary``: show progress)."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    path = _existing_source(folder)
    config = json.loads((folder / "config.json").read_text())
    reader = gguf.GGUFReader(str(path))
    for t in progress(reader.tensors, primary, desc=f"Loading weights from {path.name}", unit="tensor"):
        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(t.tensor_type).name
            raise ValueError(
                f"{path.name}: tensor {t.name} uses quantization {kind}, which gguf cannot dequantize"
            ) from None
        name = _hf_name(t.name)
        data = np.asarray(data, dtype=np.float32).reshape(_hf_shape(name, tuple(int(d) for d in reversed(t.shape))))
        if config["model_type"] in ("llama", "mistral", "mixtral"):
            if name.endswith("q_proj.weight"):
                data = _unpermute(data, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                data = _unpermute(data, config["num_key_value_heads"])
        yield name, np.array(data, copy=not data.flags.writeable, order="C")


def _save_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer and chat template in the file's metadata, saved as tokenizer files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
