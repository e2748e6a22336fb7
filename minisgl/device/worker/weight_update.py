"""New weights for a running rank, the RL control plane's worker side: a checkpoint from disk,
tensors a colocated trainer shares (``worker.tensor_payload``), or a broadcast from a trainer's
rank 0 over a group both joined (``distributed.weight_group``).

Every update is checked whole first (each tensor has a place and the served model's shape; a
checkpoint from disk is the same architecture and complete), and the ranks agree that all of
them passed before any parameter changes, so a refused update leaves the old weights serving
everywhere. Values are copied into the existing parameters (an FP8 engine quantizes float
tensors with fresh scales as they land), so CUDA graphs stay valid.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minisgl.checkpoint.locate import client_checkpoint, resolve_model_path
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.checkpoint.safetensors_header import FLOAT_DTYPES
from minisgl.device.distributed import get_tp_info
from minisgl.device.distributed.weight_group import destroy_weight_group, init_weight_group
from minisgl.device.models.loader import WeightMap, checkpoint_tensors, first_non_finite, iter_weights
from minisgl.device.worker.tensor_payload import decode_named_tensors
from minisgl.wire.control import (
    BroadcastWeights,
    JoinWeightGroup,
    LeaveWeightGroup,
    LoadWeights,
    LocalTensors,
    TensorWeights,
    WorkerReply,
)
from minisgl.wire.steps import WorkerTask

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# What must match between the served model and a checkpoint pushed into it.
SAME_MODEL_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def parse_dtype(name: str) -> torch.dtype:
    """``bfloat16`` or ``torch.bfloat16`` as a torch dtype; ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class WeightUpdater:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.groups: dict[str, dist.ProcessGroup] = {}

    def run(self, task: WorkerTask | LocalTensors) -> WorkerReply:
        """Carry out a weight task on this rank; the reply says whether it (and, for updates,
        every rank) succeeded, and why not."""
        start = time.perf_counter()
        try:
            if isinstance(task, LoadWeights):
                message = self._from_disk(task)
            elif isinstance(task, TensorWeights):
                message = self._from_tensors(task)
            elif isinstance(task, LocalTensors):
                message = self.load_named(task.named)
            elif isinstance(task, JoinWeightGroup):
                message = self._join(task)
            elif isinstance(task, BroadcastWeights):
                message = self._from_broadcast(task)
            elif isinstance(task, LeaveWeightGroup):
                message = self._leave(task)
            else:
                raise ValueError(f"not a weight task: {type(task).__name__}")
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            logger.warning("weight update refused: %s", e)
            return WorkerReply(False, str(e), time.perf_counter() - start)
        return WorkerReply(True, message, time.perf_counter() - start)

    # ---- sources -----------------------------------------------------------------------------

    def _from_disk(self, task: LoadWeights) -> str:
        load_format = task.load_format or "auto"
        wmap = WeightMap(self.runner.model)
        problem, folder = None, None
        try:
            if load_format == "dummy":
                raise ValueError("load_format dummy has no weights to load")
            if task.model_path == self.runner.args.model:  # (back to the served checkpoint: as the launch found it)
                folder = resolve_model_path(task.model_path, load_format)
            else:
                folder = client_checkpoint(task.model_path, load_format)
            self._check_config(ModelConfig.from_path(folder, self.runner.args.model_overrides()))
            tensors = list(checkpoint_tensors(folder))
            wmap.check(((name, shape) for name, _, shape in tensors), complete=True)
            kinds = [(name, dtype) for name, dtype, _ in tensors if dtype is not None and dtype not in FLOAT_DTYPES]
            if kinds:  # (a cast would load them as numbers no trained weight has)
                raise ValueError(
                    f"tensor {kinds[0][0][:200]!r} is {kinds[0][1]}; weights load from floating-point tensors"
                )
            bad = first_non_finite(folder, self.runner.device)
            if bad is not None:  # (every output would become one token)
                raise ValueError(f"tensor {bad[:200]!r} holds values that are not finite (NaN or inf)")
        except Exception as e:  # any library's error too: a file being written must not end the worker
            problem = f"{task.model_path[:300]}: {e}"
        self.agree(problem)
        wmap.load(iter_weights(folder))
        self._after_load(None)
        return f"loaded {task.model_path}"

    def _check_config(self, new: ModelConfig) -> None:
        served = self.runner.config
        for name in SAME_MODEL_FIELDS:
            if getattr(new, name) != getattr(served, name):
                raise ValueError(f"{name} is {getattr(new, name)!r}; the served model's is {getattr(served, name)!r}")

    def _from_tensors(self, task: TensorWeights) -> str:
        tp = get_tp_info()
        problem, named = None, []
        try:
            if len(task.payloads) != tp.size:
                raise ValueError(
                    f"serialized_named_tensors has {len(task.payloads)} payloads; the engine has "
                    f"{tp.size} tensor-parallel ranks (one each)"
                )
            named = decode_named_tensors(task.payloads[tp.rank], task.load_format)
        except ValueError as e:
            problem = str(e)
        return self.load_named(named, problem)

    def load_named(self, named: list[tuple[str, torch.Tensor]], problem: str | None = None) -> str:
        """Check, agree on, and load (name, full tensor) pairs; any subset of the weights."""
        wmap = WeightMap(self.runner.model)
        if problem is None:
            try:
                wmap.check(((n, tuple(t.shape)) for n, t in named), complete=False)
            except ValueError as e:
                problem = str(e)
        self.agree(problem)
        wmap.load(iter(named))
        self._after_load([n for n, _ in named])
        return f"updated {len(named)} tensors"

    def _join(self, task: JoinWeightGroup) -> str:
        if task.group_name in self.groups:
            raise ValueError(f"group {task.group_name!r} is already joined")
        backend = task.backend or ("nccl" if self.runner.device.type == "cuda" else "gloo")
        if backend == "nccl" and self.runner.device.type != "cuda":
            backend = "gloo"  # (a CPU engine; the trainer's side chooses gloo too)
        rank = task.rank_offset + get_tp_info().rank
        self.groups[task.group_name] = init_weight_group(
            backend, task.master_address, task.master_port, rank, task.world_size, task.group_name
        )
        return f"joined {task.group_name} as rank {rank} of {task.world_size}"

    def _leave(self, task: LeaveWeightGroup) -> str:
        group = self.groups.pop(task.group_name, None)
        if group is None:
            raise ValueError(f"no weight update group named {task.group_name!r}")
        destroy_weight_group(group)
        return f"left {task.group_name}"

    def _from_broadcast(self, task: BroadcastWeights) -> str:
        group = self.groups.get(task.group_name)
        if group is None:
            raise ValueError(f"no weight update group named {task.group_name!r} (call /init_weights_update_group)")
        if not len(task.names) == len(task.dtypes) == len(task.shapes):
            raise ValueError(
                f"names, dtypes and shapes differ in length ({len(task.names)}, {len(task.dtypes)}, {len(task.shapes)})"
            )
        if task.load_format not in ("direct", "flattened_bucket"):
            raise ValueError(f"load_format must be direct or flattened_bucket, got {task.load_format!r}")
        dtypes = [parse_dtype(d) for d in task.dtypes]
        problem, wmap = None, WeightMap(self.runner.model)
        try:
            wmap.check(zip(task.names, map(tuple, task.shapes)), complete=False)
        except ValueError as e:
            problem = str(e)
        # The trainer broadcasts whatever the request lists: receive it all whatever happens, so
        # it never hangs, and load it only if every rank accepted the list.
        problem = self.agree(problem, raise_=False)
        if task.load_format == "flattened_bucket":
            received: Iterator[tuple[str, torch.Tensor]] = iter(
                self._receive_bucket(group, task.names, dtypes, task.shapes)
            )
        else:
            received = self._receive(group, task.names, dtypes, task.shapes)
        if problem is not None:
            for _ in received:
                pass
            raise ValueError(problem)
        wmap.load(received)
        self._after_load(list(task.names))
        return f"received {len(task.names)} tensors"

    def _receive(
        self, group: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.runner.device)
            dist.broadcast(tensor, src=0, group=group)
            yield name, tensor

    def _receive_bucket(
        self, group: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """One uint8 tensor holding every tensor's bytes in list order (SGLang's flattened bucket)."""
        sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.runner.device)
        dist.broadcast(flat, src=0, group=group)
        out, at = [], 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes):
            out.append((name, flat[at : at + size].view(dtype).view(shape)))
            at += size
        return out

    # ---- agreement and fix-ups ---------------------------------------------------------------

    def agree(self, problem: str | None, raise_: bool = True) -> str | None:
        """Every rank's verdict on the checked update: the problem of this rank, or of another
        (named by rank) if only that one refused; raised unless ``raise_`` is False."""
        tp = get_tp_info()
        if tp.size > 1:
            flag = torch.tensor([tp.rank if problem is not None else tp.size], device=self.runner.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            first = int(flag.item())
            if first < tp.size and problem is None:
                problem = f"tensor-parallel rank {first} refused the update (its log says why)"
        if problem is not None and raise_:
            raise ValueError(problem)
        return problem

    def _after_load(self, names: list[str] | None) -> None:
        """Derived copies follow their weights: an fp8 LM head is quantized again when the head
        (or the embedding it is tied to) changed. ``names``: the tensors updated (None: all)."""
        head = self.runner.model.lm_head
        touched = names is None or any(n in ("lm_head.weight", "model.embed_tokens.weight") for n in names)
        if head.qweight is not None and touched:
            head.quantize(keep_float=True)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()  # a colocated trainer may free its tensors once we answer
