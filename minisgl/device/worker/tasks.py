"""Control-plane tasks on one rank, run between steps: new weights (``weight_update``), memory
released and taken again (``memory_saver``), a LoRA adapter read into host memory, and
checkpoint tensors read back (``models.weight_read``). Each answers with a WorkerReply; with
tensor parallelism every rank runs the task and rank 0's reply speaks for all."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import torch

from minisgl.wire.control import (
    CheckWeights,
    DropLoras,
    LoadLora,
    LocalLora,
    LocalTensors,
    MemoryOccupation,
    ReadWeights,
    WorkerReply,
)
from minisgl.wire.steps import WorkerTask

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def run_task(runner: ModelRunner, task: WorkerTask | LocalTensors | LocalLora) -> WorkerReply:
    if isinstance(task, DropLoras):
        for key in task.keys:
            runner.lora_host.pop(key, None)
        return WorkerReply(True, f"freed {len(task.keys)} adapters' host copies")
    if isinstance(task, MemoryOccupation):
        if runner.memory_saver is None:
            from minisgl.device.worker.memory_saver import MemorySaver

            runner.memory_saver = MemorySaver(runner)
        saver = runner.memory_saver
        start = time.perf_counter()
        message = saver.release(task.tags) if task.release else saver.resume(task.tags)
        logger.info("%s", message)
        return WorkerReply(True, message, time.perf_counter() - start)
    if runner.memory_saver is not None and "weights" in runner.memory_saver.released:
        return WorkerReply(False, "the weights are released: resume_memory_occupation first")
    if isinstance(task, (LoadLora, LocalLora)):
        return load_lora(runner, task)
    if isinstance(task, ReadWeights):
        return read_weights(runner, task)
    if isinstance(task, CheckWeights):
        if runner.weight_checker is None:
            from minisgl.device.worker.weight_checker import WeightChecker

            runner.weight_checker = WeightChecker(runner)
        return runner.weight_checker.run(task)
    reply = runner.updater().run(task)
    logger.info("%s (%.2f s)", reply.message, reply.seconds)
    return reply


def read_weights(runner: ModelRunner, task: ReadWeights) -> WorkerReply:
    """A checkpoint tensor's first rows as the model holds them (every rank takes part in the
    gather; the name is checked the same on each, so they agree without a vote)."""
    from minisgl.device.models.weight_read import read_weight

    start = time.perf_counter()
    try:
        values = read_weight(runner.model, task.name, task.rows)
    except ValueError as e:
        return WorkerReply(False, str(e))
    return WorkerReply(True, f"read {task.name}", time.perf_counter() - start, values.tolist())


def load_lora(runner: ModelRunner, task: LoadLora | LocalLora) -> WorkerReply:
    """Read an adapter (a folder, or tensors) into host memory; steps copy it into a device slot
    when one runs it."""
    from minisgl.device.models.lora_adapter import AdapterError, read_adapter, read_shards, tensor_adapter

    start = time.perf_counter()
    if runner.lora_rows is None:
        return WorkerReply(False, "LoRA adapters need a server started with --enable-lora")
    shards, problem = None, None
    try:
        if isinstance(task, LocalLora):
            adapter = tensor_adapter(dict(task.named), task.config)
        elif task.path:
            adapter = read_adapter(task.path)
        else:
            adapter = tensor_adapter(*_decoded_adapter(task))
        shards, message = read_shards(runner.model, runner.config, adapter, runner.lora_rank)
    except (AdapterError, ValueError) as e:
        problem = str(e)
    except Exception as e:  # a library's own error on a bad file: a refusal, never the worker's end
        problem = f"{type(e).__name__}: {e}"
    problem = runner.updater().agree(problem, raise_=False)  # every rank holds it, or none
    if problem is not None:
        return WorkerReply(False, problem)
    runner.lora_host[task.key] = shards
    logger.info("%s", message)
    return WorkerReply(True, message, time.perf_counter() - start)


def _decoded_adapter(task: LoadLora) -> tuple[dict[str, torch.Tensor], dict]:
    """SGLang's serialized LoRA tensors (a dict or a list of (name, tensor) pairs, through the
    restricted unpickler) and the adapter's config."""
    from minisgl.device.worker.tensor_payload import decode_named_tensors

    try:
        config = json.loads(task.config_json)
    except ValueError:
        raise ValueError("config_dict is not JSON") from None
    return dict(decode_named_tensors(task.payload, task.load_format)), config
