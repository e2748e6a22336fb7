"""SGLang's weight checker (``CheckWeights``): lets an RL trainer see that an update reached every
weight. A checksum is a hash per tensor of this rank's bytes and one over them all; a snapshot is
a host copy to compare against after an update; a reset fills every weight with random values,
so a compare after the next update shows any weight it left out.

The state checked is the model's parameters and persistent buffers under their names here (the
fused, sharded ones: a rank hashes its own shard), as SGLang checks its model's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minisgl.device.distributed import get_tp_info
from minisgl.wire.control import CHECK_ACTIONS, CheckWeights, WorkerReply

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

FP8_STEP = 2.0**-3  # e4m3's relative rounding step: allow_quant_error's tolerance


class WeightChecker:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.snapshot: dict[str, torch.Tensor] | None = None

    def run(self, task: CheckWeights) -> WorkerReply:
        if task.action not in CHECK_ACTIONS:
            return WorkerReply(False, f"action must be one of {', '.join(CHECK_ACTIONS)}, got {task.action[:100]!r}")
        state = dict(self._state(task.skip))
        if task.action == "checksum":
            return self._checksum(state)
        if task.action == "snapshot":
            self.snapshot = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
            return WorkerReply(True, f"snapshot of {len(state)} tensors")
        if task.action == "reset_tensors":
            for t in state.values():
                t.copy_(_random_like(t))
            return WorkerReply(True, f"reset {len(state)} tensors to random values")
        problem = self._compare(state, task.allow_quant_error)
        problem = self.runner.updater().agree(problem, raise_=False)  # (every rank checks its shard)
        return WorkerReply(problem is None, problem or f"{len(state)} tensors equal the snapshot")

    def _state(self, skip: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.runner.model
        persistent = {
            f"{module_name}.{name}" if module_name else name
            for module_name, module in model.named_modules()
            for name in module._buffers
            if name not in module._non_persistent_buffers_set
        }
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if (name in persistent or isinstance(t, torch.nn.Parameter)) and not any(s in name for s in skip):
                yield name, t.data

    def _checksum(self, state: dict[str, torch.Tensor]) -> WorkerReply:
        sums = {name: _hash(t) for name, t in state.items()}
        overall = hashlib.sha256()
        for name in sorted(sums):
            overall.update(name.encode())
            overall.update(sums[name].encode())
        tp = get_tp_info()
        info = {
            "checksums": sums,
            "per_gpu_checksum": overall.hexdigest(),
            "parallelism_info": {
                "tp_rank": tp.rank, "tp_size": tp.size, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": tp.rank, "size": tp.size,
            },
        }  # fmt: skip
        ranks = [info]
        if tp.size > 1:  # rank 0 answers for all: every rank's checksums, in rank order
            ranks = [None] * tp.size
            dist.all_gather_object(ranks, info)
        return WorkerReply(True, f"checksums of {len(sums)} tensors", values=ranks)

    def _compare(self, state: dict[str, torch.Tensor], allow_quant_error: bool) -> str | None:
        if self.snapshot is None:
            return "no snapshot to compare with: call /weights_checker with action snapshot first"
        if set(state) != set(self.snapshot):
            return f"the tensors checked are not the snapshot's ({len(state)} against {len(self.snapshot)})"
        bad = []
        for name, t in state.items():
            want, got = self.snapshot[name], t.detach().cpu()
            if torch.equal(want, got):
                continue
            diff = (got.double() - want.double()).abs()
            if allow_quant_error and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                if bool((diff <= FP8_STEP * want.double().abs() + 1e-12).all()):
                    continue
            bad.append(f"{name}: max_abs_err={diff.max().item():.4g} mean_abs_err={diff.mean().item():.4g}")
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            return f"{len(bad)} tensors differ from the snapshot: " + "; ".join(bad[:5]) + more
        return None


def _hash(t: torch.Tensor) -> str:
    """16 hex digits of a hash of the tensor's bytes (read from a copy: numpy's view of a weight's
    own storage would leave it unresizable, and memory release empties weights by resizing)."""
    data = t.detach().contiguous().view(-1).view(torch.uint8).to("cpu", copy=True).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, device=t.device, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, device=t.device) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, device=t.device, dtype=t.dtype)
