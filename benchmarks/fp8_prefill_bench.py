"""Prefill attention over an fp8 (e4m3) KV cache: FlashInfer's paged prefill reading the fp8
pages (its fa2 kernels: its fa3 ones take fp8 only with an fp8 query) against widening the
pages a chunk reads into a bf16 scratch first (``kernels.fp8.widen_pages``) and running the bf16
kernels (fa3 on the H100), as ``attention.flashinfer_backend`` does for large chunks.

Cases are prefill chunks: requests x new tokens on top of a cached prefix, requests in groups
sharing their prefix pages (as a radix hit gives them). Times are per layer (CUDA events over
repeated calls), the scratch path with its widening included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402


def chunk(reqs: int, new: int, prefix: int, groups: int, page: int, heads: tuple[int, int, int]):
    """Page lists of ``reqs`` requests in ``groups`` sharing ``prefix`` tokens, each with ``new``
    own tokens: (kv_indptr, indices, last_page_len, qo_indptr, pages in the pool)."""
    hq, hk, dim = heads
    prefix_pages, own_pages = prefix // page, -(-new // page)
    shared = [np.arange(g * prefix_pages, (g + 1) * prefix_pages) for g in range(groups)]
    base = groups * prefix_pages
    rows = [np.concatenate([shared[r % groups], base + r * own_pages + np.arange(own_pages)]) for r in range(reqs)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    last = np.full(reqs, new - (own_pages - 1) * page, dtype=np.int32)
    qo = (np.arange(reqs + 1) * new).astype(np.int32)
    return indptr, np.concatenate(rows).astype(np.int32), last, qo, base + reqs * own_pages


def timed(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    import flashinfer

    from minisgl.device.kernels.fp8 import widen_pages

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HK", "D"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--cases",
        nargs="+",
        default=[
            "64x128x2048x4",
            "1x8192x0x1",
            "1x8192x24576x1",
            "4x512x0x4",
            "1x128x0x1",
            "1x128x4096x1",
            "256x32x2048x16",
        ],
        metavar="RxNxPxG",
        help="requests x new tokens x prefix tokens x groups",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hk, dim = args.heads
    page, dev = args.page_size, torch.device("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for case in args.cases:
        reqs, new, prefix, groups = map(int, case.split("x"))
        indptr, indices, last, qo, pool = chunk(reqs, new, prefix, groups, page, args.heads)
        k8 = torch.randn(pool, page, hk, dim, device=dev).to(torch.float8_e4m3fn)
        v8 = torch.randn(pool, page, hk, dim, device=dev).to(torch.float8_e4m3fn)
        q = torch.randn(reqs * new, hq, dim, dtype=torch.bfloat16, device=dev)
        t = lambda a: torch.from_numpy(a)  # noqa: E731
        common = dict(causal=True, q_data_type=torch.bfloat16, sm_scale=dim**-0.5)
        fp8 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        fp8.plan(t(qo), t(indptr), t(indices).to(dev), t(last), hq, hk, dim, page, kv_data_type=k8.dtype, **common)
        uniq, inverse = np.unique(indices, return_inverse=True)
        uniq_d = t(uniq.astype(np.int64)).to(dev)
        wide = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wide.plan(
            t(qo),
            t(indptr),
            t(inverse.astype(np.int32)).to(dev),
            t(last),
            hq,
            hk,
            dim,
            page,
            kv_data_type=torch.bfloat16,
            **common,
        )
        kb = torch.empty(len(uniq), page, hk, dim, dtype=torch.bfloat16, device=dev)
        vb = torch.empty_like(kb)

        def widened():
            widen_pages(k8, v8, uniq_d, kb, vb)
            return wide.run(q, (kb, vb))

        ref = fp8.run(q, (k8, v8), k_scale=1.0, v_scale=1.0)
        diff = (widened().float() - ref.float()).abs().max().item()
        row = {
            "case": case,
            "pages_read": len(indices),
            "distinct_pages": len(uniq),
            "fp8_fa2_ms": timed(lambda: fp8.run(q, (k8, v8), k_scale=1.0, v_scale=1.0)),
            "widen_ms": timed(lambda: widen_pages(k8, v8, uniq_d, kb, vb)),
            "widened_bf16_ms": timed(widened),
            "max_abs_diff": diff,
            "backend": getattr(wide, "_backend", "?"),
        }
        rows.append(row)
        print("  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    save_result(
        {"gpu": torch.cuda.get_device_name(), "heads": args.heads, "page_size": page, "rows": rows},
        args.out,
        "fp8_prefill",
    )


if __name__ == "__main__":
    main()
