"""SGLang's RL control plane routes: weight updates (from disk, from a colocated trainer's
tensors, by broadcast from a trainer's rank 0), pausing and continuing generation, weight
versions, and giving GPU memory back while a trainer trains.

Bodies and answers keep SGLang's field names and defaults (``{"success", "message", ...}``, 200
or 400), so RL frameworks written for SGLang (slime, AReaL, verl, ...) drive this server as
they are. Each becomes one control message for the scheduler, which runs it between steps.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import time
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.serve.api.base import ApiBase, error_response, read_body
from minisgl.serve.api.client_paths import check_client_path
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import Schema
from minisgl.serve.api.protocol import Label
from minisgl.wire.control import (
    MAX_READ_ROWS,
    BroadcastWeights,
    CheckWeights,
    ControlReply,
    JoinWeightGroup,
    LeaveWeightGroup,
    LoadWeights,
    MemoryOccupation,
    ReadWeights,
    TensorWeights,
    WeightGroupSpec,
)
from minisgl.wire.steps import WorkerTask

# A weight update may load a checkpoint or wait for a trainer's broadcast: no 30 s limit.
UPDATE_TIMEOUT_S = 3600.0
# A trainer starts its store beside its /init_weights_update_group call: the join reaches the
# workers (whose step loop waits for the rendezvous) only once that store accepts connections.
TRAINER_WAIT_S = 60.0


async def listening(host: str, port: int, deadline_s: float) -> bool:
    """Whether something accepts TCP connections at host:port within ``deadline_s`` (retried;
    the connection is closed at once)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            left = max(end - time.monotonic(), 0.1)
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=min(left, 5.0))
            writer.close()
            return True
        except (OSError, asyncio.TimeoutError, UnicodeError):  # (refused, unreachable, no such host)
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.25)


# SGLang's knobs of its own update machinery; none changes what the weights become here.
UPDATE_INERT = {
    "is_async",
    "torch_empty_cache",
    "recapture_cuda_graph",
    "token_step",
    "manifest",
    "rid",
    "http_worker_ipc",
}


class UpdateCommon(msgspec.Struct, kw_only=True):
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Label | None = None
    keep_pause: bool = False


class FromDisk(UpdateCommon, kw_only=True):
    model_path: str
    load_format: str | None = None


class FromTensor(UpdateCommon, kw_only=True):
    serialized_named_tensors: list[str]
    load_format: str | None = None


class FromDistributed(UpdateCommon, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]]]
    group_name: str = "weight_update_group"
    load_format: str | None = None


class DestroyGroup(msgspec.Struct, kw_only=True):
    group_name: str = "weight_update_group"


class Pause(msgspec.Struct, kw_only=True):
    mode: str = "abort"


class WeightVersion(msgspec.Struct, kw_only=True):
    new_version: Label
    abort_all_requests: bool = False


class MemoryTags(msgspec.Struct, kw_only=True):
    tags: list[str] | None = None


class PostProcess(msgspec.Struct, kw_only=True):
    restore_weights_before_load: bool = False
    post_process_quantization: bool = False


class WeightsCheck(msgspec.Struct, kw_only=True):
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[Annotated[str, msgspec.Meta(max_length=1024)]] | None = None


class WeightsByName(msgspec.Struct, kw_only=True):
    name: str
    truncate_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_READ_ROWS)] = 100


# (the fields each route implements are its Struct's)
FROM_DISK = Schema("update_weights_from_disk", inert=UPDATE_INERT)
FROM_TENSOR = Schema("update_weights_from_tensor", inert=UPDATE_INERT)
FROM_DISTRIBUTED = Schema("update_weights_from_distributed", inert=UPDATE_INERT)
INIT_GROUP = Schema("init_weights_update_group", inert=UPDATE_INERT)
DESTROY_GROUP = Schema("destroy_weights_update_group", inert=UPDATE_INERT)
PAUSE = Schema("pause_generation", inert=UPDATE_INERT)
WEIGHT_VERSION = Schema("update_weight_version", inert=UPDATE_INERT)
MEMORY = Schema("release_memory_occupation", inert=UPDATE_INERT)
WEIGHTS_BY_NAME = Schema("get_weights_by_name")
WEIGHTS_CHECK = Schema("weights_checker")
POST_PROCESS = Schema("post_process_weights")


def refuse_pickled(args: Any, route: str) -> Response | None:
    """The 403 of a route whose payload is unpickled, unless --enable-weight-update-from-tensor."""
    if args.enable_weight_update_from_tensor:
        return None
    return error_response(
        403,
        f"{route} unpickles its payload: start the server with --enable-weight-update-from-tensor "
        "(and --api-key) to accept it",
    )


def _answer(reply: ControlReply, **extra: Any) -> Response:
    """SGLang's shape: success and message, 200 or 400."""
    data = dict(reply.data)
    message = str(data.pop("error", data.get("message", "")))
    body = {"success": reply.ok, "message": message, **extra}
    for key in ("num_paused_requests", "weight_version"):
        if key in data:
            body[key] = data[key]
    return JSONResponse(body, status_code=200 if reply.ok else 400)


class RlRoutes(ApiBase):
    async def _body(self, request: Request, kind: type, schema: Schema) -> Any:
        return await read_body(request, kind, self.args, schema, allow_empty=True)

    async def _weights(self, task: WorkerTask, body: UpdateCommon | None = None) -> Response:
        common = body or UpdateCommon()
        reply = await self.client.control(
            "weights",
            timeout=UPDATE_TIMEOUT_S,
            task=task,
            abort_all=common.abort_all_requests,
            flush_cache=common.flush_cache,
            weight_version=common.weight_version,
            keep_pause=common.keep_pause,
        )
        if reply.ok and "weight_version" in reply.data:
            self.weight_version = str(reply.data["weight_version"])
        return _answer(reply)

    async def update_weights_from_disk(self, request: Request) -> Response:
        body: FromDisk = await self._body(request, FromDisk, FROM_DISK)
        check_client_path(body.model_path, self.args, "model_path", served=self.args.model)
        return await self._weights(LoadWeights(body.model_path, body.load_format or "auto"), body)

    async def update_weights_from_tensor(self, request: Request) -> Response:
        refused = refuse_pickled(self.args, "update_weights_from_tensor")
        if refused is not None:
            return refused
        body: FromTensor = await self._body(request, FromTensor, FROM_TENSOR)
        try:
            payloads = [base64.b64decode(p, validate=True) for p in body.serialized_named_tensors]
        except (binascii.Error, ValueError):
            raise BadRequest(
                "serialized_named_tensors must be base64 text, one per tensor-parallel rank",
                param="serialized_named_tensors",
            ) from None
        return await self._weights(TensorWeights(payloads, body.load_format or "direct"), body)

    async def update_weights_from_distributed(self, request: Request) -> Response:
        body: FromDistributed = await self._body(request, FromDistributed, FROM_DISTRIBUTED)
        if body.load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest(
                f"load_format must be direct or flattened_bucket, got {body.load_format!r}", param="load_format"
            )
        return await self._weights(
            BroadcastWeights(body.names, body.dtypes, body.shapes, body.group_name, body.load_format or "direct"), body
        )

    async def init_weights_update_group(self, request: Request) -> Response:
        b: WeightGroupSpec = await self._body(request, WeightGroupSpec, INIT_GROUP)
        if not 0 < b.master_port < 65536 or b.world_size < 2 or b.rank_offset < 1:
            raise BadRequest("master_port must be a port, world_size >= 2 and rank_offset >= 1 (the trainer is rank 0)")
        if not await listening(b.master_address, b.master_port, TRAINER_WAIT_S):
            raise BadRequest(
                f"no trainer listens at {b.master_address[:200]}:{b.master_port} (waited {TRAINER_WAIT_S:g} s)"
            )
        return await self._weights(JoinWeightGroup(**msgspec.structs.asdict(b)))

    async def destroy_weights_update_group(self, request: Request) -> Response:
        b: DestroyGroup = await self._body(request, DestroyGroup, DESTROY_GROUP)
        return await self._weights(LeaveWeightGroup(b.group_name))

    async def get_weights_by_name(self, request: Request) -> Response:
        """The first ``truncate_size`` rows of a checkpoint tensor as served now (SGLang's answer:
        the rows as nested lists of floats; fp8 weights dequantized); 400 naming a bad name."""
        body: WeightsByName = await read_body(request, WeightsByName, self.args, WEIGHTS_BY_NAME)
        reply = await self.client.control(
            "read_weights", timeout=UPDATE_TIMEOUT_S, task=ReadWeights(body.name, body.truncate_size)
        )
        if not reply.ok:
            return error_response(400, str(reply.data.get("error")), param="name")
        return JSONResponse(reply.data["parameter"])

    async def post_process_weights(self, request: Request) -> Response:
        """SGLang's hooks around a load for int4/fp4 (compressed-tensors) checkpoints, which this
        engine does not serve: its updates land ready to serve (FP8 scales made as they land),
        so there is nothing to restore or post-process."""
        await self._body(request, PostProcess, POST_PROCESS)
        return JSONResponse({"success": True, "message": "nothing to post-process: updated weights land ready"})

    async def weights_checker(self, request: Request) -> Response:
        """SGLang's /weights_checker (``CheckWeights``): success and message, with ``ranks`` (each
        rank's checksums) and ``per_engine_checksum`` for a checksum; 400 when a compare finds
        a difference."""
        body: WeightsCheck = await self._body(request, WeightsCheck, WEIGHTS_CHECK)
        task = CheckWeights(body.action, body.allow_quant_error, body.skip_tensor_list or [])
        reply = await self.client.control("check_weights", timeout=UPDATE_TIMEOUT_S, task=task)
        if not (reply.ok and "ranks" in reply.data):
            return _answer(reply)
        ranks = list(reply.data["ranks"])
        total = hashlib.sha256()
        for info in ranks:
            total.update(str(info["per_gpu_checksum"]).encode())
        return _answer(reply, ranks=ranks, per_engine_checksum=total.hexdigest())

    async def pause_generation(self, request: Request) -> Response:
        body: Pause = await self._body(request, Pause, PAUSE)
        reply = await self.client.control("pause", mode=body.mode)
        if not reply.ok:
            return error_response(400, str(reply.data.get("error")), param="mode")
        return JSONResponse(
            {
                "message": "Generation paused successfully.",
                "status": "ok",
                "num_paused_requests": reply.data.get("num_paused_requests", 0),
            }
        )

    async def continue_generation(self, request: Request) -> Response:
        await self.client.control("continue")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def get_weight_version(self, request: Request) -> Response:
        reply = await self.client.control("weight_version")
        self.weight_version = str(reply.data["weight_version"])
        return JSONResponse({"weight_version": self.weight_version})

    async def update_weight_version(self, request: Request) -> Response:
        body: WeightVersion = await self._body(request, WeightVersion, WEIGHT_VERSION)
        reply = await self.client.control(
            "weight_version", weight_version=body.new_version, abort_all=body.abort_all_requests
        )
        self.weight_version = str(reply.data["weight_version"])
        return JSONResponse(
            {"success": True, "message": f"weight version is {self.weight_version}", "new_version": self.weight_version}
        )

    async def _memory(self, request: Request, release: bool) -> Response:
        body: MemoryTags = await self._body(request, MemoryTags, MEMORY)
        task = MemoryOccupation(release) if body.tags is None else MemoryOccupation(release, body.tags)
        return await self._weights(task)

    async def release_memory_occupation(self, request: Request) -> Response:
        return await self._memory(request, True)

    async def resume_memory_occupation(self, request: Request) -> Response:
        return await self._memory(request, False)
