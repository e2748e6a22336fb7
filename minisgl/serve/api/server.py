"""The HTTP API app (Starlette, served by uvicorn in the launcher process).

SGLang's native routes (``api.native``) and the OpenAI-compatible ones (``api.openai``,
``api.responses``) on one app, behind an optional API key. Each route decodes its body (4xx naming the bad field, fields
sorted by ``api.fields``), turns it into GenerateReq messages, and either streams updates as
server-sent events or collects them into one JSON response. A client that goes away aborts its
requests, so their KV pages go back to the pool.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from minisgl.config.args import ServerArgs
from minisgl.serve.api.base import error_response
from minisgl.serve.api.client import EngineClient, EngineError
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import IGNORED
from minisgl.serve.api.lora import LoraRoutes
from minisgl.serve.api.native import NativeRoutes
from minisgl.serve.api.responses import ResponsesRoutes
from minisgl.serve.api.rl import RlRoutes
from minisgl.wire.requests import EngineInfo

logger = logging.getLogger("minisgl.serve.api")

OPEN_PATHS = {"/health"}  # reachable without the API key (liveness probes)


class Api(NativeRoutes, ResponsesRoutes, RlRoutes, LoraRoutes):
    """Every route's handler, on one shared state."""


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


def _with_errors(api: Api, handler: Callable) -> Callable:
    """Turn the client-facing exceptions into 4xx responses and count them."""

    timer = api.metrics.func_latency.labels(handler.__name__)

    async def endpoint(request: Request) -> Response:
        start = time.perf_counter()
        try:
            return await handler(request)
        except (BadRequest, EngineError) as e:
            api.metrics.errors.labels(str(e.status)).inc()
            if api.args.log_requests:  # --log-requests: refusals too, not only finished requests
                logger.info("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return error_response(e.status, str(e), getattr(e, "param", None))
        finally:  # (a streamed response's handler returns once the stream is set up)
            timer.observe(time.perf_counter() - start)

    return endpoint


class IgnoredFieldsMiddleware:
    """Names the request fields no schema knows in an ``x-minisgl-ignored-fields`` header, so a
    client sees a misspelled field (``max_token``) without reading the server's log."""

    def __init__(self, app: Callable):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ignored: list[str] = []
        token = IGNORED.set(ignored)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start" and ignored:
                value = ", ".join(dict.fromkeys(ignored))[:1024].encode("latin-1", "replace")
                message = {**message, "headers": [*message.get("headers", []), (b"x-minisgl-ignored-fields", value)]}
            await send(message)

        try:
            await self.app(scope, receive, named)
        finally:
            IGNORED.reset(token)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but the liveness probe."""

    def __init__(self, app: Callable, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) > 1:  # which one a proxy checked and which one we read may differ
                await error_response(401, "send one Authorization header")(scope, receive, send)
                return
            if not hmac.compare_digest(given[0] if given else b"", self.expected):
                await error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _host_name(host: str) -> str:
    """The name in a Host header: ``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0]


class LoopbackHostMiddleware:
    """On a server bound to loopback, answers only requests whose Host header names loopback: a
    web page whose own name a DNS-rebinding attacker re-points to 127.0.0.1 sends its own name,
    and would otherwise reach a keyless local server from the browser."""

    def __init__(self, app: Callable):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and _host_name(host).lower() not in LOOPBACK:
                msg = f"Host {host!r} is not this server's: bound to loopback, it answers local names only"
                await error_response(403, msg)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Every route: path, the Api method that answers it, its methods (SGLang's and OpenAI's paths).
ROUTES: list[tuple[str, str, list[str]]] = [
    ("/generate", "generate", ["POST"]),
    ("/v1/completions", "completions", ["POST"]),
    ("/v1/chat/completions", "chat_completions", ["POST"]),
    ("/v1/responses", "responses", ["POST"]),
    ("/v1/responses/{response_id}", "get_response", ["GET"]),
    ("/v1/responses/{response_id}", "delete_response", ["DELETE"]),
    ("/v1/responses/{response_id}/cancel", "cancel_response", ["POST"]),
    ("/v1/score", "score", ["POST"]),
    ("/tokenize", "tokenize", ["POST"]),
    ("/v1/tokenize", "tokenize", ["POST"]),
    ("/detokenize", "detokenize", ["POST"]),
    ("/v1/detokenize", "detokenize", ["POST"]),
    ("/v1/models", "models", ["GET"]),
    ("/v1/models/{model:path}", "model", ["GET"]),
    ("/health", "health", ["GET"]),
    ("/health_generate", "health_generate", ["GET"]),
    ("/get_model_info", "model_info", ["GET"]),
    ("/model_info", "model_info", ["GET"]),
    ("/get_server_info", "server_info", ["GET"]),
    ("/server_info", "server_info", ["GET"]),
    ("/version", "version", ["GET"]),
    ("/v1/loads", "loads", ["GET"]),
    ("/get_loads", "loads", ["GET"]),
    ("/metrics", "metrics_route", ["GET"]),
    ("/flush_cache", "flush_cache", ["GET", "POST"]),
    ("/reset_prefix_cache", "flush_cache", ["POST"]),
    ("/abort_request", "abort_request", ["POST"]),
    ("/start_profile", "start_profile", ["POST"]),
    ("/stop_profile", "stop_profile", ["POST"]),
    ("/update_weights_from_disk", "update_weights_from_disk", ["POST"]),
    ("/get_weights_by_name", "get_weights_by_name", ["GET", "POST"]),
    ("/weights_checker", "weights_checker", ["GET", "POST"]),
    ("/post_process_weights", "post_process_weights", ["POST"]),
    ("/update_weights_from_tensor", "update_weights_from_tensor", ["POST"]),
    ("/update_weights_from_distributed", "update_weights_from_distributed", ["POST"]),
    ("/init_weights_update_group", "init_weights_update_group", ["POST"]),
    ("/destroy_weights_update_group", "destroy_weights_update_group", ["POST"]),
    ("/pause_generation", "pause_generation", ["POST"]),
    ("/continue_generation", "continue_generation", ["POST"]),
    ("/get_weight_version", "get_weight_version", ["GET"]),
    ("/update_weight_version", "update_weight_version", ["POST"]),
    ("/release_memory_occupation", "release_memory_occupation", ["POST"]),
    ("/load_lora_adapter", "load_lora_adapter", ["POST"]),
    ("/load_lora_adapter_from_tensors", "load_lora_adapter_from_tensors", ["POST"]),
    ("/unload_lora_adapter", "unload_lora_adapter", ["POST"]),
    ("/resume_memory_occupation", "resume_memory_occupation", ["POST"]),
]


def create_app(client: EngineClient, info: EngineInfo, args: ServerArgs, pids: dict[str, int]) -> Callable:
    """The ASGI app; ``pids`` (process name -> pid) is reported by /get_server_info."""
    api = Api(client, info, args, pids)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        yield
        await client.stop()

    app = Starlette(
        routes=[Route(path, _with_errors(api, getattr(api, name)), methods=m) for path, name, m in ROUTES],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    app = IgnoredFieldsMiddleware(app)
    if args.api_key:
        app = ApiKeyMiddleware(app, args.api_key)
    return LoopbackHostMiddleware(app) if args.host in LOOPBACK else app
