"""Two micro-batches between attentions (models/overlap.py), in one process: the split schedule
gives the whole-batch step's tokens, the model turns it on only under tensor parallelism's
deferred all-reduces, and small steps keep the plain path."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl import distributed
from minisgl.models.overlap import TwoBatchOverlap


def test_halves_between_attentions_give_the_whole_steps_tokens(tiny_llama: Path) -> None:
    """At tp=1 the all-reduces are no-ops, so the split path (forced on) must reproduce the plain
    one: greedy tokens equal, logprobs within float32 rounding of row-split GEMMs; prefill steps
    (odd row counts) and decode steps both take it."""
    from minisgl.llm import LLM

    prompts = [[1, 5, 9, 200, 31], [7] * 40, list(range(3, 90))] + [[i, i + 1, i + 2] for i in range(10, 50)]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_running_requests=64)
    want = llm.generate(prompts, params, top_logprobs=1)
    rows: list[int] = []

    class Counting(TwoBatchOverlap):
        def __call__(self, layer, nxt, final_norm, attn, *args):
            rows.append(attn.shape[0])
            return super().__call__(layer, nxt, final_norm, attn, *args)

    model = llm.runner.model.model
    model.overlap = Counting(min_rows=2)
    got = llm.generate(prompts, params, top_logprobs=1)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(
            g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"], atol=1e-5, rtol=0
        )
    layers = len(model.layers)
    assert len(rows) % layers == 0 and len(rows) >= 8 * layers  # every layer of every step
    assert len(prompts) in rows  # a decode step of every request
    assert any(r % 2 for r in rows)  # an odd prefill: the halves differ in size


def test_only_deferred_all_reduces_of_large_steps_overlap(tiny_llama: Path) -> None:
    from minisgl.model_config import ModelConfig
    from minisgl.models.llama import DecoderModel

    config = ModelConfig.from_path(tiny_llama)
    try:
        distributed.set_tp_info(0, 2, overlap=True)
        assert DecoderModel(config, 64).overlap is not None
        distributed.set_tp_info(0, 2, reduce_fp32=True, overlap=True)  # sums in the norm's place: none deferred
        assert DecoderModel(config, 64).overlap is None
        distributed.set_tp_info(0, 2)
        assert DecoderModel(config, 64).overlap is None
    finally:
        distributed.set_tp_info(0, 1)
    overlap = TwoBatchOverlap()
    assert overlap.takes(32) and not overlap.takes(31)
