"""SGLang launch flags that have no minisgl flag of their own, so that an SGLang command line never
ends in a bare argparse error: each is accepted and does what minisgl does instead (said in
``--help`` and in a warning when given), or is refused by name with the reason (exit 2).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import NoReturn

logger = logging.getLogger("minisgl.launch")

SWITCH, ONE, MANY = 0, 1, 2  # what a flag takes: nothing, one value, one or more values

# flag -> (takes, why it changes nothing here); accepted silently: what it asks for is how minisgl is.
ACCEPTED: dict[str, tuple[int, str]] = {
    "--trust-remote-code": (SWITCH, "minisgl never runs code from a checkpoint"),
    "--enable-metrics": (SWITCH, "/metrics is always served"),
    "--enable-cache-report": (SWITCH, "cached-token counts are always reported"),
    "--skip-server-warmup": (SWITCH, "the server sends no warm-up request"),
}
# flag -> (takes, what minisgl does instead); accepted and ignored with a warning.
INERT: dict[str, tuple[int, str]] = {
    "--enable-torch-compile": (SWITCH, "minisgl replays its own CUDA graphs: decode steps whole, prefill in pieces"),
    "--torch-compile-max-bs": (ONE, "no torch.compile here (see --cuda-graph-max-bs)"),
    "--sampling-backend": (ONE, "minisgl's sampler: Triton kernels on CUDA, torch elsewhere"),
    "--tokenizer-mode": (ONE, "the fast tokenizer where the checkpoint has one, else the slow one"),
    "--schedule-conservativeness": (ONE, "pages are reserved by each request's own max_new_tokens"),
    "--log-requests-level": (ONE, "--log-requests logs one line per finished or refused request"),
    "--show-time-cost": (SWITCH, "per-step timings come from /start_profile"),
    "--enable-p2p-check": (SWITCH, "GPU peer access is probed when the custom all-reduce starts"),
    "--num-continuous-decode-steps": (ONE, "overlap scheduling already launches each step behind the last"),
    "--moe-runner-backend": (ONE, "minisgl's fused MoE Triton kernel"),
    "--file-storage-path": (ONE, "minisgl keeps no file storage"),
    "--triton-attention-num-kv-splits": (ONE, "the decode kernel picks its splits per batch"),
    "--sleep-on-idle": (SWITCH, "an idle scheduler blocks on its socket"),
    "--crash-dump-folder": (ONE, "no crash dumps; --log-requests logs requests"),
    "--download-dir": (ONE, "hub downloads go to the Hugging Face cache ($HF_HOME)"),
    "--speculative-ngram-min-bfs-breadth": (ONE, "NGRAM drafts are chains, not trees"),
    "--speculative-ngram-max-bfs-breadth": (ONE, "NGRAM drafts are chains, not trees"),
    "--speculative-ngram-branch-length": (ONE, "every token of the radix tree and of each request is indexed"),
    "--speculative-ngram-match-type": (ONE, "NGRAM drafts follow the longest match"),
    "--lora-backend": (ONE, "one LoRA path: masked GEMMs over every adapter slot at once"),
    "--max-lora-chunk-size": (ONE, "one LoRA path: masked GEMMs over every adapter slot at once"),
    "--lora-eviction-policy": (ONE, "a device slot goes to the least recently used adapter (lru)"),
    "--enable-lora-overlap-loading": (SWITCH, "adapters are copied into slots from pinned memory, before the step"),
    "--mamba-full-memory-ratio": (ONE, "the state pool is sized by --max-running-requests and --max-mamba-cache-size"),
    "--mamba-scheduler-strategy": (ONE, "snapshots at each prompt's last page boundary before its last token"),
    "--enable-custom-logit-processor": (
        SWITCH,
        "request code is never run; SGLang's thinking-budget processors are served without it (/generate, chat)",
    ),
}
# flag -> (takes, why not); refused with the reason.
REFUSED: dict[str, tuple[int, str]] = {
    "--grammar-backend": (ONE, "structured output goes through xgrammar, the one backend here"),
    "--is-embedding": (SWITCH, "embedding models are not served (generation models only)"),
    "--tool-server": (ONE, "built-in tool servers are not supported: send tools in the request"),
    "--enable-dp-attention": (SWITCH, "DP attention is not built: use --dp-size replicas"),
    "--ep-size": (ONE, "expert parallelism is not built: experts split across --tp-size ranks"),
    "--enable-eplb": (SWITCH, "expert parallelism is not built"),
    "--speculative-draft-model-path": (
        ONE,
        "no draft models: --speculative-algorithm NGRAM drafts from the radix tree",
    ),
    "--speculative-num-steps": (ONE, "drafts are chains of --speculative-num-draft-tokens (NGRAM)"),
    "--speculative-eagle-topk": (ONE, "no EAGLE drafts: --speculative-algorithm NGRAM drafts chains"),
    "--allow-auto-truncate": (SWITCH, "an over-long prompt is refused with a 400, never truncated"),
    "--preferred-sampling-params": (ONE, "server-wide sampling defaults are not supported: send them per request"),
    "--enable-multimodal": (SWITCH, "multimodal models are not served"),
    "--constrained-json-whitespace-pattern": (ONE, "xgrammar's JSON whitespace rule is used as it is"),
}
# Values of a refused flag that ask for what minisgl does: accepted silently.
SAME = {"--ep-size": "1", "--grammar-backend": "xgrammar"}
# SGLang's attention backends, all served by minisgl's own choice (--attention-backend auto).
ATTENTION_BACKENDS = ("triton", "fa3", "fa4", "flashmla", "cutlass_mla", "trtllm_mha", "trtllm_mla", "flex_attention")


def _dest(flag: str) -> str:
    return "sglang_" + flag.lstrip("-").replace("-", "_")


def add_sglang_flags(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("SGLang flags minisgl answers otherwise (mapped, ignored or refused)")
    group.add_argument(
        "--cuda-graph-bs",
        dest="sglang_cuda_graph_bs",
        type=int,
        nargs="+",
        default=None,
        help="mapped: the largest becomes --cuda-graph-max-bs (graphs are captured for sizes up to it)",
    )
    for table, verdict in ((ACCEPTED, "accepted"), (INERT, "ignored"), (REFUSED, "refused")):
        for flag, (takes, why) in table.items():
            kw: dict = {"action": "store_true"} if takes == SWITCH else {"nargs": "+"} if takes == MANY else {}
            group.add_argument(flag, dest=_dest(flag), default=None, help=f"{verdict}: {why}", **kw)


def apply_sglang_flags(ns: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """Map a mapped flag, refuse a refused one by name (``error``), warn about an ignored one,
    and drop them all (the accepted ones too) from ``ns``."""
    sizes = ns.sglang_cuda_graph_bs
    del ns.sglang_cuda_graph_bs
    if sizes and ns.cuda_graph_max_bs is None:
        ns.cuda_graph_max_bs = max(sizes)
    for table, verdict in ((ACCEPTED, None), (INERT, "ignored"), (REFUSED, "refused")):
        for flag, (_, why) in table.items():
            given = getattr(ns, _dest(flag))
            delattr(ns, _dest(flag))
            if given in (None, False) or verdict is None or given == SAME.get(flag):
                continue
            if verdict == "refused":
                error(f"{flag}: {why}")
            logger.warning("%s is ignored: %s", flag, why)
