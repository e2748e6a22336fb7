"""Find a checkpoint (local folder or hub id), build the model, and fill its weights.

Weights come from one or many ``*.safetensors`` files (with or without an index), from the
.gguf file a converted GGUF folder names (``gguf_file``), or, with
``load_format="dummy"``, from a seeded random init in the real shapes (for benchmarks). FP8
checkpoints (compressed-tensors, block-wise "fp8") load their weights and scales as they are;
``quantization="fp8"`` quantizes a float checkpoint's linear weights as they load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minisgl.checkpoint.gguf_file import gguf_source, iter_gguf_shapes, iter_gguf_weights
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.checkpoint.safetensors_header import MAX_HEADER, CheckpointError, header, read_json
from minisgl.device.distributed import get_tp_info
from minisgl.device.layers.fp8_scheme import quantization_scheme
from minisgl.device.layers.quantization import FP8, FP8_MAX, to_fp8
from minisgl.device.models import get_model_class
from minisgl.utils import progress

logger = logging.getLogger(__name__)


def weights_identity(model_dir: Path, load_format: str) -> list[tuple[str, int, int]]:
    """(name, size, modification time) of each file the weights load from: a checkpoint
    rewritten in place with new weights gets a new identity (the disk KV tier's folder key)."""
    if load_format == "dummy":
        return []
    source = gguf_source(model_dir)
    files = [source] if source is not None else safetensors_files(model_dir)
    return [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "index", limit=MAX_HEADER)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise CheckpointError(f"{index.name} has no weight_map object")
        names = sorted({str(n) for n in weight_map["weight_map"].values()})
        outside = [n for n in names if Path(n).name != n or n in (".", "..")]
        if outside:
            raise CheckpointError(f"{index.name} names files outside the folder: {outside[0][:100]!r}")
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} lists missing files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (use --load-format dummy for random weights)")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint folder's tensors by name: its safetensors files, or the .gguf file a
    converted GGUF folder stands for."""
    if gguf_source(model_dir) is not None:
        for name, array in iter_gguf_weights(model_dir, get_tp_info().is_primary):
            yield name, torch.from_numpy(array)
        return
    files = safetensors_files(model_dir)
    total = 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            total += len(list(sf.keys()))
    with progress(total=total, primary=get_tp_info().is_primary, desc="Loading weights", unit="tensor") as bar:
        for f in files:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
                    bar.update(1)


def first_non_finite(model_dir: Path, device: torch.device) -> str | None:
    """The first tensor of a safetensors checkpoint holding NaN or infinity (None: none), each
    checked on ``device`` and dropped: a weight update reads its files once more for this before
    any weight changes (GGUF files, quantized, are not checked)."""
    if gguf_source(model_dir) is not None:
        return None
    for f in safetensors_files(model_dir):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if not t.is_floating_point():
                    continue
                t = t.to(device)
                if not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
                    return name
    return None


# One expert's projection (Qwen-MoE names, Mixtral's w1/w3/w2) -> our stacked parameter and shard.
# One expert's tensor (experts.3.gate_proj.weight), or every expert's stacked (experts.gate_proj.weight: GGUF).
EXPERT = re.compile(r"\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|w1|w3|w2)\.")
EXPERT_PARTS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1)}
EXPERT_PARTS |= {"down_proj": ("w2", None), "w2": ("w2", None)}

# Per-tensor K and V cache scales as checkpoints name them (vLLM/SGLang and compressed-tensors).
KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def checkpoint_shapes(model_dir: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape, read from the files' headers (nothing is loaded)."""
    for name, _, shape in checkpoint_tensors(model_dir):
        yield name, shape


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, str | None, tuple[int, ...]]]:
    """Every tensor's name, safetensors dtype (None in a GGUF file) and shape, from headers
    checked against their files (``checkpoint.safetensors_header``)."""
    if gguf_source(model_dir) is not None:
        for name, shape in iter_gguf_shapes(model_dir):
            yield name, None, shape
        return
    for f in safetensors_files(model_dir):
        for name, (dtype, shape) in header(f).items():
            yield name, dtype, shape


class WeightMap:
    """Where each checkpoint tensor goes in a model: the parameter, the fused part it fills,
    and the full (unsharded) shape it must have, so a whole update can be checked before any
    parameter changes."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules", {})
        self.renamed: dict[str, str] = getattr(model, "renamed_modules", {})
        self.tied = getattr(model.config, "tie_word_embeddings", False)
        quant = getattr(model.config, "quant", None)
        # Quantized at load, a float weight brings its own scales.
        online = quant is not None and quant.source == "online"
        self.expected = {
            n
            for n in self.params
            if not (self.tied and n == "lm_head.weight") and not (online and n.endswith("weight_scale"))
        }

    def target(self, name: str) -> tuple[str, int | str | tuple | None] | None:
        """(parameter name, part) of checkpoint tensor ``name``; None for tensors that are not
        weights (rotary tables, a tied head, KV cache scales). Raises ValueError for a name the
        model has no place for."""
        if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight") or KV_SCALE.search(name):
            return None
        if name.endswith(".weight_scale_inv"):  # block-wise checkpoints: a multiplier, despite the name
            name = name[: -len("_inv")]
        for ckpt_name, ours in self.renamed.items():
            name = name.replace(f".{ckpt_name}.", f".{ours}.")
        part = None
        expert = EXPERT.search(name)
        if expert is not None:  # experts.3.gate_proj.weight -> experts.w13_weight, part (3, 0)
            ours, shard = EXPERT_PARTS[expert.group(2)]
            name = f"{name[: expert.start()]}.experts.{ours}_{name[expert.end() :]}"
            part = (None if expert.group(1) is None else int(expert.group(1)), shard)
        else:
            for ckpt_name, (ours, shard) in self.packed.items():
                if f".{ckpt_name}." in name:
                    name, part = name.replace(f".{ckpt_name}.", f".{ours}."), shard
                    break
        if name not in self.params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self.model).__name__}")
        return name, part

    def full_shape(self, param_name: str, part: int | str | None) -> tuple[int, ...] | None:
        """The checkpoint shape a parameter (part) takes: its layer's ``checkpoint_shape`` where
        it shards or fuses, else its own; None where the shape depends on the checkpoint's
        format (fp8 scales)."""
        module_name, _, attr = param_name.rpartition(".")
        module = self.model.get_submodule(module_name)
        shape_of = getattr(module, "checkpoint_shape", None)
        if shape_of is not None:
            return shape_of(attr, part)
        return tuple(self.params[param_name].shape)

    def check(self, shapes: Iterator[tuple[str, tuple[int, ...]]], complete: bool) -> list[str]:
        """Raise ValueError naming the first tensor with no place or the wrong shape (and, when
        ``complete``, the weights none of them fills); returns the parameters they fill."""
        seen: list[str] = []
        for name, shape in shapes:
            found = self.target(name)
            if found is None:
                continue
            want = self.full_shape(*found)
            if want is not None and tuple(shape) != want:
                raise ValueError(f"tensor {name!r} has shape {list(shape)}; the served model's is {list(want)}")
            seen.append(found[0])
        if complete:
            self.require(set(seen))
        return seen

    def require(self, seen: set[str]) -> None:
        """Raise ValueError naming the weights ``seen`` lacks."""
        missing = sorted(self.expected - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy tensors into their (possibly fused, possibly sharded) parameters, in place;
        returns the parameters filled. KV cache scales go to ``model.kv_scales`` ({layer: {"k":
        s, "v": s}})."""
        kv_scales = self.model.__dict__.setdefault("kv_scales", {})
        filled: set[str] = set()
        for name, tensor in weights:
            kv = KV_SCALE.search(name)
            if kv is not None:
                kv_scales.setdefault(int(kv.group(1)), {})[kv.group(2) or kv.group(3)] = float(tensor.float().max())
                continue
            found = self.target(name)
            if found is None:
                continue
            param_name, part = found
            param = self.params[param_name]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, part)
            else:
                param.data.copy_(tensor)
            filled.add(param_name)
        return filled


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Fill every weight of a freshly built model from checkpoint tensors; raises ValueError for
    a tensor with no place and for weights none of them fills."""
    wmap = WeightMap(model)
    model.kv_scales = {}
    wmap.require(wmap.load(weights))


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in the real shapes: small normals for matrices, ones for norms; fp8
    matrices hold normals at a scale that fits four standard deviations."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    scale = 4 * 0.02 / FP8_MAX
    model.kv_scales = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        elif name.endswith("weight_scale"):
            param.data.fill_(scale)
        elif param.dtype == FP8:
            values = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device).normal_(
                0.0, 0.02, generator=gen
            )
            param.data.copy_(to_fp8(values, scale))
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def load_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> nn.Module:
    """``quantization``: ``--quantization`` (None or "fp8"); a checkpoint's own quantization
    config decides the scheme when it has one. ``quantize_lm_head``: the LM head in fp8 too."""
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unsupported load format {load_format!r} (auto, safetensors, gguf, dummy)")
    config.quant = quantization_scheme(config.quantization_config, quantization)
    if quantize_lm_head and config.quant is None:
        raise ValueError(
            "--quantize-lm-head goes with fp8 linear layers: add --quantization fp8 or load an FP8 checkpoint"
        )
    if config.quant is not None:
        logger.info(
            "fp8 linear layers (%s, %s)",
            config.quant.source,
            "per channel" if config.quant.block is None else f"{config.quant.block}-column groups",
        )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = get_model_class(config)(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, iter_weights(model_dir))
    if quantize_lm_head:
        model.lm_head.quantize(keep_float=config.tie_word_embeddings)
    return model.eval()
