"""Messages between processes: msgspec Structs, encoded as arrays (compact, never pickled)."""

from __future__ import annotations

import msgspec

from minisgl.sampling.params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    """A request taking a page-table slot: its sampling settings go to the worker once."""

    slot: int
    sampling: SamplingParams
    seed: int
    top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's; n: plus the n most likely
    prompt_ids: list[int] = []  # only sent when penalties need the prompt's tokens
    output_ids: list[int] = []  # tokens generated before a retraction, for penalties


class ForwardBatch(msgspec.Struct, array_like=True):
    """One model step, scheduler -> worker.

    Request i lives in page-table row ``slots[i]``, has ``cached_lens[i]`` tokens in the KV cache
    and computes ``new_lens[i]`` more. Before the step the worker writes
    ``page_table[table_slots[j], table_cols[j]] = table_pages[j]``. ``input_ids`` holds the new
    tokens back to back; -1 means "the token this slot sampled last step", so decode inputs need
    not round-trip through the scheduler.
    """

    slots: list[int]
    cached_lens: list[int]
    new_lens: list[int]
    input_ids: list[int]
    sample: list[bool]  # whether request i emits a token (False for a non-final prefill chunk)
    table_slots: list[int] = []
    table_cols: list[int] = []
    table_pages: list[int] = []
    new_requests: list[NewRequest] = []


class StepOutput(msgspec.Struct, array_like=True):
    """Sampled tokens of the requests with sample=True, in batch order (worker -> scheduler)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
