"""The control plane: questions for the scheduler (ControlReq) and the tasks it runs on every
worker between steps (weights, memory, adapters, profiling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class ProfileReq(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> every worker: start a torch profiler trace (or stop it and write it)."""

    start: bool
    output_dir: str = ""
    num_steps: int = 0  # stop by itself after this many steps (0: at stop_profile)
    activities: list[str] = []  # "CPU", "GPU"


class LoadWeights(msgspec.Struct, array_like=True, tag=True):
    """Copy a checkpoint (a folder, hub id or .gguf file) of the same architecture into the
    live weights."""

    model_path: str
    load_format: str = "auto"


class TensorWeights(msgspec.Struct, array_like=True, tag=True):
    """SGLang's serialized named tensors (torch's multiprocessing pickle: CUDA IPC or shared
    memory handles), one payload per tensor-parallel rank; decoded by a restricted unpickler."""

    payloads: list[bytes]
    load_format: str = "direct"  # or "flattened_bucket"


class WeightGroupSpec(msgspec.Struct, kw_only=True):
    """Where a trainer's weight group meets (SGLang's /init_weights_update_group body)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class JoinWeightGroup(WeightGroupSpec, array_like=True, tag=True, kw_only=True):
    """Join a process group with a trainer, whose rank 0 broadcasts new weights; this rank is
    ``rank_offset + tp_rank`` of ``world_size``."""


class BroadcastWeights(msgspec.Struct, array_like=True, tag=True):
    """Receive these tensors from the trainer's rank 0 over the joined group, then load them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str = "direct"  # or "flattened_bucket": one uint8 tensor of them all, back to back


class LeaveWeightGroup(msgspec.Struct, array_like=True, tag=True):
    group_name: str = "weight_update_group"


class MemoryOccupation(msgspec.Struct, array_like=True, tag=True):
    """Give the device memory behind ``tags`` back (``release``), or take it again."""

    release: bool
    tags: list[str] = msgspec.field(default_factory=lambda: ["weights", "kv_cache", "cuda_graph"])


class LoadLora(msgspec.Struct, array_like=True, tag=True):
    """Read the LoRA adapter at ``path`` into host memory under ``key`` (--enable-lora); batches
    copy it into device slots (``ForwardBatch.lora_swap_slots``). Without a path: SGLang's
    serialized tensors (``payload``, one for every rank, decoded as TensorWeights' are) with the
    adapter's config as JSON."""

    key: str
    path: str
    payload: bytes = b""
    config_json: str = ""
    load_format: str = "direct"


MAX_READ_ROWS = 1 << 20  # the most rows one ReadWeights returns


class ReadWeights(msgspec.Struct, array_like=True, tag=True):
    """The first ``rows`` rows of checkpoint tensor ``name`` as the model holds it now (SGLang's
    /get_weights_by_name): gathered over the ranks, fp8 dequantized, in WorkerReply.values."""

    name: str
    rows: int = 100


CHECK_ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")


class CheckWeights(msgspec.Struct, array_like=True, tag=True):
    """SGLang's /weights_checker: ``checksum`` the weights (a hash per tensor and per rank),
    ``snapshot`` them (a host copy), ``reset_tensors`` (random values, to see an update replace
    every one) or ``compare`` them with the snapshot; names containing a ``skip`` entry are left
    out, and ``allow_quant_error`` lets fp8 weights differ by their rounding."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip: list[str] = []


class DropLoras(msgspec.Struct, array_like=True, tag=True):
    """Free the host copies of adapters no request names any more (an unload between steps)."""

    keys: list[str]


WorkerTask = (
    LoadWeights
    | TensorWeights
    | JoinWeightGroup
    | BroadcastWeights
    | LeaveWeightGroup
    | MemoryOccupation
    | LoadLora
    | DropLoras
    | ReadWeights
    | CheckWeights
)


@dataclass
class LocalTensors:
    """New weights handed over in-process, as they are (the offline API holding its only rank):
    the tensors path without the pickle. Never sent over a socket."""

    named: list[tuple[str, Any]]


@dataclass
class LocalLora:
    """A LoRA adapter handed over in-process as tensors (the offline API holding its only rank):
    LoadLora's payload without the pickle. Never sent over a socket."""

    key: str
    named: dict[str, Any]
    config: dict[str, Any]


class WorkerReply(msgspec.Struct, array_like=True, tag=True):
    """A rank's answer to a WorkerTask (rank 0 speaks for all: the ranks agreed first)."""

    ok: bool
    message: str = ""
    seconds: float = 0.0
    values: list[Any] | None = None  # ReadWeights' rows (nested lists of floats)


class ControlReq(msgspec.Struct, tag=True):
    """A question for the scheduler, answered by ControlReply. op: "stats", "flush_cache",
    "profile" (hands ``profile`` to every worker), "pause" (``mode``), "continue", "weights"
    (runs ``task`` on every worker; ``abort_all``, ``flush_cache``, ``weight_version`` say what
    it means for requests and the cache), "weight_version" (``weight_version`` None: read it),
    "lora_load" and "lora_unload" (``lora_name``, ``lora_path``), "read_weights" (``task``: a
    ReadWeights; the rows come back as ``parameter``), "check_weights" (``task``: a CheckWeights;
    checksums come back as ``ranks``)."""

    cid: int
    op: str
    profile: ProfileReq | None = None
    task: WorkerTask | None = None
    mode: str = "abort"  # pause: abort, retract or in_place
    abort_all: bool = False
    flush_cache: bool = True
    weight_version: str | None = None
    keep_pause: bool = False  # stay paused after the update
    lora_name: str = ""  # "lora_load" (with lora_path, lora_pinned) and "lora_unload"
    lora_path: str = ""
    lora_pinned: bool = False


class ControlReply(msgspec.Struct, tag=True):
    cid: int
    ok: bool
    data: dict[str, float | int | str | bool | list[Any]]
