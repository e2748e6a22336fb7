"""Every knob in one place: EngineArgs (the engine, shared by the offline API and the launcher)
and ServerArgs (the HTTP server). Each field carries its flag's help, group and SGLang aliases,
and the command line is generated from them (``build_parser``): a new setting is one field."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from minisgl.config.sglang_flags import ATTENTION_BACKENDS, add_sglang_flags
from minisgl.serve.parsers.reasoning import PARSERS as REASONING_PARSERS
from minisgl.serve.parsers.tool_calls import PARSERS as TOOL_PARSERS
from minisgl.serve.tokenizer.completion import TEMPLATES as COMPLETION_TEMPLATES

logger = logging.getLogger("minisgl.launch")

HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_IO_BACKENDS = ("direct", "kernel")
QUANTIZATIONS = ("fp8",)  # --quantization values (FP8 checkpoints need none)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "bf16", "bfloat16")  # --kv-cache-dtype values (SGLang's names)
MAX_RUNNING_CAP = 4096  # most running requests a derived default allows
KV_TOKENS_PER_REQUEST = 512
# With speculation, CUDA graphs are captured up to k + 1 rows a request of the largest batch
# that may speculate, up to this many rows (the graphs' logits stay a few hundred MB).
SPEC_GRAPH_ROWS = 1024
SPEC_SCHEDULES = ("late", "wait", "overlap")  # --speculative-schedule values
# Checkpoint module names a LoRA adapter may adapt (--lora-target-modules; "all" is every one).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# smg's policies (--router-policy)
ROUTER_POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "prefix_hash",
)


# The --help groups, in the order they are listed.
MODEL, DEVICE, SCHED = "model", "device and memory", "scheduling and prefix cache"
HICACHE = "hierarchical cache (host memory and disk under the prefix cache)"
PARALLEL, SPEC, LORA = "parallelism", "speculative decoding", "LoRA adapters"
SERVER, LIMITS = "server", "limits (what one request may ask for)"
GROUPS = (MODEL, DEVICE, SCHED, HICACHE, PARALLEL, SPEC, LORA, SERVER, LIMITS)


def flag(group: str, help: str, *aliases: str, choices: Any = None, env: str | None = None) -> dict[str, Any]:
    """A setting's flag: its --help group and text, other spellings (SGLang's), allowed values,
    and an environment variable that gives its default."""
    return {"group": group, "help": help, "aliases": aliases, "choices": choices, "env": env}


def knob(default: Any, group: str, help: str, *aliases: str, **kw: Any) -> Any:
    """A setting with a default and its flag (``flag``)."""
    return field(default=default, metadata=flag(group, help, *aliases, **kw))


@dataclass
class EngineArgs:
    model: str = field(
        metadata=flag(MODEL, "local checkpoint folder, .gguf file, or Hugging Face hub id", "--model-path")
    )
    tokenizer: str | None = knob(None, MODEL, "tokenizer folder or hub id (default: the model's)", "--tokenizer-path")
    dtype: str = knob("auto", MODEL, "auto, bfloat16, float16 or float32")
    device: str = knob("auto", DEVICE, "auto (cuda if present, else cpu), cuda or cpu")
    load_format: str = knob(
        "auto",
        MODEL,
        "auto: safetensors, or GGUF for a .gguf file; dummy: random weights in the real shapes",
        choices=["auto", "safetensors", "gguf", "dummy"],
    )
    attention_backend: str = knob(
        "auto",
        DEVICE,
        "auto: FlashInfer (with our Triton decode kernel) on CUDA, torch elsewhere; torch_native "
        "is SGLang's name for torch; SGLang's other backends (triton, fa3, ...) mean auto here",
        choices=("auto", "torch", "torch_native", "flashinfer", *ATTENTION_BACKENDS),
    )
    # Plain decode steps on CUDA: "triton", our kernel, which cascade steps also run on, so that
    # they return the same bits (minisgl/device/kernels/partial_attention.py); or FlashInfer's decode.
    decode_attention_backend: str = knob(
        "triton",
        DEVICE,
        "plain decode steps with the flashinfer backend: triton (default), the kernel cascade "
        "steps run on, so a request's tokens are bit-identical with cascade attention on or off; "
        "or flashinfer, FlashInfer's decode kernel (faster on grouped batches with cascade off)",
        choices=["flashinfer", "triton"],
    )
    page_size: int = knob(16, SCHED, "tokens per KV page")
    mem_fraction_static: float = knob(0.88, DEVICE, "fraction of GPU memory for weights and KV cache")
    max_total_tokens: int | None = knob(None, DEVICE, "KV cache size in tokens (overrides memory sizing)")
    # None: derived from the KV pool once it is sized (``derive_max_running_requests``).
    max_running_requests: int | None = knob(
        None,
        SCHED,
        "most requests decoding at once (default: on a GPU one per 512 tokens of KV pool, 256 to 4096; on a CPU 256)",
    )
    # Hybrid models' state pool: the recurrent states' element type, and how many prefix-cache
    # snapshots it keeps (None: as many as requests run at once, plus one).
    mamba_ssm_dtype: str = knob(
        "float32",
        DEVICE,
        "hybrid models (Gated DeltaNet): the recurrent states' element type in the state pool",
        choices=["float32", "bfloat16"],
    )
    max_mamba_cache_size: int | None = knob(
        None,
        DEVICE,
        "hybrid models: state snapshots the prefix cache keeps (default: --max-running-requests + "
        "1); each is one request's recurrent state, tens of MB for the large models",
    )
    chunked_prefill_size: int = knob(8192, SCHED, "most prompt tokens of one request per step (-1: no chunking)")
    context_length: int | None = knob(
        None,
        MODEL,
        "longest prompt + output (default: the model's max_position_embeddings)",
    )
    tp_size: int = knob(1, PARALLEL, "tensor-parallel ranks (GPUs)", "--tensor-parallel-size")
    # SGLang's GPU placement: this host's rank r runs on GPU base_gpu_id + r * gpu_id_step (of
    # those CUDA_VISIBLE_DEVICES shows), so several engines can share a host (RL colocation).
    base_gpu_id: int = knob(0, PARALLEL, "the GPU of this host's first rank")
    gpu_id_step: int = knob(1, PARALLEL, "GPUs between this host's consecutive ranks")
    # RL frameworks launch with it and compare /get_server_info's value to what they sent.
    enable_memory_saver: bool = knob(
        False, DEVICE, "SGLang's: memory release (/release_memory_occupation) works with or without it"
    )
    # A tensor-parallel group over several hosts: tp_size / nnodes ranks per node, every node
    # started with the same flags and its own --node-rank; they meet at dist_init_addr (host:port).
    nnodes: int = knob(1, PARALLEL, "hosts one tensor-parallel group spans")
    node_rank: int = knob(0, PARALLEL, "this host's place among --nnodes (0 serves HTTP; the others run workers only)")
    dist_init_addr: str | None = knob(
        None,
        PARALLEL,
        "host:port of node 0 where the nodes meet (torch.distributed; ZeroMQ links to the other "
        "nodes' workers take the ports after it)",
        "--nccl-init-addr",
    )
    seed: int = knob(0, MODEL, "seed of sampling without a per-request seed, and of dummy weights", "--random-seed")
    disable_radix_cache: bool = knob(False, SCHED, "no prefix cache: every prompt is computed in full")
    schedule_policy: str = knob(
        "lpm",
        SCHED,
        "admission order: lpm (longest cached prefix first, shared prefixes together), fcfs (arrival), random",
        choices=["lpm", "fcfs", "random"],
    )
    disable_overlap_schedule: bool = knob(False, SCHED, "wait for each step's tokens before scheduling the next")
    enable_mixed_chunk: bool = knob(
        False,
        SCHED,
        "a prefill step also decodes one token for every running request (SGLang's flag), so an "
        "arriving prompt does not stall the running ones (piecewise graphs; the decode rows keep "
        "their cascade groups): with steady online traffic a lower p99 inter-token latency at "
        "equal or higher throughput; on bursts a higher p99 (early requests decode through long "
        "prefill steps)",
    )
    disable_cascade_attention: bool = knob(
        False,
        SCHED,
        "decode every request over all its pages, even those it shares with others",
    )
    enable_deterministic_inference: bool = knob(
        False,
        SCHED,
        "batch-invariant arithmetic: a request's tokens and logprobs are the same bits whatever "
        "shares its batch, however its prompt is chunked and whether its prefix was cached "
        "(sampled requests: with a sampling_seed). CPU only so far (the CUDA kernels are not "
        "built); not with speculative decoding, LoRA, FP8 or hybrid models",
    )
    # Speculative decoding drafted from the radix tree and each request's own tokens (NGRAM).
    speculative_algorithm: str | None = knob(
        None,
        SPEC,
        "NGRAM: while few requests decode, draft tokens from what followed their last tokens in "
        "the radix tree (other samples, earlier requests) and in their own tokens, and verify "
        "them in one step (greedy and seeded outputs unchanged); off by default",
        choices=["NGRAM"],
    )
    speculative_num_draft_tokens: int = knob(8, SPEC, "draft tokens verified per request per step, at most")
    speculative_ngram_min_match_window_size: int = knob(
        2,
        SPEC,
        "shortest run of a request's last tokens matched to draft",
    )
    speculative_ngram_max_match_window_size: int = knob(
        6,
        SPEC,
        "longest run of a request's last tokens matched to draft (longer matches are tried first)",
    )
    speculative_ngram_capacity: int = knob(
        1 << 18,
        SPEC,
        "n-gram index slots per match length (16 bytes each; newer n-grams replace older ones)",
    )
    # How verify steps meet the step before them: "late" (planned and loaded while it runs, drafts
    # sent once its tokens are back), "wait" (planned after it), "overlap" (planned and drafted
    # while it runs: drafts a token late or chained on a draft in flight).
    speculative_schedule: str = knob(
        "late",
        SPEC,
        "(minisgl) how a verify step meets the step before it. late: planned and loaded while "
        "that step runs, its draft tokens sent once that step's tokens are back (drafts follow "
        "every token, lengths corrected on the worker); wait: planned after that step's tokens "
        "are back; overlap: planned and drafted while it runs (drafts a token late, or chained on "
        "a draft in flight)",
        choices=SPEC_SCHEDULES,
    )
    # No verify step while more requests decode (vLLM's name): trying one at a full batch of a
    # large model costs several plain steps; a small model bound by the host may pay at any batch.
    speculative_disable_by_batch_size: int = knob(
        32,
        SPEC,
        "(vLLM's name) no verify step while more requests decode; below it the measured rule "
        "decides. Raise it for a small model bound by the host, where verify steps may pay at any "
        "batch",
    )
    cuda_graph_max_bs: int | None = knob(
        None,
        DEVICE,
        "largest decode batch run from a CUDA graph (default: max-running-requests; 0: off)",
    )
    disable_cuda_graph: bool = knob(False, DEVICE, "run every step eagerly")
    # Prefill steps of up to this many tokens replay CUDA graphs of the layers' pieces between
    # mixings (worker/piecewise_graph.py), padded to the next size captured.
    disable_piecewise_cuda_graph: bool = knob(
        False,
        DEVICE,
        "run prefill steps eagerly instead of replaying CUDA graphs of the layers' pieces between their "
        "attentions or linear-attention recurrences (on by default with CUDA graphs, one GPU)",
    )
    piecewise_cuda_graph_max_tokens: int = knob(
        8192,
        DEVICE,
        "largest prefill step (in tokens) run from piecewise CUDA graphs",
    )
    piecewise_cuda_graph_tokens: list[int] | None = knob(
        None,
        DEVICE,
        "the token counts captured (default: 16 to 1024 by doubling, then steps of 1/8)",
    )
    disable_custom_all_reduce: bool = knob(
        False,
        PARALLEL,
        "tensor parallelism on GPUs: NCCL for every all-reduce instead of the one-shot "
        "symmetric-memory kernels for small (decode) tensors, the one fused with the residual add "
        "and RMSNorm included",
    )
    enable_fp32_all_reduce: bool = knob(
        False,
        PARALLEL,
        "tensor parallelism: round as tp=1 does. The row-parallel partial sums are all-reduced in "
        "float32 and rounded once (bf16: greedy tokens at tp=2 matched tp=1 on 56/64 instead of "
        "27/64 requests; decode ~5%% slower), and under per-token fp8 their inputs are quantized "
        "with the whole row's scale (an all-reduced amax) instead of each rank's columns'",
    )
    max_prefill_tokens: int | None = knob(
        None,
        SCHED,
        "most prompt tokens of one prefill step (default: --chunked-prefill-size)",
    )
    revision: str | None = knob(None, MODEL, "branch, tag or commit of a hub model")
    json_model_override_args: str = knob(
        "{}", MODEL, "a JSON object merged into the model's config.json (nested objects key by key)"
    )
    chat_template: str | None = knob(None, MODEL, "Jinja chat template file to use instead of the model's")
    decode_log_interval: int | None = knob(
        None,
        SCHED,
        "log the stats line every N decode steps (SGLang's flag; default: every 10 s while busy)",
    )
    quantization: str | None = knob(
        None,
        MODEL,
        "fp8: linear weights quantized to FP8 e4m3 at load (per output channel) with per-token "
        "FP8 activations; FP8 checkpoints (compressed-tensors, block-wise) need no flag",
    )
    kv_cache_dtype: str = knob(
        "auto",
        MODEL,
        "auto (the model dtype), fp8_e4m3 (twice the tokens per GB, per-tensor scales from the "
        "checkpoint or 1.0) or bf16",
    )
    quantize_lm_head: bool = knob(
        False,
        MODEL,
        "with fp8 linear layers (--quantization fp8 or an FP8 checkpoint): the LM head in fp8 "
        "too, one scale per vocabulary row (8B decode: 0.46 -> 0.27 ms a step at batch 256; "
        "SmolLM2's perplexity +6.1%% against +3.3%% without; benchmarks/results/fp8_*.md)",
    )
    enable_return_routed_experts: bool = knob(
        False,
        MODEL,
        "mixture-of-experts models: a /generate request with return_routed_experts gets each "
        "token's top-k expert ids per layer in meta_info.routed_experts (base64 int32, [tokens, "
        "layers, k], -1 for dense layers), for trainers that replay the routing",
    )
    enable_return_hidden_states: bool = knob(
        False,
        MODEL,
        "a request with return_hidden_states gets the model's last hidden state (after the final "
        "norm, the LM head's input) of every prompt position and every output token but the last, "
        "in meta_info.hidden_states (SGLang's layout: the prompt's rows first, then one row per "
        "token); the chat and completions routes give each choice its last one",
    )
    grammar_compile_timeout_secs: float = knob(
        15.0,
        SCHED,
        "a request whose json_schema / regex / ebnf has not compiled after this many seconds ends "
        "with an error naming this flag (a compile cannot be stopped; later requests with the "
        "same text wait for the same compile)",
    )
    # Hierarchical cache: a host-memory tier under the radix tree (SGLang's HiCache flags).
    enable_hierarchical_cache: bool = knob(
        False,
        HICACHE,
        "keep prefixes evicted from the device pool in a host-memory pool under the radix tree, "
        "and load them back when a request matches them",
    )
    hicache_ratio: float = knob(2.0, HICACHE, "host pool size as a multiple of the device KV pool")
    hicache_size: float = knob(0.0, HICACHE, "host pool size in GB (overrides --hicache-ratio when > 0)")
    hicache_write_policy: str = knob(
        "write_through",
        HICACHE,
        "write_through: every cached prefix is copied to host as it is computed; "
        "write_through_selective: once it has been matched twice; write_back: when evicted",
        choices=HICACHE_WRITE_POLICIES,
    )
    # Loads: kernel = our page-copy kernel on a few CTAs, layer by layer, so a prefill's attention
    # starts on layer 0 while later layers load; direct = 2D DMA copies, all layers. Writes: DMA.
    hicache_io_backend: str = knob(
        "kernel",
        HICACHE,
        "kernel (default): loads through our JIT page-copy kernel on 32 CTAs reading pinned host "
        "memory, layer by layer beside the forward (87%% of the pinned copy rate on an H100); "
        "direct: loads through the DMA engines, all layers at once (84%%). Writes to host always "
        "take the DMA engines",
        choices=HICACHE_IO_BACKENDS,
    )
    hicache_storage_backend: str | None = knob(
        None,
        HICACHE,
        "file: a disk tier under the host tier; pages are written behind, keyed by a hash of "
        "their token prefix, and found again by later requests, a restarted server or another "
        "replica",
        choices=["file"],
    )
    hicache_storage_dir: str | None = knob(
        None,
        HICACHE,
        "the file backend's folder (default $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR or /tmp/hicache)",
    )
    weight_version: str = knob(
        "default",
        MODEL,
        "the name of the weights served at start; outputs carry it in meta_info.weight_version "
        "and weight updates may rename it (SGLang's flag)",
    )
    # LoRA adapters (SGLang's flags): loaded adapters live in host memory; max_loras_per_batch
    # device slots hold the ones running requests use (scheduler/lora.py, layers/lora.py).
    enable_lora: bool = knob(
        False,
        LORA,
        "serve LoRA adapters beside the base model: requests name one (/generate lora_path, an "
        "OpenAI model of base:adapter or the adapter's name); /load_lora_adapter and "
        "/unload_lora_adapter change them while serving",
    )
    lora_paths: list[str] | None = knob(
        None,
        LORA,
        "adapters loaded at start (turns --enable-lora on): NAME=PATH, PATH, or JSON "
        '{"lora_name": ..., "lora_path": ..., "pinned": ...}; a PEFT folder or hub id',
    )
    max_loras_per_batch: int = knob(
        8,
        LORA,
        "device slots for adapters: the most distinct adapters one batch runs (a request whose "
        "adapter finds no slot free of running requests waits)",
    )
    max_lora_rank: int | None = knob(
        None,
        LORA,
        "largest adapter rank the slots hold (default: the largest of --lora-paths, else 16)",
    )
    lora_target_modules: list[str] | None = knob(
        None,
        LORA,
        "modules adapters may adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj or all (default: the union of --lora-paths', else all)",
    )
    max_loaded_loras: int | None = knob(
        None,
        LORA,
        "most adapters loaded (in host memory) at once, at least --max-loras-per-batch (default: no limit)",
    )

    @property
    def storage_dir(self) -> str:
        import os

        return self.hicache_storage_dir or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/tmp/hicache")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def gpu_index(self, local_rank: int) -> int:
        """The CUDA device of this host's ``local_rank`` (--base-gpu-id, --gpu-id-step)."""
        return self.base_gpu_id + local_rank * self.gpu_id_step

    @property
    def running_limit(self) -> int:
        """max_running_requests, or its largest derived value while the pool is not sized yet."""
        return self.max_running_requests or MAX_RUNNING_CAP

    @property
    def graph_batch_size(self) -> int:
        """Most rows of a step captured in CUDA graphs (when they are on), and so the size the
        decode-sized collectives are set up for: the largest decode batch, and with speculation
        the verify rows of the largest batch that may speculate (k + 1 a request, up to
        ``SPEC_GRAPH_ROWS``)."""
        rows = min(self.cuda_graph_max_bs or self.running_limit, self.running_limit)
        if self.speculative_algorithm is not None:
            verifying = min(rows, self.speculative_disable_by_batch_size)
            rows = max(rows, min(verifying * (self.speculative_num_draft_tokens + 1), SPEC_GRAPH_ROWS))
        return rows

    def derive_max_running_requests(self, kv_tokens: int, on_gpu: bool) -> int:
        """Set max_running_requests from the KV pool unless given: one request per
        ``KV_TOKENS_PER_REQUEST`` tokens of cache (repeated samples and shared prompts hold far
        fewer private tokens than a full context), at least 256 and at most ``MAX_RUNNING_CAP``
        on a GPU; 256 on a CPU, where a step over thousands of requests is slow anyway."""
        if self.max_running_requests is None:
            derived = min(MAX_RUNNING_CAP, max(256, kv_tokens // KV_TOKENS_PER_REQUEST))
            self.max_running_requests = derived if on_gpu else 256
        return self.max_running_requests

    def prefill_chunk(self, context_len: int) -> int:
        """Most prompt tokens of one request in one step (-1 or 0: the whole prompt at once)."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else context_len

    def prefill_budget(self, context_len: int) -> int:
        """Most prompt tokens of one prefill step, over all its requests."""
        return self.max_prefill_tokens or self.prefill_chunk(context_len)

    def model_overrides(self) -> dict:
        """--json-model-override-args as a dict (a ValueError naming the flag if it is not a
        JSON object)."""
        text = self.json_model_override_args or "{}"
        if len(text) > 65536:
            raise ValueError(f"--json-model-override-args is {len(text)} characters; at most 65536")
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"--json-model-override-args is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--json-model-override-args must be a JSON object, got {type(value).__name__}")
        return value

    def validate(self) -> None:
        self.model_overrides()
        if self.base_gpu_id < 0 or self.gpu_id_step < 1:
            raise ValueError(
                f"base_gpu_id must be >= 0 and gpu_id_step >= 1, got {self.base_gpu_id}, {self.gpu_id_step}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if 0 < self.chunked_prefill_size < self.page_size or self.chunked_prefill_size < -1:
            # chunks end on page boundaries
            raise ValueError(
                f"chunked_prefill_size must be -1 (no chunking) or >= page_size ({self.page_size}), "
                f"got {self.chunked_prefill_size}"
            )
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.page_size:
            raise ValueError(
                f"max_prefill_tokens must be >= page_size ({self.page_size}), got {self.max_prefill_tokens}"
            )
        if not self.grammar_compile_timeout_secs > 0:
            raise ValueError(f"grammar_compile_timeout_secs must be > 0, got {self.grammar_compile_timeout_secs}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank={self.node_rank}, nnodes={self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"nnodes > 1 needs dist_init_addr as host:port, got {self.dist_init_addr!r}")
        if self.decode_attention_backend not in ("flashinfer", "triton"):
            raise ValueError(
                f"decode_attention_backend must be flashinfer or triton, got {self.decode_attention_backend!r}"
            )
        if self.schedule_policy not in ("fcfs", "lpm", "random"):
            raise ValueError(f"schedule_policy must be lpm, fcfs or random, got {self.schedule_policy!r}")
        if self.decode_log_interval is not None and self.decode_log_interval < 1:
            raise ValueError(f"decode_log_interval must be >= 1, got {self.decode_log_interval}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r} is not supported ({', '.join(QUANTIZATIONS)})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported ({', '.join(KV_CACHE_DTYPES)})"
            )
        if self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(
                f"piecewise_cuda_graph_max_tokens must be >= 1, got {self.piecewise_cuda_graph_max_tokens}"
            )
        if self.piecewise_cuda_graph_tokens is not None and not all(
            isinstance(n, int) and n >= 1 for n in self.piecewise_cuda_graph_tokens
        ):
            raise ValueError(
                f"piecewise_cuda_graph_tokens must be token counts >= 1, got {self.piecewise_cuda_graph_tokens}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must hold at least one page, got {self.max_total_tokens}")
        if self.enable_hierarchical_cache:
            if self.disable_radix_cache:
                raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
            if self.hicache_size < 0 or (self.hicache_size == 0 and self.hicache_ratio <= 0):
                raise ValueError(
                    f"the host pool must be > 0: --hicache-size {self.hicache_size}, "
                    f"--hicache-ratio {self.hicache_ratio}"
                )
        if self.speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(
                f"--speculative-algorithm {self.speculative_algorithm!r} is not supported: NGRAM drafts from the "
                "radix tree and needs no draft model"
            )
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError(
                f"--speculative-disable-by-batch-size must be >= 1, got {self.speculative_disable_by_batch_size}"
            )
        if self.speculative_schedule not in SPEC_SCHEDULES:
            raise ValueError(
                f"--speculative-schedule must be one of {', '.join(SPEC_SCHEDULES)}, got {self.speculative_schedule!r}"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"the n-gram match windows must satisfy 1 <= min <= max, got min {lo}, max {hi}")
        if self.hicache_storage_backend not in (None, "file"):
            raise ValueError(f"--hicache-storage-backend {self.hicache_storage_backend!r} is not supported (file)")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"--hicache-write-policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
                f"got {self.hicache_write_policy!r}"
            )
        if self.hicache_io_backend not in HICACHE_IO_BACKENDS:
            raise ValueError(
                f"--hicache-io-backend must be one of {', '.join(HICACHE_IO_BACKENDS)}, got {self.hicache_io_backend!r}"
            )
        self._validate_lora()
        self._validate_deterministic()

    def _validate_deterministic(self) -> None:
        if not self.enable_deterministic_inference:
            return
        refused = [
            ("--speculative-algorithm", self.speculative_algorithm, "verify steps are not batch-invariant"),
            ("--enable-lora", self.lora_enabled, "adapter products are not batch-invariant yet"),
            ("--quantization", self.quantization, "FP8 GEMMs are not batch-invariant yet"),
            ("an fp8 KV cache", self.kv_cache_dtype.startswith("fp8"), "not batch-invariant yet"),
        ]
        for what, asked, why in refused:
            if asked:
                raise ValueError(f"--enable-deterministic-inference with {what}: {why}")

    @property
    def lora_enabled(self) -> bool:
        """--enable-lora, or --lora-paths (which turns it on, as in SGLang)."""
        return self.enable_lora or bool(self.lora_paths)

    def _validate_lora(self) -> None:
        if not self.lora_enabled:
            return
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"--max-loaded-loras {self.max_loaded_loras} is below --max-loras-per-batch {self.max_loras_per_batch}"
            )
        unknown = sorted(set(self.lora_target_modules or []) - {*LORA_TARGET_MODULES, "all"})
        if unknown:
            raise ValueError(
                f"--lora-target-modules: {', '.join(unknown)} not served ({', '.join(LORA_TARGET_MODULES)} or all)"
            )
        names = [name for name, _, _ in parse_lora_paths(self.lora_paths or [])]
        if self.max_loaded_loras is not None and len(names) > self.max_loaded_loras:
            raise ValueError(f"--lora-paths names {len(names)} adapters; --max-loaded-loras is {self.max_loaded_loras}")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-paths names an adapter twice: {names}")


def parse_lora_paths(items: list[str]) -> list[tuple[str, str, bool]]:
    """SGLang's --lora-paths items as (name, path, pinned): NAME=PATH, PATH (named by itself), or
    JSON {"lora_name": ..., "lora_path": ..., "pinned": ...}."""
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                out.append((str(spec["lora_name"]), str(spec["lora_path"]), bool(spec.get("pinned", False))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-paths {item!r}: JSON needs lora_name and lora_path ({e})") from None
        elif "=" in item:
            name, path = item.split("=", 1)
            out.append((name, path, False))
        else:
            out.append((item, item, False))
    return out


@dataclass
class ServerArgs(EngineArgs):
    """EngineArgs plus what only the HTTP server needs."""

    host: str = knob("127.0.0.1", SERVER, "address to bind (default %(default)s)")
    port: int = knob(30000, SERVER, "HTTP port")
    api_key: str | None = knob(
        None, SERVER, "require 'Authorization: Bearer <key>' (default: $MINISGL_API_KEY)", env="MINISGL_API_KEY"
    )
    log_level: str = knob(
        "info",
        SERVER,
        "what the processes log (debug: one line per batch)",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    served_model_name: str | None = knob(None, SERVER, "name in /v1/models and OpenAI requests")
    check_model_name: bool = knob(
        False,
        SERVER,
        "answer 404 to OpenAI requests naming another model, as vLLM does (SGLang, and by default "
        "minisgl, serve any name)",
    )
    max_queued_requests: int | None = knob(
        None,
        LIMITS,
        "requests that may wait beyond the running ones; more get 503 (default: no limit)",
    )
    watchdog_timeout: float = knob(
        300.0,
        SERVER,
        "seconds a model step may take before the server reports itself dead and exits; a process "
        "that stops answering at all (stopped, frozen) ends the server after this or 20 s, "
        "whichever is shorter",
    )
    log_requests: bool = knob(False, SERVER, "log one line per finished request")
    stream_interval: int = knob(1, SERVER, "tokens per streamed update (larger: fewer events, higher throughput)")
    profile_dir: str | None = knob(
        None,
        SERVER,
        "turns the profiling routes on: /start_profile writes traces under this directory, and a "
        "client's output_dir must lie inside it (default: $SGLANG_TORCH_PROFILER_DIR; with "
        "neither, /start_profile and /stop_profile answer 403)",
    )
    responses_store: str | None = knob(
        None,
        SERVER,
        "a SQLite file to keep stored /v1/responses in, shared by every server given the same "
        "file (--dp-size replicas share one in their runtime folder); default: this server's "
        "memory",
    )
    stream_output: bool = knob(
        False,
        SERVER,
        "streamed /generate events carry only their new text, ids and logprobs (default: all so far)",
    )
    skip_tokenizer_init: bool = knob(
        False,
        SERVER,
        "load no tokenizer: prompts are token ids (input_ids), outputs are token ids (output_ids, no text)",
    )
    # Limits that keep one request from stalling the others (the tokenizer process serves all).
    max_request_bytes: int = knob(
        64 << 20,
        LIMITS,
        "largest request body (413 above; SGLang: --max-payload-size)",
        "--max-payload-size",
    )
    request_body_timeout: float = knob(30.0, LIMITS, "seconds a client may take to send its body (408 after)")
    max_sequences_per_request: int = knob(256, LIMITS, "prompts x n one request may ask for")
    max_stop_strings: int = knob(128, LIMITS, "stop strings per request")
    max_stop_length: int = knob(1024, LIMITS, "characters per stop string")
    strict_request_fields: bool = knob(
        False,
        LIMITS,
        "refuse (400) a request field no schema knows, instead of ignoring it (it is named in the "
        "x-minisgl-ignored-fields response header either way)",
    )
    tool_call_parser: str | None = knob(
        None,
        SERVER,
        "format of tool calls in answers (default: read from the chat template)",
        choices=TOOL_PARSERS,
    )
    completion_template: str | None = knob(
        None,
        SERVER,
        "fill-in-the-middle format of /v1/completions' suffix (default: the one whose special "
        "tokens the tokenizer has)",
        choices=sorted(COMPLETION_TEMPLATES),
    )
    reasoning_parser: str | None = knob(
        None,
        SERVER,
        "separate <think>...</think> into reasoning_content",
        choices=REASONING_PARSERS,
    )
    # /update_weights_from_tensor unpickles its payload (restricted to torch's shared-tensor
    # rebuilders): off unless asked for.
    enable_weight_update_from_tensor: bool = knob(
        False,
        SERVER,
        "accept /update_weights_from_tensor, whose payload is a pickle of torch shared-tensor "
        "handles (decoded by a restricted unpickler; needs --api-key unless the server binds a "
        "loopback address)",
    )
    # Clients name checkpoints and adapters on the control plane (serve/api/client_paths.py).
    weight_update_dirs: list[str] | None = knob(
        None,
        SERVER,
        "folders the control plane may load from (/update_weights_from_disk, /load_lora_adapter): "
        "other paths are refused unread (default: any absolute path)",
    )
    dp_size: int = knob(
        1,
        PARALLEL,
        "replicas (each with --tp-size GPUs) behind the smg router on --host/--port",
        "--data-parallel-size",
    )
    router_policy: str = knob(
        "cache_aware",
        PARALLEL,
        "how the smg router picks a replica with --dp-size (default %(default)s)",
        choices=ROUTER_POLICIES,
    )
    # smg's spill gate: a replica holding the prefix is passed over for the least loaded one when
    # its in-flight requests exceed the replicas' mean by both margins. smg's defaults (64, 1.5)
    # let a burst of 1024 shared-prefix requests land 368 / 96 on four replicas; these kept every
    # replica within 15% at <= 1.5 points of hit rate (benchmarks/results/tp4_h200x4_2026-11-27.md).
    router_balance_abs_threshold: int = knob(
        16,
        PARALLEL,
        "cache_aware spill gate: in-flight requests a replica holding the prefix may have above "
        "the replicas' mean before the least loaded one gets the request, with "
        "--router-balance-rel-threshold (default %(default)s; smg's 64)",
    )
    router_balance_rel_threshold: float = knob(
        1.1,
        PARALLEL,
        "cache_aware spill gate: the same as a multiple of the mean (default %(default)s; smg's 1.5)",
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each flag's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        return f"{text} (default: %(default)s)"


_TYPES = {"int": int, "float": float, "str": str}


def _add_flag(group: argparse._ArgumentGroup, f: Field) -> None:
    """A field's flag: ``--name-with-dashes`` (and its aliases), typed by its annotation."""
    meta, kind = f.metadata, f.type.replace(" | None", "")
    kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
    if kind == "bool":
        kw["action"] = "store_true"
    elif kind.startswith("list["):
        kw.update(nargs="+", type=_TYPES[kind[5:-1]])
    elif kind != "str":
        kw["type"] = _TYPES[kind]
    if f.default is MISSING:
        kw["required"] = True
    else:
        kw["default"] = os.environ.get(meta["env"]) if meta["env"] else f.default
    if meta["choices"] is not None:
        kw["choices"] = list(meta["choices"])
    group.add_argument("--" + f.name.replace("_", "-"), *meta["aliases"], **kw)


def add_flags(ap: argparse.ArgumentParser, settings: list[Field]) -> None:
    """The flags of ``settings`` (fields of EngineArgs / ServerArgs), in their --help groups
    (made in GROUPS' order on first use, so every parser lists them alike)."""
    groups = {g.title: g for g in ap._action_groups}
    for title in GROUPS:
        if title not in groups and any(f.metadata["group"] == title for f in settings):
            groups[title] = ap.add_argument_group(title)
    for f in settings:
        _add_flag(groups[f.metadata["group"]], f)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine's flags (SGLang's names), shared by the server and ``minisgl.generate``."""
    add_flags(ap, list(fields(EngineArgs)))


def normalize_engine_args(ns: argparse.Namespace) -> None:
    """SGLang's spellings of our values to ours."""
    if ns.attention_backend == "torch_native":
        ns.attention_backend = "torch"
    elif ns.attention_backend in ATTENTION_BACKENDS:
        logger.warning("--attention-backend %s: minisgl's own choice (auto) serves it", ns.attention_backend)
        ns.attention_backend = "auto"


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The EngineArgs fields of parsed arguments (for ``LLM(**...)``, model excluded)."""
    normalize_engine_args(ns)
    return {f.name: getattr(ns, f.name) for f in fields(EngineArgs) if f.name != "model" and hasattr(ns, f.name)}


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the server, in groups (``docs/flags.md`` is generated from it)."""
    ap = argparse.ArgumentParser(
        prog="python -m minisgl.launch",
        usage="%(prog)s --model MODEL [options]  (--help lists every flag)",  # not 64 lines of them
        description="Serve a model over HTTP.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # --served-model-nam is an unknown flag, not a guess
    )
    add_engine_args(ap)
    engine = {f.name for f in fields(EngineArgs)}
    add_flags(ap, [f for f in fields(ServerArgs) if f.name not in engine])
    add_sglang_flags(ap)
    return ap
