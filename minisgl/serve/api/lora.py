"""SGLang's LoRA adapter routes: /load_lora_adapter, /load_lora_adapter_from_tensors (a
colocated trainer's tensors: the pickled payload of /update_weights_from_tensor, behind the same
flag and restricted unpickler) and /unload_lora_adapter, while serving.

Each becomes one control message for the scheduler, which reads the adapter into the workers'
host memory between steps (a pinned one also takes a device slot for good) or refuses it to new
requests. The answer keeps SGLang's shape
(``success``, ``error_message``, ``loaded_adapters``), and the API keeps the scheduler's list of
adapters for the OpenAI routes' ``model`` names and ``/v1/models``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.serve.api.base import ApiBase, read_body
from minisgl.serve.api.client_paths import check_client_path
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import Schema
from minisgl.serve.api.protocol import Label
from minisgl.serve.api.rl import refuse_pickled
from minisgl.wire.control import LoadLora

# A load reads the adapter from disk (or the hub) on every worker.
LOAD_TIMEOUT_S = 600.0
_INERT = {"lora_id", "rid", "http_worker_ipc"}
LOAD = Schema("load_lora_adapter", inert=_INERT)  # (the fields each route implements are its Struct's)
FROM_TENSORS = Schema(
    "load_lora_adapter_from_tensors",
    inert=_INERT,
    default_only={"added_tokens_config": None},
    why={"added_tokens_config": "adapters that add tokens are not supported"},
)
UNLOAD = Schema("unload_lora_adapter", inert=_INERT)


class LoadAdapter(msgspec.Struct, kw_only=True):
    lora_name: Label
    lora_path: str
    pinned: bool = False


class AdapterTensors(msgspec.Struct, kw_only=True):
    lora_name: Label
    serialized_tensors: str
    config_dict: dict[str, Any]
    load_format: str | None = None
    pinned: bool = False


class UnloadAdapter(msgspec.Struct, kw_only=True):
    lora_name: Label


class LoraRoutes(ApiBase):
    async def _lora(
        self, op: str, name: str, path: str = "", pinned: bool = False, task: LoadLora | None = None
    ) -> Response:
        reply = await self.client.control(
            op, timeout=LOAD_TIMEOUT_S, lora_name=name, lora_path=path, lora_pinned=pinned, task=task
        )
        if "loaded_adapters" in reply.data:
            self.adapters = json.loads(str(reply.data["loaded_adapters"]))
        error = "" if reply.ok else str(reply.data.get("error", ""))
        body = {"success": reply.ok, "error_message": error, "loaded_adapters": self.adapters}
        return JSONResponse(body, status_code=200 if reply.ok else 400)

    async def load_lora_adapter(self, request: Request) -> Response:
        body: LoadAdapter = await read_body(request, LoadAdapter, self.args, LOAD)
        check_client_path(body.lora_path, self.args, "lora_path")
        return await self._lora("lora_load", body.lora_name, body.lora_path, body.pinned)

    async def load_lora_adapter_from_tensors(self, request: Request) -> Response:
        refused = refuse_pickled(self.args, "load_lora_adapter_from_tensors")
        if refused is not None:
            return refused
        body: AdapterTensors = await read_body(request, AdapterTensors, self.args, FROM_TENSORS)
        try:
            payload = base64.b64decode(body.serialized_tensors, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("serialized_tensors must be base64 text", param="serialized_tensors") from None
        task = LoadLora("", "", payload, json.dumps(body.config_dict), body.load_format or "direct")
        return await self._lora("lora_load", body.lora_name, pinned=body.pinned, task=task)

    async def unload_lora_adapter(self, request: Request) -> Response:
        body: UnloadAdapter = await read_body(request, UnloadAdapter, self.args, UNLOAD)
        return await self._lora("lora_unload", body.lora_name)
