"""--enable-deterministic-inference: a request's tokens and logprobs are the same bits alone, inside
batches of random others, with its prefix cached or computed, in chunks of any size, with
cascade on or off and at tp=2."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from minisgl.device import batch_invariant
from minisgl.llm import LLM
from minisgl.wire.sampling import SamplingParams
from tests.test_scheduler import make_llm

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0)
SEEDED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=1234)


def target_prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 1000) for _ in range(70)]


def others(rng: random.Random, count: int, share: list[int]) -> tuple[list[list[int]], list[SamplingParams]]:
    """``count`` random requests: random lengths and answers, some sampled, some sharing a
    prefix with ``share`` (so the target's step has cascade groups and cache hits beside it)."""
    prompts, params = [], []
    for _ in range(count):
        n = rng.randrange(4, 120)
        head = share[: rng.randrange(16, len(share))] if rng.random() < 0.3 else []
        prompts.append(head + [rng.randrange(3, 1000) for _ in range(n)])
        temp = rng.choice([0.0, 0.7, 1.0])
        params.append(SamplingParams(max_new_tokens=rng.randrange(1, 24), ignore_eos=True, temperature=temp))
    return prompts, params


def result(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


def run_in_batch(llm: LLM, target: list[int], params: SamplingParams, size: int, seed: int):
    """The target's result inside a batch of ``size`` random others, at a random place."""
    rng = random.Random(seed)
    prompts, plist = others(rng, size, target)
    at = rng.randrange(size + 1)
    prompts.insert(at, target)
    plist.insert(at, params)
    return result(llm.generate(prompts, plist, top_logprobs=0)[at])


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, tuple[list[int], list[float]]]:
    """Each target request alone, on a fresh engine without a cache."""
    llm = make_llm(tiny_llama, dtype="float32", enable_deterministic_inference=True, disable_radix_cache=True)
    target = target_prompt()
    refs = {
        name: result(llm.generate([target], p, top_logprobs=0)[0])
        for name, p in (("greedy", GREEDY), ("seeded", SEEDED))
    }
    return refs


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"disable_cascade_attention": True},
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 48, "disable_radix_cache": True},
    ],
    ids=["radix+cascade", "no-cascade", "chunk16", "chunk48-no-radix"],
)
def test_target_bits_equal_alone_and_in_random_batches(tiny_llama, reference, engine):
    llm = make_llm(tiny_llama, dtype="float32", enable_deterministic_inference=True, **engine)
    target = target_prompt()
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        for size, seed in ((1, 0), (7, 1), (31, 2), (63, 3)):
            got = run_in_batch(llm, target, params, size, seed)
            assert got == reference[name], f"{name} in a batch of {size} others (seed {seed}) with {engine}"
    llm.scheduler.check_integrity()


def test_target_bits_equal_with_its_prefix_cached(tiny_llama, reference):
    # (page size 1: a finished request's decoded tokens are cached to the last one)
    llm = make_llm(tiny_llama, dtype="float32", enable_deterministic_inference=True, page_size=1)
    target = target_prompt()
    # An earlier request computes the target's first 48 tokens and decodes past them (so the
    # cached prefix comes from a prefill of another prompt), then the target runs on its pages.
    llm.generate([target[:48] + [5, 6, 7]], GREEDY)
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        out = llm.generate([target], params, top_logprobs=0)[0]
        assert out["meta_info"]["cached_tokens"] > 0
        assert result(out) == reference[name]
    # A prompt that is the target plus its own greedy answer: its cached prefix is the target's
    # prompt and the pages its decode steps wrote; what comes after must match a cold prefill.
    follow = target + reference["greedy"][0]
    cached = llm.generate([follow], GREEDY, top_logprobs=0)[0]
    assert cached["meta_info"]["cached_tokens"] > len(target)
    cold_llm = make_llm(tiny_llama, dtype="float32", enable_deterministic_inference=True, disable_radix_cache=True)
    cold = cold_llm.generate([follow], GREEDY, top_logprobs=0)[0]
    assert result(cached) == result(cold)
    llm.scheduler.check_integrity()


def test_moe_target_bits_equal_alone_and_in_random_batches(tiny_models):
    llm = make_llm(tiny_models["qwen3_moe"], dtype="float32", enable_deterministic_inference=True)
    target = target_prompt()
    alone = result(llm.generate([target], SEEDED, top_logprobs=0)[0])
    for size, seed in ((5, 11), (40, 12)):
        assert run_in_batch(llm, target, SEEDED, size, seed) == alone
    llm.scheduler.check_integrity()


def test_tp2_target_bits_equal_across_batches(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", tp_size=2, enable_deterministic_inference=True)
    target = target_prompt()
    alone = result(llm.generate([target], GREEDY, top_logprobs=0)[0])
    for size, seed in ((3, 21), (20, 22)):
        assert run_in_batch(llm, target, GREEDY, size, seed) == alone
    del llm  # (the ranks stop with the engine)
    gc.collect()


def test_tiled_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(70, 64)
    batch_invariant.enable(True)
    try:
        full = batch_invariant.linear(x, weight)
        for m in (1, 2, 3, 17, 70):
            assert torch.equal(batch_invariant.linear(x[:m], weight), full[:m])
        assert torch.equal(batch_invariant.linear(x[33:34], weight), full[33:34])
        rows = torch.randn(5, 300)
        each = torch.cat([torch.log_softmax(r, dim=-1) for r in rows.split(1)])
        assert torch.equal(batch_invariant.rowwise(lambda t: torch.log_softmax(t, dim=-1), rows), each)
    finally:
        batch_invariant.enable(False)
    torch.testing.assert_close(full, x @ weight.t())


@pytest.mark.parametrize(
    "flags, refused",
    [
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}, "--enable-lora"),
        ({"quantization": "fp8"}, "--quantization"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "fp8 KV cache"),
    ],
)
def test_what_is_not_batch_invariant_is_refused_by_name(tiny_llama, flags, refused):
    with pytest.raises(ValueError, match=refused):
        LLM(str(tiny_llama), device="cpu", enable_deterministic_inference=True, **flags)


def test_hybrid_models_are_refused_with_the_flag(tmp_path):
    from minisgl.device.tiny_model import make_tiny_model

    path = make_tiny_model("qwen3_5", tmp_path / "h", seed=0)
    with pytest.raises(ValueError, match="enable-deterministic-inference"):
        LLM(str(path), device="cpu", enable_deterministic_inference=True)


def test_the_sglang_flag_launches_the_mode():
    from minisgl.launch import parse_args

    args = parse_args(["--model-path", "m", "--enable-deterministic-inference"])
    assert args.enable_deterministic_inference
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        parse_args(
            ["--model-path", "m", "--enable-deterministic-inference", "--speculative-algorithm", "NGRAM"]
        ).validate()
