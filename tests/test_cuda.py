"""GPU path: the JIT rope_store kernel, FlashInfer against the torch reference, real-shape decode.

Marked ``cuda``: skipped on machines without a GPU, run on the GPU machine before resolving.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from minisgl.config.args import EngineArgs
from minisgl.device.attention.base import AttentionMetadata
from minisgl.device.attention.select import create_backend
from minisgl.device.attention.synthetic import decode_metadata, mixed_metadata, prefill_metadata
from minisgl.device.kernels import rope_store, rope_store_torch, store_kv_torch
from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.device.tiny_model import make_tiny_model
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.utils import cdiv
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch
from tests.grammar_cases import MAX_NEW, REGEXES, schemas
from tests.helpers import generate, page_table_writes, prefill_batch
from tests.test_scheduler import make_llm, shared_prefix_prompts, tokens

pytestmark = pytest.mark.cuda
CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,dim", [((32, 8), 128), ((16, 8), 128), ((4, 2), 64), ((2, 1), 32), ((8, 8), 256)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kernel_matches_torch(dtype, heads, dim, page_size, qk_norm):
    """q/k norm + rotary + K/V store in one kernel, against the torch ops it replaces, on a
    layer view of the engine's cache and a qkv tensor with strided rows."""
    from minisgl.device.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    (hq, hk), layers, pages, tokens = heads, 3, 128, 100
    caches = [MHAKVCache(pages, page_size, layers, hk, dim, dtype, torch.device("cuda")) for _ in range(2)]
    slots = torch.randperm(pages * page_size, device="cuda")[:tokens]
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    cos_sin = RotaryEmbedding(dim, 4096, 500000.0, None).cuda().cos_sin
    width = (hq + 2 * hk) * dim
    qkv = torch.randn(tokens, width + 64, device="cuda", dtype=dtype)[:, :width]
    norm = None
    if qk_norm:
        norm = (
            torch.rand(dim, device="cuda", dtype=dtype) + 0.5,
            torch.rand(dim, device="cuda", dtype=dtype) + 0.5,
            1e-6,
        )
    layer = 1
    got = rope_store(qkv, hq, positions, cos_sin, caches[0].k_cache(layer), caches[0].v_cache(layer), slots, norm)
    want = rope_store_torch(
        qkv, hq, positions, cos_sin, caches[1].k_cache(layer), caches[1].v_cache(layer), slots, norm
    )
    torch.cuda.synchronize()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert got.is_contiguous() and got.shape == (tokens, hq, dim)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(caches[0].buffer, caches[1].buffer, **tol)
    # V is copied exactly, and nothing outside the written slots of the layer changed.
    assert torch.equal(caches[0].buffer[1], caches[1].buffer[1])
    assert (caches[0].buffer[:, [0, 2]] == 0).all()


def backend_outputs(
    backend,
    cache: MHAKVCache,
    meta: AttentionMetadata,
    hq: int,
    new: list[int],
    scales: tuple[float, float] = (1.0, 1.0),
) -> list[torch.Tensor]:
    """Two layers of ``backend`` on random bf16 q/k/v (seeded by the caller), their K/V stored first."""
    hk, dim = cache.k_cache(0).shape[2:]
    backend.prepare(meta)
    q = torch.randn(sum(new), hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(new), hk, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(new), hk, dim, device="cuda", dtype=torch.bfloat16)
    out = []
    for layer in range(2):
        store_kv_torch(cache.k_cache(layer), cache.v_cache(layer), k, v, meta.out_loc, scales)
        out.append(backend.forward(q, layer))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(32, 8), (16, 8), (8, 8)])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_flashinfer_matches_torch_backend(page_size, heads, mode):
    hq, hk, dim, pages = heads[0], heads[1], 128, 2048
    if mode == "prefill":
        cached, new = [0, 37, 300, 5], [45, 1, 129, 260]
    else:
        cached, new = [0, 15, 700, 31, 1023, 64], [1] * 6
    outs = []
    for name in ("torch", "flashinfer"):
        torch.manual_seed(0)  # both backends see the same cache, pages and inputs
        cache = MHAKVCache(pages, page_size, 2, hk, dim, torch.bfloat16, torch.device("cuda"))
        cache.buffer.normal_()
        meta = prefill_metadata(page_size, cached, new, pages, "cuda")
        outs.append(backend_outputs(create_backend(name, cache, hq, hk, dim), cache, meta, hq, new))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_step_attention_matches_torch_backend(page_size):
    """A mixed step (prefill rows, then decode rows in cascade groups) on FlashInfer and our
    kernel, against the torch backend on the same step."""
    hq, hk, dim = 32, 8, 128
    scale = 16 // page_size  # shared pages given for page size 16
    outs = []
    for name in ("torch", "flashinfer"):
        torch.manual_seed(0)
        cache = MHAKVCache(4096, page_size, 2, hk, dim, torch.bfloat16, torch.device("cuda"))
        cache.buffer.normal_()
        prefill = prefill_metadata(page_size, [0, 37, 300], [45, 129, 260], 1024, "cuda")
        groups = [(4 * scale, [70, 90, 65, 80]), (2 * scale, [40, 41])]
        decode = decode_metadata(page_size, groups, [33, 7], "cuda", first_page=1024)
        meta = mixed_metadata(prefill, decode)
        new = meta.new_lens
        outs.append(backend_outputs(create_backend(name, cache, hq, hk, dim), cache, meta, hq, new))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_tiny_model_fp32_on_cuda_matches_cpu(tiny_models):
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), [42]]
    results = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(
            EngineArgs(
                model=str(tiny_models["qwen3"]),
                device=device,
                max_total_tokens=4096,
                max_running_requests=4,
                page_size=16,
            )
        )
        results.append((runner.forward(prefill_batch(runner, prompts)).cpu(), generate(runner, prompts, 16)[0]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=0)
    assert results[1][1] == results[0][1]


def test_tiny_model_bf16_flashinfer_matches_torch_backend(tmp_path):
    # FlashInfer needs a real head size; 128 shares its compiled kernels with the 8B shape.
    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = [list(range(3, 40)), list(range(100, 190))]
    logits = []
    for backend in ("torch", "flashinfer"):
        runner = ModelRunner(
            EngineArgs(
                model=str(path),
                device="cuda",
                dtype="bfloat16",
                attention_backend=backend,
                max_total_tokens=4096,
                max_running_requests=4,
            )
        )
        logits.append(runner.forward(prefill_batch(runner, prompts)).float())
    torch.testing.assert_close(logits[1], logits[0], atol=3e-2, rtol=3e-2)


def test_llama8b_shape_decode_step_at_batch_64():
    batch, context = 64, 1024
    runner = ModelRunner(
        EngineArgs(
            model=str(CONFIGS / "llama3.1-8b"),
            load_format="dummy",
            device="cuda",
            context_length=2048,
            max_running_requests=batch,
            page_size=16,
            max_total_tokens=batch * (context + 16),
        )
    )
    writes = page_table_writes(runner, [context + 1] * batch)
    step = ForwardBatch(
        slots=list(range(batch)),
        cached_lens=[context] * batch,
        new_lens=[1] * batch,
        input_ids=list(range(batch)),
        sample=[True] * batch,
        **writes,
    )
    out = runner.step(step)
    assert len(out.tokens) == batch and all(0 <= t < runner.vocab_size for t in out.tokens)


def test_cuda_graphs_and_overlap_keep_greedy_tokens(tmp_path):
    """Graph replay (with padding to captured sizes) and overlap scheduling give the eager,
    synchronous engine's greedy tokens."""
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    rng = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 900, (40,), generator=rng).tolist()
    prompts = [prefix[: 10 + i] + torch.randint(3, 900, (1 + i % 7,), generator=rng).tolist() for i in range(37)]
    params = [{"max_new_tokens": 8 + i % 13, "temperature": 0.0, "ignore_eos": True} for i in range(37)]
    outs = {}
    for name, kw in {
        "eager-sync": dict(cuda_graph_max_bs=0, disable_overlap_schedule=True),
        "graphs-sync": dict(cuda_graph_max_bs=24, disable_overlap_schedule=True),
        "graphs-overlap": dict(cuda_graph_max_bs=24),
    }.items():
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=8192,
            max_running_requests=40,
            page_size=4,
            **kw,
        )
        assert (llm.runner.graphs is not None) == (kw["cuda_graph_max_bs"] != 0)
        outs[name] = [r["output_ids"] for r in llm.generate(prompts, params)]
    assert outs["graphs-sync"] == outs["eager-sync"]
    assert outs["graphs-overlap"] == outs["eager-sync"]


def test_one_token_prefill_chunks_under_cuda_graphs(tmp_path):
    """--chunked-prefill-size 1 --page-size 1: prefill batches of one new token per request look
    like decode batches and replay a graph, with rows that sample nothing (an IndexError once)."""
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = [[5 + i, 17, 23, 42 + i, 7] for i in range(6)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for kw in (dict(cuda_graph_max_bs=0), dict(cuda_graph_max_bs=8, chunked_prefill_size=1)):
        llm = LLM(str(path), device="cuda", dtype="float32", max_total_tokens=2048, page_size=1, **kw)
        outs.append([r["output_ids"] for r in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernels_match_torch(dtype):
    """FlashInfer's fused norm and SiLU-and-mul against the torch reference."""
    from minisgl.device.kernels import fused

    torch.manual_seed(0)
    tol = dict(atol=2e-2, rtol=2e-2)
    x = torch.randn(37, 4096, dtype=dtype, device="cuda")
    res = torch.randn_like(x)
    w = torch.rand(4096, dtype=dtype, device="cuda") + 0.5
    torch.testing.assert_close(fused.rmsnorm(x, w, 1e-5), fused.rmsnorm_torch(x, w, 1e-5), **tol)
    want_norm, want_res = fused.rmsnorm_torch(x + res, w, 1e-5), x + res
    got_norm, got_res = fused.add_rmsnorm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got_norm, want_norm, **tol)
    torch.testing.assert_close(got_res, want_res, **tol)
    gu = torch.randn(37, 2 * 1024, dtype=dtype, device="cuda")
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(gu), torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_launch_does_not_sync_the_host(tmp_path):
    """A step's launch (page-table writes, plan, graph replay or eager forward, cascade or not,
    sampling, copy to pinned memory) never waits for the GPU: only ``collect`` does. torch's sync debug mode
    raises on any synchronizing call made during the launches."""
    from minisgl.wire.sampling import SamplingParams
    from minisgl.wire.steps import NewRequest

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    runner = ModelRunner(
        EngineArgs(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=8192,
            max_running_requests=8,
            cuda_graph_max_bs=8,
        )
    )
    prompts = [list(range(3, 40)), list(range(100, 190)), [7] * 20]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ]
    new = [
        NewRequest(i, p, i, RequestOptions(top_logprobs=2 if i == 0 else -1), prompt_ids=prompts[i])
        for i, p in enumerate(params)
    ]
    lens = [len(p) for p in prompts]
    prefill = prefill_batch(runner, prompts, reserve=8, new_requests=new)
    decode = [
        ForwardBatch(
            slots=[0, 1, 2], cached_lens=[n + i for n in lens], new_lens=[1] * 3, input_ids=[-1] * 3, sample=[True] * 3
        )
        for i in range(4)
    ]
    for batch in decode[2:]:  # cascade steps: requests 0 and 1 as a group over one page
        batch.group_sizes, batch.group_pages = [2], [1]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.launch(prefill)
        for batch in decode:
            runner.launch(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    outs = [runner.collect() for _ in range(5)]
    assert all(len(o.tokens) == 3 for o in outs) and outs[0].top_ids is not None


def test_prompt_logprobs_on_cuda(tmp_path):
    """Prompt logprobs on the GPU: fp32 (torch attention) equal the CPU's; bf16 on FlashInfer
    with CUDA graphs within bf16 rounding, across prefill chunks. Output entropies likewise."""
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompt = list(range(3, 90))
    got = {}
    for name, kw in {
        "cpu": dict(device="cpu"),
        "fp32": dict(device="cuda", dtype="float32"),
        "bf16": dict(device="cuda", dtype="bfloat16", chunked_prefill_size=32),
    }.items():
        llm = LLM(str(path), max_total_tokens=4096, **kw)
        out = llm.generate(prompt, {"max_new_tokens": 4, "temperature": 0}, logprob_start=0, return_entropy=True)[0]
        got[name] = torch.tensor(out["meta_info"]["input_token_logprobs"][1:])
        got[name + "-entropy"] = torch.tensor(out["meta_info"]["output_token_entropy"])
        del llm
    torch.testing.assert_close(got["fp32"], got["cpu"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["bf16"], got["cpu"], atol=0.1, rtol=0.02)
    torch.testing.assert_close(got["fp32-entropy"], got["cpu-entropy"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["bf16-entropy"], got["cpu-entropy"], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_decoding_on_cuda(tmp_path, dtype):
    """On the GPU (CUDA graphs in bf16, overlap), a mixed batch of free and constrained requests:
    every constrained output parses or matches and ends by its grammar; a constrained request
    gets the same tokens with CUDA graphs as without (the mask is applied outside the graph)."""
    pytest.importorskip("xgrammar")  # the grammar extra (the GPU machine may not have it)
    prompts = shared_prefix_prompts(groups=2, per_group=8, prefix_len=24)
    shapes = schemas(len(prompts), seed=7)
    params = [
        SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        if i % 4 == 0
        else SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.0 if i % 2 else 0.8, seed=i, json_schema=json.dumps(shapes[i])
        )
        if i % 4 in (1, 3)
        else SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=i, regex=REGEXES[i % 6])
        for i in range(len(prompts))
    ]
    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    llm = make_llm(path, device="cuda", dtype=dtype)
    assert (llm.runner.graphs is not None) == (dtype == "bfloat16")  # fp32 runs the torch attention, eager
    results = llm.generate(prompts, params)
    for r, sp in zip(results, params):
        if sp.grammar is None:
            assert len(r["output_ids"]) == 64
            continue
        assert r["meta_info"]["finish_reason"] == "stop", (sp.grammar, r["text"])
        if sp.json_schema is not None:
            json.loads(r["text"])
        else:
            assert re.fullmatch(sp.regex, r["text"]), (sp.regex, r["text"])
    if llm.runner.graphs is None:
        return
    eager = make_llm(path, device="cuda", dtype=dtype, disable_cuda_graph=True)
    for i in (1, 2):
        assert tokens(eager.generate([prompts[i]], [params[i]])) == tokens(llm.generate([prompts[i]], [params[i]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_returns_float32_logits_from_half_weights(dtype):
    """The LM head keeps its GEMM's float32 accumulator: the logits equal a float32 product of
    the same half inputs far closer than a half rounding would, and are never tied by rounding."""
    from minisgl.device.layers.embedding import ParallelLMHead

    torch.manual_seed(0)
    head = ParallelLMHead(1000, 256).to("cuda", dtype)
    head.weight.data.normal_(0, 0.5)
    hidden = torch.randn(3, 7, 256, device="cuda", dtype=dtype)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 7, 1000)
    exact = hidden.float() @ head.weight.float().t()
    assert (logits - exact).abs().max() < 1e-3 * exact.abs().max()
    assert (logits - exact).abs().max() < (exact.to(dtype).float() - exact).abs().max() / 10
    assert head(hidden[:0, 0]).shape == (0, 1000)  # a step whose rows sample nothing
    # A CUDA graph's fixed buffer: the GEMM writes it in place, the same bits.
    buf = torch.full((5, 1000), float("nan"), device="cuda")
    got = head(hidden[0, :4], gather=False, out=buf[:4])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:4], logits[0, :4]) and buf[4].isnan().all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_trimmed_decode_plan_equals_flashinfers(page_size):
    """plan_decode's host-trimmed path (a graph wrapper's later steps) plans exactly what
    FlashInfer's own plan does: the same plan info and bit-equal attention outputs."""
    import flashinfer

    from minisgl.device.attention.flashinfer_backend import WORKSPACE_BYTES, plan_decode

    torch.manual_seed(0)
    hq, hk, dim, batch, max_pages = 32, 8, 128, 12, 64
    cache = torch.randn(batch * max_pages + 8, 2, page_size, hk, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)

    def graph_wrapper():
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"),
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
            paged_kv_indices_buffer=torch.zeros(batch * max_pages, dtype=torch.int32, device="cuda"),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"),
        )

    def inputs(lens):
        pages = [cdiv(n, page_size) for n in lens]
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.randperm(cache.shape[0], device="cuda")[: sum(pages)].int()
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32)
        return indptr, indices, last

    common = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=dim**-0.5)
    heads = (hq, hk, dim, page_size)
    trimmed, full = graph_wrapper(), graph_wrapper()
    for step, lens in enumerate([[40] * batch, [page_size * 3 + 1 + 5 * i for i in range(batch)], [1] * batch]):
        indptr, indices, last = inputs(lens)
        plan_decode(trimmed, indptr, indices, last, lens, heads, **common)  # full first, trimmed after
        full.plan(indptr, indices, last, *heads, **common)
        assert list(trimmed._plan_info) == list(full._plan_info), step
        assert trimmed._max_kv_len == full._max_kv_len
        assert torch.equal(trimmed.run(q, cache), full.run(q, cache)), step


@pytest.mark.cuda
def test_max_thinking_tokens_on_the_gpu(tmp_path):
    """bf16 on the GPU, decode graphs and overlap on: the budget closes thinking at the same token
    as eager synchronous steps; until then a budgeted row samples what the same prompt samples
    unbudgeted in its batch."""
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = {}
    for name, kw in {
        "eager": dict(cuda_graph_max_bs=0, disable_overlap_schedule=True, disable_piecewise_cuda_graph=True),
        "graphs": dict(cuda_graph_max_bs=8),
    }.items():
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_total_tokens=4096, **kw)
        close = llm.tokenizer.encode("</think>", add_special_tokens=False)
        prompts = [llm.tokenizer.encode(f"Question {i}: why?<think>\n") for i in range(3)]
        budgeted = [llm.generate(prompts, params, max_thinking_tokens=b) for b in (6, 0)]
        free = llm.generate(prompts, params)
        for out, budget in zip(budgeted, (6, 0)):
            for got, plain in zip(out, free):
                ids = got["output_ids"]
                assert ids[:budget] == plain["output_ids"][:budget] and ids[budget : budget + len(close)] == close
        outs[name] = [[r["output_ids"] for r in out] for out in budgeted]
        del llm
        torch.cuda.empty_cache()
    assert outs["graphs"] == outs["eager"]
