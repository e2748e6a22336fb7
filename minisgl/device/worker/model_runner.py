"""ModelRunner: owns the model, the KV cache, the page table and the sampler of one rank.

Its one job is running ForwardBatches: write the batch's page-table updates, run the model
over the new tokens of every request, and sample the next token of each request that asked for
one. ``launch`` queues a step on the device without waiting for it; ``collect`` returns the
oldest launched step's tokens (the only host sync of a step). The cache is sized from the memory
left after the weights and a warm-up pass; one extra scratch page and page-table row take the
padding rows of CUDA-graph batches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from minisgl.checkpoint.locate import resolve_model_path
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.config.args import EngineArgs
from minisgl.device import batch_invariant
from minisgl.device.attention import base
from minisgl.device.attention.base import AttentionMetadata, Gains
from minisgl.device.attention.context import set_attention_backend
from minisgl.device.attention.select import create_backend
from minisgl.device.distributed import get_tp_info, init_fused_all_reduce_norm, init_one_shot_all_reduce
from minisgl.device.kvcache.host_pool import HostKVPool
from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.device.kvcache.state_pool import StateShape, make_state_pool
from minisgl.device.layers.fp8_scheme import parse_kv_cache_dtype
from minisgl.device.layers.lora import LoraRows
from minisgl.device.layers.moe import RoutedExperts
from minisgl.device.layers.quantization import FP8
from minisgl.device.models.loader import load_model, weights_identity
from minisgl.device.sampler import SAMPLE_BLOCK, SampleOutput, Sampler
from minisgl.serve.cache.disk_store import DiskStore, fingerprint
from minisgl.utils import cdiv, resolve_device, resolve_dtype
from minisgl.wire.control import LocalLora, LocalTensors, WorkerReply
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, NewRequest, StepOutput, WorkerTask

if TYPE_CHECKING:
    from minisgl.device.models.lora_adapter import Shards
    from minisgl.device.worker.weight_checker import WeightChecker
    from minisgl.device.worker.weight_update import WeightUpdater

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 256 << 20  # default KV pool on CPU (or one full context, if larger)
CPU_WARMUP_TOKENS = 64
WARMUP_ROWS = SAMPLE_BLOCK  # sampling rows of the warm-up step: the sampler's largest block


# Requests a hybrid model runs at once unless --max-running-requests says: each holds its own
# recurrent state (63 MB for Qwen3.5-35B-A3B in float32) and the prefix cache as many snapshots.
HYBRID_MAX_RUNNING = 128


@dataclass
class _Pending:
    """A launched step: its sampled values on their way to host memory."""

    top_n: list[int]  # logprobs wanted per row, fixed at launch (a slot may change hands before collect); [] if none
    host: dict[str, torch.Tensor]
    event: torch.cuda.Event | None
    score_top: int = 0
    io_event: torch.cuda.Event | None = None  # the step's host-tier copies done
    ids: list[list[int]] | None = None  # per row, the token ids whose logprobs it wants
    id_union: list[int] | None = None  # the columns of host["id_logprobs"]


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def last_verified_torch(
    tokens: torch.Tensor,
    runs_info: torch.Tensor,
    runs: int,
    longest: int,
    last_token: torch.Tensor,
    rejected: torch.Tensor,
) -> None:
    """``kernels.verify.last_verified`` in torch (any device): the CPU path, and the kernel's reference."""
    rows = tokens.shape[0]
    following, starts, ends, slots = runs_info.split([rows, runs, runs, runs])
    run = torch.repeat_interleave(torch.arange(runs, device=tokens.device), ends - starts)
    index = torch.arange(rows, device=tokens.device).masked_fill(tokens == following, rows)
    first = torch.full((runs,), rows, dtype=torch.int64, device=tokens.device)
    first.scatter_reduce_(0, run, index, "amin")  # (a run's last row always differs: following -1)
    last_token[slots] = tokens[first]
    rejected[slots] = ends - 1 - first


class ModelRunner:
    def __init__(self, args: EngineArgs, model_dir: Path | None = None):
        args.validate()
        self.args = args
        self.device = resolve_device(args.device, args.gpu_index(0))
        if args.enable_deterministic_inference and self.device.type != "cpu":
            raise ValueError(
                "--enable-deterministic-inference: the batch-invariant CUDA kernels are not built yet (CPU only)"
            )
        batch_invariant.enable(args.enable_deterministic_inference)
        self.model_dir = model_dir or resolve_model_path(args.model, args.load_format, args.revision)
        self.config = ModelConfig.from_path(self.model_dir, args.model_overrides())
        if args.enable_deterministic_inference and self.config.quantization_config:
            raise ValueError("--enable-deterministic-inference: FP8 checkpoints' GEMMs are not batch-invariant yet")
        self.dtype = resolve_dtype(args.dtype, self.config.torch_dtype, self.device)
        self.kv_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.context_len = self.config.context_limit(args.context_length)
        self.page_size = args.page_size
        tp = get_tp_info()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # The custom all-reduces read peers' memory over NVLink: every rank on this host.
            if tp.size > 1 and not args.disable_custom_all_reduce and args.nnodes == 1:
                init_one_shot_all_reduce(self.device)
                # Decode batches (CUDA graphs and eager ones alike) up to the graph sizes.
                init_fused_all_reduce_norm(args.graph_batch_size, self.config.hidden_size)  # bound: derived later
        self.num_kv_heads = max(1, self.config.num_kv_heads // tp.size)
        self.num_qo_heads = self.config.num_heads // tp.size
        self.kv_layers = len(self.config.attention_layers)  # (a hybrid's DeltaNet layers keep no KV)
        self.model = load_model(
            self.model_dir,
            self.config,
            self.dtype,
            self.device,
            self.context_len,
            args.load_format,
            args.seed,
            args.quantization,
            args.quantize_lm_head,
        )
        self.vocab_size, self.hidden_size = self.config.vocab_size, self.config.hidden_size
        self.lora_rows = self._attach_lora()
        self.pending: deque[_Pending] = deque()
        # forward done, waiting for masks (with the step's gains)
        self._parked: tuple[ForwardBatch, torch.Tensor, Gains | None] | None = None
        # A launched batch waiting for its draft tokens: it, its gains, whether its graph is loaded.
        self._drafting: tuple[ForwardBatch, Gains | None, bool] | None = None
        self._gains: Gains | None = None  # the launching step's (``_defer``), read by ``_metadata``
        self._extras: dict[str, torch.Tensor] = {}  # the last forward's prompt scores and routed experts
        self.routed: RoutedExperts | None = None
        self.graphs = None
        self.piecewise = None
        if self.config.is_hybrid and self.device.type == "cuda" and args.max_running_requests is None:
            args.max_running_requests = HYBRID_MAX_RUNNING  # (sizes the state pool before the KV pool)
        self._slots(WARMUP_ROWS, warmup=True)
        self.num_pages = self._profile_num_pages()
        # Slots (page-table rows, sampling state) once the pool size says how many may run.
        self._slots(args.derive_max_running_requests(self.num_pages * self.page_size, self.device.type == "cuda"))
        self.routed = self._routed_experts()
        self.kv_cache = self._make_cache(self.num_pages + 1)
        self._set_kv_scales()
        self.page_table_host[self.pad_slot] = self.num_pages
        self.attn = create_backend(
            args.attention_backend,
            self.kv_cache,
            self.num_qo_heads,
            self.num_kv_heads,
            self.config.head_dim,
            args.decode_attention_backend,
            self.dtype,
        )
        self.host_pool = self._make_host_pool() if args.enable_hierarchical_cache else None
        self.num_host_pages = self.host_pool.num_pages if self.host_pool is not None else 0
        self._io_event: torch.cuda.Event | None = None
        self._events: list[torch.cuda.Event] = []  # the latest host-tier copies, per layer
        self.graph_capture_s = 0.0
        self.capture_graphs()
        self.weight_updater: WeightUpdater | None = None  # made with the first control task
        self.weight_checker: WeightChecker | None = None  # likewise (/weights_checker)
        self.memory_saver = None
        logger.info(
            "KV cache: %d pages x %d tokens (%.2f GiB, %s) on %s",
            self.num_pages,
            self.page_size,
            self.kv_cache.buffer.nbytes / 2**30,
            self.kv_dtype,
            self.device,
        )
        if self.states is not None:
            logger.info(
                "Gated DeltaNet states: %d request slots and %d snapshots (%.2f GiB, %.1f MiB each)",
                self.max_slots,
                len(self.snapshot_rows),
                self.states.nbytes / 2**30,
                self.states.nbytes / self.states.conv.shape[1] / 2**20,
            )

    # ---- set-up -------------------------------------------------------------------------------

    def _graphs_enabled(self) -> bool:
        """Whether steps may replay CUDA graphs: on a GPU, unless turned off, with a backend that
        can be captured."""
        args = self.args
        return (
            self.device.type == "cuda"
            and args.cuda_graph_max_bs != 0
            and not args.disable_cuda_graph
            and self.attn.supports_cuda_graph
        )

    def capture_graphs(self) -> bool:
        """Capture the decode graphs and the piecewise prefill graphs (where enabled); returns
        whether any were captured."""
        start = time.perf_counter()
        if self._graphs_enabled():
            from minisgl.device.worker.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, self.args.graph_batch_size)
        sizes = self._piecewise_sizes()
        if sizes:
            from minisgl.device.worker.piecewise_graph import PiecewiseGraphRunner

            self.piecewise = PiecewiseGraphRunner(self, sizes)
        self.graph_capture_s = time.perf_counter() - start
        return self.graphs is not None or self.piecewise is not None

    def drop_graphs(self) -> None:
        """Forget the captured graphs (their pools go with them): they read the addresses of
        memory about to be released."""
        self.graphs = self.piecewise = None

    def _piecewise_sizes(self) -> list[int]:
        """Token counts of the prefill steps replayed from piecewise CUDA graphs (their
        all-reduces captured with them at tp > 1): none without CUDA graphs; at most the largest
        prefill step."""
        args = self.args
        if not self._graphs_enabled() or args.disable_piecewise_cuda_graph:
            return []
        from minisgl.device.worker.piecewise_graph import token_sizes

        limit = min(args.piecewise_cuda_graph_max_tokens, args.prefill_budget(self.context_len))
        sizes = args.piecewise_cuda_graph_tokens or token_sizes(limit)
        return sorted({n for n in sizes if n <= limit})

    def _routed_experts(self) -> RoutedExperts | None:
        """The buffer the sparse layers write their expert ids to, when requests may ask for them
        (rows: the most tokens one step computes)."""
        if not self.args.enable_return_routed_experts:
            return None
        if not self.config.num_experts:
            raise ValueError(f"--enable-return-routed-experts: {self.config.architecture} has no experts")
        rows = max(self.args.prefill_budget(self.context_len), self.max_slots, WARMUP_ROWS)
        routed = RoutedExperts(self.config.num_layers, rows, self.config.num_experts_per_tok, self.device)
        for layer in self.model.model.layers:
            if hasattr(layer.mlp, "capture"):
                layer.mlp.capture = routed
        return routed

    def _attach_lora(self) -> LoraRows | None:
        """--enable-lora: every targeted layer's adapter slots (zeros until adapters load), and
        the buffer of each step's rows' slots, as long as the longest step graphs capture."""
        args = self.args
        if not args.lora_enabled:
            return None
        from minisgl.device.models.lora_adapter import attach_lora, lora_layout

        self.lora_rank, targets = lora_layout(args)
        self.lora_host: dict[str, Shards] = {}  # loaded adapters in host memory, by key
        rows = max(args.prefill_budget(self.context_len), args.graph_batch_size, WARMUP_ROWS)
        lora_rows = attach_lora(
            self.model, self.config, self.lora_rank, args.max_loras_per_batch, targets, rows, self.device
        )
        logger.info(
            "LoRA: %d adapter slots of rank %d on %s", args.max_loras_per_batch, self.lora_rank, ", ".join(targets)
        )
        return lora_rows

    def _slots(self, n: int, warmup: bool = False) -> None:
        """Page-table rows, last sampled tokens and sampling state for ``n`` requests, plus the
        padding row of CUDA-graph batches (it points at the scratch page). The ``warmup`` step
        runs one request: a hybrid's state pool has its row alone then (a row is tens of MB,
        and what the pool will take is set aside from the budget the warm-up measures)."""
        self.max_slots = self.pad_slot = n
        # On the host only: attention backends cut their page lists from it (AttentionMetadata).
        self.page_table_host = np.zeros((n + 1, cdiv(self.context_len, self.page_size)), dtype=np.int32)
        self.last_token = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        # Rows each slot's last verify run rejected, on the device and copied to (pinned) host
        # memory once that step has sampled: a step planned before its tokens were back reads
        # them for its ``resolve_rows``.
        on_gpu = self.device.type == "cuda"
        self.rejected = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        self.rejected_host = torch.zeros(n + 1, dtype=torch.int64, pin_memory=on_gpu)
        self._rejected_event: torch.cuda.Event | None = None
        # The most rows each slot's last verify run could reject (its draft's length), on the host.
        self.most_rejected = np.zeros(n + 1, dtype=np.int64)
        self.sampler = Sampler(n, self.vocab_size, self.device)
        self.adapter_of_slot = np.full(n + 1, -1, dtype=np.int64)  # each request's LoRA slot (-1: none)
        # (hybrids) each slot's state, then the prefix cache's snapshots
        rows = 1 if warmup else n + 1 + self._snapshots(n)
        self.states = make_state_pool(self.config, rows, self._ssm_dtype, self.dtype, self.device)

    def _make_cache(self, num_pages: int) -> MHAKVCache:
        return MHAKVCache(
            num_pages,
            self.page_size,
            self.kv_layers,
            self.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )

    def _make_host_pool(self) -> HostKVPool:
        """The hierarchical cache's host pool: --hicache-size GB, else --hicache-ratio times the
        device pool; refused if it would not leave a fifth of the host's available memory."""
        per_page = self.kv_bytes_per_page
        if self.args.hicache_size > 0:
            num_pages = int(self.args.hicache_size * 1e9 // per_page)
        else:
            num_pages = int(self.num_pages * self.args.hicache_ratio)
        available = _available_host_bytes() // max(1, self.args.ranks_per_node)
        if num_pages < 1 or num_pages * per_page > 0.8 * available:
            raise RuntimeError(
                f"a host KV pool of {num_pages} pages ({num_pages * per_page / 1e9:.1f} GB) does not fit in "
                f"80% of the {available / 1e9:.1f} GB of host memory available per rank; lower --hicache-ratio "
                f"or --hicache-size"
            )
        disk = None
        if self.args.hicache_storage_backend == "file":
            disk = DiskStore(self.args.storage_dir, self.storage_fingerprint, get_tp_info().size)
            logger.info("hierarchical cache storage: %s", disk.folder)
        pool = HostKVPool(num_pages, self.kv_cache, self.args.hicache_io_backend, disk, get_tp_info().rank)
        logger.info(
            "hierarchical cache: %d host pages (%.2f GiB, %s copies)",
            num_pages,
            pool.nbytes / 2**30,
            self.args.hicache_io_backend if self.device.type == "cuda" else "torch",
        )
        return pool

    @property
    def storage_fingerprint(self) -> str:
        """What this rank's KV page bytes mean: files written under it are only read back by a
        server with the same model, weights, layout and dtype."""
        a, c = self.args, self.config
        return fingerprint(
            model=str(self.model_dir),
            weights=weights_identity(self.model_dir, a.load_format),
            load_format=a.load_format,
            quantization=a.quantization,
            dummy_seed=a.seed if a.load_format == "dummy" else None,
            dtype=str(self.dtype),
            kv_dtype=str(self.kv_dtype),
            page_size=self.page_size,
            layers=self.kv_layers,
            kv_heads=self.num_kv_heads,
            head_dim=c.head_dim,
            tp=get_tp_info().size,
        )

    def _set_kv_scales(self) -> None:
        """An fp8 cache takes the checkpoint's per-layer K and V scales (1.0 where it has none)."""
        found = getattr(self.model, "kv_scales", {})
        if self.kv_dtype != FP8:
            if found:
                logger.info("the checkpoint's KV cache scales are unused: the cache is %s", self.kv_dtype)
            return
        self.kv_cache.scales = [
            (found.get(i, {}).get("k", 1.0), found.get(i, {}).get("v", 1.0)) for i in self.config.attention_layers
        ]
        logger.info("fp8 KV cache, %s", "the checkpoint's scales" if found else "scales 1.0")

    @property
    def snapshot_rows(self) -> list[int] | None:
        """A hybrid model's state-pool rows for the prefix cache's snapshots (past the slots')."""
        if self.states is None:
            return None
        return list(range(self.max_slots + 1, self.states.conv.shape[1]))

    @property
    def kv_bytes_per_page(self) -> int:
        return MHAKVCache.bytes_per_page(
            self.page_size, self.kv_layers, self.num_kv_heads, self.config.head_dim, self.kv_dtype
        )

    def _profile_num_pages(self) -> int:
        """Run the largest prefill and sampling step once, then size the cache from what is left."""
        bytes_per_page = self.kv_bytes_per_page
        # On CUDA the largest prefill measures peak activations; on CPU nothing is measured, and a
        # full 8192-token torch-attention prefill took minutes: a short one checks the path.
        tokens = min(self.args.prefill_budget(self.context_len), self.context_len)
        if self.device.type != "cuda":
            tokens = min(tokens, CPU_WARMUP_TOKENS)
        self.kv_cache = self._make_cache(cdiv(tokens, self.page_size))
        self.attn = create_backend(
            self.args.attention_backend,
            self.kv_cache,
            self.num_qo_heads,
            self.num_kv_heads,
            self.config.head_dim,
            dtype=self.dtype,
        )
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        prefill_peak = self._warmup(tokens)
        # Piecewise prefill graphs keep a pool of their own, as large as a prefill's activations.
        graph_pool = prefill_peak - before if cuda and self._piecewise_sizes() else 0
        del self.kv_cache, self.attn
        set_attention_backend(None)
        if self.args.max_total_tokens is not None:
            return cdiv(self.args.max_total_tokens, self.page_size)
        num_pages = int(self._kv_budget(graph_pool) // bytes_per_page)
        if get_tp_info().size > 1:  # every rank must hold the same pages: take the smallest budget
            n = torch.tensor([num_pages], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_pages = int(n.item())
        if num_pages < cdiv(self.context_len, self.page_size) // 8 or num_pages < 1:
            raise RuntimeError(
                f"only {num_pages} KV pages fit in memory; lower --context-length or raise --mem-fraction-static"
            )
        return num_pages

    def _kv_budget(self, graph_pool: int) -> float:
        """Bytes the KV pool may take: on CUDA what the warm-up left free within
        --mem-fraction-static, less the activations it measured, the prefill graphs' pool and
        (hybrids) the state pool; on CPU a share of the host's memory."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            budget = free - total * (1 - self.args.mem_fraction_static) - activations - graph_pool
            return budget - self._state_pool_bytes()  # (hybrids: sized by the requests, before the KV)
        # On CPU, more than every slot at full context is never useful, and a laptop should not
        # give gigabytes to it by default (--max-total-tokens asks for more).
        context = cdiv(self.context_len, self.page_size) * self.kv_bytes_per_page
        laptop = max(CPU_KV_BYTES, context)  # at least one full-context request fits
        return min(
            _available_host_bytes() * self.args.mem_fraction_static * 0.5, self.args.running_limit * context, laptop
        )

    @property
    def _ssm_dtype(self) -> torch.dtype:
        return getattr(torch, self.args.mamba_ssm_dtype)

    def _snapshots(self, slots: int) -> int:
        """Snapshot rows of the state pool: --max-mamba-cache-size, else one per slot."""
        given = self.args.max_mamba_cache_size
        return given if given is not None else slots + 1

    def _state_pool_bytes(self) -> int:
        """What a hybrid model's state pool will take: every slot's state and as many snapshots.
        Its requests are bounded up front (``__init__``): their states, tens of MB each, rather than
        the KV pool, decide how many fit."""
        if not self.config.is_hybrid:
            return 0
        n = self.args.max_running_requests
        return (n + 1 + self._snapshots(n)) * StateShape.of(self.config).bytes_per_slot(self._ssm_dtype, self.dtype)

    def _warmup(self, tokens: int) -> int:
        """Run a prefill of ``tokens``, a short one and the sampler's worst case; returns the
        allocator's peak after the prefill (CUDA; 0 elsewhere)."""
        pages = cdiv(tokens, self.page_size)
        rows = self.max_slots  # the sampler works in blocks of at most this many rows
        batch = ForwardBatch(
            slots=[0],
            cached_lens=[0],
            new_lens=[tokens],
            input_ids=[0] * tokens,
            sample=[True],
            table_slots=[0] * pages,
            table_cols=list(range(pages)),
            table_pages=list(range(pages)),
        )
        self.forward(batch)
        peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0
        # A short chunk too: on an fp8 cache short and long chunks take different prefill kernels
        # (attention.flashinfer_backend), and a kernel's first use compiles it (up to a minute).
        short = min(tokens, 16)
        self.forward(ForwardBatch(slots=[0], cached_lens=[0], new_lens=[short], input_ids=[0] * short, sample=[True]))
        # The sampler's worst case: every slot sampling with top-k/top-p over the whole vocabulary.
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
        for slot in range(rows):
            self.sampler.set_request(slot, params, [], [], seed=slot)
        logits = torch.zeros(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        self.sampler.sample(logits, list(range(rows)), [1] * rows)
        for slot in range(rows):  # leave every slot greedy, as a fresh runner has them
            self.sampler.set_request(slot, SamplingParams(temperature=0.0), [], [], seed=0)
        return peak

    # ---- one step -----------------------------------------------------------------------------

    def add_requests(self, reqs: list[NewRequest]) -> None:
        for r in reqs:
            self.sampler.set_request(
                r.slot,
                r.sampling,
                r.prompt_ids,
                r.output_ids,
                r.seed,
                r.options.top_logprobs,
                r.prompt_len,
                r.ban_ids,
                r.options.logprob_ids,
                r.options.entropy,
            )
            self.adapter_of_slot[r.slot] = r.lora_slot

    def _metadata(self, batch: ForwardBatch) -> tuple[AttentionMetadata, torch.Tensor]:
        """Apply page-table writes and build positions, inputs and KV slots for the new tokens."""
        dev = self.device
        if batch.table_slots:
            self.page_table_host[batch.table_slots, batch.table_cols] = batch.table_pages
        page, table = self.page_size, self.page_table_host
        if len(batch.input_ids) == len(batch.slots) <= base.FEW_ROWS:
            # A few decode rows (one token each) in Python: numpy's per-call cost is most of the
            # step's host time at batch 1.
            positions = batch.cached_lens
            out_loc = [int(table[s, p // page]) * page + p % page for s, p in zip(batch.slots, positions)]
            host = torch.tensor([positions, batch.slots, batch.input_ids, out_loc], dtype=torch.int64)
            fed = min(batch.input_ids, default=0) < 0
        else:
            new_lens = np.asarray(batch.new_lens, dtype=np.int64)
            cached = np.asarray(batch.cached_lens, dtype=np.int64)
            req_of_token = np.repeat(np.arange(len(new_lens)), new_lens)
            starts = np.cumsum(new_lens) - new_lens
            positions = np.arange(len(req_of_token), dtype=np.int64) - starts[req_of_token] + cached[req_of_token]
            token_slots = np.asarray(batch.slots, dtype=np.int64)[req_of_token]
            # KV slots from the host copy of the page table: one copy up instead of kernels per step.
            out_loc = table[token_slots, positions // page].astype(np.int64) * page + positions % page
            ids = np.asarray(batch.input_ids, np.int64)
            host = torch.from_numpy(np.stack([positions, token_slots, ids, out_loc]))
            fed = bool((ids < 0).any())
        positions_t, token_slots_t, input_ids, out_loc_t = host.to(dev, non_blocking=True)
        if self.lora_rows is not None:  # each row's adapter, from its request's slot
            row_slots = batch.slots if len(input_ids) == len(batch.slots) else token_slots
            adapters = self.adapter_of_slot[row_slots]
            self.lora_rows.set(torch.from_numpy(adapters).to(dev, non_blocking=True), bool((adapters >= 0).any()))
        if fed:  # rows whose input is -1: the token their slot sampled last
            input_ids = torch.where(input_ids < 0, self.last_token[token_slots_t], input_ids)
        if self._gains is not None:
            self._add_gains(batch, positions_t, out_loc_t)
        meta = AttentionMetadata(
            slots=batch.slots,
            cached_lens=batch.cached_lens,
            new_lens=batch.new_lens,
            page_table_host=self.page_table_host,
            positions=positions_t,
            out_loc=out_loc_t,
            group_sizes=batch.group_sizes,
            group_pages=batch.group_pages,
            prefill_reqs=batch.prefill_reqs,
            gains=self._gains,
        )
        return meta, input_ids

    def _add_gains(self, batch: ForwardBatch, positions: torch.Tensor, out_loc: torch.Tensor) -> None:
        """Move the gaining rows (decode rows: a token each) on by their gains, on the device: each
        row's KV slot is picked from those of the positions it may take (host page table)."""
        gains, page, table = self._gains, self.page_size, self.page_table_host
        slots = np.asarray(batch.slots, dtype=np.int64)[gains.rows]
        first = np.asarray(batch.cached_lens, dtype=np.int64)[gains.rows]
        steps = np.minimum(np.arange(int(gains.most.max()) + 1)[None, :], gains.most[:, None])  # (past most: unused)
        reach = first[:, None] + steps
        choices = table[slots[:, None], reach // page].astype(np.int64) * page + reach % page
        choices_t = torch.from_numpy(choices).to(self.device, non_blocking=True)
        positions.index_add_(0, gains.rows_on_device, gains.tokens)  # (one launch; rows are distinct)
        out_loc[gains.rows_on_device] = choices_t.gather(1, gains.tokens[:, None]).squeeze(1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, gather: bool = True) -> torch.Tensor:
        """Logits [N, vocab] of the last new token of each request with sample=True; with
        ``gather=False`` this rank's vocabulary slice of them (``_sample`` joins them if needed)."""
        self._copies(batch)
        try:
            logits = self._forward(batch, gather)
            if batch.state_saves:  # (hybrids) snapshots of the states this step left
                self.states.copy(batch.state_saves)
            return logits
        finally:
            self.kv_cache.layer_events = []

    def _copies(self, batch: ForwardBatch) -> None:
        """The batch's host-tier copies (and disk reads and writes), queued before its forward."""
        if batch.kv_writes or batch.kv_loads or batch.disk_read_keys or batch.disk_write_keys:
            self._events = self.host_pool.transfer(
                self.kv_cache,
                batch.kv_writes,
                batch.kv_loads,
                (batch.disk_read_keys, batch.disk_read_pages),
                (batch.disk_write_keys, batch.disk_write_pages),
            )
            self._io_event = self._events[-1] if self._events else None
        if batch.wait_kv_io:  # (the copies may be an earlier step's: the stream runs them in order)
            self.kv_cache.layer_events = self._events

    def _forward(self, batch: ForwardBatch, gather: bool) -> torch.Tensor:
        self._extras = {}
        if self.graphs is not None and self.graphs.can_run(batch):
            self._load_graph(batch)
            return self._replay_graph(batch, gather)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            hidden = self.piecewise.forward(batch)
        else:
            meta, input_ids = self._metadata(batch)
            self.attn.prepare(meta)
            set_attention_backend(self.attn)
            if self.states is not None:
                self.states.prepare(meta, batch.state_loads, splits=batch.state_splits)
            hidden = self.model(input_ids, meta.positions)
        if batch.score_rows:
            self._extras = self._score(hidden, batch)
        self._routing(batch, hidden)
        last = np.cumsum(batch.new_lens) - 1
        rows = torch.from_numpy(last[np.asarray(batch.sample, dtype=bool)]).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows], gather)

    def _load_graph(self, batch: ForwardBatch) -> None:
        """The batch's inputs into its CUDA graph's buffers and its attention planned."""
        if self.kv_cache.layer_events:  # a captured step cannot wait per layer: all before it
            torch.cuda.current_stream().wait_event(self.kv_cache.layer_events[-1])
        self.graphs.load(batch)

    def _replay_graph(self, batch: ForwardBatch, gather: bool) -> torch.Tensor:
        """``_forward``'s logits of the batch ``_load_graph`` loaded."""
        logits = self.graphs.replay(batch)
        self._routing(batch, self.graphs.hidden)
        return self.model.lm_head.gather(logits) if gather else logits

    def _routing(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> None:
        """The expert ids and last hidden states (``hidden``: the step's, one row per new token)
        of the rows whose requests return them (``route_rows``)."""
        if not batch.route_rows:
            return
        rows = torch.tensor(batch.route_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        if self.routed is not None:
            self._extras["routed_experts"] = self.routed.rows(rows)
        if hidden is not None and self.args.enable_return_hidden_states:
            self._extras["hidden_states"] = hidden[rows].float()

    SCORE_BLOCK = 512  # prompt rows scored at once: logits of a block are [rows, vocab] float32

    def _score(self, hidden: torch.Tensor, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Prompt logprobs: each score row's log-probability of its score id, and the top ones."""
        rows = torch.tensor(batch.score_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        ids = torch.tensor(batch.score_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        parts: dict[str, list[torch.Tensor]] = {
            "score_logprobs": [],
            "score_top_logprobs": [],
            "score_top_ids": [],
            "score_id_logprobs": [],
        }
        wanted = None
        if batch.score_logprob_ids:
            wanted = torch.tensor(batch.score_logprob_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        for at in range(0, len(rows), self.SCORE_BLOCK):
            block = slice(at, at + self.SCORE_BLOCK)
            logprobs = batch_invariant.log_softmax(self.model.compute_logits(hidden[rows[block]]).float())
            parts["score_logprobs"].append(logprobs.gather(1, ids[block, None]).squeeze(1))
            if batch.score_top > 0:
                top, top_ids = logprobs.topk(batch.score_top, dim=-1)
                parts["score_top_logprobs"].append(top)
                parts["score_top_ids"].append(top_ids)
            if wanted is not None:
                parts["score_id_logprobs"].append(logprobs[:, wanted])
        return {k: torch.cat(v) for k, v in parts.items() if v}

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch) -> None:
        """Queue one step on the device; its tokens come back through ``collect``."""
        if batch.lora_swap_slots or batch.lora_drops:
            self._swap_loras(batch)
        if not batch.slots:  # host-tier copies only, sent while the scheduler is idle
            self._copies(batch)
            io_event, self._io_event = self._io_event, None
            self.pending.append(_Pending([], {}, None, io_event=io_event))
            return
        gains = self._defer(batch) if batch.resolve_rows else None
        if batch.resolve_rows and gains is None:
            self._resolve(batch)
        self.add_requests(batch.new_requests)
        if batch.draft_rows:  # the step runs once its draft tokens come (fill_drafts)
            loaded = self.graphs is not None and self.graphs.can_run(batch)
            if loaded:  # its inputs and attention plan now, while the step before runs
                self._copies(batch)
                self._extras, self._gains = {}, gains
                try:
                    self._load_graph(batch)
                finally:
                    self._gains, self.kv_cache.layer_events = None, []
            self._drafting = (batch, gains, loaded)
            return
        self._run(batch, gains)

    def _run(self, batch: ForwardBatch, gains: Gains | None, logits: torch.Tensor | None = None) -> None:
        """The step's forward (unless its ``logits`` came from a graph loaded earlier), then its
        sampling, or its parking until its masks come."""
        if logits is None:
            self._gains = gains
            try:
                logits = self.forward(batch, gather=False)
            finally:
                self._gains = None
        if batch.mask_rows:  # constrained rows: sample when their masks come (sample_masked)
            self._parked = (batch, logits, gains)
            return
        self._sample(batch, logits, gains=gains)

    @torch.inference_mode()
    def fill_drafts(self, ids: list[int]) -> None:
        """Run the launched batch whose ``draft_rows`` waited for their input ``ids``."""
        batch, gains, loaded = self._drafting
        self._drafting = None
        for row, token in zip(batch.draft_rows, ids):
            batch.input_ids[row] = token  # (the verify step's accept reads them from the batch)
        if not loaded:
            self._run(batch, gains)
            return
        rows_t, ids_t = torch.tensor([batch.draft_rows, ids], dtype=torch.int64).to(self.device, non_blocking=True)
        self.graphs.set_input_ids(rows_t, ids_t)
        self._run(batch, gains, self._replay_graph(batch, gather=False))

    @torch.inference_mode()  # as launch: the sampler updates inference tensors (penalty counts)
    def sample_masked(self, bitmask: bytes) -> None:
        """Sample the parked batch, its ``mask_rows`` limited to the tokens ``bitmask`` allows."""
        batch, logits, gains = self._parked
        self._parked = None
        words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(batch.mask_rows), -1)
        self._sample(batch, logits, (batch.mask_rows, words), gains)

    def _sample(
        self,
        batch: ForwardBatch,
        logits: torch.Tensor,
        masks: tuple[list[int], torch.Tensor] | None = None,
        gains: Gains | None = None,
    ) -> None:
        chosen = np.asarray(batch.sample, dtype=bool)
        slots = np.asarray(batch.slots, dtype=np.int64)[chosen]
        out = SampleOutput(tokens=None)
        if len(slots):
            seq_lens = (np.asarray(batch.cached_lens, dtype=np.int64) + np.asarray(batch.new_lens, dtype=np.int64))[
                chosen
            ]
            head = self.model.lm_head
            if masks is None and self.sampler.plain_greedy(slots, seq_lens):
                out = SampleOutput(tokens=head.greedy(logits))
            else:
                shift = None
                if gains is not None:  # (every decode row samples: row i is sampled row i)
                    shift = torch.zeros(len(slots), dtype=torch.int64, device=self.device)
                    shift[gains.rows_on_device] = gains.tokens
                out = self.sampler.sample(head.gather(logits), slots, seq_lens, masks, shift)
            if batch.verify_sizes:
                self._last_verified(batch, out.tokens)
            else:
                self.last_token[torch.from_numpy(slots).to(self.device, non_blocking=True)] = out.tokens
        self.pending.append(self._to_host(out, slots, self._extras, batch.score_top))

    def _defer(self, batch: ForwardBatch) -> Gains | None:
        """Plan the ``resolve_rows`` at their shortest (as if the verify run before them rejected
        every draft row) and leave what it kept to the device (``Gains``), so the host never waits
        for that run; None where the step cannot take gains (the host waits: ``_resolve``)."""
        decode = not batch.prefill_reqs and max(batch.new_lens) == 1 and all(batch.sample)
        if not decode or not self.attn.plans_gains(bool(batch.group_sizes)):
            return None
        rows = np.asarray(batch.resolve_rows, dtype=np.int64)
        slots = np.asarray(batch.slots, dtype=np.int64)[rows]
        most = self.most_rejected[slots]
        shortest = np.asarray(batch.cached_lens, dtype=np.int64)[rows] - most
        # min_new_tokens bans stop tokens by a row's length on the host: the gain must not change it
        min_len = self.sampler.h_min_len[slots]
        if ((shortest + 1 < min_len) != (shortest + 1 + most < min_len)).any():
            return None
        for row, length in zip(batch.resolve_rows, shortest.tolist()):
            batch.cached_lens[row] = length
        rows_t, slots_t, most_t = torch.from_numpy(np.stack([rows, slots, most])).to(self.device, non_blocking=True)
        return Gains(rows, most, most_t - self.rejected[slots_t], rows_t)

    def _resolve(self, batch: ForwardBatch) -> None:
        """Lower the ``resolve_rows``' lengths by the rows their slots' verify runs rejected:
        the one step this waits for is the verify step just before (the GPU idles for the rest
        of this launch, not for the scheduler's round trip)."""
        if self._rejected_event is not None:
            self._rejected_event.synchronize()
        rejected = self.rejected_host.numpy()
        for i in batch.resolve_rows:
            batch.cached_lens[i] -= int(rejected[batch.slots[i]])

    def _last_verified(self, batch: ForwardBatch, tokens: torch.Tensor) -> None:
        """A verify step's last token per run (``ForwardBatch.verify_sizes``): its first row
        whose sample differs from the next row's input, as the scheduler will find on the host;
        each row after the runs is a run of its own (a verify step samples every row)."""
        sizes = np.asarray(batch.verify_sizes + [1] * (len(batch.slots) - sum(batch.verify_sizes)), dtype=np.int64)
        ends = np.cumsum(sizes)
        following = np.asarray(batch.input_ids[1:] + [-1], dtype=np.int64)
        following[ends - 1] = -1  # (a run's last row has no draft token after it)
        dev = self.device
        run_slots = np.asarray(batch.slots, dtype=np.int64)[ends - 1]
        self.most_rejected[run_slots] = sizes - 1  # (a row past the runs: a run of one)
        on_gpu = dev.type == "cuda"
        info = torch.from_numpy(np.concatenate([following, ends - sizes, ends, run_slots]))  # (one copy up)
        info = info.pin_memory().to(dev, non_blocking=True) if on_gpu else info
        # One launch on the GPU (minisgl.device.kernels.verify); torch steps, its reference, on a CPU.
        if on_gpu:
            from minisgl.device.kernels.verify import last_verified as apply
        else:
            apply = last_verified_torch
        apply(tokens, info, len(sizes), int(sizes.max()), self.last_token, self.rejected)
        self.rejected_host.copy_(self.rejected, non_blocking=on_gpu)
        if on_gpu:
            self._rejected_event = torch.cuda.Event()
            self._rejected_event.record()

    def _to_host(
        self, out: SampleOutput, slots: np.ndarray, scores: dict[str, torch.Tensor], score_top: int
    ) -> _Pending:
        """Start copying the sampled values (and prompt scores, routed experts) to (pinned) host
        memory; an event marks the end."""
        on_gpu = self.device.type == "cuda"
        host = {}
        values = {
            name: getattr(out, name)
            for name in ("tokens", "logprobs", "entropy", "top_ids", "top_logprobs", "id_logprobs")
        }
        for name, value in {**values, **scores}.items():
            if value is not None:
                host[name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=on_gpu)
                host[name].copy_(value, non_blocking=on_gpu)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        ids = [self.sampler.h_ids[s] for s in slots.tolist()] if out.id_union else None
        top_n = self.sampler.h_top_n[slots]
        io_event, self._io_event = self._io_event, None
        return _Pending(
            top_n.tolist() if (top_n >= 0).any() else [], host, event, score_top, io_event, ids, out.id_union
        )

    def oldest_done(self) -> bool:
        """Whether ``collect`` would return without waiting."""
        p = self.pending[0]
        return (p.event is None or p.event.query()) and (p.io_event is None or p.io_event.query())

    def collect(self) -> StepOutput:
        """Tokens (and logprobs) of the oldest launched step, waiting for it if needed."""
        p = self.pending.popleft()
        if p.event is not None:
            p.event.synchronize()
        if p.io_event is not None:  # the scheduler counts a step's copies done with its tokens
            p.io_event.synchronize()
        h = p.host
        msg = StepOutput(tokens=h["tokens"].tolist() if "tokens" in h else [])
        if "routed_experts" in h:
            msg.routed_experts = h["routed_experts"].numpy().tobytes()
        if "hidden_states" in h:
            msg.hidden_states = h["hidden_states"].numpy().tobytes()
        if "score_logprobs" in h:
            msg.score_logprobs = h["score_logprobs"].tolist()
            if p.score_top:
                msg.score_top_ids = h["score_top_ids"].tolist()
                msg.score_top_logprobs = h["score_top_logprobs"].tolist()
            if "score_id_logprobs" in h:
                msg.score_id_logprobs = h["score_id_logprobs"].tolist()
        if "entropy" in h:
            msg.entropy = h["entropy"].tolist()
        if not p.top_n:
            return msg
        if "logprobs" in h:
            msg.logprobs = h["logprobs"].tolist()
        if "top_ids" in h:
            msg.top_ids = [row[:n] for row, n in zip(h["top_ids"].tolist(), p.top_n)]
            msg.top_logprobs = [row[:n] for row, n in zip(h["top_logprobs"].tolist(), p.top_n)]
        if p.id_union:
            column = {t: c for c, t in enumerate(p.id_union)}
            msg.id_logprobs = [[row[column[t]] for t in ids] for row, ids in zip(h["id_logprobs"].tolist(), p.ids)]
        return msg

    def run_task(self, task: WorkerTask | LocalTensors | LocalLora) -> WorkerReply:
        """A control-plane task (``worker.tasks``: new weights, memory release or resume, an
        adapter, weights read back), run between steps."""
        assert not self.pending and self._parked is None and self._drafting is None, (
            "a control task came with steps in flight"
        )
        from minisgl.device.worker.tasks import run_task

        return run_task(self, task)

    def _swap_loras(self, batch: ForwardBatch) -> None:
        """The batch's adapter copies into device slots (before its forward, after every earlier
        step's on the stream), and the host copies it lets go of."""
        from minisgl.device.models.lora_adapter import write_slot

        for slot, key in zip(batch.lora_swap_slots, batch.lora_swap_keys):
            write_slot(self.model, slot, self.lora_host[key])
        for key in batch.lora_drops:
            self.lora_host.pop(key, None)

    def updater(self) -> WeightUpdater:
        if self.weight_updater is None:
            from minisgl.device.worker.weight_update import WeightUpdater

            self.weight_updater = WeightUpdater(self)
        return self.weight_updater

    def step(self, batch: ForwardBatch) -> StepOutput:
        """launch + collect: one synchronous step (tests and simple drivers)."""
        self.launch(batch)
        return self.collect()
