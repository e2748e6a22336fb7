"""Cascade decode on our Triton kernel (``minisgl.kernels.partial_attention``) against the torch
reference: on CPU through Triton's interpreter (when triton is installed), on CUDA for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl.attention.base import AttentionMetadata
from minisgl.attention.synthetic import decode_metadata
from minisgl.kvcache import MHAKVCache
from minisgl.utils import cdiv

LOG2E = 1.4426950408889634
LAYOUTS = {  # (shared pages at page size 16, member sequence lengths) per group; loose requests
    "even": ([(4, [70, 90, 65]), (3, [50, 49])], [33, 7]),
    "long loose and long own parts": ([(2, [300, 40, 41])], [700, 5]),
    "uneven, a group of one, a long group": ([(6, [100] * 21), (2, [40]), (1, [17, 18, 19, 20])], []),
    "loose first": ([(2, [40, 41])], [64, 64, 3]),
}


CHUNK = 32  # small chunks, so the layouts' short prefixes span several


def own_level(backend, q: torch.Tensor, meta: AttentionMetadata, layer: int, skip: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request over its pages past its first ``skip`` ones: (out, base-2 lse)."""
    parts = [backend._attend(q[i : i + 1], *backend._gather(layer, slot, skip[i], total), None)
             for i, (slot, total) in enumerate(zip(meta.slots, meta.seq_lens))]
    return torch.cat([o for o, _ in parts]).to(q.dtype), torch.cat([s for _, s in parts]) * LOG2E


def plan_args(meta: AttentionMetadata, page_size: int, group_pages: list[int], pad: int = 0) -> tuple:
    """TritonCascade.plan's arguments for ``meta`` with groups reading ``group_pages`` shared pages
    (plus ``pad`` rows of one token on page 0)."""
    skip = meta.skip_pages(group_pages) + [0] * pad
    lens = meta.seq_lens + [1] * pad
    slots = meta.slots + [0] * pad
    pages = [cdiv(n, page_size) - k for n, k in zip(lens, skip)]
    own = torch.cat([meta.page_table[s, k : k + p] if i < meta.num_reqs else meta.page_table[0, :1] * 0
                     for i, (s, k, p) in enumerate(zip(slots, skip, pages))])
    leaders = [sum(meta.group_sizes[:g]) for g in range(len(group_pages))]
    shared = torch.cat([meta.page_table[meta.slots[r], :p] for r, p in zip(leaders, group_pages)]
                       + [meta.page_table[0, :0]])
    tokens = [n - k * page_size for n, k in zip(lens, skip)]
    return list(meta.group_sizes), list(group_pages), page_size, shared, (tokens, pages, own)


def check(device: str, dtype: torch.dtype, graph: bool) -> None:
    """Every layout at page sizes 1 and 16, groups' pages in up to 8 items or one, free or chunked
    splits, the own level here or given: the two levels equal the single-level torch reference,
    and chunked with the own level here they equal a plain step on the kernel bit for bit. In
    graph mode, as CUDA graphs run it:
    captured on another plan with padding rows, replayed on this one."""
    from minisgl.attention import create_backend
    from minisgl.attention.cascade_triton import TritonCascade

    torch.manual_seed(0)
    hq, hk, dim = (32, 8, 128) if device == "cuda" else (8, 2, 32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for page_size in (1, 16):
        for groups, loose in LAYOUTS.values():
            groups = [(pages * (16 // page_size), lens) for pages, lens in groups]
            cache = MHAKVCache(4096 // page_size + 64, page_size, 2, hk, dim, dtype, torch.device(device))
            cache.buffer.normal_()
            ref_backend = create_backend("torch", cache, hq, hk, dim)
            n = sum(len(lens) for _, lens in groups) + len(loose)
            q = torch.randn(n, hq, dim, dtype=dtype, device=device)
            plain_meta = decode_metadata(page_size, groups, loose, device, cascade=False)
            ref_backend.prepare(plain_meta)
            ref = ref_backend.forward(q, 1).float()
            meta = decode_metadata(page_size, groups, loose, device)
            for items, chunk in ((1000, CHUNK), (16, None), (1, CHUNK)):  # many items over a group's pages to one
                plain_out = None
                for own_here in (True, False):
                    level = TritonCascade(hq, hk, dim, torch.device(device), items_per_sm=items, block_n=16,
                                          own_block_n=16, own_level=own_here, chunk_tokens=chunk)
                    group_pages = [level.shared_pages(p, page_size) for p in meta.group_pages]
                    own_out, own_lse = own_level(ref_backend, q, meta, 1, meta.skip_pages(group_pages))
                    k, v = cache.k_cache(1), cache.v_cache(1)
                    if not graph:
                        if own_here:  # the same batch as a plain step: no groups, every chunk at the own level
                            level.plan(*plan_args(plain_meta, page_size, []), None)
                            level.run_own(q, k, v, ref_backend.scale)
                            plain_out = torch.empty_like(q)
                            level.combine(plain_out)
                        sizes, pages, ps, shared, own = plan_args(meta, page_size, group_pages)
                        level.plan(sizes, pages, ps, shared, own if own_here else None, None)
                        level.run_shared(q, k, v, ref_backend.scale)
                        out, lse = (torch.empty_like(q), None) if own_here else (own_out.clone(), own_lse)
                        if own_here:
                            level.run_own(q, k, v, ref_backend.scale)
                        level.combine(out, lse)
                        torch.testing.assert_close(out.float(), ref, **tol)
                        if own_here and chunk:
                            assert torch.equal(out, plain_out), "a cascade step returns what a plain one does"
                        continue
                    size = n + 3
                    level.init_cuda_graph(size, meta.page_table.shape[1])
                    level._part_o.fill_(float("nan"))  # stale partial states must not leak into rows
                    q_buf = torch.cat([q, q[:3]])
                    out_buf = torch.zeros(size, hq, dim, dtype=dtype, device=device)
                    lse_buf = torch.zeros(size, hq, device=device)
                    pair = decode_metadata(page_size, [(CHUNK // page_size, [CHUNK + 1] * 2)], [], device)
                    capture = plan_args(pair, page_size, pair.group_pages, pad=size - 2)
                    level.plan(*capture[:4], capture[4] if own_here else None, size)

                    def step():
                        level.run_shared(q_buf, k, v, ref_backend.scale)
                        if own_here:
                            level.run_own(q_buf, k, v, ref_backend.scale)
                        level.combine(out_buf, None if own_here else lse_buf)

                    graph_obj = None
                    if device == "cuda":
                        step()  # compile outside the capture
                        graph_obj = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph_obj):
                            step()
                    sizes, pages, ps, shared, own = plan_args(meta, page_size, group_pages, pad=3)
                    level.plan(sizes, pages, ps, shared.clone(), own if own_here else None, size)
                    padding = torch.randn(3, hq, dim, dtype=dtype, device=device)
                    out_buf.copy_(torch.cat([own_out, padding]))
                    lse_buf.copy_(torch.cat([own_lse, torch.randn(3, hq, device=device)]))
                    graph_obj.replay() if graph_obj is not None else step()
                    torch.testing.assert_close(out_buf[:n].float(), ref, **tol)
                    if not own_here:
                        assert torch.equal(out_buf[n:], padding), "rows outside groups keep the own level's state"


def patch_interpreter_ranges() -> None:
    """Triton 3.6's interpreter runs ``tl.range`` as Python's ``range``, which numpy 2 refuses
    for the one-element arrays that stand for loaded scalars: unwrap them first."""
    import triton.language as tl
    from triton.runtime import interpreter

    def scalar(x):
        return int(x.handle.data.item()) if isinstance(x, tl.tensor) else x

    original = interpreter._patch_lang_core

    def patched(lang, scope):
        original(lang, scope)
        ranged = lang.range
        scope.set_attr(lang, "range", lambda *a, **kw: ranged(*map(scalar, a), **{k: scalar(v) for k, v in kw.items()}))

    interpreter._patch_lang_core = patched


def test_work_lists():
    from minisgl.attention.cascade_triton import MAX_SPLITS, own_work, shared_work

    free = dict(unit_pages=1, unit_tokens=16, chunked=False)  # page size 16, split anywhere
    # 3 tiles, about 9 items wanted: 3 splits a group, but none under 4 pages.
    work, states = shared_work([3, 1], [10, 100], members_per_tile=2, target_items=9, min_split_units=4, **free)
    rows = [tuple(r) for r in work.tolist()]
    # Group 0: tiles of 2 and 1 member, pages 0-9 in runs of 4, 4, 2 (tokens, 16 per page), one slot each.
    assert rows[:6] == [(0, 2, 0, 64, 0), (0, 2, 4, 64, 1), (0, 2, 8, 32, 2),
                        (2, 1, 0, 64, 0), (2, 1, 4, 64, 1), (2, 1, 8, 32, 2)]
    # Group 1: 100 pages in runs of 34, 34, 32.
    assert rows[6:] == [(3, 1, 10, 34 * 16, 0), (3, 1, 44, 34 * 16, 1), (3, 1, 78, 32 * 16, 2)]
    assert states.tolist() == [3, 3, 3, 3]
    # Many tiles: no splits; a huge target: at most MAX_SPLITS; no pages: no items.
    assert shared_work([1] * 40, [8] * 40, members_per_tile=2, target_items=9, min_split_units=1, **free)[1].tolist() == [1] * 40
    assert shared_work([1], [100], members_per_tile=2, target_items=1000, min_split_units=1, **free)[1].tolist() == [MAX_SPLITS]
    assert len(shared_work([3], [0], members_per_tile=2, target_items=9, min_split_units=1, **free)[0]) == 0
    own, counts = own_work([5, 17, 1], [1, 2, 1], [3, 8, 0], target_items=1, min_split_units=4, **free)
    assert own.tolist() == [[0, 1, 0, 5, 3], [1, 1, 1, 17, 8], [2, 1, 3, 1, 0]] and counts.tolist() == [1, 1, 1]
    # A long request among short ones splits into runs of whole pages (the last one partial).
    own, counts = own_work([20, 100, 3], [2, 7, 1], [0, 0, 2], target_items=5, min_split_units=2, **free)
    assert own.tolist() == [[0, 1, 0, 20, 0], [1, 1, 2, 48, 0], [1, 1, 5, 48, 1], [1, 1, 8, 4, 2],
                            [2, 1, 9, 3, 2]] and counts.tolist() == [1, 3, 1]
    # A run just past the target length stays whole rather than leaving a one-page tail.
    assert own_work([17 * 16], [17], [0], target_items=1, min_split_units=16, **free)[1].tolist() == [1]

    # Chunked (chunks of 2 pages, 32 tokens): runs of whole chunks, a state per chunk, slots numbered by chunk.
    chunked = dict(unit_pages=2, unit_tokens=32, chunked=True)
    work, states = shared_work([3, 1], [5, 50], members_per_tile=2, target_items=9, min_split_units=1, **chunked)
    assert [tuple(r) for r in work.tolist()] == [
        (0, 2, 0, 64, 0), (0, 2, 4, 64, 2), (0, 2, 8, 32, 4), (2, 1, 0, 64, 0), (2, 1, 4, 64, 2), (2, 1, 8, 32, 4),
        (3, 1, 10, 17 * 32, 0), (3, 1, 44, 17 * 32, 17), (3, 1, 78, 16 * 32, 34)]
    assert states.tolist() == [5, 5, 5, 50]
    # Own parts start at the chunk after the group's: 300 tokens from chunk 0 in runs of 4 chunks.
    own, counts = own_work([20, 300, 3], [2, 19, 1], [0, 0, 2], target_items=4, min_split_units=1, **chunked)
    assert own.tolist() == [[0, 1, 0, 20, 0], [1, 1, 2, 128, 0], [1, 1, 10, 128, 4], [1, 1, 18, 44, 8],
                            [2, 1, 21, 3, 2]] and counts.tolist() == [1, 10, 1]


@pytest.mark.parametrize("graph", [False, True])
def test_triton_interpreter_matches_reference(graph):
    """The kernels' logic on CPU: Triton's interpreter must be switched on before triton loads,
    so it runs in a child process."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    code = ("from tests.test_cascade_triton import check, patch_interpreter_ranges; import torch; "
            f"patch_interpreter_ranges(); check('cpu', torch.float32, {graph})")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True])
def test_triton_cascade_cuda(graph):
    check("cuda", torch.bfloat16, graph)
