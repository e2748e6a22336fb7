"""Traces of the worker on request (SGLang's /start_profile and /stop_profile): a torch profiler
runs over the next model steps, then each rank writes its Chrome trace and a table of its
kernels (or CPU ops) by time, headed by how busy the device was, to see where a step goes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl.wire.steps import ProfileReq

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.prof: profile | None = None
        self.req = ProfileReq(False)
        self.steps, self.started = 0, 0.0

    def handle(self, req: ProfileReq) -> None:
        self.stop()
        if req.start:
            activities = [ProfilerActivity.CPU] if "CPU" in req.activities else []
            if "GPU" in req.activities and self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities)
            self.prof.start()
            self.req, self.steps, self.started = req, 0, time.perf_counter()

    def step(self) -> None:
        """Count a launched model step; stop after the requested number."""
        if self.prof is not None:
            self.steps += 1
            if self.steps == self.req.num_steps:
                self.stop()

    def stop(self) -> None:
        if self.prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        prof, self.prof = self.prof, None
        prof.stop()
        try:
            self._write(prof, wall)
        except (OSError, ValueError) as e:  # a bad output_dir must not take the worker down
            logger.error("profile of rank %d not written: %s", self.rank, e)

    def _write(self, prof: profile, wall: float) -> None:
        os.makedirs(self.req.output_dir, exist_ok=True)
        path = os.path.join(self.req.output_dir, f"rank{self.rank}")
        prof.export_chrome_trace(path + ".trace.json.gz")
        events = prof.key_averages()
        on_gpu = any(e.self_device_time_total for e in events)
        busy = sum(e.self_device_time_total for e in events) / 1e6
        head = f"{self.steps} steps in {wall:.3f} s wall"
        head += f"; kernels {busy:.3f} s (device busy {busy / wall:.0%})\n" if on_gpu else "\n"
        table = events.table(
            sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total", row_limit=40, max_name_column_width=90
        )
        Path(path + ".txt").write_text(head + table)
        logger.info("profile of rank %d: %s; written to %s.trace.json.gz and .txt", self.rank, head.strip(), path)
