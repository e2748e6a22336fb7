"""PEFT LoRA adapters: reading an adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``, as PEFT saves them) and writing it into one slot of the model's
stacked adapters (``layers.lora``).

Supported: plain LoRA (scaling ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) on
the attention projections and the dense MLP's, any rank up to ``--max-lora-rank``. Refused by
name: DoRA, LoRA biases, per-module rank or alpha patterns, modules saved whole
(``modules_to_save``), embeddings, the LM head, and the experts of a mixture of experts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minisgl.checkpoint.locate import MAX_PATH_CHARS
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.checkpoint.safetensors_header import CheckpointError, header, read_json
from minisgl.config.args import LORA_TARGET_MODULES, EngineArgs, parse_lora_paths
from minisgl.device.distributed import get_tp_info
from minisgl.device.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.device.layers.lora import TARGETS, LoraRows, LoraWeights

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may follow lora_A)
_KEY = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
DEFAULT_RANK = 16  # --max-lora-rank when neither it nor --lora-paths says
MAX_ALPHA = 1e6  # lora_alpha beyond this scales B past any trained adapter's


class AdapterError(ValueError):
    """An adapter this server cannot serve (the message says why)."""


@dataclass
class Adapter:
    """An adapter checked against what is served here, its tensors not read yet."""

    where: str  # its folder, or "tensors" (what errors name)
    rank: int
    scaling: float
    modules: set[str]  # checkpoint module names it adapts
    weights: Path | None = None  # adapter_model.safetensors (None: ``named``)
    named: dict[str, torch.Tensor] | None = None  # tensors handed over in memory

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.named is not None:
            yield from self.named.items()
            return
        with safe_open(self.weights, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _folder(path: str) -> Path:
    """The adapter's folder: a local one (``~`` expanded for the operator's --lora-paths; a
    client's path is absolute, ``serve/api/client_paths.py``), else a hub id. A local path that
    holds no adapter gets one answer whatever is there."""
    if len(path) > MAX_PATH_CHARS:
        raise AdapterError(f"a LoRA adapter path of {len(path)} characters (at most {MAX_PATH_CHARS} characters)")
    folder = Path(path).expanduser()
    try:
        if folder.is_dir() and (folder / "adapter_config.json").is_file():
            return folder
    except OSError as e:  # a name too long, a loop of links
        raise AdapterError(f"LoRA adapter folder {path[:300]!r}: {e.strerror or e}") from None
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise AdapterError(f"no LoRA adapter at {path[:300]!r} (a folder with adapter_config.json)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "*.safetensors"]))
    except Exception as e:  # offline, unknown repo: the hub's reason
        raise AdapterError(f"could not get LoRA adapter {path!r} from the Hugging Face hub: {e}") from e


def _checked(where: str, cfg: dict, names: Iterable[str]) -> tuple[int, float, set[str]]:
    """An adapter config's rank and scaling, and the modules its tensor names adapt; AdapterError
    for what is not served here."""
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: the adapter config is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules saved whole (modules_to_save) are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise AdapterError(f"{where}: {why}")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: LoRA biases (bias {cfg['bias']!r}) are not supported")
    rank = cfg.get("r", 8)
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"{where}: r must be an integer >= 1, got {str(rank)[:40]!r}")
    alpha = cfg.get("lora_alpha", rank)
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or abs(alpha) > MAX_ALPHA:
        raise AdapterError(f"{where}: lora_alpha must be a finite number of magnitude <= {MAX_ALPHA:g}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    modules = set()
    for name in names:
        m = _KEY.search(name)
        if m is None or m.group(2) not in LORA_TARGET_MODULES:
            served = ", ".join(LORA_TARGET_MODULES)
            raise AdapterError(f"{where}: tensor {name!r} adapts a module LoRA is not served on here ({served})")
        modules.add(m.group(2))
    named = cfg.get("target_modules")  # (a string is PEFT's regex: not checked)
    uncovered = sorted(set(named) & set(LORA_TARGET_MODULES) - modules) if isinstance(named, list) else []
    if uncovered:
        raise AdapterError(f"{where}: target_modules names {', '.join(uncovered)}, which no tensor adapts")
    return rank, scaling, modules


def read_adapter(path: str) -> Adapter:
    """A PEFT folder's adapter, checked (its tensors' names read, not the tensors)."""
    folder = _folder(path)
    weights = folder / "adapter_model.safetensors"
    try:
        cfg = read_json(folder / "adapter_config.json", "adapter config")
        if not weights.exists():
            raise CheckpointError(
                "no adapter_model.safetensors (pickled .bin adapters are never read: save with safetensors)"
            )
        names = list(header(weights))
    except CheckpointError as e:
        raise AdapterError(f"{folder}: {e}") from None
    return Adapter(str(folder), *_checked(str(folder), cfg, names), weights=weights)


def tensor_adapter(named: dict[str, torch.Tensor], cfg: dict) -> Adapter:
    """An adapter handed over as tensors (PEFT's names) with its config (adapter_config.json's
    fields), checked."""
    return Adapter("tensors", *_checked("tensors", cfg, named), named=named)


def lora_layout(args: EngineArgs) -> tuple[int, list[str]]:
    """The rank the slots hold and the modules adapted: the flags, else what --lora-paths need
    (their largest rank, the union of their modules), else DEFAULT_RANK and every module."""
    files = [read_adapter(path) for _, path, _ in parse_lora_paths(args.lora_paths or [])]
    rank = args.max_lora_rank or max((f.rank for f in files), default=DEFAULT_RANK)
    targets = args.lora_target_modules
    if targets is None and files:
        return rank, sorted(set().union(*(f.modules for f in files)))
    return rank, list(LORA_TARGET_MODULES) if not targets or "all" in targets else targets


def _layer(model: nn.Module, layer: int, module: str) -> tuple[ColumnParallelLinear | RowParallelLinear, int] | None:
    path, part = TARGETS[module]
    obj = model.model.layers[layer]
    for attr in path.split("."):
        obj = getattr(obj, attr, None)
    return (obj, part) if isinstance(obj, (ColumnParallelLinear, RowParallelLinear)) else None


def attach_lora(
    model: nn.Module, config: ModelConfig, rank: int, slots: int, targets: list[str], rows: int, device: torch.device
) -> LoraRows:
    """Give every targeted linear layer its stacked adapters (zeros: no adapter yet)."""
    lora_rows = LoraRows(rows, slots, rank, device)
    dtype = model.model.embed_tokens.weight.dtype
    for layer in range(config.num_layers):
        for module in targets:
            found = _layer(model, layer, module)
            if found is None or found[0].lora is not None:  # (an expert MLP; a part of a layer already given)
                continue
            lin = found[0]
            if isinstance(lin, ColumnParallelLinear):
                lin.lora = LoraWeights(lora_rows, lin.input_size, lin.local_sizes, dtype, device)
            else:
                lin.lora = LoraWeights(lora_rows, lin.local_input, [lin.weight.shape[0]], dtype, device)
    return lora_rows


Shards = list[tuple[LoraWeights, int, torch.Tensor, torch.Tensor]]  # (layer's adapters, part, a, b)


def read_shards(model: nn.Module, config: ModelConfig, files: Adapter, max_rank: int) -> tuple[Shards, str]:
    """This rank's share of an adapter (scaling folded into B), in host memory (pinned when the
    model is on a GPU), and what was read. Raises AdapterError when the adapter does not fit
    this model or its slots."""
    path = files.where
    if files.rank > max_rank:
        raise AdapterError(f"{path}: rank {files.rank} is above --max-lora-rank {max_rank}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in files.tensors():
        m = _KEY.search(name)
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    tp = get_tp_info()
    shards: Shards = []
    for (layer, module), ab in sorted(pairs.items()):
        found = _layer(model, layer, module) if layer < config.num_layers else None
        if found is None or found[0].lora is None:
            why = "the layer has no such module" if found is None else "not among --lora-target-modules"
            raise AdapterError(f"{path}: layer {layer} {module}: {why}")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {layer} {module} lacks its lora_{'B' if 'A' in ab else 'A'}")
        lin, part = found
        if not (ab["A"].is_floating_point() and ab["B"].is_floating_point()):
            raise AdapterError(f"{path}: layer {layer} {module}: {ab['A'].dtype} tensors (floating point only)")
        a, b = ab["A"].to("cpu", copy=True), ab["B"].cpu() * files.scaling  # (never the sender's memory)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{path}: layer {layer} {module}: values that are not finite (NaN or inf)")
        rows = lin.output_sizes[part] if isinstance(lin, ColumnParallelLinear) else lin.weight.shape[0]
        r = a.shape[0]
        if r != files.rank:
            raise AdapterError(f"{path}: layer {layer} {module}: rank {r}; the config's r is {files.rank}")
        if a.shape != (r, lin.input_size) or b.shape != (rows, r) or r > max_rank:
            raise AdapterError(
                f"{path}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                f"[r <= {max_rank}, {lin.input_size}] and [{rows}, r]"
            )
        if isinstance(lin, ColumnParallelLinear):
            b = b.narrow(0, lin._source_start(part, tp.rank), lin.local_sizes[part])
        else:
            a = a.narrow(1, tp.rank * lin.local_input, lin.local_input)
        dtype, pin = lin.lora.a.dtype, lin.lora.a.is_cuda
        a, b = (t.to(dtype).contiguous() for t in (a, b))
        shards.append((lin.lora, part, a.pin_memory() if pin else a, b.pin_memory() if pin else b))
    return shards, f"LoRA adapter {path} (rank {files.rank}, {', '.join(sorted(files.modules))})"


def write_slot(model: nn.Module, slot: int, shards: Shards) -> None:
    """Put an adapter read by ``read_shards`` into ``slot`` (the modules it leaves alone: zero),
    on the current stream, after whatever was queued before."""
    for weights in lora_weights(model):
        weights.clear(slot)
    for weights, part, a, b in shards:
        weights.write(slot, part, a, b)


def lora_weights(model: nn.Module) -> set[LoraWeights]:
    """Every adapted layer's stacked adapters."""
    return {m.lora for m in model.modules() if isinstance(getattr(m, "lora", None), LoraWeights)}
