"""Speculative decoding drafted from the radix tree (--speculative-algorithm NGRAM): outputs
equal speculation off token for token (greedy and seeded sampling, with stops, logprobs,
grammars, retraction and aborts beside it), the unseeded distribution is unchanged, drafts do
get accepted, and the cache's integrity holds after every step (CheckedLLM)."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest

from minisgl.serve.cache.ngram_index import NgramIndex, suffix_hashes, window_hashes
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.wire.sampling import SamplingParams
from tests.interpreter import run_interpreted
from tests.test_scheduler import make_llm, shared_prefix_prompts, tokens

SPEC = {"speculative_algorithm": "NGRAM"}  # verify steps loaded beside the step before, drafted after it
WAITING = {**SPEC, "speculative_schedule": "wait"}  # verify steps planned after the steps before
OVERLAPPED = {**SPEC, "speculative_schedule": "overlap"}  # ...planned and drafted beside them
SCHEDULES = pytest.mark.parametrize("spec", [SPEC, WAITING, OVERLAPPED], ids=["late", "wait", "overlap"])


@pytest.fixture(autouse=True)
def verify_steps_pay(monkeypatch, request):
    """Steps speculate whenever they may: the measured rule weighs this machine's timings, which
    would make these tests' verify steps depend on its load (the rule has its own test). And
    with a schedule that plans ahead no step in flight is ever back early (on a CPU every step is
    done at launch, which would leave the late and chained drafts untested; one test lifts it)."""
    if "measured" not in request.node.name:
        monkeypatch.setattr("minisgl.serve.scheduler.spec_rule.SpecRule.pays", lambda self, decoding: True)
    if "back_early" not in request.node.name:
        monkeypatch.setattr("minisgl.device.worker.model_runner.ModelRunner.oldest_done", lambda self: False)
        monkeypatch.setattr("minisgl.serve.scheduler.worker_link.WorkerLink.oldest_done", lambda self: False)


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so a request's own tokens draft well from the start."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(3, 900) for _ in range(rng.randint(5, 12))]
        out.append(phrase * 4 + [rng.randrange(3, 900) for _ in range(rng.randint(1, 6))])
    return out


def both(path, prompts, params, spec: dict = SPEC, **kw) -> tuple[list, list, dict]:
    """Results with speculation off and on (same engine settings), and the second's stats."""
    off = make_llm(path, **kw).generate(prompts, params)
    llm = make_llm(path, **kw, **spec)
    on = llm.generate(prompts, params)
    return off, on, llm.scheduler.stats()


def hash_tokens(tokens: list[int]) -> int:
    return suffix_hashes(tokens, len(tokens))[-1]


def test_window_hashes_match_one_window_at_a_time():
    rng = np.random.default_rng(0)
    tokens_ = rng.integers(0, 150_000, size=40)
    by_length = window_hashes(tokens_, 40)
    for n in (1, 2, 5, 40):
        got = by_length[n - 1]
        assert len(got) == 41 - n
        assert [int(h) for h in got] == [suffix_hashes(tokens_[i : i + n].tolist(), n)[-1] for i in range(41 - n)]


def test_index_follows_inserts_splits_and_evictions():
    cache = RadixCacheManager(page_size=2)
    cache.ngrams = index = NgramIndex(2, 4, capacity=1 << 12)
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.insert_prefix(first, list(range(4)))
    tail = [2, 3]
    assert index.lookup(2, hash_tokens(tail), tail, 3) == [4, 5, 6]
    # A second path splits the first node after its first page: positions still read right.
    cache.insert_prefix([1, 2, 9, 9, 9, 9], [10, 11, 12])
    assert index.lookup(2, hash_tokens(tail), tail, 3) == [4, 5, 6]
    tail = [2, 9]  # a window reaching back into the split-off parent
    assert index.lookup(2, hash_tokens(tail), tail, 2) == [9, 9]
    # Evicted nodes leave the index.
    cache.evict(cache.size_info().evictable)
    assert index.lookup(2, hash_tokens(tail), tail, 2) == []
    assert index.lookup(3, hash_tokens([5, 6, 7]), [5, 6, 7], 1) == []
    assert not index.nodes


@SCHEDULES
@pytest.mark.parametrize("overlap,cascade", [(True, True), (False, True), (True, False)])
def test_greedy_and_seeded_outputs_equal_speculation_off(tiny_llama, overlap, cascade, spec, request):
    """Verify runs read their shared pages as cascade groups (beside the plain rows' groups) or
    as loose rows."""
    if cascade:
        request.getfixturevalue("cheap_cascade")
    prompts = looping_prompts(6, seed=1) + shared_prefix_prompts(2, 3, 40, seed=2)
    prompts += [prompts[0]] * 4  # samples of one prompt (what n > 1 sends), drafting from each other
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=60, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=i, max_new_tokens=60))
        else:
            params.append(SamplingParams(temperature=0.9, seed=100 + i, max_new_tokens=60, ignore_eos=True))
    kw = {"page_size": 4, "disable_overlap_schedule": not overlap}
    off, on, stats = both(tiny_llama, prompts, params, spec, **kw)
    assert tokens(on) == tokens(off)
    assert [r["meta_info"]["finish_reason"] for r in on] == [r["meta_info"]["finish_reason"] for r in off]
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
    assert (stats["cascade_steps"] > 0) == cascade


def test_radix_tree_drafts_repeat_earlier_outputs(tiny_llama):
    """A prompt served before drafts its whole output from the tree the second time."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 900) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True)
    llm = make_llm(tiny_llama, page_size=4, **SPEC)
    first = tokens(llm.generate(prompts, params))
    before = llm.scheduler.stats()
    assert tokens(llm.generate(prompts, params)) == first
    after = llm.scheduler.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert accepted > 0.9 * drafted and steps < 80 / 3
    assert after["spec_step_gain"] > 2  # what the rule weighs: most of each draft kept


@pytest.mark.parametrize("on_device", [True, False], ids=["gains", "host_waits"])
def test_verify_steps_keep_overlap_and_the_worker_finds_real_lengths(tiny_llama, monkeypatch, on_device):
    """Steps are planned while a verify step is in flight: runs drafted after a draft still
    being verified (chained), and plain rows, whose lengths count the run in flight as kept.
    The worker plans them at their shortest and the device adds what that run kept (``Gains``:
    positions, KV slots, attention lengths, sampling positions), or, where the backend cannot,
    the host waits for the run and lowers them (``_resolve``). Outputs equal speculation off
    (greedy from the tree, which chains whole drafts, and seeded sampling, which rejects some),
    and pages past the real lengths go back."""
    from minisgl.device.attention.torch_backend import TorchBackend
    from minisgl.device.worker.model_runner import ModelRunner

    seen = {"rows": 0, "lowered": 0, "chained": 0}
    if on_device:
        defer = ModelRunner._defer

        def counting(self, batch):
            rows = list(batch.resolve_rows)
            gains = defer(self, batch)
            assert gains is not None
            seen["rows"] += len(rows)
            seen["lowered"] += int((gains.tokens.cpu().numpy() < gains.most).sum())
            seen["chained"] += sum(i < sum(batch.verify_sizes) for i in rows)
            return gains

        monkeypatch.setattr(ModelRunner, "_defer", counting)
    else:
        monkeypatch.setattr(TorchBackend, "plans_gains", lambda self, cascade: False)
        resolve = ModelRunner._resolve

        def counting(self, batch):
            rejected = self.rejected_host.numpy()
            seen["rows"] += len(batch.resolve_rows)
            seen["lowered"] += sum(int(rejected[batch.slots[i]] > 0) for i in batch.resolve_rows)
            seen["chained"] += sum(i < sum(batch.verify_sizes) for i in batch.resolve_rows)
            resolve(self, batch)

        monkeypatch.setattr(ModelRunner, "_resolve", counting)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 900) for _ in range(40)] for _ in range(3)]
    off, on = make_llm(tiny_llama, page_size=4), make_llm(tiny_llama, page_size=4, **OVERLAPPED)
    for params in (
        SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=80, ignore_eos=True, seed=5),
    ):
        want = tokens(off.generate(prompts, params))
        for _ in range(2):  # the second time the tree drafts them
            assert tokens(on.generate(prompts, params)) == want
            on.scheduler.check_integrity()
    assert seen["chained"] > 0 and seen["lowered"] > 0 and seen["rows"] > seen["chained"]
    mem = on.scheduler.memory.stats()
    assert mem["free_pages"] + mem["evictable_pages"] == mem["total_pages"]


def test_drafting_reads_tokens_in_place_and_missing_requests_rest():
    """``tokens_at`` reads any span of prompt, outputs and a pending draft as the joined list
    would; a request whose verify runs kept nothing twice in a row rests two steps, and a kept
    token clears its count."""
    from minisgl.serve.scheduler import speculative as sp
    from minisgl.serve.scheduler.request import Req

    rng = random.Random(0)
    req = Req(rid=0, prompt_ids=[rng.randrange(99) for _ in range(7)], params=SamplingParams(), seed=0, max_len=99)
    req.output_ids = [rng.randrange(99) for _ in range(5)]
    pending = [1, 2, 3]
    joined = req.all_ids + pending
    for start in range(len(joined)):
        for stop in range(start, len(joined) + 1):
            assert sp.tokens_at(req, pending, start, stop) == joined[start:stop]
    assert req.num_tokens == len(req.all_ids)

    def tries(results: list[bool]) -> list[int]:
        """The steps (of as many as needed) at which it drafts, each run keeping results[i]."""
        out, step = [], 0
        for kept in results:
            while sp.resting(req):
                step += 1
            out.append(step)
            sp.count_run(req, kept)
            step += 1
        return out

    assert tries([False, False, False, False]) == [0, 1, 4, 5]
    assert tries([False, True, False, False, False]) == [2, 3, 4, 5, 8]  # (after the rest above)


def test_overlapped_verify_steps_draft_after_steps_back_early(tiny_llama):
    """With ``--speculative-schedule overlap``, steps whose tokens are already back when a verify step is
    planned (on a CPU: all of them) are processed first, so drafts follow every token as in the
    waiting mode: the same tokens as speculation off and as many accepted as waiting."""
    prompts = looping_prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    off, waiting, stats_waiting = both(tiny_llama, prompts, params, WAITING, page_size=2)
    llm = make_llm(tiny_llama, page_size=2, **OVERLAPPED)
    early = llm.generate(prompts, params)
    stats = llm.scheduler.stats()
    assert tokens(early) == tokens(waiting) == tokens(off)
    assert stats["spec_accepted_tokens"] == stats_waiting["spec_accepted_tokens"] > 0
    mem = llm.scheduler.memory.stats()
    assert mem["free_pages"] + mem["evictable_pages"] == mem["total_pages"]


def test_the_rule_speculates_while_measured_verify_steps_pay():
    """Unmeasured choices are tried first; then a verify step runs only while its tokens per
    request beat its cost in plain steps, per batch size, with the other choice tried now and
    then; steps are timed start to start, only after a step of the same kind."""
    from minisgl.serve.scheduler import spec_rule

    plan = spec_rule.SpecRule()
    for _ in range(spec_rule.MIN_GAINS):
        assert plan.wants(8)  # no verdict on the tokens yet: verify
        plan.verified(8, 1.5)
    plan.observe(True, 8, 2.0)
    assert not plan.wants(8)  # the plain step is not measured yet
    plan.observe(False, 8, 1.0)
    n = spec_rule.EXPLORE
    # each try that keeps the choice doubles the wait for the next (n, 2n, 4n steps between)
    tried = [n - 1, n, 3 * n, 3 * n + 1, 7 * n + 1, 7 * n + 2]
    plan.streak[4] = 0
    choices = [plan.wants(8) for _ in range(8 * n)]
    # 1.5 tokens a request for twice the time: plain, the verify step tried twice in a row now and then
    assert [i for i, c in enumerate(choices) if c] == tried
    # a try that changes the choice starts the interval again: the verify steps now pay
    plan.streak[4] = plan.explore[4] - 1
    assert plan.wants(8) and plan.wants(8)  # a try of two verify steps ...
    for _ in range(spec_rule.WINDOW):  # ... after which a verify step costs what a plain one does
        plan.observe(True, 8, 1.0)
    choices = [plan.wants(8) for _ in range(n + 1)]
    assert plan.explore[4] == n and [i for i, c in enumerate(choices) if not c] == [n - 1, n]
    plan.explore[4] = spec_rule.MAX_EXPLORE
    for _ in range(3 * spec_rule.MAX_EXPLORE):  # confirmed again and again, it stays at the cap
        plan.wants(8)
    assert plan.explore[4] == spec_rule.MAX_EXPLORE
    assert plan.wants(20)  # another batch size: measured apart (not yet)

    # One step that took 100 times the others (a kernel compiled for a new shape) moves nothing.
    plan.observe(True, 8, 100.0)
    assert plan.wants(8) and plan.margin(8) == 1.5

    # A clear loss (tokens under half the cost: a large model's full batch) waits the longest
    # interval before the next try, at that batch size only.
    plan = spec_rule.SpecRule(max_batch=512)  # (--speculative-disable-by-batch-size)
    plan.observe(True, 300, 3.0)
    plan.observe(False, 300, 1.0)
    for _ in range(spec_rule.MIN_GAINS):
        plan.verified(300, 1.2)
    plan.streak[9] = spec_rule.EXPLORE - 1
    assert plan.wants(300) and plan.wants(300) and not plan.wants(300)  # the try, then judged
    assert plan.explore[9] == spec_rule.MAX_EXPLORE and 1 not in plan.explore
    for _ in range(20):  # then the drafts turn good (a model looping): verify steps pay
        plan.verified(300, 3.5)
    assert plan.wants(300)

    # Waiting, tries that found no drafts gave one token a request: no verify step is needed to
    # know speculation does not pay there (a full batch whose requests rest); one such try is no
    # verdict (a lone request's tail finds drafts some steps and not others).
    plan = spec_rule.SpecRule(max_batch=512, waits=True)
    for _ in range(spec_rule.MIN_GAINS):
        assert plan.wants(256)
        plan.no_drafts(256, looked=False)
    assert not plan.wants(256) and plan.wants(16)
    # a mean over the window: empty tries and a long kept draft at one request pay together
    plan.no_drafts(1, looked=False)
    plan.verified(1, 5.0)
    plan.no_drafts(1, looked=False)
    plan.observe(True, 1, 1.5)
    plan.observe(False, 1, 1.0)
    assert plan.wants(1) and plan.margin(1) == (1 + 5 + 1) / 3 / 1.5
    # Planned beside the steps in flight, a look that found nothing cost no drain: it is no try,
    # and the verify steps' own tokens decide (new text between spans the siblings wrote).
    plan = spec_rule.SpecRule()
    plan.observe(True, 1, 1.2)
    plan.observe(False, 1, 1.0)
    for _ in range(spec_rule.MIN_GAINS):
        plan.verified(1, 3.0)
    for _ in range(2 * spec_rule.WINDOW):
        plan.no_drafts(1, looked=True)
        assert [plan.wants(1) for _ in range(spec_rule.IDLE_AFTER_NO_DRAFT + 1)][-1]
    assert plan.margin(1) == 2.5
    assert not spec_rule.SpecRule().wants(33)  # above the default bound: never

    plan = spec_rule.SpecRule()
    for now, kind in [(0.0, False), (1.0, False), (2.0, True), (5.0, True), (7.0, None), (9.0, False)]:
        plan.step_started(now)
        plan.launched(kind, 8)
    plan.step_started(10.0)
    # the first of each kind waited on the step before it: not measured; after None, nothing
    assert {key: list(times) for key, times in plan.seconds.items()} == {(False, 4): [1.0], (True, 4): [2.0]}
    # a try that found no drafts: timed as a verify step when it waited, as a plain one beside
    for waits, kind in ((True, True), (False, False)):
        plan = spec_rule.SpecRule(waits=waits)
        for now in (0.0, 1.0, 2.0):
            plan.step_started(now)
            plan.launched(True, 8, verified=False)
        assert list(plan.seconds) == [(kind, 4)]


def test_verify_steps_fit_the_largest_captured_graph(tiny_llama):
    """Drafts are cut so that a verify step's rows fit the largest captured graph (k + 1 rows a
    request of ``--cuda-graph-max-bs``; a longer step would run eagerly on the GPU)."""
    prompts = looping_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    off = make_llm(tiny_llama, page_size=2).generate(prompts, params)
    llm = make_llm(tiny_llama, page_size=2, cuda_graph_max_bs=2, **SPEC)
    assert llm.args.graph_batch_size == 2 * (llm.args.speculative_num_draft_tokens + 1)
    rows: list[int] = []
    launch = llm.scheduler.executor.launch
    llm.scheduler.executor.launch = lambda b: (rows.append(len(b.slots)) if b.verify_sizes else None, launch(b))[1]
    assert tokens(llm.generate(prompts, params)) == tokens(off)
    assert rows and max(rows) == llm.args.graph_batch_size and llm.scheduler.stats()["spec_accepted_tokens"] > 0
    # Fewer running requests than verify rows: a step has more rows than slots.
    llm = make_llm(tiny_llama, page_size=2, max_running_requests=2, cuda_graph_max_bs=2, **SPEC)
    rows.clear()
    launch = llm.scheduler.executor.launch
    llm.scheduler.executor.launch = lambda b: (rows.append(len(b.slots)) if b.verify_sizes else None, launch(b))[1]
    assert tokens(llm.generate(prompts, params)) == tokens(off)
    assert 2 < max(rows) <= llm.args.graph_batch_size


def test_pages_read_from_disk_are_indexed_for_drafts(tiny_llama, tmp_path):
    """A prompt found on the storage tier after a restart enters the tree as a host-only node,
    which the n-gram index holds like any other: its windows find their continuations."""
    import time

    from minisgl.llm import LLM
    from minisgl.serve.cache.ngram_index import suffix_hashes

    engine = dict(
        device="cpu",
        max_total_tokens=4000,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        **SPEC,
    )
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(600)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    first = LLM(str(tiny_llama), **engine)
    first.generate([prompt], params)
    deadline = time.monotonic() + 10  # (written behind by a thread)
    while len(list(tmp_path.rglob("*.r0"))) < 600 // 16 - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    del first
    again = LLM(str(tiny_llama), **engine)
    again.generate([prompt], params)
    assert again.scheduler.stats()["prefix_disk_hit_tokens"] > 0
    index = again.scheduler.cache.ngrams
    window = prompt[100:106]
    assert index.lookup(6, suffix_hashes(window, 6)[-1], window, 3) == prompt[106:109]


def test_radix_off_drafts_from_own_tokens(tiny_llama):
    prompts = looping_prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    off, on, stats = both(tiny_llama, prompts, params, page_size=2, disable_radix_cache=True)
    assert tokens(on) == tokens(off)
    assert stats["spec_accepted_tokens"] > 0


def test_stops_lengths_and_logprobs_hold(tiny_llama):
    """A stop token inside an accepted draft ends the request there; logprobs (and entropies)
    come per token."""
    prompts = looping_prompts(5, seed=3)
    free = make_llm(tiny_llama, page_size=4).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    )
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=40 - i, stop_token_ids=[r["output_ids"][20 + i]])
        for i, r in enumerate(free)
    ]
    for top in (-1, 2):
        entropy = top >= 0
        off = make_llm(tiny_llama, page_size=4).generate(prompts, params, top_logprobs=top, return_entropy=entropy)
        on = make_llm(tiny_llama, page_size=4, **SPEC).generate(
            prompts, params, top_logprobs=top, return_entropy=entropy
        )
        assert tokens(on) == tokens(off)
        assert [r["meta_info"]["finish_reason"] for r in on] == ["stop"] * 5
        if top >= 0:
            for a, b in zip(on, off):
                got, want = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
                assert len(got) == len(a["output_ids"])
                np.testing.assert_allclose(got, want, atol=1e-4)
                tops = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
                assert [[t for t, _ in row] for row in tops[0]] == [[t for t, _ in row] for row in tops[1]]
                got, want = a["meta_info"]["output_token_entropy"], b["meta_info"]["output_token_entropy"]
                assert len(got) == len(a["output_ids"])
                np.testing.assert_allclose(got, want, atol=1e-4)


@SCHEDULES
def test_retraction_and_grammars_beside_speculation(tiny_llama, spec):
    pytest.importorskip("xgrammar")
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=30, seed=3) + looping_prompts(4, seed=5)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=16, json_schema=schema)
        if i % 5 == 0
        else SamplingParams(temperature=0.7 if i % 5 == 1 else 0.0, seed=i, max_new_tokens=16 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref = tokens(make_llm(tiny_llama, page_size=2).generate(prompts, params))
    small = make_llm(tiny_llama, page_size=2, max_total_tokens=260, **spec)
    assert tokens(small.generate(prompts, params)) == ref
    stats = small.scheduler.stats()
    assert stats["retractions"] > 0 and stats["spec_verify_steps"] > 0


@SCHEDULES
def test_aborts_mid_verify_leak_nothing(tiny_llama, spec):
    llm = make_llm(tiny_llama, page_size=4, **spec)
    sched = llm.scheduler
    reqs = [
        sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True))
        for p in looping_prompts(6, seed=8)
    ]
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        if steps in (5, 9, 14):  # an abort while a verify step may be in flight
            sched.finish(reqs[steps % 6], "abort")
    assert sched.stats()["spec_verify_steps"] > 0
    mem = sched.memory.stats()
    assert mem["free_pages"] + mem["evictable_pages"] == mem["total_pages"]
    assert not sched.running and not sched.inflight


@SCHEDULES
def test_unseeded_sampling_keeps_its_distribution(tiny_llama, spec):
    """Unseeded draws: each position's token distribution with speculation on matches off (a
    chi-square test on the pooled tokens of positions 2-6 after a repeating prompt)."""
    prompt = looping_prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.5, top_k=8, max_new_tokens=6, ignore_eos=True)
    counts = []
    for kw in ({}, spec):
        llm = make_llm(tiny_llama, page_size=4, max_running_requests=16, seed=11 if kw else 12, **kw)
        outs = tokens(llm.generate([prompt] * 400, params))
        counts.append(Counter(t for o in outs for t in o[1:]))
    keys = sorted(set(counts[0]) | set(counts[1]))
    a = np.array([counts[0][k] for k in keys], dtype=float)
    b = np.array([counts[1][k] for k in keys], dtype=float)
    keep = (a + b) >= 10  # pool the rare tokens into one cell
    a = np.r_[a[keep], a[~keep].sum()]
    b = np.r_[b[keep], b[~keep].sum()]
    expected = (a + b) / 2
    chi2 = (((a - expected) ** 2 + (b - expected) ** 2) / np.maximum(expected, 1e-9)).sum()
    dof = len(a) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof)  # ~5 sigma: fails only when the distributions differ


@SCHEDULES
def test_verify_steps_at_tp2_equal_one_process(tiny_llama, spec):
    """Two tensor-parallel ranks (gloo): verify steps sample on the sharded vocabulary and keep
    each run's last token (and the rows it rejected) on every rank, so greedy and seeded outputs
    and their logprobs equal one process's without speculation. The prompts run twice: the
    second time the tree drafts their outputs."""
    import gc

    from minisgl.llm import LLM

    prompts = looping_prompts(4, seed=9)
    params = [
        {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 30, "temperature": 0.8, "seed": 3, "ignore_eos": True},
    ] * 2
    kw = dict(device="cpu", dtype="float32", max_running_requests=8, page_size=2)
    want = LLM(str(tiny_llama), **kw).generate(prompts, params, top_logprobs=2)
    llm = LLM(str(tiny_llama), tp_size=2, **kw, **spec)
    runs = [llm.generate(prompts, params, top_logprobs=2) for _ in range(2)]
    stats = llm.scheduler.stats()
    del llm
    gc.collect()
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
    for got in runs:
        assert tokens(got) == tokens(want)
        for g, w in zip(got, want):
            assert np.allclose(
                g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"], atol=1e-4
            )


@pytest.mark.cuda
@SCHEDULES
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_on_cuda_keeps_tokens(tmp_path, dtype, spec):
    """On the GPU (FlashInfer verify chunks beside cascade decode rows, CUDA graphs, overlap):
    fp32 tokens equal speculation off; bf16 verify chunks may round differently from one-token
    steps, so only half the requests must agree there."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = looping_prompts(12, seed=1) + shared_prefix_prompts(2, 4, 40, seed=2)
    params = [
        SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_new_tokens=64, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs, stats = [], None
    for kw in ({}, spec):
        llm = LLM(str(path), device="cuda", dtype=dtype, max_total_tokens=8192, page_size=4, **kw)
        outs.append(tokens(llm.generate(prompts, params)))
        outs.append(tokens(llm.generate(prompts, params)))  # the second time, drafts from the tree
        stats = llm.scheduler.stats()
    assert stats["spec_accepted_tokens"] > 0
    same = sum(a == b for a, b in zip(outs[0] + outs[1], outs[2] + outs[3]))
    # (bf16 on the tiny random checkpoint, whose logits tie often: 26 of 40 agreed on the H100)
    assert same == 2 * len(prompts) if dtype == "float32" else same >= len(prompts), f"{same} of {2 * len(prompts)}"


def test_server_streams_every_accepted_token(tiny_llama):
    """Through the server a verify step's tokens all reach the client, streamed or not, with
    their logprobs, as the offline engine gives them; each request's meta_info carries SGLang's
    spec_* counts, which add up to the server's."""
    import httpx

    from tests.server_utils import running_server

    prompts = looping_prompts(3, seed=12)
    params = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    want = tokens(make_llm(tiny_llama, page_size=4).generate(prompts, params))
    metas = []
    with running_server(tiny_llama, "--page-size", "4", "--speculative-algorithm", "NGRAM") as srv:
        for prompt, expected in zip(prompts, want):
            body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
            got = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
            assert got["output_ids"] == expected
            assert len(got["meta_info"]["output_token_logprobs"]) == len(expected)
            metas.append(got["meta_info"])
            streamed: list[int] = []
            with httpx.stream("POST", f"{srv.url}/generate", json={**body, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        streamed = event["output_ids"]
            assert streamed == expected
            metas.append(event["meta_info"])
        stats = srv.server_info()["scheduler"]
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_accept_length"] > 1
        for meta in metas:  # each decode step gave one token and the drafts it accepted
            assert meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + meta["spec_accept_token_num"]
            assert meta["spec_accept_rate"] == meta["spec_accept_token_num"] / meta["spec_draft_token_num"]
        assert sum(m["spec_accept_token_num"] for m in metas) == stats["spec_accepted_tokens"]
        assert sum(m["spec_draft_token_num"] for m in metas) == stats["spec_draft_tokens"]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        line = next(x for x in metrics.splitlines() if x.startswith("sglang:spec_accept_length{"))
        assert float(line.split()[-1]) > 1


def test_host_tier_under_the_tree_keeps_drafts_and_tokens(tiny_llama):
    """With the host tier, evicted device pages keep their nodes (host copies): drafts still
    read their tokens, and outputs equal speculation off; the cache's check holds every step."""
    prompts = looping_prompts(6, seed=13) + [p[:20] for p in looping_prompts(4, seed=14)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    kw = dict(page_size=4, max_total_tokens=600, enable_hierarchical_cache=True, hicache_ratio=4)
    off = tokens(make_llm(tiny_llama, **kw).generate(prompts, params))
    llm = make_llm(tiny_llama, **kw, **SPEC)
    assert tokens(llm.generate(prompts, params)) == off
    assert tokens(llm.generate(prompts, params)) == off  # again: prompts come back from the host tier
    stats = llm.scheduler.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["prefix_host_hit_tokens"] > 0


def verified_check(device: str) -> None:
    """The kept-tokens kernel writes what its torch reference writes: each run's first sample that
    differs from the next row's input, and the rows after it; runs of one (plain rows) too."""
    import torch

    from minisgl.device.kernels.verify import last_verified
    from minisgl.device.worker.model_runner import last_verified_torch

    rng = np.random.default_rng(3)
    for trial in range(20):
        sizes = rng.integers(1, 10, size=rng.integers(1, 12))
        ends = np.cumsum(sizes)
        rows = int(ends[-1])
        tokens = rng.integers(0, 5, size=rows)  # few ids: drafts often match
        following = tokens.copy() if trial % 2 else rng.integers(0, 5, size=rows)  # (odd: every sample matches)
        following[ends - 1] = -1
        slots = rng.permutation(40)[: len(sizes)]
        info = torch.from_numpy(np.concatenate([following, ends - sizes, ends, slots])).to(device)
        tokens_t = torch.from_numpy(tokens).to(device)
        got = [torch.full((41,), -7, dtype=torch.int64, device=device) for _ in range(2)]
        ref = [t.clone() for t in got]
        last_verified(tokens_t, info, len(sizes), int(sizes.max()), *got)
        last_verified_torch(tokens_t, info, len(sizes), int(sizes.max()), *ref)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), trial
        if trial % 2:  # every draft token matched: each run keeps all its rows
            assert (ref[1][torch.from_numpy(slots).to(device)] == 0).all()


@pytest.mark.cuda
def test_kept_tokens_kernel_matches_torch_on_cuda():
    verified_check("cuda")


def test_kept_tokens_kernel_under_the_interpreter():
    """Under Triton's interpreter (on before triton loads: a child process)."""
    run_interpreted("from tests.test_speculative import verified_check; verified_check('cpu')", timeout=600)


def test_a_predicted_output_drafts_from_where_the_answer_is_in_it():
    """OpenAI's predicted output is a draft source, ahead of the request's own tokens at each
    n-gram length; of two places an n-gram occurs in it, the one at or after the last draft's."""
    from minisgl.serve.scheduler.request import Req
    from minisgl.serve.scheduler.speculative import Drafter
    from minisgl.wire.options import RequestOptions

    predicted = [5, 6, 7, 8, 1, 2, 3, 9, 9, 1, 2, 3, 4, 4, 4]
    opts = RequestOptions(prediction_ids=predicted)
    req = Req(rid=0, prompt_ids=[40, 41], params=SamplingParams(), seed=0, max_len=99, options=opts)
    drafter = Drafter(None, 2, 3)
    req.output_ids = [5, 6, 7]
    assert drafter.draft(req, 3) == [8, 1, 2]
    req.output_ids += [8, 1, 2, 3, 9, 9]
    assert drafter.draft(req, 3) == [1, 2, 3]  # after [3, 9, 9], which occurs once
    req.output_ids += [1, 2, 3]
    assert drafter.draft(req, 3) == [4, 4, 4]  # [1, 2, 3] again: its second place, where the answer is
    req.output_ids += [7, 7]
    assert drafter.draft(req, 3) == []  # an answer that left the prediction drafts from it no more
    req.output_ids += [5, 6]  # ... until it meets it again
    assert drafter.draft(req, 2, pending=[7]) == [8, 1]


def test_a_predicted_output_speeds_decoding_and_changes_no_token(tiny_llama):
    """Greedy answers with a prediction (each one's own answer, a stretch of it changed) keep
    more drafts than with none and equal speculation off token for token."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 900) for _ in range(24)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    off = tokens(make_llm(tiny_llama, page_size=2).generate(prompts, params))
    predictions = [t[:20] + [rng.randrange(3, 900) for _ in range(6)] + t[26:] for t in off]
    kept = {}
    for name, given in (("none", None), ("predicted", predictions)):
        llm = make_llm(tiny_llama, page_size=2, disable_radix_cache=True, **SPEC)
        assert tokens(llm.generate(prompts, params, predictions=given)) == off
        kept[name] = llm.scheduler.stats()["spec_accepted_tokens"]
    assert kept["predicted"] > max(2 * kept["none"], len(prompts) * 48 // 2), kept


def test_the_server_drafts_from_a_predicted_output(smollm2_gguf):
    """Through /v1/chat/completions the tokenizer hands a prediction's tokens to a speculating
    scheduler: the same greedy answer, asked again with itself as the prediction (radix cache
    off, so no tree remembers it), keeps more drafts and reads the same. Each ask runs on a
    fresh server: the scheduler's rule for when to speculate (``spec_rule``) learns from the
    steps before, and the first ask's few kept drafts would turn it off for the second.
    (SmolLM2: its answers are text that encodes back to their tokens.)"""
    import httpx

    from tests.server_utils import running_server

    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    args = ("--speculative-algorithm", "NGRAM", "--disable-radix-cache")

    def ask(**extra) -> tuple[str, int]:
        """The answer and how many drafted tokens it kept."""
        with running_server(smollm2_gguf, *args) as srv:
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"], srv.server_info()["scheduler"]["spec_accepted_tokens"]

    text, alone = ask()
    again, predicted = ask(prediction={"type": "content", "content": text})
    assert again == text
    assert predicted > max(2 * alone, 48 // 2), (alone, predicted)
