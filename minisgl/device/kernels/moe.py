"""Fused mixture-of-experts on the GPU (Triton): routing, token-to-expert alignment and the two
grouped GEMMs, each one launch with static shapes, so a MoE layer replays inside CUDA graphs.

A step's T tokens each pick k experts: P = T * k (token, expert) pairs. ``moe_align.align`` sorts
the pairs by expert into blocks of BM rows, so one GEMM program multiplies BM rows by one
expert's weight tile. The first GEMM
gathers token rows (pair // k) against [gate | up]; SiLU-and-mul follows (or runs inside that
GEMM: ``MoeConfig.silu``; fp8 then quantizes its output in a launch of its own); the second GEMM
scales each pair's row by its routing weight and the k rows of a token are summed. The torch loop in
``layers.moe`` is the reference for all of it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.device.kernels.fused import silu_and_mul
from minisgl.device.kernels.moe_align import Alignment, align
from minisgl.device.layers import tuned_tables
from minisgl.device.layers.quantization import Fp8Act, quantize

if TYPE_CHECKING:
    from minisgl.device.layers.fp8_scheme import Fp8Scheme
    from minisgl.device.layers.moe import FusedMoE

CONFIGS_PATH = Path(__file__).parent / "configs" / "moe.json"


@triton.jit
def _topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """One token: softmax over its E router logits (float32), the k largest (lowest id first
    among equals), renormalized to sum to one with RENORM."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * E + cols, mask=cols < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(cols < E, p, -1.0)
    slots = tl.arange(0, TOPK)
    top_w = tl.zeros([TOPK], tl.float32)
    top_i = tl.zeros([TOPK], tl.int32)
    for i in tl.static_range(TOPK):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), 0)
        top_w = tl.where(slots == i, best, top_w)
        top_i = tl.where(slots == i, idx, top_i)
        p = tl.where(cols == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + row * TOPK + slots, top_w)
    tl.store(ids_ptr + row * TOPK + slots, top_i)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``layers.moe.route`` in one launch: weights float32 [T, k], expert ids int32
    [T, k]. ``top_k`` must be a power of two (every model we serve routes to 1, 2, 4 or 8)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        _topk_kernel[(T,)](
            logits.contiguous(), weights, ids, E, TOPK=top_k, BLOCK_E=triton.next_power_of_2(E), RENORM=renormalize
        )
    return weights, ids


@triton.jit
def _rows_times_expert(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    weights_ptr,
    pairs,
    expert,
    pid_n,
    P,
    N,
    K,
    a_groups,
    b_groups,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    SILU: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISE: tl.constexpr,
    ROWS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The product of ROWS pairs (``pairs``, P for padding) and BN columns of one expert, stored."""
    valid = pairs < P
    rows = (pairs // A_DIV).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rb = (rn % 2) * (N // 2) + rn // 2 if SILU else rn  # B's row of each product column
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + expert * N * K + rb[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros([ROWS, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k_left = K - kb * BK
        a = tl.load(a_ptrs, mask=valid[:, None] & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[:, None] < N) & (rk[None, :] < k_left), other=0.0)
        if GROUP:
            g = kb * BK // GROUP
            sa = tl.load(a_scale_ptr + rows * a_groups + g, mask=valid, other=0.0)
            sb = tl.load(b_scale_ptr + (expert * N + rb) * b_groups + g, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        elif PRECISE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    if FP8 and not GROUP:
        sa = tl.load(a_scale_ptr + rows, mask=valid, other=0.0)
        sb = tl.load(b_scale_ptr + expert * N + rb, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    if SILU:
        gate, up = tl.split(tl.reshape(acc, [ROWS, BN // 2, 2]))
        cn = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * (N // 2) + cn[None, :]
        out = gate * tl.sigmoid(gate) * up
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cn[None, :] < N // 2))
    else:
        c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


@triton.jit(do_not_specialize=["P"])  # (as moe_align's kernels: no compile per pair count)
def _expert_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,
    K,
    a_groups,
    b_groups,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    SILU: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISE: tl.constexpr,
    HALVES: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[pair] = A[pair // A_DIV] @ B[expert]^T for a BM-row block of pairs and BN columns; B is
    [E, N, K]. PRECISE: float32 products in full precision (not TF32). FP8: A and B are e4m3
    with per-row scales ([rows, 1] / [E, N]) or, with GROUP, one per row and GROUP columns
    ([rows, a_groups] / [E, N, b_groups]). SILU: B is [gate | up] (N = 2I rows) and C [P, I] =
    silu(A @ gate^T) * (A @ up^T): a program's product columns take gate and up rows in turn
    (column c is row c // 2 of gate for even c, of up for odd c), so one dot yields both halves
    of BN / 2 outputs and the [P, 2I] product is never stored (half the bytes written, and no
    SiLU-and-mul launch to read them back). HALVES: a block whose second half is all padding
    multiplies its first BM / 2 rows only, so large blocks read an expert's weights once for up
    to BM rows without paying BM rows of products for an expert that has fewer than BM / 2."""
    pid = tl.program_id(0)
    n_m = tl.num_programs(0) // tl.cdiv(N, BN)
    n_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    first = sorted_ptr + pid_m * BM
    # padding comes last in a block: its second half is unused when its middle row is padding
    half_only = tl.load(first + BM // 2) >= P if HALVES else False
    if half_only:
        _rows_times_expert(
            a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, weights_ptr, tl.load(first + tl.arange(0, BM // 2)),
            expert, pid_n, P, N, K, a_groups, b_groups,
            A_DIV, MUL_WEIGHT, SILU, FP8, GROUP, PRECISE, BM // 2, BN, BK,
        )  # fmt: skip
    else:
        _rows_times_expert(
            a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, weights_ptr, tl.load(first + tl.arange(0, BM)),
            expert, pid_n, P, N, K, a_groups, b_groups,
            A_DIV, MUL_WEIGHT, SILU, FP8, GROUP, PRECISE, BM, BN, BK,
        )  # fmt: skip


class GemmConfig(NamedTuple):
    bn: int
    bk: int
    group_m: int
    warps: int
    stages: int
    halves: bool = False  # a block with at most BM / 2 rows in use multiplies BM / 2 rows only


def expert_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    alignment: Alignment,
    P: int,
    a_div: int,
    out_dtype: torch.dtype,
    config: GemmConfig,
    weights: torch.Tensor | None = None,
    group: int | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """[P, N]: each pair's row of A (row pair // a_div) times its expert's B [N, K], scaled by
    ``weights`` [P] when given; with ``silu``, B is [gate | up] and the product goes through
    SiLU-and-mul ([P, N / 2]). Rows of padding blocks are never written."""
    fp8 = a_scale is not None
    N, K = b.shape[1], b.shape[2]
    assert not silu or config.bn % 2 == 0, "SiLU pairs a gate and an up column"
    c = torch.empty(P, N // 2 if silu else N, dtype=out_dtype, device=a.device)
    grid = (alignment.block_expert.numel() * triton.cdiv(N, config.bn),)
    _expert_gemm_kernel[grid](
        a, a_scale if fp8 else a, b, b_scale if fp8 else b, c, weights if weights is not None else c,
        alignment.sorted_ids, alignment.block_expert, alignment.num_padded, P, N, K,
        a_scale.shape[-1] if fp8 else 1, b_scale.shape[-1] if fp8 and group else 1,
        A_DIV=a_div, MUL_WEIGHT=weights is not None, SILU=silu, FP8=fp8, GROUP=group or 0,
        PRECISE=a.dtype == torch.float32, HALVES=config.halves,
        BM=alignment.bm, BN=config.bn, BK=min(config.bk, group) if group else config.bk, GROUP_M=config.group_m,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return c


class MoeConfig(NamedTuple):
    """Tiles for one MoE layer at one token count: the block rows both GEMMs share, each GEMM's
    own (BN, BK, GROUP_M, warps, stages), and whether the first GEMM applies SiLU-and-mul itself
    (the tuner keeps it where it measures faster than the two launches)."""

    bm: int
    up: GemmConfig  # [gate | up]: N = 2 * intermediate product columns, K = hidden
    down: GemmConfig  # N = hidden, K = intermediate
    silu: bool = False


def table_key(num_experts: int, intermediate: int, hidden: int, top_k: int, kind: str) -> str:
    """``kind``: bf16, fp8 (per channel) or fp8-b128 (128-column groups): ``table_kind``."""
    return f"E={num_experts},I={intermediate},H={hidden},k={top_k},{kind}"


_FLOAT_KINDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def table_kind(dtype: torch.dtype, group: int | None, quantized: bool) -> str:
    """The table's name for experts in ``dtype`` (unquantized) or fp8 with ``group`` columns a
    scale (None: one per channel); the names the tuner writes under."""
    if not quantized:
        return _FLOAT_KINDS[dtype]
    return "fp8" if group is None else f"fp8-b{group}"


def layer_key(moe: FusedMoE, dtype: torch.dtype) -> str:
    """The table key of a MoE layer whose activations are ``dtype``: the one name the model's
    path looks up and the tuner writes under."""
    quant = moe.quant
    kind = table_kind(dtype, None if quant is None else quant.block, quant is not None)
    return table_key(moe.num_experts, moe.local, moe.hidden, moe.top_k, kind)


def default_config(tokens: int, num_experts: int, top_k: int) -> MoeConfig:
    """Tiles by the rows an expert gets on average, for shapes no tuned table covers."""
    per_expert = tokens * top_k / num_experts
    if per_expert <= 16:
        return MoeConfig(16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4))
    if per_expert <= 64:
        return MoeConfig(64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(64, 64, 8, 4, 4))
    return MoeConfig(64, GemmConfig(128, 64, 8, 4, 3), GemmConfig(128, 64, 8, 4, 3))


@functools.lru_cache(maxsize=1 << 12)
def moe_config(tokens: int, key: str, num_experts: int, top_k: int, gpu: str, chip: str = "") -> MoeConfig:
    """The tiles tuned for the token count nearest ``tokens`` (by ratio) on this GPU, or one of
    its chip, and shape (``benchmarks/moe_bench.py --tune`` writes ``configs/moe.json``), else
    ``default_config``."""
    entry = tuned_tables.table(CONFIGS_PATH, gpu, chip).get(key)
    if not entry:
        return default_config(tokens, num_experts, top_k)
    nearest = min(entry, key=lambda b: abs(math.log(int(b) / max(tokens, 1))))
    bm, up, down, *silu = entry[nearest]
    return MoeConfig(bm, GemmConfig(*up), GemmConfig(*down), bool(silu and silu[0]))


def config_for(tokens: int, key: str, num_experts: int, top_k: int, device: torch.device) -> MoeConfig:
    return moe_config(tokens, key, num_experts, top_k, *tuned_tables.gpu(device.index or 0))


def fused_experts(moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``layers.moe.experts_torch`` for x [T, H] (T > 0) on the GPU: align, [gate | up] GEMM,
    SiLU-and-mul (inside the GEMM where the table says so; quantizing for fp8), weighted down
    GEMM, sum of each token's k rows (``sum_rows``)."""
    T, H = x.shape
    k = moe.top_k
    P = T * k
    quant = moe.quant
    group = None if quant is None else quant.block
    config = config_for(T, layer_key(moe, x.dtype), moe.num_experts, k, x.device)
    alignment = align(ids, moe.num_experts, config.bm)
    act: torch.Tensor | Fp8Act = x if quant is None else quantize(x, group)
    up = _gemm(act, moe.w13_weight, moe.w13_weight_scale, alignment, P, k, x.dtype, config.up, None, group, config.silu)
    act = mid_activation(up, quant, config.silu)
    out = _gemm(
        act, moe.w2_weight, moe.w2_weight_scale, alignment, P, 1, x.dtype, config.down, weights.contiguous(), group
    )
    return sum_rows(out, k)


def mid_activation(up: torch.Tensor, quant: Fp8Scheme | None, silu_done: bool) -> torch.Tensor | Fp8Act:
    """The second GEMM's input from the first's output: SiLU-and-mul unless the GEMM applied it,
    quantized per token (or group) for fp8 experts."""
    if not silu_done:
        return silu_and_mul(up, quant)
    return up if quant is None else quantize(up, quant.block)


@triton.jit
def _sum_rows_kernel(x_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sum over j < K of x[t * K + j, cols], in float32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rows = t * K + tl.arange(0, K)
    x = tl.load(x_ptr + rows[:, None] * H + cols[None, :], mask=cols[None, :] < H, other=0.0)
    tl.store(out_ptr + t * H + cols, tl.sum(x.to(tl.float32), 0).to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: the sum of each token's k consecutive rows of x [T * k, H] (one program per
    token and column block: 6 us at 1024 tokens of Qwen3-30B-A3B on the H100, torch's strided
    reduction 18)."""
    H = x.shape[1]
    out = torch.empty(x.shape[0] // k, H, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(H))
    _sum_rows_kernel[(out.shape[0], triton.cdiv(H, block))](x, out, H, K=k, BLOCK=block, num_warps=4)
    return out


def _gemm(act, weight, weight_scale, alignment, P, a_div, dtype, config, weights, group, silu=False) -> torch.Tensor:
    """``expert_gemm`` of a float or an already quantized activation."""
    if isinstance(act, Fp8Act):
        a, a_scale = act.data, act.scale
        return expert_gemm(a, a_scale, weight, weight_scale, alignment, P, a_div, dtype, config, weights, group, silu)
    return expert_gemm(act, None, weight, None, alignment, P, a_div, dtype, config, weights, silu=silu)
