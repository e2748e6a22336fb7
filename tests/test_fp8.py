"""FP8: quantizers, fp8 linear layers, FP8 checkpoints of both formats, and the FP8 KV cache.

CPU tests run the torch reference; ``cuda`` tests compare the Triton kernels, ``_scaled_mm``, the
rope_store kernel's fp8 store and the attention kernels' fp8 reads against it.
"""

from __future__ import annotations

import json

import pytest
import torch

from minisgl.config.args import EngineArgs
from minisgl.device.attention.select import create_backend
from minisgl.device.kernels import rope_store, rope_store_torch, store_kv_torch
from minisgl.device.kernels.rope_store import from_cache
from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.device.layers.fp8_gemm import GEMM_CONFIGS_PATH, GEMM_ROW_BUCKETS, tuned_gemm
from minisgl.device.layers.fp8_scheme import Fp8Scheme, quantization_scheme
from minisgl.device.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.device.layers.quantization import (
    FP8,
    dequantize,
    fp8_linear,
    quantize,
    quantize_blocks,
    quantize_torch,
    quantize_weight,
    row_scales,
)
from minisgl.device.tiny_model import make_tiny_model
from minisgl.device.worker.model_runner import ModelRunner
from scripts.quantize_checkpoint import convert, quantization_config
from tests.test_scheduler import make_llm, shared_prefix_prompts, tokens

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


# ---- quantizers and layers (CPU) ----------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 128, 32])
def test_quantize_round_trip_is_within_fp8_precision(block):
    torch.manual_seed(0)
    x = torch.randn(7, 576) * torch.logspace(-3, 2, 7)[:, None]  # rows of very different sizes
    x[3] = 0.0  # padding rows quantize to zeros with a finite scale
    q, scale = quantize_torch(x, block)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.shape == ((7, 1) if block is None else (7, -(-576 // block)))
    assert torch.isfinite(scale).all() and (dequantize(q, scale, block)[3] == 0).all()
    back = dequantize(q, scale, block)
    # e4m3 keeps 3 mantissa bits (relative error 2^-4), subnormals a step of 2^-9 of the scale.
    step = scale if block is None else scale.repeat_interleave(block, 1)[:, :576]
    assert ((back - x).abs() <= x.abs() * 2**-4 + step * 2**-9).all()
    assert q.float().abs().max() == 448.0  # the scale puts each group's largest value at the top


def test_block_weight_scales_repeat_over_their_rows():
    torch.manual_seed(0)
    w = torch.randn(300, 200)  # partial tiles on both sides
    q, tiles = quantize_blocks(w, 128)
    assert tiles.shape == (3, 2)
    per_row = row_scales(tiles, 300, 128)
    assert per_row.shape == (300, 2)
    assert torch.equal(dequantize(q, per_row, 128), dequantize(*quantize_weight(w, 128), 128))
    torch.testing.assert_close(dequantize(q, per_row, 128), w, atol=0.07 * w.abs().max(), rtol=0)


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_layers_load_float_and_fp8_tensors_alike(block):
    """A fused layer quantizes each float part whole; fed the parts already quantized (a
    checkpoint), it holds the same bytes and scales. Its output is the dequantized product."""
    torch.manual_seed(0)
    scheme = Fp8Scheme(block=block)
    parts = {"q": torch.randn(576, 320), "k": torch.randn(192, 320), "v": torch.randn(192, 320)}
    online = QKVParallelLinear(320, 64, 9, 3, False, scheme)
    stored = QKVParallelLinear(320, 64, 9, 3, False, scheme)
    for part, w in parts.items():
        online.weight.weight_loader(online.weight, w, part)
        if block is None:
            q, s = quantize_torch(w)
        else:
            q, s = quantize_blocks(w, block)
        stored.weight.weight_loader(stored.weight, q, part)
        stored.weight_scale.weight_loader(stored.weight_scale, s, part)
    assert torch.equal(online.weight.view(torch.uint8), stored.weight.view(torch.uint8))
    assert torch.equal(online.weight_scale, stored.weight_scale)
    x = torch.randn(5, 320)
    want = dequantize(*quantize_torch(x, block), block) @ dequantize(online.weight, online.weight_scale, block).t()
    torch.testing.assert_close(online(x), want)
    full = torch.cat(list(parts.values()))
    assert ((online(x) - x @ full.t()).norm() / (x @ full.t()).norm()) < 0.06

    row = RowParallelLinear(320, 128, quant=scheme)
    w = torch.randn(128, 320)
    row.weight.weight_loader(row.weight, w)
    torch.testing.assert_close(dequantize(row.weight, row.weight_scale, block), w, atol=0.07 * w.abs().max(), rtol=0)


def test_per_tensor_checkpoint_scales_expand_to_rows():
    layer = ColumnParallelLinear(64, [32, 48], quant=Fp8Scheme(source="fp8"))
    for part, (rows, value) in enumerate(((32, 0.5), (48, 0.25))):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(value), part)
    assert torch.equal(layer.weight_scale, torch.tensor([0.5] * 32 + [0.25] * 48))


def test_quantization_schemes_and_refusals():
    assert quantization_scheme(None, None) is None
    assert quantization_scheme(None, "fp8") == Fp8Scheme()
    assert quantization_scheme(quantization_config("compressed-tensors"), None).block is None
    assert quantization_scheme(quantization_config("block"), "fp8").block == 128
    with pytest.raises(ValueError, match="awq"):
        quantization_scheme({"quant_method": "awq"}, None)
    with pytest.raises(ValueError, match="static"):
        quantization_scheme({"quant_method": "fp8", "activation_scheme": "static"}, None)
    static = quantization_config("compressed-tensors")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="dynamic"):
        quantization_scheme(static, None)
    with pytest.raises(ValueError, match="int4"):
        quantization_scheme(None, "int4")
    for bad in (dict(quantization="awq"), dict(kv_cache_dtype="fp8_e5m2")):
        with pytest.raises(ValueError, match=list(bad.values())[0]):
            EngineArgs(model="x", **bad).validate()


# ---- engines (CPU reference) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_model("llama", root / "float", seed=0)
    return {
        "float": src,
        "compressed-tensors": convert(src, root / "ct", "compressed-tensors"),
        "block": convert(src, root / "block", "block", kv_scale=0.5),
    }


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), [42, 43]]


def test_fp8_checkpoints_give_the_online_quantized_tokens(fp8_checkpoints, monkeypatch):
    """Per channel: the compressed-tensors checkpoint against --quantization fp8 of its source.
    Block-wise: the block checkpoint against the same 128 x 128 blocks made at load."""
    online = tokens(make_llm(fp8_checkpoints["float"], quantization="fp8").generate(PROMPTS, GREEDY))
    plain = tokens(make_llm(fp8_checkpoints["float"]).generate(PROMPTS, GREEDY))
    stored = make_llm(fp8_checkpoints["compressed-tensors"])
    assert stored.runner.model.config.quant.source == "compressed-tensors"
    assert tokens(stored.generate(PROMPTS, GREEDY)) == online
    assert online != plain  # the quantization is real
    block = tokens(make_llm(fp8_checkpoints["block"]).generate(PROMPTS, GREEDY))
    import minisgl.device.models.loader as loader

    monkeypatch.setattr(loader, "quantization_scheme", lambda *_: Fp8Scheme(block=128))
    assert tokens(make_llm(fp8_checkpoints["float"]).generate(PROMPTS, GREEDY)) == block


def test_checkpoint_kv_scales_reach_an_fp8_cache(fp8_checkpoints):
    llm = make_llm(fp8_checkpoints["block"], kv_cache_dtype="fp8_e4m3")
    assert llm.runner.kv_cache.scales == [(0.5, 0.5)] * llm.runner.config.num_layers
    assert make_llm(fp8_checkpoints["block"]).runner.kv_cache.scales[0] == (1.0, 1.0)  # unused in fp32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied head and one tied to the embedding
def test_quantized_lm_head(tiny_models, arch):
    """--quantize-lm-head: the head held in fp8 per vocabulary row, logits equal to the
    dequantized product (per-token activations) in float32; an untied head's float weight is
    freed, a tied one's stays for the embedding; refused without fp8 linear layers."""
    from minisgl.device.layers.quantization import dequantize, quantize_torch

    runner = ModelRunner(
        EngineArgs(model=str(tiny_models[arch]), device="cpu", quantization="fp8", quantize_lm_head=True)
    )
    head, tied = runner.model.lm_head, runner.config.tie_word_embeddings
    assert head.qweight.dtype == FP8 and head.qscale.shape == (head.qweight.shape[0],)
    assert ("weight" in dict(head.named_parameters())) == tied
    hidden = torch.randn(5, runner.config.hidden_size)
    q, s = quantize_torch(hidden)
    want = dequantize(q, s) @ dequantize(head.qweight, head.qscale).t()
    got = head(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want[:, : runner.vocab_size], atol=0, rtol=0)
    buf = torch.empty(5, head.qweight.shape[0])  # a CUDA graph's fixed buffer (the slice, padded rows too)
    assert head(hidden, gather=False, out=buf).data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:, : runner.vocab_size], got, atol=0, rtol=0)
    float_head = ModelRunner(EngineArgs(model=str(tiny_models[arch]), device="cpu", quantization="fp8")).model.lm_head
    torch.testing.assert_close(got, float_head(hidden), atol=0.05 * float_head(hidden).abs().max().item(), rtol=0.1)
    with pytest.raises(ValueError, match="--quantize-lm-head goes with fp8 linear layers"):
        ModelRunner(EngineArgs(model=str(tiny_models[arch]), device="cpu", quantize_lm_head=True))


def test_fp8_kv_cache_holds_more_tokens_and_round_trips(tiny_llama):
    # Enough requests that memory (256 MB on CPU), not slots x context, bounds the pool.
    runners = {
        kv: ModelRunner(EngineArgs(model=str(tiny_llama), device="cpu", kv_cache_dtype=kv, max_running_requests=4096))
        for kv in ("auto", "fp8_e4m3")
    }
    assert runners["fp8_e4m3"].kv_cache.buffer.dtype == FP8
    # fp32 model: a quarter of the bytes per token, four times the pages in the same budget
    assert runners["fp8_e4m3"].kv_bytes_per_page * 4 == runners["auto"].kv_bytes_per_page
    assert runners["fp8_e4m3"].num_pages == 4 * runners["auto"].num_pages

    cache = MHAKVCache(8, 4, 1, 2, 16, FP8, torch.device("cpu"))
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16) * 30
    loc = torch.tensor([0, 3, 4, 17, 30])
    store_kv_torch(cache.k_cache(0), cache.v_cache(0), k, v, loc, scales=(0.5, 0.25))
    got_k = from_cache(cache.k_cache(0).reshape(-1, 2, 16)[loc], 0.5)
    got_v = from_cache(cache.v_cache(0).reshape(-1, 2, 16)[loc], 0.25)
    torch.testing.assert_close(got_k, k, atol=0, rtol=2**-4)
    torch.testing.assert_close(got_v, v.clamp(-112, 112), atol=0, rtol=2**-4)  # 448 * 0.25 saturates


def test_fp8_engine_radix_and_cascade_agree(tiny_llama, monkeypatch):
    """With fp8 weights and KV: radix on and off, cascade on and off give the same tokens."""
    from minisgl.serve.scheduler import cascade

    for name, value in (
        ("MIN_GROUP_SIZE", 2),
        ("MIN_SHARED_TOKENS", 1),
        ("MIN_SAVED_SHARE", 0),
        ("MIN_BATCH", 1),
        ("ON_CPU", True),
    ):
        monkeypatch.setattr(cascade, name, value)
    prompts = shared_prefix_prompts(groups=3, per_group=4, prefix_len=40)
    kw = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    ref = tokens(make_llm(tiny_llama, disable_radix_cache=True, **kw).generate(prompts, GREEDY))
    grouped = make_llm(tiny_llama, **kw)
    assert tokens(grouped.generate(prompts, GREEDY)) == ref and grouped.scheduler.stats()["cascade_steps"] > 0
    assert tokens(make_llm(tiny_llama, disable_cascade_attention=True, **kw).generate(prompts, GREEDY)) == ref


# ---- CUDA kernels against the reference ---------------------------------------------------------


def _close_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], block) -> None:
    torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=0)
    # The kernels' float32 sums may round a value across an fp8 step from the reference's.
    torch.testing.assert_close(dequantize(*got, block), dequantize(*want, block), rtol=0.13, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("cols", [576, 4096])
def test_triton_quantizers_match_torch(dtype, block, cols):
    from minisgl.device.kernels.fp8 import quantize_rows, rmsnorm_quant
    from minisgl.device.kernels.fused import rmsnorm_torch

    torch.manual_seed(0)
    x = torch.randn(37, cols, device="cuda", dtype=dtype)
    res = torch.randn(37, cols, device="cuda", dtype=dtype)
    w = torch.rand(cols, device="cuda", dtype=dtype) + 0.5
    _close_fp8(quantize_rows(x, block), quantize_torch(x, block), block)
    gate_up = torch.randn(37, 2 * cols, device="cuda", dtype=dtype)
    gate, up = gate_up.chunk(2, -1)
    _close_fp8(
        quantize_rows(gate_up, block, silu=True),
        quantize_torch(torch.nn.functional.silu(gate.float()).mul(up.float()).to(dtype), block),
        block,
    )
    _close_fp8(rmsnorm_quant(x, None, w, 1e-6, block), quantize_torch(rmsnorm_torch(x, w, 1e-6), block), block)
    res2 = res.clone()
    got = rmsnorm_quant(x, res2, w, 1e-6, block)
    torch.testing.assert_close(res2, x + res)
    _close_fp8(got, quantize_torch(rmsnorm_torch(x + res, w, 1e-6), block), block)
    empty = quantize_rows(x[:0], block)
    assert empty[0].shape == (0, cols)


@pytest.mark.cuda
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m", [1, 37, 256, 600])
@pytest.mark.parametrize("n,k", [(1536, 576), (4096, 2304)])  # small weights (Triton) and large (cuBLAS)
def test_fp8_gemms_match_the_dequantized_product(block, m, n, k):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, block)
    act = quantize(x, block)
    got = fp8_linear(act, wq, ws, None, block).float()
    want = dequantize(act.data, act.scale, block) @ dequantize(wq, ws, block).t()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)  # outputs near 1: half a bf16 step is 0.004
    if block is None:  # our Triton kernel with per-channel scales too
        from minisgl.device.kernels.fp8 import block_matmul

        got = block_matmul(act.data, act.scale, wq, ws, None, torch.bfloat16).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)  # outputs near 1: half a bf16 step is 0.004
        for config in tuned_configs():  # every tile the tuned tables may pick
            got = block_matmul(act.data, act.scale, wq, ws, None, torch.bfloat16, config).float()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2, msg=str(config))


def tuned_configs() -> set[tuple[int, ...]]:
    tables = json.loads(GEMM_CONFIGS_PATH.read_text())
    return {tuple(c) for shapes in tables.values() for by_rows in shapes.values() for c in by_rows.values() if c}


def test_tuned_gemm_table_lookup():
    """The shipped table covers every row bucket of each shape with a Triton tile or cuBLAS
    (null); lookups take the smallest bucket holding the rows and leave other shapes, GPUs and
    batches past the last bucket to the size rule."""
    tables = json.loads(GEMM_CONFIGS_PATH.read_text())
    assert "NVIDIA H100 80GB HBM3" in tables
    for gpu, shapes in tables.items():
        for shape, by_rows in shapes.items():
            assert sorted(map(int, by_rows)) == list(GEMM_ROW_BUCKETS), shape
            for config in filter(None, by_rows.values()):
                bm, bn, warps, stages = config
                assert bm in (16, 32, 64, 128) and bn in (64, 128) and warps in (4, 8) and stages >= 2
    gpu = "NVIDIA H100 80GB HBM3"
    n, k = 4096, 14336  # the 8B's down_proj
    by_rows = tables[gpu][f"{n}x{k}"]
    for rows, bucket in ((1, 16), (16, 16), (17, 32), (200, 256), (512, 512)):
        config = by_rows[str(bucket)]
        assert tuned_gemm(rows, n, k, gpu) == (True, tuple(config) if config else None)
    assert tuned_gemm(513, n, k, gpu) == (False, None)
    assert tuned_gemm(64, 4096, 4095, gpu) == (False, None)
    assert tuned_gemm(64, n, k, "another GPU") == (False, None)


@pytest.mark.cuda
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_writes_fp8_like_the_reference(qk_norm):
    from minisgl.device.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    hq, hk, dim, tokens_, scales = 32, 8, 128, 100, (0.5, 2.0)
    caches = [MHAKVCache(64, 16, 2, hk, dim, FP8, torch.device("cuda")) for _ in range(2)]
    slots = torch.randperm(64 * 16, device="cuda")[:tokens_]
    positions = torch.randint(0, 4096, (tokens_,), device="cuda")
    cos_sin = RotaryEmbedding(dim, 4096, 500000.0, None).cuda().cos_sin
    qkv = torch.randn(tokens_, (hq + 2 * hk) * dim, device="cuda", dtype=torch.bfloat16) * 4
    norm = (torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5,) * 2 + (1e-6,) if qk_norm else None
    got = rope_store(qkv, hq, positions, cos_sin, caches[0].k_cache(1), caches[0].v_cache(1), slots, norm, scales)
    want = rope_store_torch(
        qkv, hq, positions, cos_sin, caches[1].k_cache(1), caches[1].v_cache(1), slots, norm, scales=scales
    )
    torch.testing.assert_close(got, want, atol=6e-2, rtol=2e-2)  # q of |x| up to ~20 in bf16
    for layer in range(2):
        for view in ("k_cache", "v_cache"):
            a, b = getattr(caches[0], view)(layer).float(), getattr(caches[1], view)(layer).float()
            # One e4m3 step at most: the reference rotates in bf16 arithmetic, the kernel in float32
            # (k differs by a bf16 step, near zero magnified by 1 / k_scale).
            torch.testing.assert_close(a, b, atol=0.07, rtol=0.13)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["prefill", "prefill_wide", "decode", "cascade"])
def test_attention_kernels_read_fp8_like_the_reference(mode):
    """prefill_wide: a chunk large enough that its pages are widened to bf16 for the 16-bit
    kernels, two of its requests sharing their cached pages (read once into the scratch)."""
    from minisgl.device.attention.synthetic import prefill_metadata
    from tests.test_cuda import backend_outputs

    hq, hk, dim, pages, page_size, scales = 32, 8, 128, 512, 16, (0.7, 1.3)
    if mode == "prefill":
        cached, new = [0, 37, 300, 5], [45, 1, 129, 260]
    elif mode == "prefill_wide":
        cached, new = [1024, 1024, 300, 0], [600, 700, 1000, 300]
    else:
        cached, new = [300, 200, 700, 400, 1023, 64], [1] * 6
    outs = []
    for name in ("torch", "flashinfer"):
        torch.manual_seed(0)
        cache = MHAKVCache(pages, page_size, 2, hk, dim, FP8, torch.device("cuda"))
        cache.buffer.copy_(torch.randn(cache.buffer.shape, device="cuda").to(FP8))
        cache.scales = [scales, scales]
        meta = prefill_metadata(page_size, cached, new, pages, "cuda")
        if mode == "cascade":  # two groups of two sharing their first 8 and 4 pages
            meta.group_sizes, meta.group_pages = [2, 2], [8, 4]
            meta.page_table_host[1, :8] = meta.page_table_host[0, :8]
            meta.page_table_host[3, :4] = meta.page_table_host[2, :4]
        if mode == "prefill_wide":
            meta.page_table_host[1, :64] = meta.page_table_host[0, :64]  # a shared cached prefix
        backend = create_backend(name, cache, hq, hk, dim, dtype=torch.bfloat16)
        outs.append(backend_outputs(backend, cache, meta, hq, new, scales))
        if name == "flashinfer" and mode.startswith("prefill"):
            widened = backend.wide_pages
            assert (widened is not None) == (mode == "prefill_wide")
            if widened is not None:  # every page read, once
                read = {
                    int(p)
                    for row, (c, n) in enumerate(zip(cached, new))
                    for p in meta.page_table_host[row, : -(-(c + n) // page_size)]
                }
                assert sorted(widened.tolist()) == sorted(read)
    for ref, got in zip(*outs):
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [5, 300])  # our Triton kernel, then cuBLAS
@pytest.mark.parametrize("vocab", [5000, 5008])  # cuBLAS takes whole 16-row groups only
def test_fp8_lm_head_matches_the_reference_on_cuda(rows, vocab):
    from minisgl.device.kernels.fp8 import quantize_rows
    from minisgl.device.layers.quantization import dequantize, fp8_logits, quantize_torch

    torch.manual_seed(0)
    w = (torch.randn(vocab, 512, device="cuda") * 0.05).to(torch.bfloat16)
    wq, ws = quantize_torch(w)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    got = fp8_logits(x, wq, ws.view(-1))
    q, s = quantize_rows(x, None)  # the GPU's quantizer (test_triton_quantizers_match_torch checks it)
    want = dequantize(q, s) @ dequantize(wq, ws).t()
    assert got.dtype == torch.float32
    # Hopper's fp8 tensor-core sums keep fewer bits than float32 (0.006 seen on logits near 1, a
    # fifth of the fp8 rounding of the inputs themselves).
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
def test_fp8_prefill_widened_or_not_gives_the_same_logits(tmp_path, monkeypatch):
    """A long prefill on an fp8 cache through widened pages (bf16 kernels) and through FlashInfer's
    fa2 kernels on the fp8 pages: two exact views of the same pages, so the logits agree to the
    kernels' rounding (their summation orders differ, so not to the bit)."""
    from minisgl.device.attention import flashinfer_backend
    from tests.helpers import prefill_batch

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    runner = ModelRunner(
        EngineArgs(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=16384,
            page_size=16,
            kv_cache_dtype="fp8_e4m3",
            cuda_graph_max_bs=0,
        )
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (900, 700, 1000, 300)]
    logits = {}
    for name, least in {"wide": flashinfer_backend.WIDE_MIN_CHUNK_TOKENS, "fa2": 1 << 30}.items():
        monkeypatch.setattr(flashinfer_backend, "WIDE_MIN_CHUNK_TOKENS", least)
        logits[name] = runner.forward(prefill_batch(runner, prompts)).float()
        assert (runner.attn.wide_pages is not None) == (name == "wide")
    torch.testing.assert_close(logits["wide"], logits["fa2"], atol=5e-2, rtol=5e-2)
    assert (logits["wide"].argmax(-1) == logits["fa2"].argmax(-1)).all()


@pytest.mark.cuda
def test_fp8_engine_on_cuda_graphs_overlap_and_cascade(tmp_path):
    """W8A8 + fp8 KV in bf16 on the GPU: CUDA graphs with overlap and cascade on give the eager,
    synchronous, cascade-off tokens (the decode kernel's exactness holds on fp8 pages too)."""
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=48)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for name, kw in {
        "eager": dict(cuda_graph_max_bs=0, disable_overlap_schedule=True, disable_cascade_attention=True),
        "graphs": dict(cuda_graph_max_bs=32),
    }.items():
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=8192,
            max_running_requests=32,
            page_size=16,
            quantization="fp8",
            kv_cache_dtype="fp8_e4m3",
            **kw,
        )
        outs[name] = [r["output_ids"] for r in llm.generate(prompts, params)]
    assert outs["graphs"] == outs["eager"]


def test_regexes_hold_under_fp8(tiny_llama):
    """Grammars mask the logits whatever computed them: every regex holds with FP8 weights and KV."""
    import re

    from minisgl.wire.sampling import SamplingParams
    from tests.grammar_cases import MAX_NEW, REGEXES

    llm = make_llm(tiny_llama, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=i, regex=p) for i, p in enumerate(REGEXES)]
    for r, pattern in zip(llm.generate([f"Answer {i}:" for i in range(len(REGEXES))], params), REGEXES):
        assert r["meta_info"]["finish_reason"] == "stop" and re.fullmatch(pattern, r["text"]), (pattern, r["text"])


def test_a_gpu_takes_the_tiles_its_table_lacks_from_its_chip(tmp_path):
    """Tuned tables are per GPU name; shapes a GPU's own table lacks come from tables tuned on
    the same chip (an H200 runs the H100's tiles), never from another chip's."""
    from minisgl.device.kernels import moe as kmoe
    from minisgl.device.layers import tuned_tables

    path = tmp_path / "tiles.json"
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    tables = {h100: {"a": {"1": 1}, "b": {"1": 2, "8": 2}}, h200: {"b": {"8": 3}}, "NVIDIA A100": {"c": {"1": 4}}}
    path.write_text(json.dumps(tables))
    # its own buckets first, its chip's at the sizes it was not tuned at
    assert tuned_tables.table(path, h200, "sm90x132") == {"a": {"1": 1}, "b": {"1": 2, "8": 3}}
    assert tuned_tables.table(path, "NVIDIA H800", "sm90x132") == tables[h100]  # (the first name of two)
    assert tuned_tables.table(path, "NVIDIA H800", "sm80x108") == {}
    assert tuned_tables.table(path, h200) == {"b": {"8": 3}}  # (no chip: its own alone)
    # the shipped tables: the H200 has fp8 GEMM tiles for the 8B shapes alone, MoE tiles at 256
    # and 1024 tokens (bf16 and fp8) and none for block-wise fp8 experts
    n, k = 1024, 1024  # Qwen3-0.6B's o_proj, tuned on the H100
    assert tuned_gemm(64, n, k, h200) == (False, None)
    assert tuned_gemm(64, n, k, h200, "sm90x132") == tuned_gemm(64, n, k, h100) != (False, None)
    key = kmoe.table_key(128, 768, 2048, 8, kmoe.table_kind(torch.bfloat16, None, True))
    assert kmoe.moe_config(16, key, 128, 8, h200, "sm90x132") == kmoe.moe_config(16, key, 128, 8, h100)
    assert kmoe.moe_config(1024, key, 128, 8, h200, "sm90x132") == kmoe.moe_config(1024, key, 128, 8, h200)
    assert kmoe.moe_config(1024, key, 128, 8, h200) != kmoe.moe_config(1024, key, 128, 8, h100)
    block = kmoe.table_key(128, 768, 2048, 8, kmoe.table_kind(torch.bfloat16, 128, True))
    assert kmoe.moe_config(256, block, 128, 8, h200) == kmoe.default_config(256, 128, 8)
    assert kmoe.moe_config(256, block, 128, 8, h200, "sm90x132") == kmoe.moe_config(256, block, 128, 8, h100)
    assert kmoe.moe_config(256, block, 128, 8, h100) != kmoe.default_config(256, 128, 8)
