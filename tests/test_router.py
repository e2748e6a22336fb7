"""The smg router (SGLang's cache-aware gateway) in front of two servers, unchanged, and as
``--dp-size 2`` starts it: /generate and the OpenAI routes pass through it, it registers the
workers without complaint, and 4 groups x 8 requests sharing long prefixes hit each replica's
cache (round robin would not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minisgl.serve.data_parallel import find_smg
from tests.server_utils import ROOT

pytestmark = pytest.mark.skipif(find_smg() is None, reason="the smg router is not installed (test extra)")


def test_smg_cache_aware_router_over_two_servers(tiny_llama):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "smg_check.py"), "--model", str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["generate"] and report["completions"] and report["chat"]
    assert not report["router_warnings"], report["router_warnings"]
    # Each group's ~550-token prefix is computed once, on the replica the router keeps it on.
    assert report["hit_rate"] > 0.85, report
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(report["loads_keys"]), report["loads_keys"]


def test_router_flags_reach_smg_and_not_the_replicas(monkeypatch):
    """--router-* flags become smg's own flags (by default a tighter spill gate than smg's, which
    lets bursts pile onto one replica); the replicas get none of them."""
    from minisgl.launch import parse_args
    from minisgl.serve import data_parallel

    argv = ["--model", "m", "--dp-size", "2", "--router-balance-abs-threshold", "32"]
    argv += ["--router-balance-rel-threshold=1.25", "--page-size", "4"]
    launcher = data_parallel.DataParallelLauncher(parse_args(argv), argv)
    started = []
    monkeypatch.setattr(data_parallel.subprocess, "Popen", lambda cmd, **_: started.append(cmd))
    launcher._start_router("smg")
    cmd = " ".join(started[0])
    assert "--balance-abs-threshold 32 --balance-rel-threshold 1.25" in cmd, cmd
    assert not [a for a in launcher.argv if a.startswith("--router")] and "--page-size" in launcher.argv
    launcher._stop_all()
    started.clear()
    launcher = data_parallel.DataParallelLauncher(parse_args(argv[:4]), argv[:4])
    launcher._start_router("smg")
    assert "--balance-abs-threshold 16 --balance-rel-threshold 1.1" in " ".join(started[0])
    launcher._stop_all()


def test_dp_size_two_behind_the_router(tiny_llama):
    """--dp-size 2: both APIs through the router; 4 groups x 8 requests sharing long prefixes
    compute each group's prefix once (the replicas' own counters, against the token trie of the
    prompts); a replica whose worker is killed is reported while the other keeps serving; SIGTERM
    leaves no process and the exit code says a replica died."""
    import random
    import re
    import signal
    import time

    import httpx
    from transformers import AutoTokenizer

    from tests.server_utils import ServerProcess, alive, descendants

    srv = ServerProcess(tiny_llama, "--dp-size", "2", "--page-size", "1", "--max-total-tokens", "8192")
    try:
        srv.wait_ready(timeout=240)
        replicas = re.search(r"smg cache_aware: (.*)\)", srv.output).group(1).split(", ")
        assert len(replicas) == 2
        r = httpx.post(
            f"{srv.url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        for route, body in [
            ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ]:
            r = httpx.post(f"{srv.url}{route}", json={"model": str(tiny_llama), **body}, timeout=60)
            assert r.status_code == 200, r.text
        # The Responses API: a follow-up finds its previous response on whichever replica the
        # router picks, in the store the replicas share (each replica's own memory found 1 in 6
        # follow-ups through smg). Here each turn goes to the other replica directly.
        ask = {"model": str(tiny_llama), "input": "Hi", "max_output_tokens": 3}
        previous = httpx.post(f"{srv.url}/v1/responses", json=ask, timeout=60).json()["id"]
        for turn in range(4):
            follow = {**ask, "previous_response_id": previous}
            r = httpx.post(f"{replicas[turn % 2]}/v1/responses", json=follow, timeout=60)
            assert r.status_code == 200, r.text
            previous = r.json()["id"]

        before = [httpx.get(f"{u}/server_info").json()["scheduler"] for u in replicas]
        rng = random.Random(0)
        words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
        prefixes = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(4)]
        prompts = [f"{p} question {g}.{m}:" for m in range(8) for g, p in enumerate(prefixes)]
        for text in prompts:
            r = httpx.post(
                f"{srv.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}}, timeout=60
            )
            assert r.status_code == 200, r.text
        after = [httpx.get(f"{u}/server_info").json()["scheduler"] for u in replicas]
        computed = sum(a["prefill_tokens"] - b["prefill_tokens"] for a, b in zip(after, before))
        tok = AutoTokenizer.from_pretrained(tiny_llama)

        def distinct(texts: list[str]) -> int:  # tokens in the prefix trie of texts: what one cache computes
            trie = set()
            for text in texts:
                ids = tuple(tok.encode(text))
                trie.update(ids[:k] for k in range(1, len(ids) + 1))
            return len(trie)

        # Each group's prefix computed once: at most the groups' own tries; at least one cache's.
        per_group = sum(distinct(prompts[g::4]) for g in range(4))
        assert distinct(prompts) <= computed <= per_group, (computed, distinct(prompts), per_group)

        victim = httpx.get(f"{replicas[0]}/get_server_info").json()["processes"]["worker-0"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "still serving" not in srv.output and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "1 of 2 replicas still serving" in srv.output, srv.output[-3000:]
        served = 0
        for k in range(8):  # the router marks the dead replica unhealthy; the other answers
            for _ in range(20):
                r = httpx.post(
                    f"{srv.url}/generate",
                    json={"text": f"after {k}", "sampling_params": {"max_new_tokens": 2}},
                    timeout=60,
                )
                if r.status_code == 200:
                    served += 1
                    break
                time.sleep(0.5)
        assert served == 8
        tree = descendants(srv.proc.pid)
        assert srv.stop(signal.SIGTERM, timeout=60) == 1  # a replica died during the run
        time.sleep(1)
        assert not [p for p in tree if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


# Cases the smg router answers itself, not the replicas: its HTTP mode reads a stored response
# from its own history storage (which that mode never writes), and its typed /v1/completions
# body takes no token-id prompt. Against one server these pass (test_responses).
SMG_OWNED = ("completion_token_ids", "responses_retrieve", "responses_delete")


def test_the_openai_audit_through_dp_size_two(smollm2_gguf):
    """scripts/openai_audit.py through --dp-size 2 (the router spreading calls over two
    replicas that share the Responses store): every case passes but the router's own."""
    from scripts.openai_audit import Audit, build
    from tests.server_utils import ServerProcess

    srv = ServerProcess(smollm2_gguf, "--dp-size", "2", "--dtype", "float32", "--max-total-tokens", "16384")
    try:
        srv.wait_ready(timeout=240)
        results = build(Audit(srv.url)).run()
    finally:
        srv.stop()
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert set(failed) == set(SMG_OWNED), failed
    assert all("No response found" in failed[k] for k in SMG_OWNED[1:]), failed
