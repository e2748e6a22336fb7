"""RequestOptions: everything one request asks for beyond its sampling parameters.

Built once, where a route parses the request body; carried as it is through the tokenizer, the
scheduler and the worker (``GenerateReq`` -> ``TokenizedReq`` -> ``Req`` -> ``NewRequest``) and
read again where meta_info is built. A new per-request option is a field here, the code that
reads it, and its test: no hop in between re-lists the options. The tokenizer fills the two
token-id fields from the text ones (``prediction_ids``, ``think_markers``).
"""

from __future__ import annotations

import msgspec


class RequestOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Logprobs (SGLang's return_logprob, top_logprobs_num, logprob_start_len, token_ids_logprob,
    # return_text_in_logprobs): -1 none; 0 the chosen token's; n the n most likely too.
    top_logprobs: int = -1
    logprob_start: int = -1  # prompt logprobs from this position (-1: none)
    logprob_ids: list[int] = []  # these ids' logprobs at every position
    text_in_logprobs: bool = False  # each logprob entry with its token's text
    entropy: bool = False  # return_entropy: each output token's distribution's entropy
    prompt_ids: bool = False  # return_prompt_token_ids: the prompt's ids with the first update
    # Captures (return_routed_experts from routed_experts_start_len, -1: none; return_hidden_states).
    routed_start: int = -1
    hidden_states: bool = False
    cache_salt: str | None = None  # extra_key / cache_salt: prefixes shared only with the same key
    lora: str | None = None  # lora_path: the name of a loaded adapter it runs under
    # max_thinking_tokens (-1: none); think_open: the model starts inside its thinking section.
    think_budget: int = -1
    think_open: bool = False
    think_markers: list[list[int]] = []  # the open and close markers' ids (the tokenizer's)
    require_reasoning: bool = False  # SGLang's: the model thinks first; a grammar constrains what follows
    prediction: str | None = None  # OpenAI's predicted output: a draft source, no result depends on it
    prediction_ids: list[int] = []  # ``prediction`` tokenized (the tokenizer's)
    no_logs: bool = False  # SGLang's no_logs (zero data retention): --log-requests skips it

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs >= 0

    @property
    def thinks(self) -> bool:
        """Whether the scheduler follows its thinking (a budget, or a grammar held until after it)."""
        return self.think_budget >= 0 or self.require_reasoning
