"""ModelRunner: owns the model, the KV cache, the page table and the sampler of one rank.

Its one job is ``step(batch) -> StepOutput``: write the batch's page-table updates, run the
model over the new tokens of every request, and sample the next token of each request that
asked for one. The cache is sized from the memory left after the weights and a warm-up pass.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from minisgl.args import EngineArgs
from minisgl.attention import AttentionMetadata, create_backend
from minisgl.attention.context import set_attention_backend
from minisgl.config import ModelConfig
from minisgl.distributed import get_tp_info
from minisgl.kvcache import MHAKVCache
from minisgl.messages import ForwardBatch, NewRequest, StepOutput
from minisgl.models.loader import load_model, resolve_model_path
from minisgl.sampling import SampleOutput, Sampler, SamplingParams
from minisgl.utils import cdiv, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class ModelRunner:
    def __init__(self, args: EngineArgs, model_dir: Path | None = None):
        args.validate()
        self.args = args
        self.device = resolve_device(args.device)
        self.model_dir = model_dir or resolve_model_path(args.model, args.load_format)
        self.config = ModelConfig.from_path(self.model_dir)
        self.dtype = resolve_dtype(args.dtype, self.config.torch_dtype, self.device)
        self.context_len = self.config.context_limit(args.context_length)
        self.page_size = args.page_size
        self.max_slots = args.max_running_requests
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        tp = get_tp_info()
        self.num_kv_heads = max(1, self.config.num_kv_heads // tp.size)
        self.num_qo_heads = self.config.num_heads // tp.size
        self.model = load_model(
            self.model_dir, self.config, self.dtype, self.device, self.context_len, args.load_format, args.seed
        )
        self.vocab_size = self.config.vocab_size
        self.page_table = torch.zeros(
            (self.max_slots, cdiv(self.context_len, self.page_size)), dtype=torch.int32, device=self.device
        )
        self.last_token = torch.zeros(self.max_slots, dtype=torch.int64, device=self.device)
        self.sampler = Sampler(self.max_slots, self.vocab_size, self.device)
        self.num_pages = self._profile_num_pages()
        self.kv_cache = self._make_cache(self.num_pages)
        self.attn = create_backend(
            args.attention_backend, self.kv_cache, self.num_qo_heads, self.num_kv_heads, self.config.head_dim
        )
        logger.info(
            "KV cache: %d pages x %d tokens (%.2f GiB, %s) on %s",
            self.num_pages, self.page_size, self.kv_cache.buffer.nbytes / 2**30, self.dtype, self.device,
        )

    # ---- set-up -------------------------------------------------------------------------------

    def _make_cache(self, num_pages: int) -> MHAKVCache:
        return MHAKVCache(
            num_pages, self.page_size, self.config.num_layers, self.num_kv_heads,
            self.config.head_dim, self.dtype, self.device,
        )

    def _profile_num_pages(self) -> int:
        """Run the largest prefill and sampling step once, then size the cache from what is left."""
        bytes_per_page = MHAKVCache.bytes_per_page(
            self.page_size, self.config.num_layers, self.num_kv_heads, self.config.head_dim, self.dtype
        )
        tokens = min(self.args.chunked_prefill_size, self.context_len)
        self.kv_cache = self._make_cache(cdiv(tokens, self.page_size))
        self.attn = create_backend(
            self.args.attention_backend, self.kv_cache, self.num_qo_heads, self.num_kv_heads, self.config.head_dim
        )
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self._warmup(tokens)
        del self.kv_cache, self.attn
        set_attention_backend(None)
        if self.args.max_total_tokens is not None:
            return cdiv(self.args.max_total_tokens, self.page_size)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            budget = free - total * (1 - self.args.mem_fraction_static) - activations
        else:
            # On CPU, more than every slot at full context is never useful.
            useful = self.max_slots * cdiv(self.context_len, self.page_size) * bytes_per_page
            budget = min(_available_host_bytes() * self.args.mem_fraction_static * 0.5, useful)
        num_pages = int(budget // bytes_per_page)
        if get_tp_info().size > 1:  # every rank must hold the same pages: take the smallest budget
            n = torch.tensor([num_pages], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_pages = int(n.item())
        if num_pages < cdiv(self.context_len, self.page_size) // 8 or num_pages < 1:
            raise RuntimeError(
                f"only {num_pages} KV pages fit in memory; lower --context-length or raise --mem-fraction-static"
            )
        return num_pages

    def _warmup(self, tokens: int) -> None:
        pages = cdiv(tokens, self.page_size)
        rows = min(self.max_slots, 256)
        batch = ForwardBatch(
            slots=[0], cached_lens=[0], new_lens=[tokens], input_ids=[0] * tokens, sample=[True],
            table_slots=[0] * pages, table_cols=list(range(pages)), table_pages=list(range(pages)),
        )
        self.forward(batch)
        # The sampler's worst case: every slot sampling with top-k/top-p over the whole vocabulary.
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
        for slot in range(rows):
            self.sampler.set_request(slot, params, [], [], seed=slot)
        logits = torch.zeros(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        self.sampler.sample(logits, list(range(rows)), [1] * rows)
        self.sampler.set_request(0, SamplingParams(temperature=0.0), [], [], seed=0)

    # ---- one step -----------------------------------------------------------------------------

    def add_requests(self, reqs: list[NewRequest]) -> None:
        for r in reqs:
            self.sampler.set_request(r.slot, r.sampling, r.prompt_ids, r.output_ids, r.seed, r.top_logprobs)

    def _metadata(self, batch: ForwardBatch) -> tuple[AttentionMetadata, torch.Tensor]:
        """Apply page-table writes and build positions, inputs and KV slots for the new tokens."""
        dev = self.device
        if batch.table_slots:
            upd = torch.tensor([batch.table_slots, batch.table_cols, batch.table_pages], dtype=torch.int64)
            upd = upd.to(dev, non_blocking=True)
            self.page_table[upd[0], upd[1]] = upd[2].to(torch.int32)
        new_lens = np.asarray(batch.new_lens, dtype=np.int64)
        cached = np.asarray(batch.cached_lens, dtype=np.int64)
        req_of_token = np.repeat(np.arange(len(new_lens)), new_lens)
        starts = np.cumsum(new_lens) - new_lens
        positions = np.arange(len(req_of_token), dtype=np.int64) - starts[req_of_token] + cached[req_of_token]
        slots = np.asarray(batch.slots, dtype=np.int64)
        host = torch.from_numpy(np.stack([positions, slots[req_of_token], np.asarray(batch.input_ids, np.int64)]))
        positions_t, token_slots, input_ids = host.to(dev, non_blocking=True)
        input_ids = torch.where(input_ids < 0, self.last_token[token_slots], input_ids)
        pages = self.page_table[token_slots, positions_t // self.page_size].to(torch.int64)
        out_loc = pages * self.page_size + positions_t % self.page_size
        meta = AttentionMetadata(
            slots=batch.slots, cached_lens=batch.cached_lens, new_lens=batch.new_lens,
            page_table=self.page_table, slots_t=torch.from_numpy(slots).to(dev, non_blocking=True),
            positions=positions_t, out_loc=out_loc,
        )
        return meta, input_ids

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] of the last new token of each request with sample=True."""
        meta, input_ids = self._metadata(batch)
        self.attn.prepare(meta)
        set_attention_backend(self.attn)
        hidden = self.model(input_ids, meta.positions)
        last = np.cumsum(batch.new_lens) - 1
        rows = torch.from_numpy(last[np.asarray(batch.sample, dtype=bool)]).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> StepOutput:
        self.add_requests(batch.new_requests)
        logits = self.forward(batch)
        chosen = [i for i, s in enumerate(batch.sample) if s]
        if not chosen:
            return StepOutput(tokens=[])
        slots = [batch.slots[i] for i in chosen]
        seq_lens = [batch.cached_lens[i] + batch.new_lens[i] for i in chosen]
        out = self.sampler.sample(logits, slots, seq_lens)
        self.last_token[torch.tensor(slots, device=self.device)] = out.tokens
        return self._to_message(out, slots)

    def _to_message(self, out: SampleOutput, slots: list[int]) -> StepOutput:
        msg = StepOutput(tokens=out.tokens.tolist())
        if out.logprobs is not None:
            msg.logprobs = out.logprobs.tolist()
        if out.top_ids is not None:
            wanted = [self.sampler.h_top_n[s] for s in slots]
            msg.top_ids = [row[:n] for row, n in zip(out.top_ids.tolist(), wanted)]
            msg.top_logprobs = [row[:n] for row, n in zip(out.top_logprobs.tolist(), wanted)]
        return msg
