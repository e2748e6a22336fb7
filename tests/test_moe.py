"""Mixture-of-experts: the fused GPU path (routing, alignment, grouped GEMMs, fp8) against the
torch reference of ``layers.moe``, loading per-expert and stacked checkpoint tensors, and whole
MoE checkpoints against radix on/off. (Token-for-token agreement with transformers for every
architecture is ``test_models``'s.)"""

from __future__ import annotations

import pytest
import torch

from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.moe import FusedMoE, experts_torch, route
from minisgl.device.tiny_model import make_tiny_model
from tests.interpreter import run_interpreted
from tests.test_rl import check_reads

cuda = pytest.mark.cuda


def make_moe(experts: int, top_k: int, hidden: int, inter: int, quant=None, device="cpu", dtype=torch.float32, seed=0):
    """A FusedMoE filled from random per-expert float tensors (quantized as they load under fp8)."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            moe = FusedMoE(experts, top_k, hidden, inter, quant)
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for e in range(experts):
        for shard in (0, 1):
            moe.load(moe.w13_weight, torch.randn(inter, hidden, generator=gen).to(device) / hidden**0.5, (e, shard))
        moe.load(moe.w2_weight, torch.randn(hidden, inter, generator=gen).to(device) / inter**0.5, (e, None))
    return moe


def test_route_softmax_topk_renormalize():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    w, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids[0].tolist() == [1, 2] and ids.dtype == torch.int32
    torch.testing.assert_close(w[0], probs[0, [1, 2]])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


def test_stacked_checkpoint_tensor_loads_like_per_expert_tensors():
    """GGUF (and fused exports) store experts stacked [E, rows, cols]: the same parameters."""
    per_expert = make_moe(4, 2, 32, 16)
    stacked = FusedMoE(4, 2, 32, 16, None)
    gate_up = per_expert.w13_weight.data
    stacked.load(stacked.w13_weight, gate_up[:, :16], (None, 0))
    stacked.load(stacked.w13_weight, gate_up[:, 16:], (None, 1))
    stacked.load(stacked.w2_weight, per_expert.w2_weight.data, (None, None))
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    assert torch.equal(stacked.w2_weight, per_expert.w2_weight)
    # Read back (get_weights_by_name): the first experts' up rows and down columns, split on the experts' width.
    up, dim, start, length = stacked.checkpoint_piece("w13_weight", (None, 1), 3)
    assert torch.equal(up, gate_up[:3, 16:]) and (dim, start, length) == (1, 0, 16)
    down, dim, _, _ = stacked.checkpoint_piece("w2_weight", (None, None), 10)
    assert torch.equal(down, per_expert.w2_weight.data) and dim == 2


@pytest.mark.parametrize("block", [None, 16])
def test_fp8_experts_stay_close_to_float(block):
    """fp8 weights and activations: the reference moves the output by fp8's rounding only."""
    x = torch.randn(9, 32)
    w, ids = route(torch.randn(9, 8), 2, True)
    dense = make_moe(8, 2, 32, 32)
    fp8 = make_moe(8, 2, 32, 32, Fp8Scheme(block=block, source="test"))
    want = experts_torch(x, dense.w13_weight, dense.w2_weight, w, ids)
    got = fp8(x, w, ids)
    assert (got - want).norm() / want.norm() < 0.1  # e4m3 keeps 3 mantissa bits: up to 6% per value


def test_moe_checkpoint_radix_on_and_off_give_the_same_tokens(tmp_path):
    from minisgl.llm import LLM

    path = make_tiny_model("qwen3_moe", tmp_path / "qwen3-moe")
    prefix = list(range(30, 90))
    prompts = [prefix + [200 + i, 7, 8] for i in range(6)]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for off in (True, False):
        llm = LLM(str(path), device="cpu", disable_radix_cache=off, max_running_requests=8)
        outs.append([r["output_ids"] for r in llm.generate(prompts, params)])
        llm.scheduler.check_integrity()
    assert outs[0] == outs[1]


# ---- the fused path on the GPU ------------------------------------------------------------------


def check_fused_kernels() -> None:
    """``kmoe.fused_experts`` against the torch loop, float and fp8 (per channel and 32-column
    groups), with SiLU-and-mul apart and inside the first GEMM, in 16-row blocks and in 32-row
    blocks that multiply 16 rows where those hold every pair, at 1, 20 and 600 tokens (1200
    pairs: the many-program alignment); the alignment alone at 5600 pairs of 128 experts. Random
    data from a fixed seed."""
    from unittest import mock

    from minisgl.device.kernels import moe as kmoe

    torch.manual_seed(0)
    for quant in (None, Fp8Scheme(None, "test"), Fp8Scheme(32, "test")):
        moe = make_moe(8, 2, 64, 32, quant)
        for tokens in (1, 20, 600):
            x = torch.randn(tokens, 64)
            w, ids = route(torch.randn(tokens, 8), 2, False)
            scales = (moe.w13_weight_scale, moe.w2_weight_scale)
            want = experts_torch(x, moe.w13_weight, moe.w2_weight, w, ids, quant, *scales)
            tiles = kmoe.GemmConfig(32, 32, 1, 4, 1)
            halves = tiles._replace(halves=True)  # 32-row blocks, 16 rows where those suffice
            configs = [
                kmoe.MoeConfig(bm, t, t, silu) for bm, t in ((16, tiles), (32, halves)) for silu in (False, True)
            ]
            for config in configs:
                with mock.patch.object(kmoe, "config_for", lambda *_, c=config: c):
                    got = kmoe.fused_experts(moe, x, w, ids)
                error = ((got - want).norm() / want.norm()).item()
                # fp8: a float32 sum in another order can round an activation to the next e4m3
                # value (6% of one element); a wrong row, scale or expert moves it by ~1
                assert error < (1e-5 if quant is None else 1e-3), (quant, tokens, config, error)
    # Qwen3-30B-A3B's routing shape past one chunk: 700 tokens x 8 of 128 experts, 6 chunks
    ids = torch.stack([torch.randperm(128)[:8] for _ in range(700)]).int()
    check_alignment(ids, 128, 64)
    ids = torch.stack([torch.randperm(60)[:4] for _ in range(50)]).int()  # experts not a power of two
    check_alignment(ids, 60, 16)


def check_alignment(ids: torch.Tensor, experts: int, bm: int) -> None:
    """``align``: every pair once, in a block of its own expert; blocks padded to BM rows each."""
    from minisgl.device.kernels.moe_align import align

    a = align(ids, experts, bm)
    P = ids.numel()
    used = int(a.num_padded.item())
    assert used % bm == 0 and used <= a.sorted_ids.numel()
    flat = ids.flatten().cpu()
    rows = a.sorted_ids[:used].cpu()
    real = rows[rows < P]
    assert sorted(real.tolist()) == list(range(P))
    owner = a.block_expert.cpu().repeat_interleave(bm)[:used]
    assert torch.equal(flat[real.long()], owner[rows < P].long())
    counts = torch.bincount(flat.long(), minlength=experts)
    assert used == int(((counts + bm - 1) // bm * bm).sum())


def test_the_model_path_reads_the_tuned_table():
    """Every kind the tuner writes is a name ``fused_experts`` looks up (bf16 experts once asked
    for "bfloat16", found nothing and ran on the untuned default tiles)."""
    pytest.importorskip("triton")
    import json

    from minisgl.device.kernels import moe as kmoe

    kinds = {kmoe.table_kind(torch.bfloat16, None, False)} | {
        kmoe.table_kind(torch.bfloat16, g, True) for g in (None, 128)
    }
    tables = json.loads(kmoe.CONFIGS_PATH.read_text())
    for gpu, shapes in tables.items():
        for key, buckets in shapes.items():
            assert key.rsplit(",", 1)[1] in kinds, key
            bm, up, down, *silu = buckets["1024"]
            got = kmoe.moe_config(1024, key, 128, 8, gpu)
            assert got == kmoe.MoeConfig(bm, kmoe.GemmConfig(*up), kmoe.GemmConfig(*down), bool(silu and silu[0]))
    bf16 = kmoe.table_key(128, 768, 2048, 8, kmoe.table_kind(torch.bfloat16, None, False))
    assert bf16 in tables["NVIDIA H100 80GB HBM3"]


def test_fused_kernels_on_cpu_through_the_interpreter():
    """The fused path's logic (routing, alignment, both GEMMs and the SiLU inside the first) on
    CPU: Triton's interpreter must be on before triton loads, so it runs in a child process.
    (On CPU the fp8 values stay float32 on the e4m3 grid, so fp8 matches the torch loop too.)"""
    run_interpreted("from tests.test_moe import check_fused_kernels; check_fused_kernels()")


@cuda
@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (60, 4)])
def test_topk_kernel_matches_torch(experts, top_k):
    logits = torch.randn(300, experts, device="cuda", dtype=torch.bfloat16)
    for renorm in (False, True):
        w, ids = route(logits, top_k, renorm)
        probs = torch.softmax(logits.float(), -1)
        ref_w, ref_ids = torch.topk(probs, top_k, -1)
        if renorm:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values)
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@cuda
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 32, 4), (5, 32, 4), (64, 32, 4), (1000, 32, 4), (8192, 128, 8)])
@pytest.mark.parametrize("bm", [16, 64])
def test_align_places_every_pair_once_in_its_experts_blocks(tokens, experts, top_k, bm):
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).int()
    check_alignment(ids, experts, bm)


@cuda
@pytest.mark.parametrize("quant", [None, "fp8", "fp8-b128"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 333])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 256, 128), (128, 8, 512, 256)])
def test_fused_experts_match_the_reference(quant, tokens, experts, top_k, hidden, inter):
    # Seeded: one token's fp8 error is one row's, and an e4m3 rounding flip in that row moved an
    # unseeded run past the bound about once in 70.
    torch.manual_seed(tokens)
    scheme = {None: None, "fp8": Fp8Scheme(None, "test"), "fp8-b128": Fp8Scheme(128, "test")}[quant]
    moe = make_moe(experts, top_k, hidden, inter, scheme, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w, ids = route(torch.randn(tokens, experts, device="cuda"), top_k, True)
    got = moe(x, w, ids)
    want = experts_torch(
        x, moe.w13_weight, moe.w2_weight, w, ids, scheme, moe.w13_weight_scale, moe.w2_weight_scale
    ).float()
    assert got.shape == (tokens, hidden) and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() / want.norm() < (2e-2 if quant is None else 3e-2)


@cuda
@pytest.mark.parametrize("quant", [None, "fp8", "fp8-b128"])
@pytest.mark.parametrize("tokens", [1, 64, 333, 2048])
def test_silu_inside_the_first_gemm_matches_the_reference(tokens, quant):
    """SiLU-and-mul in the first GEMM's epilogue (what the tuner may pick per shape and kind),
    at the table's widest product tiles too (256 columns: 128 outputs a program), and in
    128-row blocks that multiply 64 rows where those hold every pair."""
    from unittest import mock

    from minisgl.device.kernels import moe as kmoe

    torch.manual_seed(tokens)
    scheme = {None: None, "fp8": Fp8Scheme(None, "test"), "fp8-b128": Fp8Scheme(128, "test")}[quant]
    moe = make_moe(128, 8, 512, 256, scheme, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    w, ids = route(torch.randn(tokens, 128, device="cuda"), 8, True)
    want = experts_torch(
        x, moe.w13_weight, moe.w2_weight, w, ids, scheme, moe.w13_weight_scale, moe.w2_weight_scale
    ).float()
    default = kmoe.default_config(tokens, 128, 8)._replace(silu=True)
    halves = default._replace(bm=128, up=default.up._replace(halves=True), down=default.down._replace(halves=True))
    for config in (default, default._replace(up=default.up._replace(bn=256)), halves):
        with mock.patch.object(kmoe, "config_for", lambda *_, c=config: c):
            got = moe(x, w, ids)
        assert (got.float() - want).norm() / want.norm() < (2e-2 if quant is None else 3e-2), config


@cuda
def test_fused_experts_in_float32_are_exact():
    """float32 models on the GPU (tests, tensor-parallel checks) take the kernels with full
    float32 products, not TF32."""
    moe = make_moe(8, 2, 64, 32, device="cuda")
    x = torch.randn(20, 64, device="cuda")
    w, ids = route(torch.randn(20, 8, device="cuda"), 2, False)
    want = experts_torch(x, moe.w13_weight, moe.w2_weight, w, ids)
    torch.testing.assert_close(moe(x, w, ids), want, atol=1e-5, rtol=1e-5)


@cuda
def test_fused_experts_replay_in_a_cuda_graph():
    moe = make_moe(16, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(8, 16, device="cuda")
    out = moe(x, *route(logits, 4, True))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, *route(logits, 4, True))
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    w, ids = route(logits, 4, True)
    torch.testing.assert_close(out, experts_torch(x, moe.w13_weight, moe.w2_weight, w, ids), atol=2e-2, rtol=2e-2)


@cuda
def test_tiny_moe_bf16_on_cuda_matches_cpu_greedy_prefix(tmp_path):
    """A whole MoE checkpoint with graphs and overlap on the GPU: its fp32 run equals the CPU's
    tokens; bf16 with graphs equals bf16 eager, routed experts (written inside the graphs) too."""
    from minisgl.llm import LLM

    path = make_tiny_model("qwen3_moe", tmp_path / "qwen3-moe", overrides={"head_dim": 128})
    prompts = [list(range(3, 40)), list(range(100, 190)), [5, 6, 7]]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for name, kw in {
        "cpu": dict(device="cpu"),
        "cuda-fp32": dict(device="cuda", dtype="float32", attention_backend="torch", cuda_graph_max_bs=0),
        "bf16-eager": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=0, disable_overlap_schedule=True),
        "bf16-graphs": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8),
    }.items():
        llm = LLM(str(path), max_running_requests=8, max_total_tokens=4096, enable_return_routed_experts=True, **kw)
        out = llm.generate(prompts, params, return_routed_experts=True)
        runs[name] = [(r["output_ids"], r["meta_info"]["routed_experts"]) for r in out]
    assert runs["cuda-fp32"] == runs["cpu"]
    assert runs["bf16-graphs"] == runs["bf16-eager"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routed_experts_are_the_routers_choice_in_transformers(tiny_models, arch):
    """meta_info.routed_experts holds, for every position the model ran (prompt and outputs but
    the last), each layer's top-k experts: those transformers' router picks (-1 in dense layers).
    From routed_experts_start_len on only, the earlier prompt may come from the cache."""
    check_routed_experts(tiny_models[arch])


def check_routed_experts(path, cached: bool = True) -> None:
    """``test_routed_experts_are_the_routers_choice_in_transformers`` on the checkpoint at
    ``path``; ``cached``: whether the last request finds its prompt cached (a hybrid's does not:
    requests that return every prompt position's experts recompute the prompt and leave no
    state snapshot)."""
    from transformers import AutoModelForCausalLM

    from minisgl.llm import LLM
    from minisgl.utils import routed_experts_array

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", enable_return_routed_experts=True, max_running_requests=8)
    cfg = llm.runner.config
    prefix = list(range(40, 80))
    prompts = [prefix + [300 + i, 9] for i in range(3)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first = llm.generate(prompts[:1], params, return_routed_experts=True)[0]
    rest = llm.generate(prompts[1:], params, return_routed_experts=True)  # their prefix is cached
    late = llm.generate(prompts[2], params, return_routed_experts=True, routed_experts_start=len(prompts[2]))[0]
    llm.scheduler.check_integrity()
    assert (late["meta_info"]["cached_tokens"] > 0) == cached
    for prompt, res in zip(prompts, [first, *rest]):
        seq = prompt + res["output_ids"][:-1]
        got = routed_experts_array(res["meta_info"], cfg.num_layers, cfg.num_experts_per_tok)
        assert got.shape == (len(seq), cfg.num_layers, cfg.num_experts_per_tok)
        with torch.no_grad():
            routers = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        sparse = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        assert len(routers) == len(sparse)
        for layer, logits in zip(sparse, routers):
            want = torch.topk(logits.reshape(len(seq), -1), cfg.num_experts_per_tok, dim=-1).indices
            assert torch.equal(torch.from_numpy(got[:, layer].copy()).sort(-1).values, want.int().sort(-1).values)
        for layer in set(range(cfg.num_layers)) - set(sparse):
            assert (got[:, layer] == -1).all()
    full = routed_experts_array(rest[1]["meta_info"], cfg.num_layers, cfg.num_experts_per_tok)
    tail = routed_experts_array(late["meta_info"], cfg.num_layers, cfg.num_experts_per_tok)
    assert late["output_ids"] == rest[1]["output_ids"]
    assert (tail == full[len(prompts[2]) :]).all()


def test_routed_experts_need_the_server_flag(tiny_models):
    from minisgl.llm import LLM

    llm = LLM(str(tiny_models["qwen3_moe"]), device="cpu", max_running_requests=4)
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        llm.generate([[5, 6, 7]], {"max_new_tokens": 2}, return_routed_experts=True)


def test_moe_at_tp2_equals_tp1(tiny_models):
    """Experts split on their width across two ranks (gloo, fp32): the partial sums all-reduced
    after give tp=1's tokens and routed experts, Qwen2-MoE's shared expert included."""
    from minisgl.llm import LLM

    path = tiny_models["qwen2_moe"]
    prompts = [[1, 5, 9, 200, 31], list(range(3, 60))]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    kw = dict(device="cpu", dtype="float32", max_running_requests=4, enable_return_routed_experts=True)
    want = LLM(str(path), **kw).generate(prompts, params, return_routed_experts=True)
    tp2 = LLM(str(path), tp_size=2, **kw)
    got = tp2.generate(prompts, params, return_routed_experts=True)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["routed_experts"] for g in got] == [w["meta_info"]["routed_experts"] for w in want]
    check_reads(tp2, path, rows=64)  # every expert's shards gathered back into its tensors


@pytest.mark.parametrize("fmt", ["block", "compressed-tensors"])
def test_fp8_moe_checkpoints_load_with_no_flag(tiny_models, tmp_path, fmt):
    """Qwen3-30B-A3B-FP8's layout (experts' weights fp8 with 128 x 128 block scales) and the
    per-channel compressed-tensors one load as they are; logits stay near the float model's."""
    from scripts.quantize_checkpoint import convert
    from tests.helpers import prefill_batch
    from tests.test_models import make_runner

    src = tiny_models["qwen3_moe"]
    dst = convert(src, tmp_path / fmt, fmt)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    ref = make_runner(src)
    fp8 = make_runner(dst)
    assert (
        fp8.config.quant is not None and fp8.model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    )
    want = ref.forward(prefill_batch(ref, prompts))
    got = fp8.forward(prefill_batch(fp8, prompts))
    # fp8 moves the tiny models' logits about 10%: the dense tiny Qwen3 by 0.093 (block) and
    # 0.106 (per channel), this MoE by 0.108 and 0.092.
    assert (got - want).norm() / want.norm() < 0.15


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
# Hugging Face name part -> llama.cpp's (experts stacked under one name per part)
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps"}
EXPERT_GGUF |= {"down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def write_gguf(folder, path, arch: str) -> None:
    """A float32 .gguf file of a tiny Hugging Face checkpoint, laid out as llama.cpp's converter
    lays MoE models out: experts stacked [E, rows, cols], Llama's q/k rows interleaved, the
    shared expert's gate a vector, the byte-level BPE tokenizer in the metadata."""
    import json
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    name = GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(path), name)
    heads, kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(config.get("head_dim") or hidden // heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])

    def permute(t: np.ndarray, n: int) -> np.ndarray:  # the inverse of the loader's _unpermute
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    for key, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        a = t.float().numpy()
        if key in top:
            w.add_tensor(top[key], a)
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", key)
        layer, part, kind = int(m.group(1)), m.group(2).replace("block_sparse_moe", "mlp"), m.group(3)
        e = re.match(r"mlp\.experts\.(\d+)\.(\w+)$", part)
        if e:
            experts.setdefault((layer, EXPERT_GGUF[e.group(2)]), {})[int(e.group(1))] = a
            continue
        if name == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, heads if part.endswith("q_proj") else kv)
        if part == "mlp.shared_expert_gate":
            a = a.reshape(-1)
        w.add_tensor(f"blk.{layer}.{GGUF_NAMES[part]}.{kind}", a)
    for (layer, part), per_expert in experts.items():
        w.add_tensor(f"blk.{layer}.{part}.weight", np.stack([per_expert[i] for i in sorted(per_expert)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_moe_files_give_the_checkpoints_tokens(tiny_models, tmp_path, arch):
    """A GGUF file of each MoE family (stacked experts, the router, Qwen2-MoE's shared expert,
    Qwen3-MoE's dense layer found from its missing router) serves the tokens of the Hugging Face
    checkpoint it was written from."""
    from minisgl.checkpoint.gguf_file import converted_checkpoint
    from minisgl.llm import LLM

    path = tmp_path / f"{arch}.gguf"
    write_gguf(tiny_models[arch], path, arch)
    folder = converted_checkpoint(path, tmp_path / "cache")
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 90))]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    kw = dict(device="cpu", dtype="float32", max_total_tokens=4096)
    want = LLM(str(tiny_models[arch]), **kw).generate(prompts, params, top_logprobs=1)
    got = LLM(str(folder), **kw).generate(prompts, params, top_logprobs=1)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(
            g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"], atol=1e-5, rtol=0
        )


def test_routed_experts_through_the_openai_routes(tiny_models):
    """SGLang's return_routed_experts on /v1/completions and /v1/chat/completions: the first
    choice's experts in the response's sglext (also as the last streamed chunk), or each
    choice's in its meta_info with return_meta_info; the offline engine's, from
    routed_experts_start_len on (0: the whole prompt)."""
    import httpx

    from minisgl.llm import LLM
    from tests.server_utils import ServerProcess
    from tests.test_server import sse_events

    path = tiny_models["qwen3_moe"]
    prompt = list(range(40, 70))
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    llm = LLM(str(path), device="cpu", enable_return_routed_experts=True, max_running_requests=4)
    want = llm.generate(prompt, params, return_routed_experts=True, routed_experts_start=7)[0]["meta_info"]
    srv = ServerProcess(path, "--enable-return-routed-experts", "--served-model-name", "moe")
    try:
        srv.wait_ready()
        body = {"model": "moe", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        body.update(return_routed_experts=True, routed_experts_start_len=7)
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["sglext"]["routed_experts"] == want["routed_experts"]
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["sglext"]["routed_experts"] == want["routed_experts"]
        bad = httpx.post(f"{srv.url}/v1/completions", json={**body, "routed_experts_start_len": -1}, timeout=60)
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
        # chat: each choice's experts in its meta_info (from the prompt's first position here)
        chat = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        chat.update(return_routed_experts=True, return_meta_info=True, return_prompt_token_ids=True, n=2)
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert "sglext" not in r
        for choice in r["choices"]:
            ids = choice["prompt_token_ids"]
            alone = llm.generate(ids, {**params, "max_new_tokens": 3}, return_routed_experts=True)[0]["meta_info"]
            assert choice["meta_info"]["routed_experts"] == alone["routed_experts"]
    finally:
        srv.stop()
