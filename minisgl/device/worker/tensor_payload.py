"""SGLang's ``serialized_named_tensors``: named tensors a colocated trainer shares with the
engine, as torch's multiprocessing pickle of CUDA IPC (or shared-memory) handles, base64 text
on the wire.

Unpickling input from the network runs whatever it names, so the decoder here admits only
torch's functions that reopen a shared tensor, torch's tensor, storage, size and dtype types,
and the metadata record of SGLang's flattened buckets (mapped onto ``BucketEntry``); any other
global refuses the whole payload. Servers accept this route only with
``--enable-weight-update-from-tensor`` and, where an API key is set, from its holders.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch

LOAD_FORMATS = ("direct", "flattened_bucket")
MAX_NAME_CHARS = 1024  # a checkpoint tensor's name (the longest real ones are ~100)

_REBUILDERS = {
    "rebuild_cuda_tensor",
    "rebuild_tensor",
    "rebuild_storage_filename",
    "rebuild_storage_empty",
    "rebuild_typed_storage",
    "rebuild_typed_storage_child",
}
_TYPES = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "UntypedStorage"),
    ("torch", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
}
_BUCKET_MODULES = {"sglang.srt.weight_sync.tensor_bucket", __name__}


class BucketEntry:
    """One tensor of a flattened bucket: bytes [start_idx, end_idx) of the bucket's uint8 tensor
    hold it (SGLang's FlattenedTensorMetadata fields)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _REBUILDERS:
            import torch.multiprocessing.reductions as reductions

            return getattr(reductions, name)
        if (module, name) in _TYPES:
            obj: Any = __import__(module, fromlist=[name])
            return getattr(obj, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _BUCKET_MODULES and name in ("FlattenedTensorMetadata", "BucketEntry"):
            return BucketEntry
        raise pickle.UnpicklingError(f"the payload names {module}.{name}, which a tensor payload may not")


def _tensor(obj: Any, what: str) -> torch.Tensor:
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a tensor")
    return obj


def _name(obj: Any) -> str:
    """A tensor's name, checked to be text before anything renders it: a payload's objects can
    share parts, so a small pickle can stand for a list whose text would take gigabytes."""
    if not isinstance(obj, str):
        raise ValueError(f"serialized_named_tensors: a tensor name is a {type(obj).__name__}, not a string")
    if len(obj) > MAX_NAME_CHARS:
        raise ValueError(f"serialized_named_tensors: a tensor name of {len(obj)} characters (at most {MAX_NAME_CHARS})")
    return obj


def decode_named_tensors(payload: bytes | str, load_format: str | None = "direct") -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one rank's payload (raw pickle bytes, or its base64 text).
    Raises ValueError naming what is wrong; nothing outside the allowed set is ever imported."""
    load_format = load_format or "direct"
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    raw = payload.encode() if isinstance(payload, str) else payload
    if not raw.startswith(b"\x80"):  # not a pickle (protocol >= 2 starts with PROTO): base64 text
        try:
            raw = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("serialized_named_tensors: not base64 of a torch multiprocessing pickle") from None
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
    except Exception as e:  # a refused global, a truncated pickle, a dead IPC handle
        raise ValueError(f"serialized_named_tensors: {type(e).__name__}: {str(e)[:300]}") from None
    if load_format == "flattened_bucket":
        return _from_bucket(obj)
    if isinstance(obj, dict):  # (SGLang's LoRA tensors: name -> tensor)
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in obj):
        raise ValueError("serialized_named_tensors: load_format direct takes (name, tensor) pairs or a dict of them")
    named = [(_name(name), t) for name, t in obj]
    return [(name, _tensor(t, f"tensor {name!r}")) for name, t in named]


def _from_bucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise ValueError(
            "serialized_named_tensors: load_format flattened_bucket takes a dict of flattened_tensor and metadata"
        )
    flat = _tensor(obj["flattened_tensor"], "flattened_tensor")
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be 1-D uint8, got {flat.dtype} of {list(flat.shape)}")
    out = []
    if not isinstance(obj["metadata"], list):
        raise ValueError("flattened_bucket metadata must be a list of FlattenedTensorMetadata records")
    for entry in obj["metadata"]:
        if not isinstance(entry, BucketEntry):
            raise ValueError("flattened_bucket metadata entries must be FlattenedTensorMetadata records")
        name = _name(getattr(entry, "name", None))
        try:
            dtype, shape = entry.dtype, torch.Size(entry.shape)
            start, end = int(entry.start_idx), int(entry.end_idx)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"flattened_bucket metadata of {name!r}: {type(e).__name__}") from None
        if (
            not isinstance(dtype, torch.dtype)
            or not 0 <= start <= end <= flat.numel()
            or (end - start != shape.numel() * dtype.itemsize)
        ):
            raise ValueError(f"flattened_bucket metadata of {name!r} does not fit the flattened tensor")
        out.append((name, flat[start:end].view(dtype).view(shape)))
    return out


def encode_named_tensors(named: Iterable[tuple[str, torch.Tensor]], flattened: bool = False) -> str:
    """A trainer's side: base64 text of ``named`` as SGLang's clients serialize it (CUDA tensors
    travel as IPC handles; CPU tensors through shared memory, so the engine must run on this
    host). ``flattened``: one uint8 bucket of them all (load_format flattened_bucket)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    named = list(named)
    obj: Any = named
    # CPU tensors: shared-memory files by name (the decoder refuses file descriptors, whose
    # unpickling connects back to this process).
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    if flattened:
        parts, meta, at = [], [], 0
        for name, t in named:
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            entry = BucketEntry()
            entry.name, entry.shape, entry.dtype = name, t.shape, t.dtype
            entry.start_idx, entry.end_idx, entry.numel = at, at + flat.numel(), flat.numel()
            parts.append(flat)
            meta.append(entry)
            at += flat.numel()
        obj = {"flattened_tensor": torch.cat(parts), "metadata": meta}
    buf = io.BytesIO()
    try:
        ForkingPickler(buf).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode()
