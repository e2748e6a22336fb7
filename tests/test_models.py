"""Every architecture matches Hugging Face transformers on the same tiny fp32 checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from minisgl.config.args import EngineArgs
from minisgl.device.tiny_model import ARCHS
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.wire.steps import ForwardBatch
from tests.helpers import generate, page_table_writes, prefill_batch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 77)), [42]]


def make_runner(path, page_size: int = 1, **kw) -> ModelRunner:
    return ModelRunner(
        EngineArgs(
            model=str(path), page_size=page_size, max_total_tokens=8192, device="cpu", max_running_requests=8, **kw
        )
    )


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    runner, hf = make_runner(tiny_models[arch]), hf_model(tiny_models[arch])
    logits = runner.forward(prefill_batch(runner, PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_position_matches_transformers(tiny_models, arch):
    """Each token's logits, obtained by decoding the prompt one token at a time."""
    runner, hf = make_runner(tiny_models[arch], page_size=4), hf_model(tiny_models[arch])
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    writes = page_table_writes(runner, [len(prompt)])
    for pos, tok in enumerate(prompt):
        batch = ForwardBatch(
            slots=[0], cached_lens=[pos], new_lens=[1], input_ids=[tok], sample=[True], **(writes if pos == 0 else {})
        )
        torch.testing.assert_close(runner.forward(batch)[0], ref[pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(tiny_models, arch):
    runner, hf = make_runner(tiny_models[arch]), hf_model(tiny_models[arch])
    ours, _ = generate(runner, PROMPTS, max_new=32)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    for prompt, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), generation_config=gen_cfg)[0, len(prompt) :]
        assert tokens == ref.tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_two_part_prefill_equals_full_prefill(tiny_llama, page_size):
    runner = make_runner(tiny_llama, page_size=page_size)
    prompts = [list(range(3, 40)), list(range(50, 71)), list(range(200, 290))]
    full = runner.forward(prefill_batch(runner, prompts))
    # Same prompts in other pages: first a prefix, then the rest attending to it via the page rows.
    offset = 64
    writes = page_table_writes(runner, [len(p) for p in prompts], first_page=offset)
    cuts = [17, 16, 45]
    first = ForwardBatch(
        slots=[0, 1, 2],
        cached_lens=[0, 0, 0],
        new_lens=cuts,
        input_ids=sum((p[:c] for p, c in zip(prompts, cuts)), []),
        sample=[False] * 3,
        **writes,
    )
    assert runner.forward(first).shape[0] == 0
    second = ForwardBatch(
        slots=[0, 1, 2],
        cached_lens=cuts,
        new_lens=[len(p) - c for p, c in zip(prompts, cuts)],
        input_ids=sum((p[c:] for p, c in zip(prompts, cuts)), []),
        sample=[True] * 3,
    )
    torch.testing.assert_close(runner.forward(second), full, atol=1e-5, rtol=0)


def test_mixed_prefill_and_decode_batch(tiny_llama):
    """A step holding one decoding request and one prefilling request gives each its own logits."""
    runner = make_runner(tiny_llama, page_size=4)
    a, b = list(range(10, 30)), list(range(400, 413))
    alone = runner.forward(prefill_batch(runner, [a + [7], b]))
    writes = page_table_writes(runner, [len(a) + 1, len(b)])
    runner.forward(ForwardBatch(slots=[0], cached_lens=[0], new_lens=[len(a)], input_ids=a, sample=[True], **writes))
    mixed = runner.forward(
        ForwardBatch(
            slots=[0, 1], cached_lens=[len(a), 0], new_lens=[1, len(b)], input_ids=[7] + b, sample=[True, True]
        )
    )
    torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
