"""Piecewise prefill graphs: the forward cut at attention, padded to a captured size, gives what
the plain forward gives. On CPU the pieces run eagerly (the split and the padding); on CUDA they
replay captured graphs."""

from __future__ import annotations

import pytest
import torch

from minisgl.config.args import EngineArgs
from minisgl.device.tiny_model import make_tiny_model
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.device.worker.piecewise_graph import PiecewiseGraphRunner, token_sizes
from minisgl.llm import LLM
from tests.helpers import generate, prefill_batch
from tests.test_scheduler import make_llm, shared_prefix_prompts


def test_token_sizes_pad_little_above_1024():
    sizes = token_sizes(8192)
    assert sizes[:7] == [16, 32, 64, 128, 256, 512, 1024] and sizes[-1] == 8192
    assert sizes == sorted(set(sizes))
    for low, high in zip(sizes, sizes[1:]):
        assert high - low <= (low if low < 1024 else low / 8)
    assert len(sizes) == 7 + 24
    assert token_sizes(100) == [16, 32, 64, 100] and token_sizes(16) == [16] and token_sizes(5) == [5]


@pytest.mark.parametrize("arch,quant", [("llama", None), ("qwen3", None), ("qwen3", "fp8")])
def test_pieces_with_padding_match_the_plain_forward(tiny_models, arch, quant):
    """Three prompts (65 tokens) padded to 128: same logits, same KV in the requests' pages,
    same greedy tokens through decode."""
    kw = dict(
        model=str(tiny_models[arch]),
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=4,
        page_size=16,
        quantization=quant,
        kv_cache_dtype="fp8_e4m3" if quant else "auto",
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), [42]]
    plain, pieces = ModelRunner(EngineArgs(**kw)), ModelRunner(EngineArgs(**kw))
    pieces.piecewise = PiecewiseGraphRunner(pieces, [16, 32, 64, 128], capture=False)
    logits = [r.forward(prefill_batch(r, prompts)) for r in (plain, pieces)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    pages = 1 + 4 + 1  # the requests' pages from page 0 (7, 57 and 1 tokens): all written the same
    for layer in range(plain.config.num_layers):
        for cache in ("k_cache", "v_cache"):
            a, b = getattr(plain.kv_cache, cache)(layer)[:pages], getattr(pieces.kv_cache, cache)(layer)[:pages]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert generate(pieces, prompts, 8)[0] == generate(plain, prompts, 8)[0]


def test_pieces_under_the_scheduler_keep_tokens(tiny_models):
    """Chunked prefill over cached prefixes (radix cache on), every chunk through the pieces:
    the plain engine's greedy tokens, the cache's integrity held after every step."""
    prompts = shared_prefix_prompts(3, 4, 40)
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outs, used = [], []
    for piecewise in (False, True):
        llm = make_llm(tiny_models["qwen3"], chunked_prefill_size=48, page_size=4)
        if piecewise:
            llm.runner.piecewise = PiecewiseGraphRunner(llm.runner, token_sizes(48), capture=False)
            run = llm.runner.piecewise.forward
            llm.runner.piecewise.forward = lambda batch: used.append(sum(batch.new_lens)) or run(batch)
        outs.append([r["output_ids"] for r in llm.generate(prompts, params)])
    assert outs[1] == outs[0]
    assert used and max(used) <= 48 and any(n not in token_sizes(48) for n in used)  # padded steps ran


def test_padding_longer_than_a_context(tiny_models):
    """A step padded by more than a context: the padding goes as several requests on the
    padding slot, and the real rows are what the plain forward gives."""
    kw = dict(
        model=str(tiny_models["llama"]),
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=4,
        page_size=16,
        context_length=64,
    )
    plain, pieces = ModelRunner(EngineArgs(**kw)), ModelRunner(EngineArgs(**kw))
    pieces.piecewise = PiecewiseGraphRunner(pieces, [16, 256], capture=False)
    assert pieces.piecewise._padding(200).new_lens == [64, 64, 64, 8]
    prompts = [list(range(3, 40)), list(range(50, 60))]
    logits = [r.forward(prefill_batch(r, prompts)) for r in (plain, pieces)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_piecewise_is_off_without_cuda_graphs(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", max_total_tokens=2048)
    assert llm.runner.piecewise is None and llm.runner._piecewise_sizes() == []


@pytest.mark.cuda
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_piecewise_graphs_keep_greedy_tokens_on_cuda(tmp_path, quant):
    """Captured pieces against the eager prefill, bf16 (and fp8 weights + KV): logits of one
    padded step close, greedy tokens of a shared-prefix run under the scheduler equal."""
    path = make_tiny_model("qwen3", tmp_path / "qwen3-hd128", overrides={"head_dim": 128})
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=16384,
        max_running_requests=64,
        page_size=16,
        chunked_prefill_size=512,
        quantization=quant,
        kv_cache_dtype="fp8_e4m3" if quant else "auto",
    )
    prompts = [list(range(3, 40)), list(range(100, 190)), [7] * 300]
    logits, llms = [], []
    for piecewise in (False, True):
        llm = make_llm(path, disable_piecewise_cuda_graph=not piecewise, **kw)
        assert (llm.runner.piecewise is not None) == piecewise
        runner = llm.runner
        logits.append(runner.forward(prefill_batch(runner, prompts)).float())
        llms.append(llm)
    assert set(llms[1].runner.piecewise.graphs) == {16, 32, 64, 128, 256, 512}  # 427 tokens padded to 512
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2, rtol=5e-2)
    prompts = shared_prefix_prompts(4, 8, 200)
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = [[r["output_ids"] for r in llm.generate(prompts, params)] for llm in llms]
    same = sum(a == b for a, b in zip(*outs))
    # bf16 GEMMs over a padded row count may round differently: nearly every request agrees.
    assert same >= len(prompts) - 2, f"{same} of {len(prompts)} requests agree"


@pytest.mark.cuda
def test_piecewise_graphs_wait_for_host_tier_loads(tmp_path):
    """Conversations that outgrow a small device pool come back through the host tier, loaded
    layer by layer beside the forward: replayed pieces wait for each layer's copies as the eager
    forward does (same tokens with the pieces off, loads really happened)."""
    from tests.test_hicache import multi_turn

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    outs = []
    for piecewise in (True, False):
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=1200,
            enable_hierarchical_cache=True,
            hicache_ratio=4,
            hicache_io_backend="kernel",
            disable_piecewise_cuda_graph=not piecewise,
        )
        assert (llm.runner.piecewise is not None) == piecewise
        outs.append(multi_turn(llm))
        assert llm.scheduler.stats()["host_loaded_pages"] > 0
        llm.runner.host_pool.close()
    assert outs[0] == outs[1]
