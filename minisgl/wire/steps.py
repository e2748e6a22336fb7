"""One model step between the scheduler and its workers: the batch, what it samples, and the
messages that complete a launched batch (late draft ids, grammar masks)."""

from __future__ import annotations

import msgspec

from minisgl.wire.control import ProfileReq, WorkerTask
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams

# Most groups one cascade decode step may have: CUDA graphs plan the shared level for a fixed
# number of groups per captured batch size (min(size // 2, this)).
MAX_CASCADE_GROUPS = 64


class NewRequest(msgspec.Struct, array_like=True):
    """A request taking a page-table slot: its sampling settings go to the worker once."""

    slot: int
    sampling: SamplingParams
    seed: int
    options: RequestOptions  # (the worker reads top_logprobs, logprob_ids and entropy)
    prompt_ids: list[int] = []  # only sent when penalties need the prompt's tokens
    output_ids: list[int] = []  # tokens generated before a retraction, for penalties
    prompt_len: int = 0
    ban_ids: list[int] = []  # masked until min_new_tokens are out (EOS and stop tokens)
    lora_slot: int = -1  # the adapter slot its rows use (-1: the base model)


class ForwardBatch(msgspec.Struct, array_like=True, tag=True):
    """One model step, scheduler -> worker.

    Request i lives in page-table row ``slots[i]``, has ``cached_lens[i]`` tokens in the KV cache
    and computes ``new_lens[i]`` more. Before the step the worker writes
    ``page_table[table_slots[j], table_cols[j]] = table_pages[j]``. ``input_ids`` holds the new
    tokens back to back; -1 means "the token this slot sampled last step", so decode inputs need
    not round-trip through the scheduler.

    Cascade decode (``group_sizes`` non-empty): the first ``sum(group_sizes)`` requests come in
    groups, group g being the next ``group_sizes[g]`` of them, whose page-table rows all begin
    with the same ``group_pages[g]`` pages (a prefix they share in the radix tree). Attention
    reads those pages once per group and each request's remaining pages on their own.

    A mixed step (--enable-mixed-chunk, ``prefill_reqs`` > 0): the first ``prefill_reqs`` requests
    are prefill chunks, the rest decode one token each, and the groups cover those.
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
    group_sizes: list[int] = []
    group_pages: list[int] = []
    prefill_reqs: int = 0
    # A verify step (speculative decoding): the first sum(verify_sizes) requests come in runs, one
    # per drafting request: rows of its slot at successive positions (its last token, then its
    # draft), each sampling the position after it. Its last token comes from the run's first row
    # whose sample differs from the next row's input (the last row has none).
    verify_sizes: list[int] = []
    # Prompt logprobs: rows of the step's new tokens whose next-token distribution is scored,
    # the token each is scored against, and how many top tokens to return with them.
    score_rows: list[int] = []
    score_ids: list[int] = []
    score_top: int = 0
    score_logprob_ids: list[int] = []  # ids scored at every score row (the union of its requests')
    # Structured output: indices (among the rows with sample=True) of rows whose tokens must
    # follow a grammar. The worker runs the forward pass, then samples once a SampleMasks comes.
    mask_rows: list[int] = []
    # Hierarchical cache: page copies before this step, writes (device, host) then loads (host,
    # device), flattened pairs; with wait_kv_io the step's layers wait for their copies (they
    # read loaded pages or reuse pages whose write may still run), else the copies run beside it.
    kv_writes: list[int] = []
    kv_loads: list[int] = []
    wait_kv_io: bool = False
    # The storage tier: pages read from disk into host pages before the copies (the scheduler
    # checked the files), and host pages (their copies done) to write behind, by key.
    disk_read_keys: list[bytes] = []
    disk_read_pages: list[int] = []
    disk_write_keys: list[bytes] = []
    disk_write_pages: list[int] = []
    # Rows of the step's new tokens whose expert ids (--enable-return-routed-experts) and last
    # hidden states (--enable-return-hidden-states) come back.
    route_rows: list[int] = []
    # Requests (indices into slots) whose verify step was still in flight when this one was
    # planned: their cached_lens count every row of that verify run as kept, and the worker
    # lowers them by the rows it rejected (known on the device by the time this step starts:
    # the worker plans them at their shortest and the device adds back what was kept).
    resolve_rows: list[int] = []
    # Rows whose input ids come after the batch, in a DraftIds (--speculative-schedule late): a
    # verify step's draft tokens, made once the steps before it are back, while the worker loads
    # the step's inputs and plans its attention.
    draft_rows: list[int] = []
    # LoRA adapters (scheduler/lora.py): copy adapter lora_swap_keys[i] (held in host memory) into
    # device slot lora_swap_slots[i] before this step's forward; free the host copies of lora_drops.
    lora_swap_slots: list[int] = []
    lora_swap_keys: list[str] = []
    lora_drops: list[str] = []
    # Hybrid models' state snapshots (``StatePool``): flattened (snapshot, slot) pairs copied into
    # requests' rows before the forward, (slot, snapshot) pairs copied out of them after it, and
    # (slot, snapshot, tokens) triples: the state after the chunk's first ``tokens`` tokens, saved
    # part-way through the forward (a snapshot inside a chunk, without a step of its own).
    state_loads: list[int] = []
    state_saves: list[int] = []
    state_splits: list[int] = []


class DraftIds(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> worker, after a batch with draft_rows: the input id of each such row."""

    ids: list[int]


class SampleMasks(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> worker, right after a batch with mask_rows: each such row's allowed tokens,
    int32 words [len(mask_rows), ceil(vocab / 32)] (bit t % 32 of word t // 32 allows token t)."""

    bitmask: bytes


ToWorker = ForwardBatch | DraftIds | SampleMasks | ProfileReq | WorkerTask


class StepOutput(msgspec.Struct, array_like=True, tag=True):
    """Sampled tokens of the requests with sample=True, in batch order (worker -> scheduler)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    entropy: list[float] | None = None  # of each row's distribution (rows of requests that ask)
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Prompt logprobs, one per ``ForwardBatch.score_rows`` entry (top ones cut to ``score_top``).
    score_logprobs: list[float] | None = None
    score_top_ids: list[list[int]] | None = None
    score_top_logprobs: list[list[float]] | None = None
    # Logprobs of requested token ids: per sampled row, that request's ids in its order; per
    # score row, every id of ``ForwardBatch.score_logprob_ids``.
    id_logprobs: list[list[float]] | None = None
    score_id_logprobs: list[list[float]] | None = None
    # Per ``ForwardBatch.route_rows`` entry, every layer's top-k expert ids: int32 [rows, layers, k],
    # and (--enable-return-hidden-states) its last hidden state: float32 [rows, hidden].
    routed_experts: bytes = b""
    hidden_states: bytes = b""
