"""Hybrid models (Gated DeltaNet + gated attention: Qwen3-Next, Qwen3.5 dense and MoE) on CPU.

Tiny fp32 checkpoints give transformers' greedy tokens; radix on and off, chunk sizes, page
sizes, n copies of one prompt and retraction all give the same tokens; a prompt extending an
earlier one starts from a snapshot (cached_tokens > 0). A fuzzed scheduler over an executor whose
"state" is the very token sequence each slot has consumed checks that every snapshot a request
starts from is the state of exactly its prefix, under random arrivals, aborts and eviction.
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import pytest
import torch

from minisgl.config.args import EngineArgs
from minisgl.device.layers.gated_delta import causal_conv, fla_chunked, gated_delta_rule, l2norm, varlen_conv
from minisgl.device.tiny_model import HYBRID_ARCHS, make_tiny_model
from minisgl.llm import LLM
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, StepOutput

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
STEM = [7, 20, 33, 41, 5, 9, 100, 120, 3, 8, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]
PROMPTS = [STEM, STEM + [80, 81, 82, 83], STEM[:9] + [90, 91], [4, 4, 8, 200, 17]]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: make_tiny_model(arch, root / arch, seed=0) for arch in HYBRID_ARCHS}


def reference(path: Path, prompts: list[list[int]], n: int = GREEDY["max_new_tokens"]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(p) :].tolist())
    return outs


def run(path: Path, prompts: list[list[int]], warm: list[list[int]] = (), **kwargs) -> list[dict]:
    """Generate ``prompts`` after ``warm`` ones (which fill the cache), checking the cache after."""
    kwargs = {"dtype": "float32", "max_total_tokens": 4096, **kwargs}
    llm = LLM(str(path), **kwargs)
    if warm:
        llm.generate(list(warm), GREEDY)
    out = llm.generate(prompts, GREEDY)
    llm.scheduler.check_integrity()
    return out


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_tokens_equal_transformers_with_and_without_the_cache(hybrids, arch):
    want = reference(hybrids[arch], PROMPTS)
    cached = run(hybrids[arch], PROMPTS, warm=PROMPTS[:1])
    assert [o["output_ids"] for o in cached] == want
    assert cached[0]["meta_info"]["cached_tokens"] > 0 and cached[1]["meta_info"]["cached_tokens"] > 0
    plain = run(hybrids[arch], PROMPTS, warm=PROMPTS[:1], disable_radix_cache=True)
    assert [o["output_ids"] for o in plain] == want
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in plain)


@pytest.mark.parametrize("page, chunk", [(1, 16), (4, 64), (16, -1), (1, -1)])
def test_chunk_and_page_sizes_give_the_same_tokens(hybrids, page, chunk):
    path = hybrids["qwen3_5"]
    want = reference(path, PROMPTS)
    out = run(path, PROMPTS, warm=PROMPTS[1:2], page_size=page, chunked_prefill_size=chunk)
    assert [o["output_ids"] for o in out] == want


def test_copies_of_one_prompt_start_from_the_first_ones_snapshot(hybrids):
    """n = 4 as the server sends it (four requests at once): one computes the prompt, the three
    others wait a step for its snapshot and compute only its last page; all four are greedy-equal
    to one request alone."""
    path = hybrids["qwen3_next"]
    (want,) = reference(path, [STEM])
    out = run(path, [STEM] * 4, page_size=1)
    assert all(o["output_ids"] == want for o in out)
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0] + [len(STEM) - 1] * 3


def test_a_prompts_last_snapshot_is_saved_inside_its_one_prefill_step(hybrids):
    """The snapshot at the prompt's last page is saved part-way through the prefill's forward
    (no step of its own for the last page), and the next turn starts from it with the tokens
    of no cache at all."""
    path = hybrids["qwen3_5"]
    prompt = [5, 6] + STEM
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096, page_size=4)
    steps = []
    forward = llm.runner.forward
    llm.runner.forward = lambda batch, *a, **k: steps.append(batch) or forward(batch, *a, **k)
    first = llm.generate([prompt], GREEDY)[0]
    prefills = [b for b in steps if any(n > 1 for n in b.new_lens)]
    assert len(prefills) == 1 and len(prefills[0].state_splits) == 3
    longer = prompt + first["output_ids"] + [11, 12]
    again = llm.generate([longer], GREEDY)[0]
    llm.scheduler.check_integrity()
    assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 4 * 4
    assert again["output_ids"] == run(path, [longer], disable_radix_cache=True)[0]["output_ids"]


def test_an_extended_prompt_hits_and_a_retracted_request_finishes_the_same(hybrids):
    path = hybrids["qwen3_5_moe"]
    prompts = [[i, i + 1] + STEM for i in range(2, 40, 3)]  # (nothing shared: the pool runs out)
    want = reference(path, prompts)
    # A pool of 160 tokens for 13 requests of ~33: some are retracted and come back.
    llm = LLM(str(path), dtype="float32", max_total_tokens=160, page_size=1, max_running_requests=8)
    out = llm.generate(prompts, GREEDY)
    llm.scheduler.check_integrity()
    assert [o["output_ids"] for o in out] == want
    assert llm.scheduler.stats()["retractions"] > 0
    # The next turn of the first conversation starts from its prompt's snapshot.
    longer = prompts[0] + want[0] + [11, 12]
    first, again = run(path, [longer], warm=prompts[:1], page_size=1), run(path, [longer], disable_radix_cache=True)
    assert first[0]["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    assert first[0]["output_ids"] == again[0]["output_ids"] == reference(path, [longer])[0]


def test_prompts_branching_after_a_shared_prefix_hit_at_the_branch_point(hybrids):
    """A system prompt, then different questions, one after another: the first computes its
    prompt, the second finds the system prompt's pages but no state there, computes it again and
    leaves a snapshot at the branch point, and from the third on the system prompt is a hit."""
    path = hybrids["qwen3_next"]
    prompts = [STEM + [q, q + 1, q + 2] for q in (200, 300, 400, 500)]
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096, page_size=4)
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]
    llm.scheduler.check_integrity()
    assert [o["output_ids"] for o in outs] == reference(path, prompts)
    shared = len(STEM) - len(STEM) % 4
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, shared, shared]


def test_prompts_arriving_together_compute_their_shared_prefix_once(hybrids):
    """Three groups of four prompts, each group sharing a system prompt, all waiting at once
    (shuffled): the first of a group admitted learns from the waiting queue where the others
    branch from it and leaves a snapshot there, the others wait a step for it, so every system
    prompt is computed once (prefill tokens = distinct prompt tokens), tokens as without cache."""
    path = hybrids["qwen3_5"]
    rng = random.Random(0)
    systems = [[rng.randrange(1, 250) for _ in range(32)] for _ in range(3)]
    prompts = [s + [rng.randrange(1, 250) for _ in range(5)] for s in systems for _ in range(4)]
    rng.shuffle(prompts)
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096, page_size=4)
    outs = llm.generate(prompts, GREEDY)
    llm.scheduler.check_integrity()
    stats = llm.scheduler.stats()
    assert stats["prefill_tokens"] == 3 * 32 + 12 * 5
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0] * 3 + [32] * 9
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in run(path, prompts, disable_radix_cache=True)]


def test_each_turn_of_many_conversations_starts_from_its_last_prompts_snapshot(hybrids):
    """Conversations taking turns: a turn extends its conversation where the cached path ends,
    which is no branch point, so it takes one snapshot (its prompt's end) and its prefill is one
    chunk; every later turn starts from its last prompt's snapshot."""
    path = hybrids["qwen3_5"]
    page, convs, turns = 4, 4, 3
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096, page_size=page, max_mamba_cache_size=4 * convs)
    rng = random.Random(1)
    history, previous = [[rng.randrange(1, 250) for _ in range(9)] for _ in range(convs)], []
    for turn in range(turns):
        prompts = [h + [rng.randrange(1, 250) for _ in range(6)] for h in history]
        outs = llm.generate(prompts, GREEDY)
        llm.scheduler.check_integrity()
        assert len(llm.scheduler.cache.holders) == convs * (turn + 1)
        if previous:  # (a snapshot sits at the last page boundary before a prompt's last token)
            assert [o["meta_info"]["cached_tokens"] for o in outs] == [(len(p) - 1) // page * page for p in previous]
        previous, history = prompts, [p + o["output_ids"] for p, o in zip(prompts, outs)]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in run(path, prompts, disable_radix_cache=True)]


def test_snapshot_rows_run_out_shallowest_first_among_equally_recent():
    """A walk touches a whole path at once, so a conversation's older snapshots are as recent as
    its newest: when rows run out, the least recently used path loses its shallowest."""
    from minisgl.serve.cache.snapshot_manager import SnapshotRadixCacheManager

    cache = SnapshotRadixCacheManager(page_size=1, rows=[0, 1, 2])
    a, b = list(range(1, 13)), list(range(100, 106))

    def insert(ids: list[int], pages: list[int]) -> None:
        handle, _ = cache.match_prefix(ids)
        cache.lock_handle(handle)
        handle, _, _ = cache.commit(ids, pages, handle)
        cache.lock_handle(handle, unlock=True)

    insert(a, list(range(12)))
    insert(b, list(range(20, 26)))
    for ids in (a[:8], a[:4], b):  # (the deeper of a's first)
        cache.attach(ids, cache.take())
    cache.now = 1  # (written by the step that took them)
    cache.match_prefix(a)
    cache.match_prefix(b)  # b used after a
    assert cache.fork_depth(a + [50, 51]) == 0  # extends a where its path ends: no branch point
    assert cache.fork_depth(a[:6] + [50, 51]) == 6  # leaves it midway
    c = list(range(200, 205))
    insert(c, list(range(30, 35)))
    cache.attach(c, cache.take())
    assert sorted(n.depth for n in cache.holders.values()) == [5, 6, 8]
    cache.check_integrity()


def test_the_state_pool_follows_its_flags(hybrids):
    """--max-mamba-cache-size snapshot rows past the slots', --mamba-ssm-dtype the states' type;
    with two snapshots for four prompts the least recently used give way, and tokens stay exact."""
    path = hybrids["qwen3_5"]
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096, max_mamba_cache_size=2, max_running_requests=4)
    assert len(llm.runner.snapshot_rows) == 2 and llm.runner.states.ssm.dtype == torch.float32
    outs = [llm.generate([p], GREEDY)[0]["output_ids"] for p in PROMPTS]
    llm.scheduler.check_integrity()
    assert outs == reference(path, PROMPTS)
    half = LLM(str(path), dtype="float32", max_total_tokens=4096, mamba_ssm_dtype="bfloat16")
    assert half.runner.states.ssm.dtype == torch.bfloat16
    assert len(half.generate(PROMPTS[:1], GREEDY)[0]["output_ids"]) == GREEDY["max_new_tokens"]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])  # (the grouped and the split projections)
def test_tensor_parallel_ranks_split_the_heads_and_give_the_same_tokens(hybrids, arch):
    """tp=2 over gloo: each rank holds half the DeltaNet and attention heads (and its half of the
    state pool); greedy tokens, cache hits included, equal one process's."""
    kw = dict(device="cpu", dtype="float32", max_running_requests=8, max_total_tokens=2048)
    want = [o["output_ids"] for o in LLM(str(hybrids[arch]), **kw).generate(PROMPTS, GREEDY)]
    llm = LLM(str(hybrids[arch]), tp_size=2, **kw)
    llm.generate(PROMPTS[:1], GREEDY)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in out] == want
    assert out[1]["meta_info"]["cached_tokens"] > 0


def test_new_weights_serve_at_once_and_no_snapshot_of_the_old_ones_is_reused(hybrids, tmp_path):
    """RL: /update_weights_from_disk copies another checkpoint into the live model (the norms'
    and conv's loaders included): the next tokens are the new checkpoint's (snapshots of the old
    weights are never hits), and survive a memory release (the state pool's too) and resume."""
    old, new = hybrids["qwen3_5_moe"], make_tiny_model("qwen3_5_moe", tmp_path / "new", seed=1)
    want = reference(new, PROMPTS)
    llm = LLM(str(old), dtype="float32", max_total_tokens=4096)
    llm.generate(PROMPTS, GREEDY)
    assert llm.update_weights_from_disk(str(new))[0]
    out = llm.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in out] == want
    assert out[0]["meta_info"]["cached_tokens"] == 0  # (the later prompts may hit the new weights' snapshots)
    llm.release_memory_occupation()
    assert llm.runner.states.ssm.untyped_storage().nbytes() == 0  # (the state pool goes with the KV pool)
    llm.resume_memory_occupation()
    assert llm.runner.states.ssm.untyped_storage().nbytes() == llm.runner.states.ssm.numel() * 4
    assert [o["output_ids"] for o in llm.generate(PROMPTS, GREEDY)] == want
    llm.scheduler.check_integrity()


def test_hybrids_refuse_what_they_cannot_do_exactly_yet(hybrids):
    with pytest.raises(ValueError, match="speculative-algorithm.*hybrid"):
        LLM(str(hybrids["qwen3_5"]), dtype="float32", max_total_tokens=1024, speculative_algorithm="NGRAM")


# ---- the scheduler's snapshots, fuzzed ------------------------------------------------------------

EOS, VOCAB = 1, 60


def next_token(seq: tuple[int, ...]) -> int:
    """The fake model: a token that depends on the whole sequence (so on the recurrent state)."""
    h = hash(seq)
    return EOS if h % 37 == 0 else 2 + h % (VOCAB - 2)


class StateExecutor:
    """Each pool row holds the token sequence it has consumed (its "state"): a step checks that a
    request's row holds exactly ``cached_len`` tokens after its loads, feeds it the new tokens and
    samples ``next_token`` of the whole sequence; saves copy rows, as the worker does."""

    def __init__(self, rows: int):
        self.rows: list[tuple[int, ...]] = [()] * rows
        self.last = [0] * rows  # each slot's last sampled token (decode inputs of -1)
        self.launched: deque[ForwardBatch] = deque()

    def launch(self, batch: ForwardBatch) -> None:
        self.launched.append(batch)

    def oldest_done(self) -> bool:
        return True

    def collect(self) -> StepOutput:
        batch = self.launched.popleft()
        for src, dst in zip(batch.state_loads[::2], batch.state_loads[1::2]):
            self.rows[dst] = self.rows[src]
        splits = {s: (dst, n) for s, dst, n in zip(*(batch.state_splits[i::3] for i in range(3)))}
        tokens, row = [], 0
        for slot, cached, new, sample in zip(batch.slots, batch.cached_lens, batch.new_lens, batch.sample):
            state = () if cached == 0 else self.rows[slot]
            assert len(state) == cached, f"slot {slot} holds {len(state)} tokens, the step says {cached}"
            ids = [self.last[slot] if t < 0 else t for t in batch.input_ids[row : row + new]]
            if slot in splits:  # a snapshot part-way through the chunk
                dst, n = splits[slot]
                assert 0 < n < new, "a split inside the chunk"
                self.rows[dst] = state + tuple(ids[:n])
            self.rows[slot] = state + tuple(ids)
            row += new
            if sample:
                self.last[slot] = next_token(self.rows[slot])
                tokens.append(self.last[slot])
        for slot, dst in zip(batch.state_saves[::2], batch.state_saves[1::2]):
            self.rows[dst] = self.rows[slot]
        return StepOutput(tokens=tokens)


def truth(prompt: list[int], n: int) -> list[int]:
    seq, out = tuple(prompt), []
    for _ in range(n):
        out.append(next_token(seq))
        seq += (out[-1],)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_snapshots_always_hold_their_prefix(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4])
    slots = rng.choice([4, 16])
    args = EngineArgs(
        model="",
        page_size=page,
        max_running_requests=slots,
        chunked_prefill_size=rng.choice([page * 4, 32, -1]),
        schedule_policy=rng.choice(["lpm", "fcfs"]),
        disable_overlap_schedule=seed % 2 == 1,
    )
    rows = list(range(slots + 1, 2 * slots + 2)) if seed % 3 else list(range(slots + 1, slots + 4))  # few: eviction
    num_pages = 500 // page
    sched = Scheduler(args, num_pages, 512, VOCAB, [EOS], StateExecutor(2 * slots + 2), snapshot_rows=rows)
    stems = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(5, 80))] for _ in range(4)]
    reqs = []
    for _ in range(250):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(stems)[: rng.randint(1, 80)] + [
                rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 20))
            ]
            if reqs and rng.random() < 0.3:  # the next turn of an earlier conversation
                old = rng.choice(reqs)
                prompt = old.prompt_ids + old.output_ids + [rng.randrange(2, VOCAB) for _ in range(3)]
            params = SamplingParams(max_new_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=rng.random() < 0.5)
            for _ in range(rng.choice([1, 1, 4])):
                if len(prompt) + params.max_new_tokens < 512:
                    reqs.append(sched.add_request(prompt, params))
        if rng.random() < 0.1:
            live = [r for r in reqs if not r.finished]
            if live:
                sched.finish(rng.choice(live), "abort")
        if sched.has_work:
            sched.step()
        sched.check_integrity()
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    assert sched.stats()["prefix_hit_tokens"] > 0
    for r in reqs:
        want = truth(r.prompt_ids, len(r.output_ids))
        assert r.output_ids == want, f"request {r.rid} diverged from its prefix's tokens"
    assert sched.cache.size_info().protected == 0


# ---- the GPU path: flash-linear-attention's kernels against the torch reference ---------------


def varlen_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_indices):
    """flash-linear-attention's varlen chunked forward in the torch reference: each sequence of
    ``cu_seqlens`` from its own initial state, each key head shared by its value heads (and the
    chunk indices checked against the sequences)."""
    assert output_final_state and all(x.is_contiguous() for x in (q, k, v, g, beta))
    bounds = cu_seqlens.tolist()
    chunks = [(i, c) for i, (s, e) in enumerate(zip(bounds, bounds[1:])) for c in range(-(-(e - s) // 64))]
    assert chunk_indices.tolist() == [list(c) for c in chunks]
    ratio = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(ratio, dim=2) * scale, k.repeat_interleave(ratio, dim=2)
    state, out = initial_state.clone(), []
    for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
        out.append(gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state[i : i + 1]))
    return None, torch.cat(out, dim=1), None, state, None, None


def test_a_prefill_step_batches_the_conv_and_runs_a_part_way_snapshot_in_two_passes(monkeypatch):
    """The GPU prefill path over a stand-in for FLA's kernel, from ``StatePool.prepare``: the
    batched conv (``varlen_conv``) and the chunked kernel's two passes for a request saving its
    state part-way give the outputs, states and snapshots of running each request's conv and
    each segment's recurrence one after the other in the torch reference."""
    import sys
    import types

    from minisgl.device.kvcache.state_pool import StatePool, StateShape

    fake = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    fake.chunk_gated_delta_rule_fwd = varlen_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk", fake)
    torch.manual_seed(0)
    hk, hv, dk, dv, width = 1, 2, 8, 8, 3
    channels = 2 * hk * dk + hv * dv
    pool = StatePool(StateShape(1, channels, width, hv, dk, dv), 8, torch.float32, torch.float32, torch.device("cpu"))
    pool.conv.normal_()
    pool.ssm.normal_(std=0.1)
    # Three requests of 10, 81 and 4 tokens in slots 3, 1, 5; slot 1 saves its state after 70 tokens to row 6.
    meta = types.SimpleNamespace(slots=[3, 1, 5], new_lens=[10, 81, 4], cached_lens=[5, 5, 5])
    x, weight = torch.randn(95, channels), torch.randn(channels, width + 1)
    a, b = torch.randn(95, hv), torch.randn(95, hv)
    gates = types.SimpleNamespace(A_log=torch.randn(hv) * 0.3, dt_bias=torch.randn(hv))
    conv, ssm = pool.conv[0].clone(), pool.ssm[0].clone()  # the reference's, request by request
    outs = []
    for slot, (s, n), cut in zip(meta.slots, [(0, 10), (10, 81), (91, 4)], [None, 70, None]):
        heads = [(s, n)] if cut is None else [(s, cut), (s + cut, n - cut)]
        for i, (start, m) in enumerate(heads):
            r = slice(start, start + m)
            mixed = causal_conv(x[r], weight, conv[slot])
            qr, kr, vr = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
            qr = l2norm(qr.reshape(m, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
            kr = l2norm(kr.reshape(m, hk, dk)).repeat_interleave(hv // hk, dim=1)
            g = -gates.A_log.exp() * torch.nn.functional.softplus(a[r] + gates.dt_bias)
            outs.append(
                gated_delta_rule(qr[None], kr[None], vr.reshape(1, m, hv, dv), g[None], b[r].sigmoid()[None],
                                 ssm[slot : slot + 1])[0]
            )  # fmt: skip
            if cut is not None and i == 0:
                conv[6], ssm[6] = conv[slot], ssm[slot]
    pool.prepare(meta, [], splits=[1, 6, 70])
    assert pool.prefill.splits is not None and not pool.decode
    mixed = varlen_conv(x, weight, pool.conv[0], pool.prefill)
    q, k, v = (t.reshape(95, -1, dk).contiguous() for t in mixed.split([hk * dk, hk * dk, hv * dv], dim=-1))
    g = -gates.A_log.exp() * torch.nn.functional.softplus(a + gates.dt_bias)
    o = fla_chunked(l2norm(q), l2norm(k), v, g, b.sigmoid(), pool.ssm[0], pool)
    torch.testing.assert_close(o, torch.cat(outs), rtol=0, atol=1e-5)
    for row in (3, 1, 5, 6):
        torch.testing.assert_close(pool.conv[0, row], conv[row], rtol=0, atol=1e-6)
        torch.testing.assert_close(pool.ssm[0, row], ssm[row], rtol=0, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_fla_kernels_on_cuda_match_the_reference(hybrids, arch):
    """The logits of a prefill step of three prompts on the GPU (FLA's varlen chunked kernel,
    fp32, torch attention) against the CPU's torch reference. FLA multiplies in TF32 and
    autotunes its tiles, so tokens of a random tiny model may split a near-tie either way from
    run to run: logits are compared within TF32's error, not tokens."""
    from minisgl.device.worker.model_runner import ModelRunner
    from tests.helpers import prefill_batch

    prompts = [STEM, STEM[:9] + [90, 91], [4, 4, 8, 200, 17]]
    logits = []
    for device in ("cpu", "cuda"):
        args = EngineArgs(model=str(hybrids[arch]), device=device, dtype="float32", max_total_tokens=4096)
        runner = ModelRunner(args)
        logits.append(runner.forward(prefill_batch(runner, prompts)).float().cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_hybrid_bf16_on_cuda_agrees_with_fp32(tmp_path):
    """bf16 weights with FlashInfer attention (a head size it compiles: 128) and FLA: the first
    tokens agree with the CPU's fp32 ones on most prompts, as the other models' bf16 checks allow."""
    path = make_tiny_model("qwen3_5_moe", tmp_path / "hd128", overrides={"head_dim": 128})
    want = [o["output_ids"] for o in run(path, PROMPTS)]
    out = run(path, PROMPTS, device="cuda", dtype="bfloat16")
    assert sum(o["output_ids"][:4] == w[:4] for o, w in zip(out, want)) >= len(PROMPTS) - 1


@pytest.mark.cuda
def test_hybrid_decode_in_cuda_graphs_equals_eager(tmp_path):
    """Decode steps replayed from CUDA graphs (the state pool's rows stepped in place by slot)
    give the eager steps' tokens, with the radix cache on (a warm prompt's snapshot) and off."""
    path = make_tiny_model("qwen3_5_moe", tmp_path / "hd128", overrides={"head_dim": 128})
    kw = {"device": "cuda", "dtype": "bfloat16", "max_total_tokens": 4096, "disable_piecewise_cuda_graph": True}
    eager = LLM(str(path), disable_cuda_graph=True, **kw)
    want = [o["output_ids"] for o in eager.generate(PROMPTS, GREEDY)]
    del eager
    for radix_off in (False, True):
        llm = LLM(str(path), disable_radix_cache=radix_off, **kw)
        assert llm.runner.graphs is not None and llm.runner.piecewise is None
        llm.generate(PROMPTS[:1], GREEDY)
        assert [o["output_ids"] for o in llm.generate(PROMPTS, GREEDY)] == want
        llm.scheduler.check_integrity()


@pytest.mark.cuda
def test_hybrid_prefill_in_piecewise_graphs_equals_eager(tmp_path):
    """Prefill steps replayed from piecewise graphs (norms, projections, experts) with the conv,
    FLA's recurrence and attention run eagerly between them: the eager prefill's greedy tokens
    under the scheduler, radix on, chunks of 64 and snapshots part-way through them."""
    from tests.test_scheduler import make_llm, shared_prefix_prompts

    path = make_tiny_model("qwen3_5_moe", tmp_path / "hd128", overrides={"head_dim": 128})
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384, page_size=16, chunked_prefill_size=64)
    prompts = shared_prefix_prompts(4, 4, 150)
    turns = [p + list(range(200, 260)) for p in prompts[:4]]
    outs = []
    for piecewise in (False, True):
        llm = make_llm(path, disable_piecewise_cuda_graph=not piecewise, **kw)
        assert (llm.runner.piecewise is not None) == piecewise
        outs.append([r["output_ids"] for r in llm.generate(prompts, GREEDY) + llm.generate(turns, GREEDY)])
        assert llm.scheduler.stats()["prefix_hit_tokens"] > 0
        llm.scheduler.check_integrity()
    same = sum(a == b for a, b in zip(*outs))
    # bf16 GEMMs over a padded row count may round differently: nearly every request agrees.
    assert same >= len(outs[0]) - 2, f"{same} of {len(outs[0])} requests agree"


def test_routed_experts_and_logprobs_of_a_hybrid_moe(hybrids):
    """Qwen3.5-MoE: each position's experts are transformers' router's (every layer sparse), and
    the greedy tokens' logprobs are transformers' log-softmax, with the radix cache on."""
    from transformers import AutoModelForCausalLM

    from tests.test_moe import check_routed_experts

    path = hybrids["qwen3_5_moe"]
    check_routed_experts(path, cached=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_total_tokens=4096)
    llm.generate(PROMPTS[:1], GREEDY)
    for prompt, res in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, top_logprobs=0)):
        seq = prompt + res["output_ids"]
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        got = res["meta_info"]["output_token_logprobs"]
        torch.testing.assert_close(torch.tensor(got), want[range(len(got)), res["output_ids"]], atol=1e-4, rtol=1e-4)
    llm.scheduler.check_integrity()


def test_fp8_quantizes_the_hybrid_projections_and_the_cache_stays_exact(hybrids):
    """--quantization fp8: the Gated DeltaNet and gated-attention projections are fp8 as the MLPs
    are (the small b/a gates stay float), and radix on and off give the same tokens."""
    path = hybrids["qwen3_next"]
    outs = []
    for radix_off in (False, True):
        llm = LLM(str(path), dtype="float32", max_total_tokens=4096, quantization="fp8", disable_radix_cache=radix_off)
        layer = llm.runner.model.model.layers[0]
        assert layer.linear_attn.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn
        assert layer.linear_attn.out_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.linear_attn.in_proj_ba.weight.dtype == torch.float32
        assert llm.runner.model.model.layers[3].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        llm.generate(PROMPTS[:1], GREEDY)
        outs.append([o["output_ids"] for o in llm.generate(PROMPTS, GREEDY)])
        llm.scheduler.check_integrity()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_prefill_through_the_pieces_keeps_tokens(hybrids, arch):
    """Piecewise prefill (eager pieces on CPU, padded to the sizes, each layer's conv and
    recurrence or attention between them): under the scheduler, radix on, chunks of 48 and
    snapshots part-way, the plain engine's greedy tokens, the cache's integrity held."""
    from minisgl.device.worker.piecewise_graph import PiecewiseGraphRunner, token_sizes
    from tests.test_scheduler import make_llm, shared_prefix_prompts

    prompts = shared_prefix_prompts(2, 3, 37)
    prompts += [prompts[0] + [5, 6, 7] * 9, prompts[1] + list(range(40, 70))]  # (extend cached prompts)
    outs, steps = [], []
    for piecewise in (False, True):
        llm = make_llm(hybrids[arch], chunked_prefill_size=48, page_size=4)
        if piecewise:
            llm.runner.piecewise = pieces = PiecewiseGraphRunner(llm.runner, token_sizes(48), capture=False)
            run = pieces.forward
            pieces.forward = lambda batch: steps.append((sum(batch.new_lens), bool(batch.state_splits))) or run(batch)
        outs.append([r["output_ids"] for r in llm.generate(prompts[:6], GREEDY)])
        outs[-1] += [r["output_ids"] for r in llm.generate(prompts[6:], GREEDY)]
        llm.scheduler.check_integrity()
    assert outs[1] == outs[0]
    assert any(n not in token_sizes(48) for n, _ in steps)  # padded steps ran
    assert any(split for _, split in steps)  # and some saved a snapshot part-way
