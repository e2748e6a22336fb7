"""Messages between processes: msgspec Structs, encoded as arrays (compact, never pickled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from minisgl.sampling.params import SamplingParams

# Most groups one cascade decode step may have: CUDA graphs plan the shared level for a fixed
# number of groups per captured batch size (min(size // 2, this)).
MAX_CASCADE_GROUPS = 64


class NewRequest(msgspec.Struct, array_like=True):
    """A request taking a page-table slot: its sampling settings go to the worker once."""

    slot: int
    sampling: SamplingParams
    seed: int
    top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's; n: plus the n most likely
    prompt_ids: list[int] = []  # only sent when penalties need the prompt's tokens
    output_ids: list[int] = []  # tokens generated before a retraction, for penalties
    prompt_len: int = 0
    ban_ids: list[int] = []  # masked until min_new_tokens are out (EOS and stop tokens)
    logprob_ids: list[int] = []  # token ids whose logprobs come with every output token
    lora_slot: int = -1  # the adapter slot its rows use (-1: the base model)
    entropy: bool = False  # each output token comes with its distribution's entropy


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


class DraftIds(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> worker, after a batch with draft_rows: the input id of each such row."""

    ids: list[int]


class SampleMasks(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> worker, right after a batch with mask_rows: each such row's allowed tokens,
    int32 words [len(mask_rows), ceil(vocab / 32)] (bit t % 32 of word t // 32 allows token t)."""

    bitmask: bytes


class ProfileReq(msgspec.Struct, array_like=True, tag=True):
    """Scheduler -> every worker: start a torch profiler trace (or stop it and write it)."""

    start: bool
    output_dir: str = ""
    num_steps: int = 0  # stop by itself after this many steps (0: at stop_profile)
    activities: list[str] = []  # "CPU", "GPU"


# ---- the RL control plane: weights and memory, scheduler -> every worker --------------------------
# The scheduler sends one of these only with no step in flight; every rank answers with a
# WorkerReply, and none changes its weights unless every rank checked the new ones.


class LoadWeights(msgspec.Struct, array_like=True, tag=True):
    """Copy a checkpoint (a folder, hub id or .gguf file) of the same architecture into the
    live weights."""

    model_path: str
    load_format: str = "auto"


class TensorWeights(msgspec.Struct, array_like=True, tag=True):
    """SGLang's serialized named tensors (torch's multiprocessing pickle: CUDA IPC or shared
    memory handles), one payload per tensor-parallel rank; decoded by a restricted unpickler."""

    payloads: list[bytes]
    load_format: str = "direct"  # or "flattened_bucket"


class WeightGroupSpec(msgspec.Struct, kw_only=True):
    """Where a trainer's weight group meets (SGLang's /init_weights_update_group body)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class JoinWeightGroup(WeightGroupSpec, array_like=True, tag=True, kw_only=True):
    """Join a process group with a trainer, whose rank 0 broadcasts new weights; this rank is
    ``rank_offset + tp_rank`` of ``world_size``."""


class BroadcastWeights(msgspec.Struct, array_like=True, tag=True):
    """Receive these tensors from the trainer's rank 0 over the joined group, then load them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str = "direct"  # or "flattened_bucket": one uint8 tensor of them all, back to back


class LeaveWeightGroup(msgspec.Struct, array_like=True, tag=True):
    group_name: str = "weight_update_group"


class MemoryOccupation(msgspec.Struct, array_like=True, tag=True):
    """Give the device memory behind ``tags`` back (``release``), or take it again."""

    release: bool
    tags: list[str] = msgspec.field(default_factory=lambda: ["weights", "kv_cache", "cuda_graph"])


class LoadLora(msgspec.Struct, array_like=True, tag=True):
    """Read the LoRA adapter at ``path`` into host memory under ``key`` (--enable-lora); batches
    copy it into device slots (``ForwardBatch.lora_swap_slots``). Without a path: SGLang's
    serialized tensors (``payload``, one for every rank, decoded as TensorWeights' are) with the
    adapter's config as JSON."""

    key: str
    path: str
    payload: bytes = b""
    config_json: str = ""
    load_format: str = "direct"


MAX_READ_ROWS = 1 << 20  # the most rows one ReadWeights returns


class ReadWeights(msgspec.Struct, array_like=True, tag=True):
    """The first ``rows`` rows of checkpoint tensor ``name`` as the model holds it now (SGLang's
    /get_weights_by_name): gathered over the ranks, fp8 dequantized, in WorkerReply.values."""

    name: str
    rows: int = 100


WorkerTask = (
    LoadWeights
    | TensorWeights
    | JoinWeightGroup
    | BroadcastWeights
    | LeaveWeightGroup
    | MemoryOccupation
    | LoadLora
    | ReadWeights
)


@dataclass
class LocalTensors:
    """New weights handed over in-process, as they are (the offline API holding its only rank):
    the tensors path without the pickle. Never sent over a socket."""

    named: list[tuple[str, Any]]


@dataclass
class LocalLora:
    """A LoRA adapter handed over in-process as tensors (the offline API holding its only rank):
    LoadLora's payload without the pickle. Never sent over a socket."""

    key: str
    named: dict[str, Any]
    config: dict[str, Any]


ToWorker = ForwardBatch | DraftIds | SampleMasks | ProfileReq | WorkerTask


class WorkerReply(msgspec.Struct, array_like=True, tag=True):
    """A rank's answer to a WorkerTask (rank 0 speaks for all: the ranks agreed first)."""

    ok: bool
    message: str = ""
    seconds: float = 0.0
    values: list[Any] | None = None  # ReadWeights' rows (nested lists of floats)


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


# ---- serving: API <-> tokenizer <-> scheduler <-> worker ----------------------------------------
# Every socket carries one tagged union, so a receiver decodes with a single typed decoder.


class ChatMessage(msgspec.Struct):
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls: {"type", "function": {name, arguments}}
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None


class GenerateReq(msgspec.Struct):
    """One sequence to generate: exactly one of text, input_ids or messages (rendered by the chat
    template)."""

    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    top_logprobs: int = -1
    fill_context: bool = False  # max_new_tokens becomes whatever context the prompt leaves
    logprob_start: int = -1  # prompt logprobs from this position (-1: none)
    logprob_ids: list[int] = []  # SGLang's token_ids_logprob: these ids' logprobs at every position
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking, ...)
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants
    # SGLang's return_routed_experts (with routed_experts_start_len): each position's experts per
    # layer from this position on, with the last message (-1: none).
    routed_start: int = -1
    hidden_states: bool = False  # SGLang's return_hidden_states: every position's, with the last message
    prediction: str | None = None  # OpenAI's predicted output: a draft source, no result depends on it
    continue_final: bool = False  # continue_final_message: the last message is left open and continued
    truncate: bool = False  # the Responses API's truncation "auto": the oldest messages dropped to fit
    lora: str | None = None  # the LoRA adapter it runs under (SGLang's lora_path: a loaded adapter's name)
    prompt_ids: bool = False  # SGLang's return_prompt_token_ids: the prompt's ids come back with the first update
    entropy: bool = False  # SGLang's return_entropy: each output token's distribution's entropy
    # SGLang's max_thinking_tokens (-1: none): then the reasoning markers are forced; think_open:
    # the model starts thinking (the reasoning parser says so) whatever the prompt shows.
    think_budget: int = -1
    think_open: bool = False
    suffix: str | None = None  # completions' suffix: the text after the hole a fill-in-the-middle prompt fills


class GenerateBatch(msgspec.Struct, tag=True):
    """API -> tokenizer: the sequences of one HTTP request (prompts x n), sent as one message and
    passed on as one ``TokenizedBatch``, so the scheduler sees them all at once and prefills them
    in one step rather than one per step as they trickle in."""

    reqs: list[GenerateReq]


class TokenizedReq(msgspec.Struct):
    """One sequence, tokenized."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    top_logprobs: int = -1
    logprob_start: int = -1  # prompt logprobs from this position (-1: none)
    logprob_ids: list[int] = []
    cache_salt: str | None = None  # shares cached prefixes only with requests of the same salt
    routed_start: int = -1
    prediction_ids: list[int] = []
    hidden_states: bool = False
    lora: str | None = None
    entropy: bool = False
    think_budget: int = -1
    think_markers: list[list[int]] = []  # the open and close markers' ids (with a budget)
    think_open: bool = False


class TokenizedBatch(msgspec.Struct, tag=True):
    """Tokenizer -> scheduler: the accepted sequences of one ``GenerateBatch``."""

    reqs: list[TokenizedReq]


class AbortReq(msgspec.Struct, tag=True):
    """Ends a request wherever it is. reason "stop" comes from a matched stop string."""

    rid: str
    reason: str = "abort"


class ControlReq(msgspec.Struct, tag=True):
    """A question for the scheduler, answered by ControlReply. op: "stats", "flush_cache",
    "profile" (hands ``profile`` to every worker), "pause" (``mode``), "continue", "weights"
    (runs ``task`` on every worker; ``abort_all``, ``flush_cache``, ``weight_version`` say what
    it means for requests and the cache), "weight_version" (``weight_version`` None: read it),
    "lora_load" and "lora_unload" (``lora_name``, ``lora_path``), "read_weights" (``task``: a
    ReadWeights; the rows come back as ``parameter``)."""

    cid: int
    op: str
    profile: ProfileReq | None = None
    task: WorkerTask | None = None
    mode: str = "abort"  # pause: abort, retract or in_place
    abort_all: bool = False
    flush_cache: bool = True
    weight_version: str | None = None
    keep_pause: bool = False  # stay paused after the update
    lora_name: str = ""  # "lora_load" (with lora_path, lora_pinned) and "lora_unload"
    lora_path: str = ""
    lora_pinned: bool = False


class ControlReply(msgspec.Struct, tag=True):
    cid: int
    ok: bool
    data: dict[str, float | int | str | bool | list[Any]]


class TextReq(msgspec.Struct, tag=True):
    """API -> tokenizer, answered there by TextReply (SGLang's /tokenize and /detokenize): token
    ids of ``texts`` (``special_tokens``: add the template's BOS and the like), or the texts of
    ``ids`` (``special_tokens``: keep them in the text)."""

    cid: int
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    special_tokens: bool = True


class TextReply(msgspec.Struct, tag=True):
    cid: int
    ids: list[list[int]] = []
    texts: list[str] = []
    error: str | None = None  # why the tokenizer could not answer (no tokenizer, an id it lacks)


class TokenOut(msgspec.Struct, array_like=True):
    """New tokens of one request since the last message. The first message after admission has
    no tokens (it tells the API the request was accepted); ``error`` means it was refused."""

    rid: str
    tokens: list[int] = []
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    finish_reason: str | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, those the host tier supplied
    error: str | None = None
    # With the first token of a request that asked for prompt logprobs: positions
    # input_start.. of the prompt, each its logprob given the tokens before it.
    input_start: int = 0
    input_logprobs: list[float] = []
    input_top_ids: list[list[int]] = []
    input_top_logprobs: list[list[float]] = []
    id_logprobs: list[list[float]] = []  # per token, the logprobs of the request's logprob_ids
    input_id_logprobs: list[list[float]] = []
    entropy: list[float] = []  # per token, its distribution's entropy (requests that ask)
    # With the last message, if asked: int32 [positions, layers, k] expert ids of every position
    # the model computed for it (prompt and outputs but the last); float32 [positions, hidden]
    # last hidden states of every position.
    routed_experts: bytes = b""
    hidden_states: bytes = b""


class TokenBatch(msgspec.Struct, tag=True):
    """Scheduler -> tokenizer: one step's outputs."""

    items: list[TokenOut]


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    text: str
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: list[tuple[int, str, float]] = []
    ids: list[tuple[int, str, float]] = []  # the request's token_ids_logprob, in its order


class ReqUpdate(msgspec.Struct, array_like=True):
    """Tokenizer -> API: what one request produced since its last update, detokenized."""

    rid: str
    text: str = ""  # new text, safe to show (complete characters, no part of a stop string)
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    matched: str | None = None  # the stop string that finished it (finish_reason "stop")
    input_logprobs: list[TokenLogprob] = []  # the prompt's, from its logprob_start on (once)
    routed_experts: bytes = b""  # with the last update (``TokenOut.routed_experts``)
    hidden_states: bytes = b""  # with the last update (``TokenOut.hidden_states``)
    prompt_ids: list[int] = []  # with the first update, when the request asked (``GenerateReq.prompt_ids``)
    host_cached_tokens: int = 0  # of cached_tokens, those the host tier supplied
    entropy: list[float] = []  # per new token, when the request asked (``GenerateReq.entropy``)

    def then(self, later: ReqUpdate) -> ReqUpdate:
        """One update saying what this one and then ``later`` said (updates held back or queued
        are sent as one)."""
        return ReqUpdate(
            self.rid,
            self.text + later.text,
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            later.finish_reason,
            later.prompt_tokens or self.prompt_tokens,
            later.cached_tokens,
            later.error,
            later.matched,
            self.input_logprobs + later.input_logprobs,
            later.routed_experts or self.routed_experts,
            later.hidden_states or self.hidden_states,
            self.prompt_ids or later.prompt_ids,
            later.host_cached_tokens,
            self.entropy + later.entropy,
        )


class UpdateBatch(msgspec.Struct, tag=True):
    items: list[ReqUpdate]


class EngineInfo(msgspec.Struct, tag=True):
    """Sent once along the start-up chain (worker -> scheduler -> tokenizer -> launcher)."""

    model_path: str
    num_pages: int
    page_size: int
    context_len: int
    vocab_size: int
    max_running_requests: int = 0
    eos_ids: list[int] = []
    tool_call_parser: str | None = None  # the format of tool calls in answers (flag, or read from the template)
    kv_cache_dtype: str = ""  # the pool's element type, e.g. bfloat16 or float8_e4m3fn
    kv_bytes_per_token: int = 0  # K and V of one token over all layers (this rank's heads)
    quantization: str | None = None  # where the fp8 linear weights came from (online, or the checkpoint format)
    num_host_pages: int = 0  # the hierarchical cache's host pool (0: off)
    storage_fingerprint: str = ""  # what the KV bytes mean (model, layout, dtype): the disk tier's folder
    weight_version: str = "default"  # of the weights serving now (--weight-version, then each update's)
    device: str = "cpu"  # the workers' device type (the scheduler itself never loads torch)
    hidden_size: int = 0  # of the model's hidden states (rows of return_hidden_states)
    speculative: bool = False  # the scheduler drafts tokens (a request's predicted output is a draft source)
    lora_adapters: dict[str, str] = {}  # loaded LoRA adapters, name -> path (--lora-paths)


ToTokenizer = GenerateBatch | AbortReq | ControlReq | ControlReply | TextReq | TokenBatch | EngineInfo
ToScheduler = TokenizedBatch | AbortReq | ControlReq
ToApi = UpdateBatch | ControlReply | TextReply
