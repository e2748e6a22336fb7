"""The speculation benchmarks run end to end on the tiny checkpoint (CPU, a few tokens): their
engine set-up and hooks follow the engine's flags and signatures, which a benchmark otherwise
meets only on the GPU."""

from __future__ import annotations

import json
import sys

from benchmarks import spec_bench, spec_cost, spec_replay, step_phases
from minisgl.serve.scheduler import spec_rule, speculative


def test_spec_bench_runs_every_mode_with_the_samples_of_speculation_off(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    argv = ["spec_bench.py", "--model", str(tiny_llama), "--prompts", "1", "--samples", "3", "--max-new-tokens", "12"]
    argv += ["--device", "cpu", "--dtype", "float32", "--temperature", "0", "--schedules", "wait", "overlap", "late"]
    argv += ["--disable-by-batch-size", "2", "32", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    spec_bench.main()
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows][0] == "off" and len(rows) == 7
    assert all(r["same_as_off"] == 1.0 and r["output_tokens"] == 36 for r in rows)
    assert rows[0]["paired_speedup"] == 1.0 and all(r["paired_speedup"] > 0 for r in rows)


def test_spec_replay_records_and_replays(tiny_llama, tmp_path, monkeypatch):
    recorded, replayed = tmp_path / "rec.json", tmp_path / "rep.json"
    argv = ["spec_replay.py", "record", "--model", str(tiny_llama), "--prompts", "1", "--samples", "3"]
    argv += ["--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32", "--out", str(recorded)]
    monkeypatch.setattr(sys, "argv", argv)
    spec_replay.main()
    monkeypatch.setattr(sys, "argv", ["spec_replay.py", "replay", str(recorded), "--overlap", "--out", str(replayed)])
    spec_replay.main()
    rows = json.loads(replayed.read_text())["results"]
    assert rows and all(r["steps"] <= 11 for r in rows)


def test_spec_cost_times_verify_steps_of_every_k(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "cost.json"
    # (it bypasses the rule and the rests for its process: put them back afterwards)
    monkeypatch.setattr(spec_rule.SpecRule, "pays", spec_rule.SpecRule.pays)
    monkeypatch.setattr(speculative, "count_run", speculative.count_run)
    argv = ["spec_cost.py", "--model", str(tiny_llama), "--batch", "2", "--k", "0", "2", "--steps", "6"]
    monkeypatch.setattr(sys, "argv", argv + ["--context", "32", "--out", str(out)])
    spec_cost.main()
    rows = json.loads(out.read_text())["results"]
    assert [(r["k"], r["steps"]) for r in rows] == [(0, 5), (2, 5)]


def test_step_phases_times_each_mode_by_kind(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "phases.json"
    # (it wraps the engine's methods with timers and bypasses the rule: put them back afterwards)
    for cls, name in step_phases.PHASES:
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setattr(spec_rule.SpecRule, "pays", spec_rule.SpecRule.pays)
    monkeypatch.setattr(step_phases.scheduler.Scheduler, "step", step_phases.scheduler.Scheduler.step)
    argv = ["step_phases.py", "--model", str(tiny_llama), "--prompts", "1", "--samples", "3", "--max-new-tokens"]
    argv += ["12", "--device", "cpu", "--dtype", "float32", "--modes", "off", "late", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    step_phases.main()
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["off", "late"]
    for row in rows:
        assert row["ms_per_step"]["ModelRunner.launch"] > 0
        assert sum(kind["steps"] for kind in row["by_kind"].values()) == row["steps"] - 1
        assert all(kind["phases"] for kind in row["by_kind"].values())


def test_online_clients_stream_every_token_and_count_refusals(tiny_llama):
    """The streaming client the online benchmarks share (aiohttp, several processes): every
    token of every stream counted, at most one inter-token gap per token after the first, and a refused
    request reported with the server's reason instead of ending the run."""
    from benchmarks.online_serving import run_clients
    from tests.server_utils import ServerProcess

    srv = ServerProcess(tiny_llama, "--max-total-tokens", "8192")
    try:
        srv.wait_ready()
        prompts = [[5 + i, 6, 7, 8] for i in range(6)] + [[3] * 2000]  # the last is over the context
        results, elapsed, _ = run_clients(srv.url, prompts, [9] * 7, None, None, procs=2)
    finally:
        srv.stop()
    ok = [r for r in results if "error" not in r]
    # one gap per token after the first event's (a busy API joins tokens into one event)
    assert [r["tokens"] for r in ok] == [9] * 6 and all(len(r["itl"]) <= 8 and r["ttft"] <= r["e2e"] for r in ok)
    (refused,) = [r for r in results if "error" in r]
    assert refused["error"].startswith("HTTP 400") and "context" in refused["error"] and elapsed > 0
