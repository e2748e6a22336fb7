"""Cascade decode on our Triton kernel (``minisgl.device.kernels.partial_attention``) against the torch
reference: on CPU through Triton's interpreter (when triton is installed), on CUDA for real."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.device.attention.base import AttentionMetadata
from minisgl.device.attention.synthetic import decode_metadata
from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.utils import cdiv
from tests.interpreter import run_interpreted

LAYOUTS = {  # (shared pages at page size 16, member sequence lengths) per group; loose requests
    "even": ([(4, [70, 90, 65]), (3, [50, 49])], [33, 7]),
    "long loose and long own parts": ([(2, [300, 40, 41])], [700, 5]),
    "uneven, a group of one, a long group": ([(6, [100] * 21), (2, [40]), (1, [17, 18, 19, 20])], []),
    "loose first": ([(2, [40, 41])], [64, 64, 3]),
}


def plan_args(
    meta: AttentionMetadata,
    page_size: int,
    group_pages: list[int],
    pad: int = 0,
    lens: np.ndarray | None = None,
    page_lens: np.ndarray | None = None,
) -> tuple:
    """TritonCascade.plan's arguments for ``meta`` with groups reading ``group_pages`` shared pages
    (plus ``pad`` rows of one token on page 0); ``lens`` in place of its lengths, with page lists
    for ``page_lens`` tokens (where rows may grow)."""
    skip = meta.skip_pages(group_pages).tolist() + [0] * pad
    lens = (meta.seq_lens if lens is None else lens).tolist() + [1] * pad
    page_lens = lens if page_lens is None else page_lens.tolist() + [1] * pad
    slots = meta.slots + [0] * pad
    pages = [cdiv(n, page_size) - k for n, k in zip(page_lens, skip)]
    table = torch.from_numpy(meta.page_table_host).to(meta.positions.device)
    own = torch.cat(
        [
            table[s, k : k + p] if i < meta.num_reqs else table[0, :1] * 0
            for i, (s, k, p) in enumerate(zip(slots, skip, pages))
        ]
    )
    leaders = [sum(meta.group_sizes[:g]) for g in range(len(group_pages))]
    shared = torch.cat([table[meta.slots[r], :p] for r, p in zip(leaders, group_pages)] + [table[0, :0]])
    tokens = [n - k * page_size for n, k in zip(lens, skip)]
    return list(meta.group_sizes), list(group_pages), page_size, shared, tokens, own


SPLITS = {  # TritonCascade options: segments of one tile (many resumed mid-segment), or long ones;
    # shared items of 32 or 64 query rows
    "short segments": dict(block_n=16, items_per_sm=1000, min_segment_tokens=16, shared_rows=32),
    "long segments": dict(block_n=16, items_per_sm=1, min_segment_tokens=256, shared_rows=64),
}
# On CUDA also the engine's configuration, with its wider tiles, and shared items of 16 rows (a
# tp rank's default with fewer than 8 KV heads); the interpreter runs only the
# splits above (its numpy sums vary with a tile's rows, which wider tiles expose).
CUDA_SPLITS = {"defaults": {}, "16 rows": dict(shared_rows=16)}


def check(device: str, dtype: torch.dtype, graph: bool) -> None:
    """Every layout at page sizes 1 and 16, with short and long segments: a plain step on the
    kernel and a cascade step both equal the single-level torch reference, and equal each other
    bit for bit. In graph mode, as CUDA graphs run it: captured on another plan with padding
    rows, replayed on this one, over stale states, giving the eager step's bits."""
    from minisgl.device.attention import base
    from minisgl.device.attention.cascade_triton import TritonCascade, header_size
    from minisgl.device.attention.select import create_backend

    torch.manual_seed(0)
    few_rows = base.FEW_ROWS
    hq, hk, dim = (32, 8, 128) if device == "cuda" else (8, 2, 32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        """Bit for bit on the GPU. The interpreter's tile sums are numpy's, whose rounding
        varies with a tile's rows and the numpy build, so there it is a tight tolerance."""
        if device == "cuda":
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=what)

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
            k, v, scale = cache.k_cache(1), cache.v_cache(1), ref_backend.scale
            splits = {**SPLITS, **(CUDA_SPLITS if device == "cuda" else {})}
            # Work lists planned in Python (the engine's few-row steps) and in numpy (larger ones).
            for options, small in [(o, s) for o in splits.values() for s in (few_rows, 0)]:
                base.FEW_ROWS = small
                level = TritonCascade(hq, hk, dim, torch.device(device), **options)
                group_pages = [level.shared_pages(p, page_size) for p in meta.group_pages]
                level.plan(*plan_args(plain_meta, page_size, []), None)  # the same batch as a plain step
                plain = level.forward(q, k, v, scale, ("own", "combine"))
                torch.testing.assert_close(plain.float(), ref, **tol)
                if not graph:
                    level.plan(*plan_args(meta, page_size, group_pages), None)
                    out = level.forward(q, k, v, scale)
                    torch.testing.assert_close(out.float(), ref, **tol)
                    same(out, plain, "a cascade step returns what a plain one does")
                    continue
                size = n + 3
                level.init_cuda_graph(size + 40, meta.page_table_host.shape[1])  # a ladder's larger sizes too
                for stale in (level._acc, level._m, level._l):
                    stale.fill_(float("nan"))  # stale partial states must not leak into rows
                q_buf = torch.cat([q, q[:3]])
                out_buf = torch.zeros(size, hq, dim, dtype=dtype, device=device)
                pair = decode_metadata(page_size, [(64 // page_size, [65] * 2)], [], device)
                level.plan(*plan_args(pair, page_size, pair.group_pages, pad=size - 2), size)
                # laid out for the captured size, not the largest: a small step copies a small header
                end = level.shared.work.data_ptr() + 4 * level.shared.work.numel() - level._header.data_ptr()
                assert end == 4 * header_size(size, level.max_states(size))

                def step():
                    out_buf.copy_(level.forward(q_buf, k, v, scale))

                graph_obj = None
                if device == "cuda":
                    step()  # compile outside the capture
                    graph_obj = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph_obj):
                        step()
                level.plan(*plan_args(meta, page_size, group_pages, pad=3), size)
                graph_obj.replay() if graph_obj is not None else step()
                same(out_buf[:n], plain, "a graph replay returns the eager plain step's bits")
    base.FEW_ROWS = few_rows


def check_gains(device: str, dtype: torch.dtype, graph: bool) -> None:
    """Rows planned at their shortest with room to grow (``extra``), then lengthened on the device
    (``gain``), attend as a plan at their real lengths does: plain and cascade steps, work lists
    from both planners, eager and (on CUDA) replayed from a graph captured on another plan."""
    from minisgl.device.attention import base
    from minisgl.device.attention.cascade_triton import TritonCascade

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    few_rows = base.FEW_ROWS
    hq, hk, dim = (32, 8, 128) if device == "cuda" else (8, 2, 32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for page_size in (1, 16):
        for groups, loose in LAYOUTS.values():
            groups = [(pages * (16 // page_size), lens) for pages, lens in groups]
            cache = MHAKVCache(4096 // page_size + 64, page_size, 2, hk, dim, dtype, torch.device(device))
            cache.buffer.normal_()  # keys past a row's real length would change its output
            k, v = cache.k_cache(1), cache.v_cache(1)
            for cascade in (False, True):
                meta = decode_metadata(page_size, groups, loose, device, cascade=cascade)
                n = meta.num_reqs
                q = torch.randn(n, hq, dim, dtype=dtype, device=device)
                for options, small in [(o, f) for o in SPLITS.values() for f in (few_rows, 0)]:
                    base.FEW_ROWS = small
                    level = TritonCascade(hq, hk, dim, torch.device(device), **options)
                    group_pages = [level.shared_pages(p, page_size) for p in meta.group_pages]
                    longest = meta.seq_lens
                    own = longest - meta.skip_pages(group_pages) * page_size
                    # (some rows planned with no key past their group's shared pages: those shrink)
                    most = np.minimum(rng.integers(0, 6, n), np.minimum(own, longest - 1))
                    gain = rng.integers(0, most + 1)
                    real = longest - most + gain
                    group_pages = level.growing_shared_pages(group_pages, meta.group_sizes, longest - most, page_size)
                    level.plan(*plan_args(meta, page_size, group_pages, lens=real), None)
                    want = level.forward(q, k, v, 0.1)
                    rows = np.flatnonzero(most)
                    tokens = torch.from_numpy(gain[rows]).to(device)
                    shortest = longest - most
                    if not graph:
                        level.plan(
                            *plan_args(meta, page_size, group_pages, lens=shortest, page_lens=longest), None, most
                        )
                        level.gain(rows, tokens)
                        torch.testing.assert_close(level.forward(q, k, v, 0.1), want, **tol)
                        continue
                    size = n + 3
                    level.init_cuda_graph(size + 8, meta.page_table_host.shape[1])
                    q_buf, out_buf = torch.cat([q, q[:3]]), torch.zeros(size, hq, dim, dtype=dtype, device=device)
                    pair = decode_metadata(page_size, [(64 // page_size, [65] * 2)], [], device)
                    level.plan(*plan_args(pair, page_size, pair.group_pages, pad=size - 2), size)

                    def step():
                        out_buf.copy_(level.forward(q_buf, k, v, 0.1))

                    step()
                    graph_obj = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph_obj):
                        step()
                    args = plan_args(meta, page_size, group_pages, pad=3, lens=shortest, page_lens=longest)
                    level.plan(*args, size, np.concatenate([most, [0, 0, 0]]))
                    level.gain(rows, tokens)
                    graph_obj.replay()
                    torch.testing.assert_close(out_buf[:n], want, **tol)
    base.FEW_ROWS = few_rows


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
    from minisgl.device.attention.cascade_triton import own_work, segment_tokens, shared_work
    from minisgl.device.kernels.partial_attention import FINAL, RESUME

    # Segments: the longest request splits into about its share of the items, in whole units.
    assert segment_tokens(np.array([1000] * 64), 64, target_items=66, min_tokens=256) == 1024
    assert segment_tokens(np.array([1025]), 64, target_items=66, min_tokens=128) == 128  # 9 parts
    assert segment_tokens(np.array([1025]), 64, target_items=4, min_tokens=16) == 320  # 4 segments, the last 65 tokens
    assert segment_tokens(np.array([5000, 10, 10]), 16, target_items=4, min_tokens=16) == 1264
    # Groups of 3 and 1 rows sharing 64 and 160 tokens (page 16), tiles of 2 members, segments of 128.
    work = shared_work([3, 1], [64, 160], page_size=16, segment=128, members_per_item=2)
    assert work.tolist() == [
        [0, 2, 0, 64, 0, 0],
        [2, 1, 0, 64, 0, 0],  # group 0: one segment, two tiles
        [3, 1, 4, 128, 0, 0],
        [3, 1, 12, 32, 1, 0],
    ]  # group 1: pages 4-13, two segments
    assert len(shared_work([3], [0], 16, 128, 2)) == 0
    # Own items: rows 0-2 past 64 shared tokens, row 3 past 160, row 4 loose; segments of 128.
    lens = np.array([100, 128, 300, 200, 129])
    shared = np.array([64, 64, 64, 160, 0])
    work, counts = own_work(lens, shared, page_size=16, segment=128)
    assert work.tolist() == [
        [0, 1, 0, 36, 0, RESUME | FINAL],  # one segment: resumes the shared state, writes the output
        [1, 1, 3, 64, 0, RESUME | FINAL],
        [2, 1, 7, 64, 0, RESUME],
        [2, 1, 11, 128, 1, 0],
        [2, 1, 19, 44, 2, 0],  # three segments
        [3, 1, 22, 40, 1, RESUME],  # segment 1 started by the shared level (tokens 128-159)
        [4, 1, 25, 128, 0, 0],
        [4, 1, 33, 1, 1, 0],
    ]
    assert counts.tolist() == [1, 1, 3, 2, 2]
    # A shared part ending on a segment boundary: the own part starts the next segment afresh.
    work, counts = own_work(np.array([300]), np.array([256]), page_size=16, segment=128)
    assert work.tolist() == [[0, 1, 0, 44, 2, 0]] and counts.tolist() == [3]


def test_small_batches_plan_the_numpy_work_lists():
    """``small_work`` (Python, steps of a few rows) gives ``shared_work`` and ``own_work``'s lists,
    and ``segment_tokens`` the same segment from a list as from an array."""
    from minisgl.device.attention.cascade_triton import own_work, segment_tokens, shared_work, small_work

    rng = np.random.default_rng(0)
    for _ in range(300):
        page, unit = int(rng.choice([1, 16])), int(rng.choice([16, 64]))
        rows = int(rng.integers(1, 33))
        sizes = []
        while sum(sizes) < rows and rng.random() < 0.6:
            sizes.append(int(rng.integers(1, rows - sum(sizes) + 1)))
        group_tokens = [int(rng.integers(0, 40)) * unit for _ in sizes]
        shared = [t for t, n in zip(group_tokens, sizes) for _ in range(n)] + [0] * (rows - sum(sizes))
        lens = [s + int(rng.integers(1, 900)) for s in shared]
        segment = segment_tokens(lens, unit, int(rng.integers(1, 200)), int(rng.choice([16, 256])))
        members = int(rng.choice([2, 4, 8]))
        flat, n_shared, counts = small_work(sizes, group_tokens, lens, shared, page, segment, members)
        want_shared = shared_work(sizes, group_tokens, page, segment, members)
        want_own, want_counts = own_work(np.asarray(lens), np.asarray(shared), page, segment)
        assert flat[: 6 * n_shared] == want_shared.ravel().tolist()
        assert flat[6 * n_shared :] == want_own.ravel().tolist()
        assert counts == want_counts.tolist()
    for lens in ([5], [1, 1], [300, 7, 1025], [4096] * 20):
        for target in (1, 7, 66):
            assert segment_tokens(lens, 64, target, 256) == segment_tokens(np.asarray(lens), 64, target, 256)


@pytest.mark.parametrize("graph", [False, True])
def test_triton_interpreter_matches_reference(graph):
    """The kernels' logic on CPU: Triton's interpreter must be switched on before triton loads,
    so it runs in a child process."""
    pytest.importorskip("triton")
    in_interpreter(f"check('cpu', torch.float32, {graph})")


def in_interpreter(call: str) -> None:
    """Run ``call`` (a function of this file) under Triton's interpreter in a child process."""
    imports = "from tests.test_cascade_triton import check, check_gains, patch_interpreter_ranges; import torch"
    run_interpreted(f"{imports}; patch_interpreter_ranges(); {call}")


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True])
def test_triton_cascade_cuda(graph):
    check("cuda", torch.bfloat16, graph)


def test_growing_rows_keep_a_key_past_their_groups_shared_pages():
    from minisgl.device.attention.cascade_triton import TritonCascade

    level = TritonCascade(8, 2, 32, torch.device("cpu"), block_n=16)
    # groups of 2 and 3 rows (page 16, tiles of 16): the first group's shortest row ends on its
    # shared pages' end, the second keeps a key past them
    lens = np.array([64, 70, 100, 90, 95, 5])
    assert level.growing_shared_pages([4, 5], [2, 3], lens, 16) == [3, 5]
    assert level.growing_shared_pages([], [], lens, 16) == []


def test_rows_that_gain_on_the_device_attend_as_planned_at_their_lengths():
    """``TritonCascade.gain`` through Triton's interpreter (a child process, as above)."""
    pytest.importorskip("triton")
    in_interpreter("check_gains('cpu', torch.float32, False)")


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True])
def test_rows_that_gain_on_the_device_attend_as_planned_at_their_lengths_cuda(graph):
    check_gains("cuda", torch.bfloat16, graph)


@pytest.mark.cuda
@pytest.mark.parametrize("hq", [32, 16])  # GQA 4 (the 8B) and 2 (Qwen3-0.6B)
def test_fp8_cascade_steps_in_their_own_stages_give_the_plain_bits(hq):
    """fp8 pages with the engine's fp8 options (GQA 4: 128-key tiles, cascade steps in two
    pipeline stages, plain steps in five; GQA 2: plain steps in two warps; both: cascade steps'
    own level capped at 128 registers; tiles widened in registers): a cascade step returns the
    plain step's bits, and both the torch reference's values."""
    from minisgl.device.attention.cascade_triton import TritonCascade, fp8_page_options
    from minisgl.device.attention.select import create_backend

    torch.manual_seed(0)
    hk, dim, page_size, scales, fp8 = 8, 128, 16, (0.7, 1.3), torch.float8_e4m3fn
    options = fp8_page_options(hq, hk)
    stages = 2 if hq == 32 else 5
    assert options == (
        dict(block_n=128, cascade_num_stages=2, cascade_own_maxnreg=128)
        if hq == 32
        else dict(cascade_own_maxnreg=128, plain_num_warps=2)
    )
    groups, loose = [(16, [300, 400, 257]), (24, [390, 385]), (8, [130] * 9)], [700, 33]
    cache = MHAKVCache(4096 // page_size, page_size, 1, hk, dim, fp8, torch.device("cuda"))
    cache.buffer.copy_(torch.randn(cache.buffer.shape, device="cuda").to(fp8))
    cache.scales = [scales]
    k, v = cache.k_cache(0), cache.v_cache(0)
    plain_meta = decode_metadata(page_size, groups, loose, "cuda", cascade=False)
    meta = decode_metadata(page_size, groups, loose, "cuda")
    q = torch.randn(meta.num_reqs, hq, dim, dtype=torch.bfloat16, device="cuda")
    ref_backend = create_backend("torch", cache, hq, hk, dim, dtype=torch.bfloat16)
    ref_backend.prepare(plain_meta)
    ref = ref_backend.forward(q, 0).float()
    level = TritonCascade(hq, hk, dim, torch.device("cuda"), **options)
    level.plan(*plan_args(plain_meta, page_size, []), None)
    plain = level.forward(q, k, v, ref_backend.scale, ("own", "combine"), scales)
    group_pages = [level.shared_pages(p, page_size) for p in meta.group_pages]
    assert all(group_pages)  # every group has a shared level
    level.plan(*plan_args(meta, page_size, group_pages), None)
    out = level.forward(q, k, v, ref_backend.scale, kv_scales=scales)
    assert level.own.launch["num_stages"] == stages and level.own.launch["maxnreg"] == 128
    assert level.own_launches[False]["num_stages"] == 5 and "maxnreg" not in level.own_launches[False]
    assert level.own_launches[False]["num_warps"] == (4 if hq == 32 else 2)
    assert torch.equal(out, plain)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_page_lists_are_cut_on_the_host_like_slices():
    """The backend's page lists (``FlashInferBackend._page_indices``, numpy on the page table's
    host copy) equal the rows' slices concatenated, empty runs and all."""
    from minisgl.device.attention.flashinfer_backend import FlashInferBackend

    rng = np.random.default_rng(0)
    table = rng.integers(0, 1 << 20, size=(400, 30), dtype=np.int32)
    for n in (1, 25, 300):  # slices in Python up to FEW_ROWS rows, numpy past it
        rows = rng.permutation(400)[:n]
        first = rng.integers(0, 10, size=n)
        counts = rng.integers(0, 21, size=n)
        counts[[0, n // 2]] = 0 if n > 1 else counts[[0, 0]]
        got = FlashInferBackend._page_indices(table, rows, first, counts)
        want = np.concatenate([table[r, f : f + c] for r, f, c in zip(rows, first, counts)])
        assert got.dtype == np.int32 and np.array_equal(got, want)
    assert FlashInferBackend._page_indices(table, [], [], []).shape == (0,)
