"""Host-tier copy bandwidth against plain pinned-memory copies, in the 8B's KV shape.

    python benchmarks/hicache_bandwidth.py [--layers 32 --kv-heads 8 --head-dim 128 --page-size 16]

Pinned reference: one contiguous ``copy_`` of a pinned buffer to the device and back. Host tier:
``HostKVPool.transfer`` of N scattered pages (loads: host -> device, writes: device -> host),
each page every layer's K and V: loads through our page-copy kernel at each ``--ctas`` and
through 2D DMA copies (``--hicache-io-backend kernel`` / ``direct``), writes through the DMA
copies (both backends write that way). Prints GB/s, the share of the pinned rate and the time
the host thread spends queueing the copies. Then overlap: a load of ``--overlap-pages`` pages beside a chain of
bf16 GEMMs (a prefill's work) on the compute stream, each alone and both at once: a copy that
leaves the SMs to the GEMMs finishes both in about the longer of the two.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.device.kvcache.host_pool import HostKVPool
from minisgl.device.kvcache.mha_pool import MHAKVCache


def timed(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def issue_time(fn, repeat: int = 3) -> float:
    """Seconds the host thread spends queueing the copies (what a scheduler step pays)."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-pages", type=int, default=8192)
    ap.add_argument("--host-pages", type=int, default=16384)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument(
        "--ctas",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 1 << 20],
        help="CTAs of the copy kernel (1<<20: one per block, as many as there are)",
    )
    ap.add_argument("--overlap-pages", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = MHAKVCache(
        args.device_pages,
        args.page_size,
        args.layers,
        args.kv_heads,
        args.head_dim,
        torch.bfloat16,
        torch.device("cuda"),
    )
    page_bytes = MHAKVCache.bytes_per_page(args.page_size, args.layers, args.kv_heads, args.head_dim, torch.bfloat16)
    rows = []
    size = max(args.pages) * page_bytes
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d = size / timed(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9
    d2h = size / timed(lambda: pinned.copy_(dev, non_blocking=True)) / 1e9
    print(f"pinned contiguous copy of {size / 1e9:.2f} GB: H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    pinned = dev = None  # (freed before the page copies)
    rng = random.Random(0)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")

    def gemms() -> None:
        for _ in range(100):
            a @ b

    compute = timed(gemms)
    overlap = []
    print(f"GEMM chain alone: {1e3 * compute:.1f} ms")
    for backend, ctas in [("kernel", c) for c in args.ctas] + [("direct", 0)]:
        pool = HostKVPool(args.host_pages, cache, backend, kernel_ctas=ctas or 1)
        name = f"{backend}" + (f"/{ctas}" if backend == "kernel" else "")
        for n in args.pages:
            dpages, hpages = rng.sample(range(args.device_pages), n), rng.sample(range(args.host_pages), n)
            loads = [x for pair in zip(hpages, dpages) for x in pair]
            writes = [x for pair in zip(dpages, hpages) for x in pair]
            jobs = [("load", [], loads, h2d)] + ([("write", writes, [], d2h)] if backend == "direct" else [])
            for kind, w, ld, ref in jobs:  # (writes always take the DMA engines: measured once)
                rate = n * page_bytes / timed(lambda: pool.transfer(cache, w, ld)) / 1e9
                issue = issue_time(lambda: pool.transfer(cache, w, ld))
                rows.append(
                    {
                        "backend": backend,
                        "ctas": ctas,
                        "direction": kind,
                        "pages": n,
                        "bytes": n * page_bytes,
                        "gb_per_s": rate,
                        "share_of_pinned": rate / ref,
                        "issue_ms": 1e3 * issue,
                    }
                )
                print(
                    f"{name:13s} {kind:6s} {n:5d} pages ({n * page_bytes / 1e6:7.1f} MB): {rate:6.1f} GB/s "
                    f"= {100 * rate / ref:5.1f}% of pinned; the host thread held {1e3 * issue:.2f} ms"
                )
        n = args.overlap_pages
        dpages, hpages = rng.sample(range(args.device_pages), n), rng.sample(range(args.host_pages), n)
        loads = [x for pair in zip(hpages, dpages) for x in pair]
        copy = timed(lambda: pool.transfer(cache, [], loads))
        both = timed(lambda: (pool.transfer(cache, [], loads), gemms()))
        overlap.append(
            {
                "backend": backend,
                "ctas": ctas,
                "pages": n,
                "copy_ms": 1e3 * copy,
                "gemms_ms": 1e3 * compute,
                "both_ms": 1e3 * both,
                "hidden": (copy + compute - both) / min(copy, compute),
            }
        )
        print(
            f"{name:13s} overlap: load {1e3 * copy:.1f} ms, GEMMs {1e3 * compute:.1f} ms, both {1e3 * both:.1f} ms "
            f"({100 * overlap[-1]['hidden']:.0f}% of the shorter hidden)"
        )
        pool.close()
    save_result(
        {
            "args": vars(args),
            "pinned_h2d": h2d,
            "pinned_d2h": d2h,
            "page_bytes": page_bytes,
            "rows": rows,
            "overlap": overlap,
        },
        args.out,
        "hicache_bandwidth",
    )


if __name__ == "__main__":
    main()
