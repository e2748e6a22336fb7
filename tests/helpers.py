"""A minimal driver for ModelRunner used by engine tests (the real scheduler comes later).

Each request gets a contiguous run of pages, enough for its prompt and outputs.
"""

from __future__ import annotations

from minisgl.device.worker.model_runner import ModelRunner
from minisgl.utils import cdiv
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, NewRequest


def page_table_writes(runner: ModelRunner, lengths: list[int], first_page: int = 0) -> dict[str, list[int]]:
    """Assign request i (slot i) pages for ``lengths[i]`` tokens, back to back from ``first_page``."""
    writes: dict[str, list[int]] = {"table_slots": [], "table_cols": [], "table_pages": []}
    page = first_page
    for slot, n in enumerate(lengths):
        for col in range(cdiv(n, runner.page_size)):
            writes["table_slots"].append(slot)
            writes["table_cols"].append(col)
            writes["table_pages"].append(page)
            page += 1
    return writes


def prefill_batch(runner: ModelRunner, prompts: list[list[int]], reserve: int = 0, **kw) -> ForwardBatch:
    return ForwardBatch(
        slots=list(range(len(prompts))),
        cached_lens=[0] * len(prompts),
        new_lens=[len(p) for p in prompts],
        input_ids=sum(prompts, []),
        sample=[True] * len(prompts),
        **page_table_writes(runner, [len(p) + reserve for p in prompts]),
        **kw,
    )


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new: int,
    params: list[SamplingParams] | None = None,
    top_logprobs: int = -1,
) -> tuple[list[list[int]], list]:
    """Prefill every prompt in one batch, then decode ``max_new - 1`` steps with -1 inputs."""
    params = params or [SamplingParams(temperature=0.0)] * len(prompts)
    new = [
        NewRequest(
            slot=i, sampling=p, seed=1000 + i, options=RequestOptions(top_logprobs=top_logprobs), prompt_ids=prompts[i]
        )
        for i, p in enumerate(params)
    ]
    outs = [runner.step(prefill_batch(runner, prompts, reserve=max_new, new_requests=new))]
    lens = [len(p) for p in prompts]
    for _ in range(max_new - 1):
        batch = ForwardBatch(
            slots=list(range(len(prompts))),
            cached_lens=lens,
            new_lens=[1] * len(prompts),
            input_ids=[-1] * len(prompts),
            sample=[True] * len(prompts),
        )
        outs.append(runner.step(batch))
        lens = [n + 1 for n in lens]
    tokens = [[o.tokens[i] for o in outs] for i in range(len(prompts))]
    return tokens, outs
