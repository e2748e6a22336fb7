"""The hostile cases of the hardening audits, replayed against a live server.

    python scripts/hardening_check.py --model /tmp/tinyllama     # on CPU; prints one row a case

Each case sends what the audit sent and says what a hardened server answers; at the end every
process must still be up (/health 200) with no request left, no answer may have been a 5xx,
and last the scheduler, the tokenizer and the launcher are stopped with SIGSTOP in turn: the
server must end (exit 1) within the watchdog time and leave no process. The control plane's
cases send damaged checkpoints and adapters (``--model``: a one-file safetensors folder). Exit
status 1 when any case fails. The disk tier's cases (links, forged, changed and cut files, a
rewritten checkpoint) need files planted between a check and a read and are tests instead
(``tests/test_hicache.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.local_server import alive, wait_ready  # noqa: E402

API_KEY = "audit-key"
SLOW_REGEX = r"(?:.|\n){0,10}(?:.|\n){0,10}[\ue000\ue001]"


class Audit:
    def __init__(self, url: str):
        self.url = url
        self.rows: list[tuple[str, str, bool]] = []
        self.statuses: list[int] = []

    def call(self, method: str, route: str, **kw) -> httpx.Response:
        kw["headers"] = kw.get("headers") or [("Authorization", f"Bearer {API_KEY}")]
        r = httpx.request(method, self.url + route, timeout=kw.pop("timeout", 60), **kw)
        self.statuses.append(r.status_code)
        return r

    def case(self, name: str, got: str, ok: bool) -> None:
        self.rows.append((name, got, ok))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {got}", flush=True)


def api_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hostile_requests(a: Audit, api_pid: int) -> None:
    r = a.call("POST", "/start_profile", json={"profile_prefix": "a\u0000b", "num_steps": 1})
    a.case("profile prefix with a NUL", f"{r.status_code}", r.status_code == 400)
    r = a.call("POST", "/start_profile", json={"output_dir": "/tmp/x\u0000y"})
    a.case("profile output_dir with a NUL", f"{r.status_code}", r.status_code == 400)

    hostile = {
        "text": "Tell me a long story.",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "stop_regex": [SLOW_REGEX] * 128},
    }
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(a.call("POST", "/generate", json=hostile, timeout=300)))
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    r = a.call("POST", "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    took = time.monotonic() - start
    t.join(300)
    a.case("4-token request beside 128 slow stop_regex patterns", f"{took:.3f} s", r.status_code == 200 and took < 1)
    a.case("the slow patterns' own request", f"{out[0].status_code}", out[0].status_code == 400)

    before = api_rss_mb(api_pid)
    meta = {"k": "v" * 4_000_000}
    codes = set()
    for _ in range(150):
        body = {"model": "m", "input": "hi", "max_output_tokens": 1, "metadata": meta}
        codes.add(a.call("POST", "/v1/responses", json=body).status_code)
    grown = api_rss_mb(api_pid) - before
    a.case("150 responses with 4 MB of metadata", f"statuses {sorted(codes)}, API RSS +{grown:.0f} MB", codes == {400})

    r = a.call("POST", "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2, "cache_salt": "A"})
    rid = r.json().get("id", "")
    other = a.call("GET", f"/v1/responses/{rid}", params={"cache_salt": "B"}).status_code
    own = a.call("GET", f"/v1/responses/{rid}", params={"cache_salt": "A"}).status_code
    a.case("a stored response read by another tenant", f"other {other}, own {own}", other == 404 and own == 200)
    body = {"model": "m", "input": "again", "max_output_tokens": 2, "cache_salt": "B", "previous_response_id": rid}
    r = a.call("POST", "/v1/responses", json=body)
    a.case("previous_response_id across tenants", f"{r.status_code}", r.status_code == 400)
    r = a.call("POST", "/abort_request", json={"abort_all": True})
    a.case("abort_all", r.text.strip(), r.status_code == 200 and set(r.json()) == {"aborted_count"})

    r = a.call("POST", "/generate", json={"text": "hi", "sampling_params": {"n": 9, "max_new_tokens": 2}})
    a.case("n beyond running + queued capacity", f"{r.status_code}", r.status_code == 400)

    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}")]
    r = a.call("GET", "/get_server_info", headers=headers)
    a.case("two Authorization headers, the last one right", f"{r.status_code}", r.status_code == 401)
    r = a.call("GET", "/health", headers=[("Authorization", f"Bearer {API_KEY}"), ("Host", "attacker.example")])
    a.case("a Host that is not loopback", f"{r.status_code}", r.status_code == 403)

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
    from prometheus_client.parser import text_string_to_metric_families as text_families

    for what, accept, parse in (
        ("OpenMetrics", "application/openmetrics-text; version=1.0.0", openmetrics_families),
        ("text", "text/plain", text_families),
    ):
        r = a.call("GET", "/metrics", headers=[("Authorization", f"Bearer {API_KEY}"), ("Accept", accept)])
        try:
            untyped = [f.name for f in parse(r.text) if f.type == "unknown"]
            seen = f"{r.status_code}, families without a type: {untyped[:3]}"
        except ValueError as e:
            untyped, seen = ["(unparsed)"], f"{r.status_code}, parser: {e}"
        a.case(f"/metrics as {what}", seen, r.status_code == 200 and not untyped)


def damaged_checkpoints(folder: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Copies of a one-file checkpoint whose model.safetensors a trainer might leave half
    written, or a client might point anywhere, each with what its refusal must name: each must
    be refused before any weight changes."""
    import torch
    from safetensors.torch import load_file, save_file

    data = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")

    def tensors(fn):
        return lambda f: save_file({k: fn(v) for k, v in load_file(folder / "model.safetensors").items()}, f)

    file = "model.safetensors"
    variants = {
        "cut in half": (lambda f: f.write_bytes(data[: len(data) // 2]), file),
        "header only": (lambda f: f.write_bytes(data[: 8 + n]), file),
        "header of 2^62 bytes": (lambda f: f.write_bytes((1 << 62).to_bytes(8, "little") + data[8:]), file),
        "header of 100 GB": (lambda f: f.write_bytes((100 << 30).to_bytes(8, "little") + data[8:]), file),
        "a link to /dev/zero": (lambda f: f.symlink_to("/dev/zero"), file),
        "a FIFO": (lambda f: os.mkfifo(f), file),
        "int8 tensors": (tensors(lambda t: t.to(torch.int8)), "is I8"),
        "NaN weights": (tensors(lambda t: t.clone().fill_(float("nan")) if t.dim() == 1 else t), "not finite"),
    }
    out = {}
    for i, (what, (make, why)) in enumerate(variants.items()):
        copy = root / f"damaged{i}"
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.safetensors"))
        make(copy / "model.safetensors")
        out[what] = (copy, why)
    return out


def damaged_adapters(good: Path, root: Path) -> dict[str, str]:
    """Adapter paths a careless client sends, each with what its refusal must name: a path too
    long for the file system, a config nested past any parser or that is a FIFO, weights cut in
    half; and configs that contradict their tensors, or values no trained adapter has."""
    import torch
    from safetensors.torch import load_file, save_file

    from minisgl.config.args import LORA_TARGET_MODULES

    config_of = json.loads((good / "adapter_config.json").read_text())
    rank = config_of["r"]

    def config(**changes):
        return lambda c, w: c.write_text(json.dumps({**config_of, **changes}))

    def tensors(fn):
        return lambda c, w: save_file({k: fn(v) for k, v in load_file(w).items()}, w)

    def fifo(c, w):
        c.unlink()
        os.mkfifo(c)

    variants = {
        "nested": (lambda c, w: c.write_text("[" * 100_000 + "]" * 100_000), "not JSON"),
        "fifo": (fifo, "no LoRA adapter at"),  # (never opened: the folder holds no regular config)
        "cut": (lambda c, w: w.write_bytes(w.read_bytes()[: w.stat().st_size // 2]), "cut short"),
        "rank": (config(r=rank // 2), f"the config's r is {rank // 2}"),
        "rank-text": (config(r=str(rank)), "r must be an integer"),
        "alpha-nan": (config(lora_alpha=float("nan")), "lora_alpha must be a finite number"),
        "alpha-huge": (config(lora_alpha=1e308), "lora_alpha must be a finite number"),
        "targets": (config(target_modules=list(LORA_TARGET_MODULES)), "no tensor adapts"),  # (good adapts fewer)
        "nan": (tensors(lambda t: torch.full_like(t, float("nan"))), "not finite"),
        "int8": (tensors(lambda t: t.to(torch.int8)), "floating point only"),
    }
    out = {"/" + "x" * 5000: "4096 characters", "/" + "x" * 300: "File name too long"}
    for what, (make, why) in variants.items():
        folder = root / f"damaged-{what}"
        shutil.copytree(good, folder)
        make(folder / "adapter_config.json", folder / "adapter_model.safetensors")
        out[str(folder)] = why
    return out


def control_plane(a: Audit, model: str, root: Path) -> None:
    """Damaged checkpoints and adapters: each a 4xx naming the problem, and the next request
    served at once with the old weights."""
    from minisgl.device.tiny_model import make_lora_adapter

    probe = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = a.call("POST", "/generate", json=probe).json().get("output_ids")

    def served(name: str, r: httpx.Response, why: str) -> None:
        start = time.monotonic()
        after = a.call("POST", "/generate", json=probe)
        took = time.monotonic() - start
        ok = 400 <= r.status_code < 500 and why in r.text and after.json().get("output_ids") == before and took < 1
        a.case(name, f"{r.status_code} {r.text[:90]!r}; next request {took:.2f} s", ok)

    for what, (folder, why) in damaged_checkpoints(Path(model), root).items():
        r = a.call("POST", "/update_weights_from_disk", json={"model_path": str(folder)})
        served(f"update_weights_from_disk: {what}", r, why)
    good = make_lora_adapter(Path(model), root / "adapter", ("q_proj", "v_proj"), rank=4)
    for path, why in damaged_adapters(good, root).items():
        r = a.call("POST", "/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
        served(f"load_lora_adapter: {why}", r, why)
    # Paths: no '~', no hub ids, and one answer for a file, a folder of anything and nothing
    for route, field in (("/update_weights_from_disk", "model_path"), ("/load_lora_adapter", "lora_path")):
        body = {"lora_name": "bad"} if field == "lora_path" else {}
        for path, why in (("~root/ckpt", "absolute path"), ("org/name", "absolute path")):
            served(f"{route}: {field} {path}", a.call("POST", route, json={**body, field: path}), why)
        answers = []
        for path in ("/etc/passwd", "/nonexistent/x", str(root)):
            r = a.call("POST", route, json={**body, field: path})
            answers.append((r.status_code, r.text.replace(path, "<path>")))
        same = len(set(answers)) == 1 and answers[0][0] == 400
        a.case(f"{route}: a file, nothing and a folder answer alike", answers[0][1][:90], same)
    # A trainer group at an address where nothing listens: refused after its wait, serving meanwhile
    with socket.socket() as s:  # (a port nothing listens on)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "g"}
    joined: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: joined.append(a.call("POST", "/init_weights_update_group", json=body, timeout=200))
    )
    t.start()
    time.sleep(1.0)
    start = time.monotonic()
    out = a.call("POST", "/generate", json=probe).json().get("output_ids")
    took = time.monotonic() - start
    a.case("a generate while a trainer-group join waits", f"{took:.2f} s", out == before and took < 1)
    t.join(200)
    r = joined[0] if joined else None
    ok = r is not None and r.status_code == 400 and "no trainer listens" in r.text
    a.case(
        "init_weights_update_group where no trainer listens",
        f"{r.status_code if r else None} {r.text[:90] if r else ''!r}",
        ok,
    )
    # Names the server keeps and echoes in every answer
    r = a.call("POST", "/load_lora_adapter", json={"lora_name": "n" * 100_000, "lora_path": str(good)})
    served("a lora_name of 100,000 characters", r, "lora_name")
    r = a.call("POST", "/update_weight_version", json={"new_version": "v" * 1_000_000})
    served("a weight version of 1,000,000 characters", r, "new_version")


def server(model: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minisgl.launch", "--model", model, "--port", str(port), "--device", "cpu"]
    cmd += ["--log-level", "warning", "--max-running-requests", "4", "--max-queued-requests", "4", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def watched_server(model: str, port: int, watchdog: float) -> tuple[subprocess.Popen, dict[str, int]]:
    """A ready server with this watchdog and the pid of each of its processes by name."""
    proc = server(model, port, "--watchdog-timeout", str(watchdog))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, httpx.get(f"{url}/get_server_info", timeout=30).json()["processes"]


def stopped_process(a: Audit, model: str, port: int, name: str, watchdog: float) -> None:
    proc, processes = watched_server(model, port, watchdog)
    pids = list(processes.values())
    start = time.monotonic()
    os.kill(processes[name], signal.SIGSTOP)
    try:
        code = proc.wait(watchdog + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    took = time.monotonic() - start
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    ok = code == 1 and took < watchdog + 3 and not left
    a.case(f"SIGSTOP of the {name}", f"exit {code} after {took:.1f} s, {len(left)} processes left", ok)


def killed_scheduler(a: Audit, model: str, port: int, watchdog: float) -> None:
    """kill -9 of the scheduler while a request runs: that request is answered 503 (the server
    is going away), never 500, and the server exits 1 leaving no process."""
    proc, processes = watched_server(model, port, watchdog)
    pids = list(processes.values())
    body = {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    answers: list[str] = []

    def run() -> None:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120)
            answers.append(f"{r.status_code} {r.text[:120]}")
        except httpx.HTTPError as e:  # (the server closed the connection without an answer)
            answers.append(type(e).__name__)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    os.kill(processes["scheduler"], signal.SIGKILL)
    t.join(120)
    try:
        code = proc.wait(watchdog + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    left = [p for p in pids if p != processes["scheduler"] and alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    got = answers[0] if answers else "no answer"
    ok = got.startswith("503") and code == 1 and not left
    a.case("kill -9 of the scheduler mid-request", f"request {got}, exit {code}, {len(left)} processes left", ok)


def stopped_launcher(a: Audit, model: str, port: int, watchdog: float) -> None:
    """SIGSTOP of the launcher itself: its engine processes exit within the limit; continued,
    it exits 1."""
    proc, processes = watched_server(model, port, watchdog)
    pids = [p for p in processes.values() if p != proc.pid]
    os.kill(proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - start < watchdog + 10:
        time.sleep(0.1)
    took = time.monotonic() - start
    os.kill(proc.pid, signal.SIGCONT)
    code = proc.wait(60)
    ok = code == 1 and took < watchdog + 3
    a.case("SIGSTOP of the launcher", f"engine processes gone after {took:.1f} s, launcher exit {code}", ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=30177)
    ap.add_argument("--watchdog", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="a JSON file of the rows")
    args = ap.parse_args()
    profiles = tempfile.mkdtemp(prefix="minisgl-audit-")  # profiling on, so its names are checked
    proc = server(args.model, args.port, "--api-key", API_KEY, "--profile-dir", profiles, "--enable-lora")
    a = Audit(f"http://127.0.0.1:{args.port}")
    try:
        wait_ready(a.url, proc)
        hostile_requests(a, proc.pid)
        control_plane(a, args.model, Path(profiles))
        info = a.call("GET", "/get_server_info").json()
        health = a.call("GET", "/health").status_code
        active = info["active_requests"]
        a.case("afterwards", f"/health {health}, active requests {active}", health == 200 and active == 0)
        a.case("no answer was a 5xx", f"{len(a.statuses)} answers", not [s for s in a.statuses if s >= 500])
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(profiles, ignore_errors=True)
    for name in ("scheduler", "tokenizer"):
        stopped_process(a, args.model, args.port, name, args.watchdog)
    stopped_launcher(a, args.model, args.port, args.watchdog)
    killed_scheduler(a, args.model, args.port, args.watchdog)
    if args.out:
        Path(args.out).write_text(json.dumps([{"case": n, "got": g, "ok": ok} for n, g, ok in a.rows], indent=1))
    failed = [n for n, _, ok in a.rows if not ok]
    print(f"{len(a.rows) - len(failed)} of {len(a.rows)} cases hold" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
