"""Launcher lifecycle: the ready line, API keys, SIGTERM, a dying child, bad arguments.
Each case starts its own server and checks that no process of it survives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import ROOT, ServerProcess, alive, descendants, free_port, running_server


def _all_gone(pids: set[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_sigterm_stops_everything(tiny_llama: Path):
    srv = ServerProcess(tiny_llama, "--api-key", "s3cret")
    try:
        srv.wait_ready()
        assert sum(line.startswith("minisgl ready") for line in srv.lines) == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200  # open for probes
        r = httpx.get(f"{srv.url}/v1/models", timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        # Two Authorization headers (a proxy may check one, we read the other): refused.
        twice = [("Authorization", "Bearer wrong"), ("Authorization", "Bearer s3cret")]
        r = httpx.get(f"{srv.url}/v1/models", headers=httpx.Headers(twice), timeout=10)
        assert r.status_code == 401 and "one Authorization" in r.text
        auth = {"Authorization": "Bearer s3cret"}
        # Bound to loopback: a Host naming anything else (DNS rebinding from a browser) is refused.
        for host, status in (("evil.example.com", 403), ("localhost:1234", 200), ("[::1]:80", 200)):
            r = httpx.get(f"{srv.url}/v1/models", headers={**auth, "Host": host}, timeout=10)
            assert r.status_code == status, (host, r.text)
        r = httpx.post(
            f"{srv.url}/generate",
            headers=auth,
            timeout=30,
            json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
        )
        assert r.status_code == 200
        procs = srv.server_info(**auth)["processes"]
        children = descendants(srv.proc.pid)
        assert procs.pop("api") == srv.proc.pid  # the launcher serves the API itself
        assert set(procs.values()) <= children
        # Process titles say which process is which (ps, top).
        for name, pid in {"api": srv.proc.pid, **procs}.items():
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"minisgl::{name}".encode()), name
        start = time.monotonic()
        code = srv.stop(signal.SIGTERM)
        assert code == 0, srv.output
        assert time.monotonic() - start < 10
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


def test_dead_worker_stops_everything(tiny_llama: Path):
    srv = ServerProcess(tiny_llama)
    try:
        srv.wait_ready()
        worker = srv.server_info()["processes"]["worker-0"]
        children = descendants(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        code = srv.proc.wait(20)
        assert code == 1, srv.output
        assert "worker-0 process exited with code -9" in srv.output
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.parametrize("name", ["scheduler", "tokenizer"])
def test_a_stopped_process_stops_everything(tiny_llama: Path, name: str):
    """SIGSTOP leaves a process alive but silent: its heartbeat stops, and the launcher ends the
    server with exit 1 within the watchdog time instead of serving /health while clients hang."""
    srv = ServerProcess(tiny_llama, "--watchdog-timeout", "3")
    try:
        srv.wait_ready()
        pid = srv.server_info()["processes"][name]
        children = descendants(srv.proc.pid)
        start = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        code = srv.proc.wait(30)
        assert code == 1, srv.output
        assert time.monotonic() - start < 3 + 3, time.monotonic() - start  # the limit, a beat, the shutdown
        assert f"the {name} process has not answered for 3 s" in srv.output
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


def test_a_stopped_launcher_takes_its_children_down(tiny_llama: Path):
    """SIGSTOP of the launcher (the API process): its children see its heartbeat stop and exit
    within the limit, so no engine runs on unreachable; continued, the launcher finds them gone
    and exits 1."""
    srv = ServerProcess(tiny_llama, "--watchdog-timeout", "3")
    try:
        srv.wait_ready()
        children = descendants(srv.proc.pid)
        engine = set(srv.server_info()["processes"].values()) - {srv.proc.pid}
        assert engine and engine <= children
        os.kill(srv.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        assert _all_gone(engine, timeout=3 + 3), [p for p in engine if alive(p)]
        assert time.monotonic() - start < 3 + 3
        os.kill(srv.proc.pid, signal.SIGCONT)  # (multiprocessing's resource tracker waits for it)
        assert srv.proc.wait(30) == 1, srv.output
        assert "the launcher has not answered for 3 s" in srv.output
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        if srv.proc.poll() is None:
            os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop(signal.SIGKILL)


def test_failed_start_and_bad_arguments(tmp_path: Path):
    run = [sys.executable, "-m", "minisgl.launch", "--device", "cpu"]
    bad = subprocess.run(
        run + ["--model", str(tmp_path), "--page-size", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "page_size must be >= 1" in bad.stderr
    missing = subprocess.run(
        run + ["--model", str(tmp_path / "nope")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1  # the launcher says it
    # A relative path whose first folder exists is a missing folder, never a hub id.
    (tmp_path / "checkpoints").mkdir()
    relative = subprocess.run(
        run + ["--model", "checkpoints/nope"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert relative.returncode == 1 and "is not a hub id" in relative.stderr, relative.stderr
    # A port in use: one line, no traceback (an AssertionError from stopping unstarted children before).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = subprocess.run(
            run
            + [
                "--model",
                str(ROOT / "benchmarks/configs/qwen3-0.6b"),
                "--load-format",
                "dummy",
                "--port",
                str(s.getsockname()[1]),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert taken.returncode == 1 and "Address already in use" in taken.stderr and "Traceback" not in taken.stderr


def test_tensor_parallel_on_cpu_matches_one_rank(tiny_llama: Path):
    """Two worker processes (gloo all-reduce) give the same greedy tokens as the offline engine."""
    from minisgl.llm import LLM

    want = LLM(str(tiny_llama), device="cpu").generate("Hello world", {"max_new_tokens": 16, "temperature": 0})
    srv = ServerProcess(tiny_llama, "--tp-size", "2")
    try:
        srv.wait_ready()
        assert set(srv.server_info()["processes"]) == {"api", "tokenizer", "scheduler", "worker-0", "worker-1"}
        r = httpx.post(
            f"{srv.url}/generate",
            timeout=60,
            json={"text": "Hello world", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        )
        assert r.json()["output_ids"] == want[0]["output_ids"]
        assert srv.stop() == 0
    finally:
        srv.stop(signal.SIGKILL)


def test_tensor_parallel_over_two_nodes_on_one_host(tiny_llama: Path):
    """--nnodes 2: node 1 runs worker-1 only, joins node 0's gloo group at --dist-init-addr and
    takes its batches over TCP; tokens equal one rank's; SIGTERM to node 0 stops node 1 too."""
    from minisgl.llm import LLM

    prompt = {"text": "Hello world", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    want = LLM(str(tiny_llama), device="cpu").generate(prompt["text"], prompt["sampling_params"])
    base = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl.launch",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            *base,
            "--node-rank",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    node0 = ServerProcess(tiny_llama, *base, "--node-rank", "0")
    try:
        node0.wait_ready()
        assert set(node0.server_info()["processes"]) == {"api", "tokenizer", "scheduler", "worker-0"}
        r = httpx.post(f"{node0.url}/generate", json=prompt, timeout=60)
        assert r.json()["output_ids"] == want[0]["output_ids"]
        children = descendants(node0.proc.pid) | descendants(node1.pid)
        assert len(children) >= 4  # tokenizer, scheduler, worker-0; worker-1
        assert node0.stop() == 0, node0.output
        assert node1.wait(20) == 0
        output = node1.stdout.read()
        assert "minisgl node 1: ranks 1-1 of 2" in output and "has gone; stopping" in output
        assert "ERROR" not in output and "Traceback" not in output, output
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        node0.stop(signal.SIGKILL)
        node1.kill()
        node1.wait()


def test_multi_node_arguments_are_checked(tmp_path: Path):
    run = [sys.executable, "-m", "minisgl.launch", "--device", "cpu", "--model", str(tmp_path)]
    for extra, message in [
        (["--tp-size", "2", "--nnodes", "2"], "needs dist_init_addr as host:port"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "multiple of nnodes"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"],
            "node_rank must be in [0, nnodes)",
        ),
        (["--dp-size", "2", "--nnodes", "2"], "one smg router over them"),
    ]:
        bad = subprocess.run(run + extra, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (extra, bad.stderr)


def test_hung_worker_trips_the_watchdog(tiny_llama: Path):
    """A stopped worker used to keep /health at 200 and streams hanging forever."""
    with running_server(tiny_llama, "--watchdog-timeout", "2") as srv:
        worker = srv.server_info()["processes"]["worker-0"]
        children = descendants(srv.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        try:
            r = httpx.post(
                f"{srv.url}/generate", timeout=30, json={"text": "hi", "sampling_params": {"max_new_tokens": 50}}
            )
            assert r.status_code != 200
        except httpx.HTTPError:
            pass  # the server went away mid-request: also an error for the client
        assert srv.proc.wait(30) == 1, srv.output
        assert "--watchdog-timeout" in srv.output
        if alive(worker):
            os.kill(worker, signal.SIGCONT)
        assert _all_gone(children), [p for p in children if alive(p)]


def test_port_in_use_fails_before_loading_and_api_key_from_env(tiny_llama: Path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "minisgl.launch",
                "--model",
                str(tiny_llama),
                "--device",
                "cpu",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 1 and f"cannot serve at 127.0.0.1:{port}" in res.stderr
        assert "Loading" not in res.stderr and time.monotonic() - start < 30
    os.environ["MINISGL_API_KEY"] = "from-env"
    try:
        srv = ServerProcess(tiny_llama)
    finally:
        del os.environ["MINISGL_API_KEY"]
    try:
        srv.wait_ready()
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 401
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer from-env"}, timeout=10)
        assert r.status_code == 200
    finally:
        srv.stop(signal.SIGKILL)


def test_queue_limit_answers_503(tiny_llama: Path):
    """A full server answers 503 with Retry-After; a request that could never fit (more
    sequences than running + queued may hold) answers 400 at once, even on an idle server."""
    with running_server(
        tiny_llama, "--max-queued-requests", "0", "--max-running-requests", "2", "--max-total-tokens", "256"
    ) as srv:
        body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 4, "n": 3}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "--max-queued-requests" in r.text, r.text
        body["n"] = 2
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).status_code == 200
        # No max_tokens: as many as fit the pool (256 tokens), not the context (1024), so not refused.
        chat = {"model": str(tiny_llama), "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
    with running_server(tiny_llama, "--max-queued-requests", "0", "--max-running-requests", "2") as srv:
        long = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**long, "n": 2}, timeout=60) as running:
            lines = running.iter_lines()  # held: a dropped iterator closes the stream, which aborts it
            next(x for x in lines if x.startswith("data: "))
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, "n": 1}, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "capacity" in r.json()["error"]["message"]


def test_shutdown_ends_open_streams_with_an_error_event(tiny_llama: Path):
    with running_server(tiny_llama) as srv:
        body = {
            "model": str(tiny_llama),
            "prompt": "Once",
            "max_tokens": 1000,
            "stream": True,
            "ignore_eos": True,
            "logprobs": 20,
        }
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert srv.proc.wait(20) == 0


def test_installed_package_has_every_module(tmp_path: Path):
    """Imported from outside the source tree: a package folder without __init__.py is left out
    of a built wheel, and the server then fails at import."""
    import pkgutil

    import minisgl

    names = [m.name for m in pkgutil.walk_packages(minisgl.__path__, "minisgl.")]
    code = "import importlib, sys; [importlib.import_module(n) for n in sys.argv[1:]]; print('ok')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code, "minisgl.launch", *names],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.stdout.strip() == "ok", res.stderr[-2000:]
