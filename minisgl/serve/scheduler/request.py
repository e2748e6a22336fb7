"""Req: one generation request as the scheduler sees it (tokens, pages, lock, progress)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from minisgl.serve.cache import CacheHandle
from minisgl.serve.scheduler.prediction import Prediction
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams

PromptScore = tuple[float, list[tuple[int, float]], list[float]]  # (logprob, top (id, logprob), ids' logprobs)


@dataclass(eq=False, slots=True)  # slots: smaller objects, faster attribute reads in per-step loops
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + outputs may not exceed this many tokens
    options: RequestOptions = field(default_factory=RequestOptions)  # as the route built it
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_entropy: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # What the model computes per position, kept from position ``capture_start`` on (-1: nothing):
    # SGLang's return_routed_experts from ``routed_from`` (-1: not asked), the expert ids (int32
    # [layers, k] bytes), and its return_hidden_states (``hidden``: from position 0), the last
    # hidden state (float32 [hidden] bytes): ``captures`` holds (experts, hidden) of positions
    # capture_start, capture_start + 1, ... as recorded, sent when it finishes. Those prompt
    # positions are computed, not taken from the cache, except the ones already recorded (a
    # retracted request reuses them).
    capture_start: int = -1
    routed_from: int = -1
    captures: list[tuple[bytes, bytes]] = field(default_factory=list)
    output_id_logprobs: list[list[float]] = field(default_factory=list)  # per output token, per logprob_ids
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed
    host_cached_tokens: int = 0  # of those, tokens the host tier held (loaded back)
    # The tree of the prefix cache it reads and fills: its salt's, under the weights current when
    # it was queued (KV of older weights is never matched; ``Scheduler.new_weights``).
    kv_salt: str | None = None
    # Its LoRA adapter's slot on the workers (-1: none) and that adapter's key (its cache tree).
    lora_slot: int = -1
    lora_key: str | None = None
    queued_step: int = 0  # the scheduler step at which it last came to the queue (for aging)
    retracted: bool = False  # re-prefills its own tokens: no longer counts cache hits
    # Prompt logprobs from this position (-1: none): position j's logprob given tokens < j, with
    # its top tokens and the logprobs of logprob_ids; filled as prefill chunks run, sent with the
    # first output token.
    logprob_start: int = -1
    prompt_scores: dict[int, PromptScore] = field(default_factory=dict)
    prompt_scores_sent: bool = False
    # Structured output: the grammar being compiled, then the matcher that has seen every output
    # token processed so far; ``error`` is set when the grammar does not compile.
    grammar_future: Any = None
    grammar_deadline: float = 0.0  # time.monotonic() by which the grammar must have compiled
    matcher: Any = None
    think: Any = None  # its thinking budget (``think_budget.ThinkBudget``), if it has one
    masked: bool = False  # a grammar or a thinking budget: its rows may need masks (one check a step)
    error: str | None = None
    # Cache state, valid while the request holds a page-table slot.
    slot: int | None = None
    handle: CacheHandle = CacheHandle(0)  # the locked cached prefix
    pages: list[int] = field(default_factory=list)  # KV pages for tokens [0, kv_len)
    kv_len: int = 0  # tokens whose KV is computed or being computed by a sent step
    table_len: int = 0  # entries of `pages` already written to the worker's page table
    prefill_target: int = 0  # at admission: every token so far needs KV before decoding resumes
    # Hybrid models: the snapshot row its state starts from at its next step, the row its state
    # is copied to after it (-1: none), and (row, tokens) of a snapshot inside its next chunk.
    state_load: int = -1
    state_save: int = -1
    state_split: tuple[int, int] = (-1, 0)
    snapshot_at: list[int] = field(default_factory=list)  # where its prompt's snapshots go (ascending)
    # The short path of output processing (no logprobs, no grammar): its stop tokens and how
    # many tokens it may generate, set when it is queued.
    plain: bool = False
    stop_ids: frozenset[int] = frozenset()
    max_outputs: int = 0
    sent_tokens: int = 0  # output tokens the scheduler process has sent on (it sends the rest)
    # Speculative decoding: its own tokens' n-gram tables (n -> hash -> end position) as far as
    # ``ngrams_upto``, the hashes of its last windows (``ngram_keys``, ending at ``ngram_keys_end``:
    # the next step's new windows), verify runs in a row with nothing accepted, and plain steps
    # before it drafts again.
    ngrams: dict[int, dict[int, int]] | None = None
    ngrams_upto: int = 0
    ngram_keys: list[int] = field(default_factory=list)
    ngram_keys_end: int = -1
    spec_misses: int = 0
    spec_pause: int = 0
    # OpenAI's predicted output's n-gram tables once it drafts (``Prediction``).
    prediction: Prediction | None = None
    # Its last verify step still in flight (-1: none) and that step's draft (empty exactly when
    # none: drafts are never empty): until its tokens are back, kv_len counts the whole draft as
    # kept (a step planned meanwhile has the worker find the real length). ``verify_chain``: the
    # tokens that draft was made after are right so far, so the next may follow it.
    verify_step: int = -1
    verify_draft: list[int] = field(default_factory=list)
    verify_chain: bool = True
    # (speculation) draft tokens verified and those kept: SGLang's per-request spec_* meta_info
    spec_drafted: int = 0
    spec_accepted: int = 0
    # Place in the waiting queue (None while not waiting): its sequence number and trie node.
    queue_seq: int | None = None
    queue_node: Any = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt and outputs (the prompt list itself while there are no outputs: do not mutate)."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids), without joining the lists."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still to compute: prefill must not skip their positions."""
        return self.logprob_start >= 0 and not self.prompt_scores_sent

    @property
    def recomputes_prompt(self) -> bool:
        """It computes prompt positions the cache may hold (for their logprobs or experts): its
        pages enter the cache when it ends, never while an identical prompt may run."""
        return self.scores_prompt or self.captured_until < len(self.prompt_ids)

    @property
    def captured_until(self) -> int:
        """The first position not recorded (a huge number if nothing is asked)."""
        return self.capture_start + len(self.captures) if self.capture_start >= 0 else 1 << 62

    def routed_experts(self) -> bytes:
        """The expert ids of the positions it asked for, from ``routed_from`` on."""
        if self.routed_from < 0:
            return b""
        return b"".join(experts for experts, _ in self.captures[self.routed_from - self.capture_start :])

    def hidden_states(self) -> bytes:
        return b"".join(hidden for _, hidden in self.captures) if self.options.hidden_states else b""

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ReqEvent(NamedTuple):
    """What happened to a request, in the order it happened (``Scheduler.take_events``): every
    reader (the scheduler process, the offline API) sees one request's events in this order.

    ``accepted``: queued, or ended at once (``ended``: nothing to generate, or its grammar did not
    compile, ``req.error``); ``output``: a step gave it a token or finished it; ``aborted``: the
    engine ended it with no new token (a pause or weight update that aborts everything)."""

    kind: str
    req: Req
    ended: bool = False
