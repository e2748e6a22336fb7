"""Hostile request bodies on every route: never a 5xx, never a dead process, and the server is
idle and clean afterwards (no request registered, every page free or evictable)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import ServerProcess
from tests.test_server import idle_and_clean

ROUTES = [
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/abort_request",
    "/flush_cache",
    "/tokenize",
    "/detokenize",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/get_weights_by_name",
]
FIELDS = [
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "top_logprobs_num",
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "max_new_tokens",
    "stop_token_ids",
    "min_p",
    "abort_all",
    "role",
    "content",
    "echo",
    "tokens",
    "add_special_tokens",
    "skip_special_tokens",
    "lora_path",
    "lora_name",
    "suffix",
    "name",
    "truncate_size",
    "return_token_ids",
    "return_prompt_token_ids",
    "return_meta_info",
    "return_cached_tokens_details",
    "structural_tag",
    "response_format",
    "reasoning",
    "reasoning_effort",
    "cache_salt",
]

HUGE_INTS = st.sampled_from([2**31, 2**63, 2**64 - 1, 2**64 + 7, -(2**63) - 1, 10**40, -1, 0])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 3000),
    HUGE_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)),
    max_leaves=20,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
# Bodies that are valid but for a field or two, so the fuzz also reaches the engine.
near_valid = st.fixed_dictionaries(
    {"text": st.text(min_size=1, max_size=20)},
    optional={
        "sampling_params": st.dictionaries(st.sampled_from(FIELDS[13:23]), scalars, max_size=3),
        "rid": st.text(max_size=8),
        "return_logprob": st.booleans(),
        "top_logprobs_num": scalars,
    },
)
STATUSES: list[int] = []

# Bytes JSON cannot carry as text: invalid UTF-8, lone surrogates, deep nesting, NaN, truncation.
RAW = [
    b'{"text": "\xff\xfe"}',
    b'{"text": "\\ud800"}',
    b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"text": "a", "sampling_params": {"temperature": NaN}}',
    b'{"text": "a"',
    b"\x00\x01",
    b"null",
    b"[]",
    b'{"input_ids": [1e400]}',
    b'{"text": "a", "sampling_params": {"max_new_tokens": 1e3}}',
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    srv = ServerProcess(tiny_llama, "--page-size", "4", "--max-total-tokens", "4096", "--served-model-name", "tiny")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _post(srv: ServerProcess, route: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{srv.url}{route}", content=content, headers={"content-type": "application/json"}, timeout=60)


def _fix_max(body: dict) -> dict:
    """Keep generations short so the fuzz spends its time on parsing, not decoding."""
    for key in ("max_tokens", "max_new_tokens"):
        if isinstance(body.get(key), int) and 16 < body[key] < 2**31:
            body[key] = 16
    if isinstance(body.get("sampling_params"), dict):
        _fix_max(body["sampling_params"])
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(route=st.sampled_from(ROUTES), body=st.one_of(bodies, near_valid), stream=st.booleans())
def test_fuzzed_bodies_never_5xx(server: ServerProcess, route: str, body: dict, stream: bool):
    if "text" in body and isinstance(body.get("sampling_params"), dict):
        route = "/generate"
    body = _fix_max(body)
    if route.startswith("/v1/") and "model" not in body:
        body["model"] = "tiny"
    body["stream"] = stream
    r = _post(server, route, json.dumps(body).encode())
    STATUSES.append(r.status_code)
    assert r.status_code < 500, (route, body, r.text)
    assert server.proc.poll() is None


@pytest.mark.parametrize("raw", RAW)
@pytest.mark.parametrize("route", ROUTES[:3])
def test_raw_bytes_never_5xx(server: ServerProcess, route: str, raw: bytes):
    r = _post(server, route, raw)
    assert 400 <= r.status_code < 500, (route, raw[:60], r.text)
    assert "error" in r.json()


def test_idle_and_clean_after_fuzzing(server: ServerProcess):
    assert 200 in STATUSES and 400 in STATUSES, sorted(set(STATUSES))  # the fuzz reached both paths
    assert server.proc.poll() is None
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    info = server.server_info()
    assert info["active_requests"] == 0, info
    idle_and_clean(server)
