"""The RL control plane over HTTP, as SGLang's RL clients drive it: each update route against
a fresh engine on the new checkpoint, pause modes with requests in flight, weight versions,
memory release, and refused payloads that leave the old weights serving."""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from minisgl.device.distributed.weight_group import destroy_weight_group, init_weight_group
from minisgl.device.worker.tensor_payload import encode_named_tensors
from minisgl.llm import LLM
from tests.server_utils import ServerProcess, free_port, running_server
from tests.test_rl import ENGINE, checkpoints, state_dict  # noqa: F401  (fixture)
from tests.test_server import idle_and_clean, sse_events

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 99], [40, 41, 42]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(
        checkpoints["A"],
        "--page-size",
        "4",
        "--max-total-tokens",
        "8192",
        "--enable-weight-update-from-tensor",
        "--weight-version",
        "v0",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, list[list[int]]]:
    return {
        name: [r["output_ids"] for r in LLM(str(checkpoints[name]), **ENGINE).generate(PROMPTS, GREEDY)]
        for name in ("A", "B")
    }


def post(srv: ServerProcess, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body if body is not None else {}, timeout=timeout)


def generate(srv: ServerProcess) -> list[dict]:
    out = post(srv, "/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY})
    assert out.status_code == 200, out.text
    return out.json()


def outputs(srv: ServerProcess) -> list[list[int]]:
    return [r["output_ids"] for r in generate(srv)]


def to_a(srv: ServerProcess, checkpoints) -> None:
    r = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints["A"]), "weight_version": "A"})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_update_from_disk_with_the_body_rl_clients_send(server, checkpoints, reference):
    first = generate(server)
    assert [r["output_ids"] for r in first] == reference["A"]
    assert all(r["meta_info"]["weight_version"] == "v0" for r in first)
    # AReaL's and slime's bodies: abort_all_requests, weight_version, SGLang's own knobs
    body = {
        "model_path": str(checkpoints["B"]),
        "load_format": None,
        "abort_all_requests": True,
        "weight_version": "B",
        "flush_cache": True,
        "is_async": False,
        "keep_pause": False,
        "recapture_cuda_graph": False,
        "token_step": 3,
    }
    r = post(server, "/update_weights_from_disk", body)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["message"]
    after = generate(server)
    assert [x["output_ids"] for x in after] == reference["B"]
    assert {x["meta_info"]["weight_version"] for x in after} == {"B"}
    assert httpx.get(f"{server.url}/get_weight_version", timeout=10).json() == {"weight_version": "B"}
    chat = post(server, "/v1/completions", {"model": "x", "prompt": PROMPTS[0], "max_tokens": 2})
    assert chat.json()["metadata"] == {"weight_version": "B"}
    to_a(server, checkpoints)
    assert outputs(server) == reference["A"]
    idle_and_clean(server)


def test_weights_checker_sees_an_update_reach_every_weight(server, checkpoints, reference):
    """SGLang's /weights_checker as slime drives it: checksum, snapshot, reset every weight to
    random values (a new cache epoch: no KV of the old weights is served), compare (400 naming
    what differs), update from disk, compare again (200), and the tokens are the checkpoint's."""
    first = post(server, "/weights_checker", {"action": "checksum"}).json()
    assert first["success"] and len(first["ranks"]) == 1 and len(first["per_engine_checksum"]) == 64
    sums = first["ranks"][0]["checksums"]
    assert "model.embed_tokens.weight" in sums and not any("cos_sin" in name for name in sums)
    assert first["ranks"][0]["parallelism_info"]["tp_size"] == 1
    assert httpx.get(f"{server.url}/weights_checker", timeout=30).json() == first  # (GET: a checksum)
    assert post(server, "/weights_checker", {"action": "snapshot"}).json()["success"]
    assert post(server, "/weights_checker", {"action": "compare"}).status_code == 200
    assert post(server, "/weights_checker", {"action": "reset_tensors"}).json()["success"]
    assert outputs(server) != reference["A"]
    r = post(server, "/weights_checker", {"action": "compare"})
    assert r.status_code == 400 and "differ from the snapshot" in r.json()["message"]
    skipped = post(server, "/weights_checker", {"action": "checksum", "skip_tensor_list": ["layers.1."]}).json()
    assert skipped["success"] and not any("layers.1." in name for name in skipped["ranks"][0]["checksums"])
    to_a(server, checkpoints)
    r = post(server, "/weights_checker", {"action": "compare"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert (
        post(server, "/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"]
        == first["per_engine_checksum"]
    )
    assert outputs(server) == reference["A"]
    for body in ({"restore_weights_before_load": True}, {"post_process_quantization": True}):  # (slime's)
        r = post(server, "/post_process_weights", body)
        assert r.status_code == 200 and r.json()["success"] is True
    bad = post(server, "/weights_checker", {"action": "explode"})
    assert bad.status_code == 400 and "action must be one of" in bad.json()["message"]
    idle_and_clean(server)


def test_get_weights_by_name_over_http(server, checkpoints):
    """SGLang's route and body (GET or POST): the tensor's first rows as nested lists, the new
    weights' after an update; a bad name or size is a 400 naming it."""
    name = "model.layers.1.self_attn.k_proj.weight"
    for ckpt in ("B", "A"):
        r = post(server, "/update_weights_from_disk", {"model_path": str(checkpoints[ckpt])})
        assert r.status_code == 200, r.text
        want = state_dict(checkpoints[ckpt])[name][:2].tolist()
        assert post(server, "/get_weights_by_name", {"name": name, "truncate_size": 2}).json() == want
        got = httpx.request("GET", f"{server.url}/get_weights_by_name", json={"name": name, "truncate_size": 2})
        assert got.json() == want
    assert len(post(server, "/get_weights_by_name", {"name": "model.norm.weight"}).json()) == 64  # (100 asked)
    for body, word in (
        ({"name": "model.layers.9.mlp.up_proj.weight"}, "model.layers.9"),
        ({"name": name, "truncate_size": -1}, "truncate_size"),
        ({"truncate_size": 3}, "name"),
    ):
        r = post(server, "/get_weights_by_name", body)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    idle_and_clean(server)


def test_update_from_tensor_direct_and_bucketed(server, checkpoints, reference):
    sd = list(state_dict(checkpoints["B"]).items())
    body = {
        "serialized_named_tensors": [encode_named_tensors(sd)],
        "load_format": None,
        "flush_cache": True,
        "weight_version": "B-tensor",
    }
    r = post(server, "/update_weights_from_tensor", body)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert outputs(server) == reference["B"]
    # slime's colocated body: one flattened bucket per rank, a string weight version, no flush field
    sd_a = list(state_dict(checkpoints["A"]).items())
    body = {
        "serialized_named_tensors": [encode_named_tensors(sd_a, flattened=True)],
        "load_format": "flattened_bucket",
        "weight_version": "7",
    }
    r = post(server, "/update_weights_from_tensor", body)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert outputs(server) == reference["A"]
    assert generate(server)[0]["meta_info"]["weight_version"] == "7"


class _Evil:
    def __reduce__(self):
        return os.system, ("touch /tmp/minisgl-pwned-http",)


def test_bad_payloads_get_4xx_and_the_old_weights_serve(server, checkpoints, reference):
    marker = Path("/tmp/minisgl-pwned-http")
    marker.unlink(missing_ok=True)
    sd = state_dict(checkpoints["B"])
    name = "model.layers.1.mlp.down_proj.weight"  # (not square: its transpose is the wrong shape)
    cases = [
        ("/update_weights_from_disk", {"model_path": str(checkpoints["Q"])}, "architecture"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, "no checkpoint at"),
        ("/update_weights_from_disk", {"model_path": "/etc"}, "no checkpoint at"),
        ("/update_weights_from_disk", {"model_path": "~/ckpt"}, "absolute path"),
        ("/update_weights_from_disk", {}, "model_path"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [base64.b64encode(pickle.dumps([("w", _Evil())])).decode()]},
            "system",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["@@not base64@@"]}, "base64"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors([(name, sd[name].t().contiguous())])]},
            "shape",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors([("model.no.such.weight", sd[name])])]},
            "no place",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors([(name, sd[name])])] * 2},
            "ranks",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]]}, "group"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ]
    for path, body, words in cases:
        r = post(server, path, body)
        assert r.status_code in (400, 422), (path, body, r.status_code, r.text)
        text = r.text
        assert words in text, (path, words, text)
    assert not marker.exists()
    assert outputs(server) == reference["A"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    idle_and_clean(server)


def broadcast_updates(srv: ServerProcess, checkpoints, reference, engine_ranks: int) -> None:
    """The test process is the trainer's rank 0; the engine's ranks join as ranks 1.. (gloo):
    both load formats, then a list the engine refuses, which is still received (the trainer
    never hangs) and leaves the weights as they were."""
    port, group_name = free_port(), "trainer_group"
    world = 1 + engine_ranks
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(
            post,
            srv,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": world,
                "group_name": group_name,
                "backend": "nccl",
            },
        )
        group = init_weight_group("gloo", "127.0.0.1", port, 0, world, group_name)
        assert joined.result().json()["success"], joined.result().text
        try:
            for load_format, ckpt in (("direct", "B"), ("flattened_bucket", "A")):
                sd = state_dict(checkpoints[ckpt])
                body = {
                    "names": list(sd),
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in sd.values()],
                    "shapes": [list(t.shape) for t in sd.values()],
                    "group_name": group_name,
                    "load_format": load_format,
                    "flush_cache": True,
                    "weight_version": ckpt,
                }
                done = pool.submit(post, srv, "/update_weights_from_distributed", body)
                if load_format == "direct":
                    for t in sd.values():
                        dist.broadcast(t.contiguous(), src=0, group=group)
                else:
                    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in sd.values()])
                    dist.broadcast(flat, src=0, group=group)
                assert done.result().json()["success"], done.result().text
                assert outputs(srv) == reference[ckpt]
            t = torch.zeros(3, 3)
            done = pool.submit(
                post,
                srv,
                "/update_weights_from_distributed",
                {
                    "names": ["model.nothing.weight"],
                    "dtypes": ["float32"],
                    "shapes": [[3, 3]],
                    "group_name": group_name,
                },
            )
            dist.broadcast(t, src=0, group=group)
            assert done.result().status_code == 400 and "no place" in done.result().text
            assert outputs(srv) == reference["A"]
        finally:
            r = post(srv, "/destroy_weights_update_group", {"group_name": group_name})
            destroy_weight_group(group)
        assert r.json()["success"], r.text


def test_update_from_distributed_broadcast(server, checkpoints, reference):
    broadcast_updates(server, checkpoints, reference, engine_ranks=1)


def test_update_from_distributed_broadcast_at_tp2(checkpoints, reference):
    """Both ranks of a tp=2 server join the trainer's group (ranks 1 and 2 of 3), each cuts its
    own shard from the broadcast tensors, and the tokens are those of the new checkpoint."""
    with running_server(checkpoints["A"], "--page-size", "4", "--max-total-tokens", "8192", "--tp-size", "2") as srv:
        assert outputs(srv) == reference["A"]
        broadcast_updates(srv, checkpoints, reference, engine_ranks=2)
        sums = post(srv, "/weights_checker", {"action": "checksum"}).json()  # (each rank hashes its shard)
        assert [r["parallelism_info"]["tp_rank"] for r in sums["ranks"]] == [0, 1]
        assert sums["ranks"][0]["checksums"].keys() == sums["ranks"][1]["checksums"].keys()
        assert sums["ranks"][0]["per_gpu_checksum"] != sums["ranks"][1]["per_gpu_checksum"]


def _stream(srv: ServerProcess, prompt: list[int], n: int, out: list) -> None:
    with httpx.stream(
        "POST",
        f"{srv.url}/generate",
        json={"input_ids": prompt, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": n}},
        timeout=120,
    ) as r:
        out.append(sse_events(r.iter_lines()))


def _wait_running(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 30
    while srv.server_info()["scheduler"]["running_requests"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_pause_abort_ends_requests_with_their_tokens(server):
    results: list = []
    threads = [threading.Thread(target=_stream, args=(server, [3 + i, 4, 5, 6], 900, results)) for i in range(6)]
    for t in threads:
        t.start()
    _wait_running(server, 6)
    time.sleep(0.05)
    r = post(server, "/pause_generation", {"mode": "abort"})
    assert r.json()["status"] == "ok" and r.json()["num_paused_requests"] == 6
    for t in threads:
        t.join(60)
    assert len(results) == 6
    for events in results:
        last = events[-2]
        assert last["meta_info"]["finish_reason"] == {"type": "abort"} and 0 < len(last["output_ids"]) < 900
        assert events[-1] == "[DONE]"
    # queued while paused, run after continue
    later = ThreadPoolExecutor(1).submit(generate, server)
    time.sleep(0.5)
    assert not later.done() and server.server_info()["scheduler"]["queued_requests"] == 3
    assert post(server, "/flush_cache").status_code == 400  # SGLang's answer while requests are queued
    assert post(server, "/continue_generation").json()["status"] == "ok"
    assert len(later.result(60)) == 3
    idle_and_clean(server)
    assert post(server, "/flush_cache").json() == {"success": True}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_then_update_then_continue(server, checkpoints, reference, mode):
    """Requests in flight survive a pause, an update and continue; with ``retract`` they
    recompute under B, so each finishes with all its tokens and no page is lost."""
    results: list = []
    threads = [threading.Thread(target=_stream, args=(server, p, 600, results)) for p in PROMPTS]
    for t in threads:
        t.start()
    _wait_running(server, len(PROMPTS))
    r = post(server, "/pause_generation", {"mode": mode})
    assert r.status_code == 200
    s = server.server_info()["scheduler"]
    assert (s["queued_requests"], s["running_requests"]) == ((3, 0) if mode == "retract" else (0, 3))
    r = post(server, "/update_weights_from_disk", {"model_path": str(checkpoints["B"]), "weight_version": "B"})
    assert r.json()["success"], r.text
    assert post(server, "/continue_generation").status_code == 200
    for t in threads:
        t.join(60)
    for events in results:
        final = events[-2]
        assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 600
        assert final["meta_info"]["weight_version"] == "B"
    assert outputs(server) == reference["B"]
    to_a(server, checkpoints)
    idle_and_clean(server)


def test_updates_never_interleave(server, checkpoints, reference):
    """Two updates at once: the scheduler runs them one after the other; the version it reports
    is the last one applied, and the tokens are that checkpoint's."""
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                post,
                server,
                "/update_weights_from_disk",
                {"model_path": str(checkpoints[name]), "weight_version": name},
            )
            for name in ("B", "A")
        ]
        assert all(f.result().json()["success"] for f in futs)
    version = httpx.get(f"{server.url}/get_weight_version", timeout=10).json()["weight_version"]
    assert outputs(server) == reference[version]
    to_a(server, checkpoints)


def test_release_and_resume_memory(server, reference):
    r = post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.json()["success"], r.text
    waiting = ThreadPoolExecutor(1).submit(outputs, server)  # queued until the memory is back
    time.sleep(0.5)
    assert not waiting.done()
    assert post(server, "/resume_memory_occupation", {}).json()["success"]
    assert waiting.result(60) == reference["A"]
    r = post(server, "/update_weight_version", {"new_version": "renamed"})
    assert r.json() == {"success": True, "message": "weight version is renamed", "new_version": "renamed"}
    assert generate(server)[0]["meta_info"]["weight_version"] == "renamed"
    idle_and_clean(server)


def test_tensor_route_needs_its_flag(tiny_llama):
    with running_server(tiny_llama, "--max-total-tokens", "4096") as srv:
        r = post(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [json.dumps("x")]})
        assert r.status_code == 403 and "--enable-weight-update-from-tensor" in r.text
        body = {"lora_name": "a", "serialized_tensors": "x", "config_dict": {}}
        r = post(srv, "/load_lora_adapter_from_tensors", body)
        assert r.status_code == 403 and "--enable-weight-update-from-tensor" in r.text


def test_bodies_rl_frameworks_send_are_accepted(server, checkpoints, reference):
    """Bodies as AReaL's and verl's/slime's SGLang clients build them, unchanged (fields this
    server has no use for, such as verl's ``selector``, are ignored with a warning)."""
    areal_disk = {"model_path": str(checkpoints["B"]), "abort_all_requests": True}
    assert post(server, "/update_weights_from_disk", areal_disk).json()["success"]
    assert outputs(server) == reference["B"]
    verl_tensor = {
        "serialized_named_tensors": [encode_named_tensors(state_dict(checkpoints["A"]).items())],
        "load_format": "direct",
        "flush_cache": True,
        "selector": "all",
    }
    assert post(server, "/update_weights_from_tensor", verl_tensor).json()["success"]
    assert (
        post(server, "/update_weight_version", {"new_version": "run-0001", "abort_all_requests": True}).json()[
            "new_version"
        ]
        == "run-0001"
    )
    assert outputs(server) == reference["A"]
    for path, body in (
        ("/pause_generation", {}),
        ("/continue_generation", {}),
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
    ):
        assert post(server, path, body).status_code == 200, path
    assert httpx.get(f"{server.url}/flush_cache", timeout=10).status_code == 200  # SGLang's tests call it by GET
    assert outputs(server) == reference["A"]


def test_rl_loop_runs_every_update_path_on_cpu(checkpoints, tmp_path):
    """benchmarks/rl_loop.py end to end: rollout, a trainer step, each update path in turn."""
    from benchmarks.rl_loop import main

    rows = main(
        [
            "--model",
            str(checkpoints["A"]),
            "--steps",
            "3",
            "--prompts",
            "2",
            "--samples",
            "4",
            "--max-new-tokens",
            "8",
            "--release-memory",
            "--port",
            str(free_port()),
            "--group-port",
            str(free_port()),
            "--out",
            str(tmp_path / "rows.json"),
        ]
    )
    assert [r["path"] for r in rows] == ["tensor", "disk", "distributed"]
    assert all(r["samples"] == 8 and r["output_tokens"] == 64 for r in rows)


def test_routed_experts_over_http(tiny_models):
    """SGLang's return_routed_experts on /generate (MoE, --enable-return-routed-experts):
    base64 int32 [positions, layers, k] in meta_info, the offline API's values, and a 400 for a
    negative routed_experts_start_len."""
    from minisgl.utils import routed_experts_array

    path = tiny_models["qwen3_moe"]
    prompt = list(range(30, 70))
    want = LLM(str(path), device="cpu", enable_return_routed_experts=True).generate(
        prompt, GREEDY, return_routed_experts=True
    )[0]
    with running_server(path, "--enable-return-routed-experts") as srv:
        body = {"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True}
        got = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"]
        assert routed_experts_array(got["meta_info"], 2, 2).shape == (len(prompt) + 7, 2, 2)
        body["routed_experts_start_len"] = len(prompt)
        tail = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
        assert routed_experts_array(tail["meta_info"], 2, 2).shape == (7, 2, 2)
        body["routed_experts_start_len"] = -1
        bad = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
        idle_and_clean(srv)


def test_a_join_waits_off_the_step_loop_for_the_trainers_store():
    """/init_weights_update_group first waits, in the API's event loop, for something to listen
    at the trainer's address: nothing there is a refusal after the deadline, a store that comes
    up late is found."""
    import asyncio
    import socket

    from minisgl.serve.api.rl import listening

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # (a port nothing listens on)
    start = time.monotonic()
    assert not asyncio.run(listening("127.0.0.1", port, 0.6))
    assert 0.6 <= time.monotonic() - start < 3
    assert not asyncio.run(listening("no-such-host.invalid", port, 0.3))
    late = socket.socket()
    late.bind(("127.0.0.1", port))
    timer = threading.Timer(0.5, late.listen)
    timer.start()
    try:
        assert asyncio.run(listening("127.0.0.1", port, 5.0))
    finally:
        timer.join()
        late.close()
