"""FP8 activation quantizers fused into the ops that produce GEMM inputs, and a block-scaled GEMM,
in Triton (CUDA only; ``layers.quantization`` holds the torch reference of each).

Quantizing an activation with separate torch ops (abs, amax, divide, cast) costs more than the
FP8 GEMM saves (8B layer at batch 256: 281 us against bf16's 209, issue 29). Here each GEMM input
is quantized by the kernel that makes it: RMSNorm (with the residual add) before qkv and
gate_up, SiLU-and-mul before down, and one pass of its own for the attention output before o.
Every kernel rounds the value to the model dtype first, as the unfused ops would, then takes
the row's (or group's) amax and writes fp8 and a float32 scale (the kernels spell out
``FP8_MAX`` = 448 and ``MIN_SCALE`` = 1e-12 of ``layers.quantization``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn  # (as layers.quantization.FP8; a kernel does not import the layers above it)

CHUNK = 1024  # columns per loop step of the row kernels that do not hold a whole row
WARPS = 4
WHOLE_ROW = 16384  # per-token rows up to this many columns are quantized in one pass


@triton.jit
def _store_groups(y, out_ptr, scale_ptr, row, cols, n_cols, n_groups, col0, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """Quantize ``y`` [GROUPS * GROUP] (columns ``cols``) with one scale per GROUP columns."""
    g = tl.reshape(tl.abs(y), (GROUPS, GROUP))
    scale = tl.maximum(tl.max(g, 1) / 448.0, 1e-12)
    q = tl.reshape(tl.reshape(y, (GROUPS, GROUP)) / scale[:, None], (GROUPS * GROUP,))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    gid = col0 // GROUP + tl.arange(0, GROUPS)
    tl.store(scale_ptr + row * n_groups + gid, scale, mask=gid < n_groups)


@triton.jit
def _store_row(y, out_ptr, scale_ptr, row, cols, n_cols):
    """Quantize ``y`` (columns ``cols``, the whole row) with one scale."""
    scale = tl.maximum(tl.max(tl.abs(y), 0) / 448.0, 1e-12)
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    n_cols,
    n_groups,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One row: (x + residual, stored back to residual), RMSNorm, times the weight, quantized."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)  # rounds in the model dtype
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = ((xf * rstd).to(x.dtype) * w).to(tl.float32)
    if GROUP == 0:
        _store_row(y, out_ptr, scale_ptr, row, cols, n_cols)
    else:
        _store_groups(y, out_ptr, scale_ptr, row, cols, n_cols, n_groups, 0, BLOCK // GROUP, GROUP)


@triton.jit
def _value(x_ptr, row, cols, n_cols, SILU: tl.constexpr):
    """The GEMM input at ``cols`` of ``row``, rounded to the model dtype: x itself, or
    silu(gate) * up of x = [gate | up] (2 * n_cols wide)."""
    mask = cols < n_cols
    if SILU:
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype)
    else:
        y = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    return y.to(tl.float32)


@triton.jit
def _rows_quant_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    n_cols,
    n_groups,
    SILU: tl.constexpr,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """One row of x (or of silu(gate) * up) quantized. Per group: CHUNK columns at a time, one
    pass. Per row: the whole row in registers (WHOLE: CHUNK covers it), or two passes over
    chunks (the amax, then the values, recomputed from L2)."""
    row = tl.program_id(0).to(tl.int64)
    if GROUP != 0:
        for start in tl.range(0, n_cols, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            y = _value(x_ptr, row, cols, n_cols, SILU)
            _store_groups(y, out_ptr, scale_ptr, row, cols, n_cols, n_groups, start, CHUNK // GROUP, GROUP)
    elif WHOLE:
        cols = tl.arange(0, CHUNK)
        _store_row(_value(x_ptr, row, cols, n_cols, SILU), out_ptr, scale_ptr, row, cols, n_cols)
    else:
        amax = tl.zeros([CHUNK], tl.float32)
        for start in tl.range(0, n_cols, CHUNK):
            amax = tl.maximum(amax, tl.abs(_value(x_ptr, row, start + tl.arange(0, CHUNK), n_cols, SILU)))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
        for start in tl.range(0, n_cols, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            q = tl.minimum(tl.maximum(_value(x_ptr, row, cols, n_cols, SILU) / scale, -448.0), 448.0)
            tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
        tl.store(scale_ptr + row, scale)


def _outputs(rows: int, cols: int, block: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    groups = 1 if block is None else triton.cdiv(cols, block)
    return (
        torch.empty(rows, cols, dtype=FP8, device=device),
        torch.empty(rows, groups, dtype=torch.float32, device=device),
    )


def quantize_rows(
    x: torch.Tensor, block: int | None, silu: bool = False, chunk: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (or silu(gate) * up of x [T, 2K] with ``silu``) to fp8 and scales. Per token, rows
    up to ``WHOLE_ROW`` columns are held whole (one pass): the 8B's 14336-wide SiLU-and-mul took
    12.2 us at batch 256 in two passes of 1024 columns, 9.6 us at best over chunk sizes and warps."""
    x = x.contiguous()
    cols = x.shape[1] // 2 if silu else x.shape[1]
    q, scale = _outputs(x.shape[0], cols, block, x.device)
    if x.shape[0]:
        if block is not None:
            chunk = max((chunk or CHUNK) // block, 1) * block
        elif chunk is None:
            chunk = triton.next_power_of_2(cols) if cols <= WHOLE_ROW else CHUNK
        warps = num_warps or (min(16, max(4, chunk // 1024)) if chunk >= cols else WARPS)
        _rows_quant_kernel[(x.shape[0],)](
            x,
            q,
            scale,
            cols,
            scale.shape[1],
            SILU=silu,
            CHUNK=chunk,
            GROUP=block or 0,
            WHOLE=block is None and chunk >= cols,
            num_warps=warps,
        )
    return q, scale


def rmsnorm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, block: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (+ residual, which is updated in place) times ``weight``, quantized."""
    rows, cols = x.shape
    q, scale = _outputs(rows, cols, block, x.device)
    width = triton.next_power_of_2(max(cols, block or 1))
    if rows:
        _rmsnorm_quant_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            q,
            scale,
            cols,
            scale.shape[1],
            eps,
            HAS_RES=residual is not None,
            BLOCK=width,
            GROUP=block or 0,
            num_warps=min(16, max(4, width // 512)),
        )
    return q, scale


@triton.jit
def tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, SWIZZLE: tl.constexpr):
    """The (row, column) tile of program ``pid``: tiles go in groups of SWIZZLE columns, so
    neighbouring programs share weight tiles in L2."""
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first_n = pid // (SWIZZLE * n_m) * SWIZZLE
    size = min(n_n - first_n, SWIZZLE)
    return (pid % (SWIZZLE * n_m)) // size, first_n + (pid % (SWIZZLE * n_m)) % size


@triton.jit
def _matmul_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    n_groups,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP: tl.constexpr,
    SWIZZLE: tl.constexpr,
    PER_GROUP: tl.constexpr,
):
    """C = (A * a_scale) (B * b_scale)^T with A [M, K], B [N, K] fp8, in K steps of GROUP. With
    PER_GROUP one scale per row and GROUP columns for each, every step's product scaled before
    it is added; else one per row ([M] and [N]), applied once at the end."""
    pid_m, pid_n = tile(tl.program_id(0), M, N, BM, BN, SWIZZLE)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, GROUP)
    acc = tl.zeros([BM, BN], tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k = g * GROUP + rk
        a = tl.load(a_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[:, None] * K + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        if PER_GROUP:
            sa = tl.load(as_ptr + rm * n_groups + g, mask=rm < M, other=0.0)
            sb = tl.load(bs_ptr + rn * n_groups + g, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not PER_GROUP:
        acc = (
            acc
            * tl.load(as_ptr + rm, mask=rm < M, other=0.0)[:, None]
            * tl.load(bs_ptr + rn, mask=rn < N, other=0.0)[None, :]
        )
    tl.store(
        c_ptr + rm[:, None] * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def block_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: int | None,
    dtype: torch.dtype,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """A [M, K] fp8 times B [N, K] fp8 (all contiguous), with scales [M, K / block] and
    [N, K / block], or with ``block`` None per row ([M, 1] and [N]). ``config``: (BM, BN, warps,
    stages) instead of the size-based choice."""
    assert a.is_contiguous() and b.is_contiguous() and a_scale.is_contiguous() and b_scale.is_contiguous()
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, dtype=dtype, device=a.device)
    if config is None:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
        bn = 64 if M <= 64 else 128
        config = (bm, bn, 4 if bm <= 64 else 8, 3)
    bm, bn, warps, stages = config
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        c,
        M,
        N,
        K,
        b_scale.shape[1] if block else 1,
        BM=bm,
        BN=bn,
        GROUP=block or 128,
        SWIZZLE=8,
        PER_GROUP=block is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return c


@triton.jit
def _widen_pages_kernel(k_ptr, v_ptr, pages_ptr, k_out_ptr, v_out_ptr, page_elems, BLOCK: tl.constexpr):
    """Scratch page i of K and V = pool page ``pages[i]``, widened from fp8 (exact: e4m3 values
    are bf16 and fp16 values)."""
    i = tl.program_id(0).to(tl.int64)
    src = tl.load(pages_ptr + i).to(tl.int64) * page_elems
    dst = i * page_elems
    for start in range(0, page_elems, BLOCK):
        at = start + tl.arange(0, BLOCK)
        ok = at < page_elems
        k = tl.load(k_ptr + src + at, mask=ok)
        tl.store(k_out_ptr + dst + at, k.to(k_out_ptr.dtype.element_ty), mask=ok)
        v = tl.load(v_ptr + src + at, mask=ok)
        tl.store(v_out_ptr + dst + at, v.to(v_out_ptr.dtype.element_ty), mask=ok)


def widen_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
) -> None:
    """k_out[i], v_out[i] = the fp8 pool's page ``pages[i]`` in the outputs' dtype; caches
    [pages, page_size, Hk, D] contiguous per page, outputs [len(pages), page_size, Hk, D]."""
    page_elems = k_cache[0].numel()
    assert k_cache.stride(0) == v_cache.stride(0) == page_elems and k_out.is_contiguous() and v_out.is_contiguous()
    if len(pages):
        _widen_pages_kernel[(len(pages),)](
            k_cache, v_cache, pages, k_out, v_out, page_elems, BLOCK=4096, num_warps=WARPS
        )
