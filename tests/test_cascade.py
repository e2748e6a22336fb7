"""Cascade decode: two-level attention equals single-level, groups come from the radix tree,
and the engine's tokens do not change with it (CPU, fp32, torch reference backend)."""

from __future__ import annotations

import pytest
import torch

from minisgl.device.attention.select import create_backend
from minisgl.device.attention.synthetic import decode_metadata, mixed_metadata, prefill_metadata
from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.serve.scheduler import cascade
from minisgl.wire.sampling import SamplingParams
from tests.test_scheduler import make_llm, shared_prefix_prompts, tokens

LAYOUTS = {
    "even": ([(4, [70, 90, 65]), (3, [50, 49])], [33, 7]),
    "uneven, a group of one": ([(6, [100] * 7), (2, [40]), (1, [17, 18, 19, 20])], []),
    "no loose requests": ([(5, [81, 82])], []),
    "loose first-page sharers": ([(2, [40, 41])], [64, 64, 3]),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_level_equals_single_level(page_size, layout):
    torch.manual_seed(0)
    groups, loose = LAYOUTS[layout]
    # Shared pages are given for page size 16; at page size 1 the same tokens span 16x the pages.
    scale = 16 // page_size
    groups = [(pages * scale, lens) for pages, lens in groups]
    hq, hk, dim = 8, 2, 32
    cache = MHAKVCache(2048, page_size, 2, hk, dim, torch.float32, torch.device("cpu"))
    cache.buffer.normal_()
    backend = create_backend("torch", cache, hq, hk, dim)
    q = torch.randn(sum(len(lens) for _, lens in groups) + len(loose), hq, dim)
    outs = []
    for two_level in (True, False):
        backend.prepare(decode_metadata(page_size, groups, loose, "cpu", cascade=two_level))
        outs.append(backend.forward(q, layer_id=1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    # The batched (padded) decode path against one request at a time.
    torch.testing.assert_close(outs[1], backend._forward_each(q, layer_id=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_step_equals_its_parts(page_size):
    """A mixed step's attention (prefill rows, then decode rows in cascade groups) equals each
    part as a step of its own; rows past the step's (piecewise graphs' padding) stay untouched."""
    torch.manual_seed(0)
    hq, hk, dim = 8, 2, 32
    cache = MHAKVCache(4096, page_size, 2, hk, dim, torch.float32, torch.device("cpu"))
    cache.buffer.normal_()
    backend = create_backend("torch", cache, hq, hk, dim)
    scale = 16 // page_size
    prefill = prefill_metadata(page_size, [0, 37, 300], [45, 129, 260], 1024, "cpu")
    decode = decode_metadata(page_size, [(4 * scale, [70, 90, 65]), (2 * scale, [40, 41])], [33], "cpu", 1024)
    mixed = mixed_metadata(prefill, decode)
    tokens, head = sum(mixed.new_lens), sum(prefill.new_lens)
    q = torch.randn(tokens + 5, hq, dim)
    out = torch.zeros_like(q)
    backend.prepare(mixed)
    backend.forward(q, 1, out)
    backend.prepare(prefill)
    alone = [backend.forward(q[:head], 1)]
    backend.prepare(decode)
    alone.append(backend.forward(q[head:tokens], 1))
    torch.testing.assert_close(out[:tokens], torch.cat(alone), atol=1e-5, rtol=1e-5)
    assert not out[tokens:].any()


def spy_groups(llm) -> list[tuple[list[int], list[int], int]]:
    """Record the cascade groups and size of every batch the runner launches."""
    seen, launch = [], llm.runner.launch

    def spying(batch):
        seen.append((list(batch.group_sizes), list(batch.group_pages), len(batch.slots)))
        launch(batch)

    llm.runner.launch = spying
    return seen


def test_groups_follow_the_radix_tree(tiny_llama, cheap_cascade):
    page = 4
    prompts = shared_prefix_prompts(groups=3, per_group=4, prefix_len=21, seed=3)
    llm = make_llm(tiny_llama, page_size=page)
    seen = spy_groups(llm)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    decode = [g[:2] for g in seen if g[0]]
    assert decode, "no decode step carried cascade groups"
    # Once all are decoding: three groups of four, each sharing the 20-token page-aligned prefix.
    assert ([4, 4, 4], [5, 5, 5]) in decode
    for sizes, pages in decode:
        assert all(n >= 2 for n in sizes) and all(p >= 1 for p in pages)


def test_cost_rule_drops_groups_that_do_not_pay(tiny_llama):
    prompts = shared_prefix_prompts(groups=2, per_group=3, prefix_len=21, seed=4)
    llm = make_llm(tiny_llama, page_size=4)
    seen = spy_groups(llm)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert seen and not any(sizes for sizes, _, _ in seen), "20 shared tokens are below the measured minimum"


def test_no_groups_on_cpu_by_default(tiny_llama, monkeypatch):
    """The cost rule was fitted on the H100; on CPU the two-level path is slower than plain
    decode, so a CPU engine forms no groups however much its requests share."""
    monkeypatch.setattr(cascade, "MIN_GROUP_SIZE", 2)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(cascade, "MIN_SAVED_SHARE", 0)
    monkeypatch.setattr(cascade, "MIN_BATCH", 1)
    llm = make_llm(tiny_llama, page_size=4)
    seen = spy_groups(llm)
    llm.generate(
        shared_prefix_prompts(groups=2, per_group=4, prefix_len=41, seed=6),
        SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
    )
    assert seen and not any(sizes for sizes, _, _ in seen)
    assert llm.scheduler.stats()["cascade_steps"] == 0


def test_cost_rule_weighs_saved_reads_against_the_batch(tiny_llama, monkeypatch):
    """Groups run as a cascade only when they skip MIN_SAVED_SHARE of the step's KV reads: the
    same groups beside long requests of their own do not."""
    import random

    monkeypatch.setattr(cascade, "MIN_GROUP_SIZE", 2)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(cascade, "MIN_BATCH", 1)
    monkeypatch.setattr(cascade, "ON_CPU", True)
    grouped = shared_prefix_prompts(groups=2, per_group=4, prefix_len=41, seed=6)
    rng = random.Random(1)
    long_alone = [[rng.randrange(3, 1000) for _ in range(300)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    ran = {}
    for name, prompts in (("groups only", grouped), ("with long requests", grouped + long_alone)):
        llm = make_llm(tiny_llama, page_size=4)
        seen = spy_groups(llm)
        llm.generate(prompts, params)
        ran[name] = any(sizes for sizes, _, n in seen if n == len(prompts))
    assert ran == {"groups only": True, "with long requests": False}


@pytest.mark.parametrize("page_size,prefix_len,pool", [(1, 37, 16384), (16, 37, 16384), (4, 40, 400)])
def test_cascade_tokens_equal_plain(tiny_llama, cheap_cascade, page_size, prefix_len, pool):
    """Greedy tokens with cascade on equal cascade off; the small pool forces retraction and
    eviction between steps, so groups change while requests come and go."""
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=prefix_len, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    kw = dict(page_size=page_size, max_total_tokens=pool, chunked_prefill_size=128)
    plain = tokens(make_llm(tiny_llama, disable_cascade_attention=True, **kw).generate(prompts, params))
    llm = make_llm(tiny_llama, **kw)
    seen = spy_groups(llm)
    assert tokens(llm.generate(prompts, params)) == plain
    assert any(sizes for sizes, _, _ in seen), "cascade never ran"
    if pool < 1000:
        assert llm.scheduler.stats()["retractions"] > 0


# ---- CUDA: FlashInfer's two levels against its single level and the torch reference ----------


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=["8b", "smollm2"])
def test_flashinfer_cascade_matches_plain(page_size, layout, graph, heads):
    """bf16, the 8B and SmolLM2 head shapes; plain steps on FlashInfer's decode and on our kernel
    (the default), cascade steps; in graph mode the batch has padded rows, as CUDA graphs run it."""
    torch.manual_seed(0)
    groups, loose = LAYOUTS[layout]
    # 256 more shared tokens: the shared level reads whole 64-token tiles of a prefix.
    groups = [((pages + 16) * (16 // page_size), [n + 256 for n in lens]) for pages, lens in groups]
    hq, hk, dim = heads
    cache = MHAKVCache(2048, page_size, 2, hk, dim, torch.bfloat16, torch.device("cuda"))
    cache.buffer.normal_()
    n = sum(len(lens) for _, lens in groups) + len(loose)
    q = torch.randn(n, hq, dim, dtype=torch.bfloat16, device="cuda")
    outs = {}
    for name, two_level in (
        ("torch", False),
        ("flashinfer decode", False),
        ("flashinfer", False),
        ("flashinfer", True),
    ):
        if name == "flashinfer decode":
            backend = create_backend("flashinfer", cache, hq, hk, dim, decode_backend="flashinfer")
        else:
            backend = create_backend(name, cache, hq, hk, dim)
        meta = decode_metadata(page_size, groups, loose, "cuda", cascade=two_level)
        size = None
        if graph and name != "torch":
            size = n + 3  # three padding rows reading page 0
            pad = dict(slots=meta.slots + [0] * 3, cached_lens=meta.cached_lens + [0] * 3, new_lens=[1] * size)
            meta.slots, meta.cached_lens, meta.new_lens = pad["slots"], pad["cached_lens"], pad["new_lens"]
            backend.init_cuda_graph(size, meta.page_table_host.shape[1])
        backend.prepare(meta, graph_batch_size=size)
        qq = torch.cat([q, torch.randn(3, hq, dim, dtype=q.dtype, device="cuda")]) if size else q
        outs[name, two_level] = backend.forward(qq, 1)[:n].float()
    ref = outs["torch", False]
    for key in [("flashinfer decode", False), ("flashinfer", False), ("flashinfer", True)]:
        torch.testing.assert_close(outs[key], ref, atol=2e-2, rtol=2e-2)
    # A plain decode step on our kernel returns exactly what the cascade does (FlashInfer's plain
    # decode differs from either in about half the outputs).
    assert torch.equal(outs["flashinfer", False], outs["flashinfer", True])


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_greedy_tokens_on_bf16(tmp_path, cheap_cascade, page_size):
    """64 shared-prefix requests (shared parts not page-aligned) through graphs and overlap,
    cascade on and off in bf16, against an fp32 run of the same checkpoint. The tiny model's
    random weights leave near-ties in its logits that bf16 rounding flips, so the bar is bf16's
    own noise: cascade must agree with fp32 about as often as the plain bf16 path does."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = shared_prefix_prompts(groups=6, per_group=11, prefix_len=300, seed=7)[:64]
    params = [SamplingParams(temperature=0.0, max_new_tokens=8 + i % 9, ignore_eos=True) for i in range(64)]
    outs = {}
    for name, kw in {
        "fp32": dict(dtype="float32", attention_backend="torch", disable_cascade_attention=True),
        "plain flashinfer": dict(
            dtype="bfloat16", disable_cascade_attention=True, decode_attention_backend="flashinfer"
        ),
        "plain": dict(dtype="bfloat16", disable_cascade_attention=True),
        "cascade": dict(dtype="bfloat16"),
    }.items():
        llm = LLM(
            str(path),
            device="cuda",
            max_total_tokens=16384,
            max_running_requests=64,
            page_size=page_size,
            cuda_graph_max_bs=32,
            **kw,
        )
        seen = spy_groups(llm)
        outs[name] = tokens(llm.generate(prompts, params))
        llm.scheduler.check_integrity()
        if name.startswith("cascade"):
            ran = [n for sizes, _, n in seen if sizes]
            assert any(n <= 32 for n in ran) and any(n > 32 for n in ran), "cascade ran in graphs and eagerly"

    def agree(a: str, b: str) -> tuple[int, list[tuple[int, int]]]:
        pairs = list(zip(outs[a], outs[b]))
        first = [
            (i, next(j for j, (x, y) in enumerate(zip(u, v)) if x != y)) for i, (u, v) in enumerate(pairs) if u != v
        ]
        return 64 - len(first), first

    report = {k: agree(*k) for k in [("cascade", "plain"), ("plain flashinfer", "fp32"), ("cascade", "fp32")]}
    for (a, b), (same, first) in report.items():
        print(f"page {page_size}: {a} vs {b}: {same}/64 identical; first divergences (request, token): {first}")
    assert report["cascade", "fp32"][0] >= report["plain flashinfer", "fp32"][0] - 4
    assert report["cascade", "plain"][0] == 64  # one kernel, one pass per request: a cascade step changes no bit
