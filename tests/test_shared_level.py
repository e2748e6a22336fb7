"""The Triton shared level (``minisgl.kernels.shared_level``) against the torch reference: on
CPU through Triton's interpreter (when triton is installed), on CUDA for real."""

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

LOG2E = 1.4426950408889634
LAYOUTS = {  # (shared pages at page size 16, member sequence lengths) per group; loose requests
    "even": ([(4, [70, 90, 65]), (3, [50, 49])], [33, 7]),
    "uneven, a group of one, a long group": ([(6, [100] * 21), (2, [40]), (1, [17, 18, 19, 20])], []),
    "loose first": ([(2, [40, 41])], [64, 64, 3]),
}


def own_level(backend, q: torch.Tensor, meta: AttentionMetadata, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request over its pages past its group's shared ones: (out, base-2 lse)."""
    skip = meta.skip_pages()
    parts = [backend._attend(q[i : i + 1], *backend._gather(layer, slot, skip[i], total), None)
             for i, (slot, total) in enumerate(zip(meta.slots, meta.seq_lens))]
    return torch.cat([o for o, _ in parts]).to(q.dtype), torch.cat([s for _, s in parts]) * LOG2E


def check(device: str, dtype: torch.dtype, graph: bool) -> None:
    """Every layout at page sizes 1 and 16, splits of 16 to 4096 tokens: the two levels with the
    Triton shared level equal the single-level torch reference."""
    from minisgl.attention import create_backend
    from minisgl.attention.cascade_triton import TritonSharedLevel

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
            ref_backend.prepare(decode_metadata(page_size, groups, loose, device, cascade=False))
            ref = ref_backend.forward(q, 1).float()
            meta = decode_metadata(page_size, groups, loose, device)
            ref_backend.prepare(meta)
            for split in (16, 64, 4096):
                level = TritonSharedLevel(hq, hk, dim, torch.device(device), split_tokens=split, block_n=16)
                pages = meta.group_pages
                leaders = torch.tensor([sum(meta.group_sizes[:g]) for g in range(len(pages))])
                indices = torch.cat([meta.page_table[int(r), :p] for r, p in zip(leaders, pages)])
                own_out, own_lse = own_level(ref_backend, q, meta, 1)
                if not graph:
                    level.plan(list(meta.group_sizes), list(pages), page_size, indices, None)
                    level.run(q, cache.k_cache(1), cache.v_cache(1), ref_backend.scale)
                    level.combine(own_out, own_lse)
                    torch.testing.assert_close(own_out.float(), ref, **tol)
                    continue
                # As CUDA graphs run it: captured on another plan (one pair sharing page 0) with
                # three padding rows, replayed on this one; stale partials must not leak.
                size = n + 3
                level.init_cuda_graph(size, meta.page_table.shape[1])
                level._part_o.fill_(float("nan"))
                q_buf = torch.cat([q, q[:3]])
                out_buf = torch.zeros(size, hq, dim, dtype=dtype, device=device)
                lse_buf = torch.zeros(size, hq, device=device)
                level.plan([2], [1], page_size, torch.zeros(1, dtype=torch.int32, device=device), size)

                def step():
                    level.run(q_buf, cache.k_cache(1), cache.v_cache(1), ref_backend.scale)
                    level.combine(out_buf, lse_buf)

                graph_obj = None
                if device == "cuda":
                    step()  # compile outside the capture
                    graph_obj = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph_obj):
                        step()
                level.plan(list(meta.group_sizes), list(pages), page_size, indices.clone(), size)
                padding = torch.randn(3, hq, dim, dtype=dtype, device=device)
                out_buf.copy_(torch.cat([own_out, padding]))
                lse_buf.copy_(torch.cat([own_lse, torch.randn(3, hq, device=device)]))
                graph_obj.replay() if graph_obj is not None else step()
                torch.testing.assert_close(out_buf[:n].float(), ref, **tol)
                assert torch.equal(out_buf[n:], padding), "rows outside groups keep the own level's output"


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


def test_work_list():
    from minisgl.attention.cascade_triton import MAX_SPLITS, work_list

    work, splits = work_list([3, 1], [10, 100], members_per_tile=2, split_pages=4)
    rows = [tuple(r) for r in work.tolist()]
    # Group 0: tiles of 2 and 1 member, pages 0-9 in runs of 4, 4, 2.
    assert rows[:6] == [(0, 2, 0, 4, 0), (0, 2, 4, 4, 1), (0, 2, 8, 2, 2), (2, 1, 0, 4, 0), (2, 1, 4, 4, 1), (2, 1, 8, 2, 2)]
    # Group 1: 100 pages at most MAX_SPLITS runs.
    g1 = rows[6:]
    assert len(g1) == MAX_SPLITS and sum(r[3] for r in g1) == 100 and g1[0][2] == 10
    assert splits.tolist() == [3, 3, 3, MAX_SPLITS]


@pytest.mark.parametrize("graph", [False, True])
def test_triton_interpreter_matches_reference(graph):
    """The kernel's logic on CPU: Triton's interpreter must be switched on before triton loads,
    so it runs in a child process."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    code = ("from tests.test_shared_level import check, patch_interpreter_ranges; import torch; "
            f"patch_interpreter_ranges(); check('cpu', torch.float32, {graph})")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True])
def test_triton_shared_level_cuda(graph):
    check("cuda", torch.bfloat16, graph)
