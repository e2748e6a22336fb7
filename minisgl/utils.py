"""Small helpers shared by every layer of the stack: device, dtype and logging choices.

torch is imported only inside the device and dtype helpers: the tokenizer, scheduler and API
processes use this module too and never load torch (hundreds of MB of memory each)."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def progress(iterable: Any = None, primary: bool = True, **kw: Any) -> Any:
    """A tqdm bar on a terminal only (written to a log file, its frames would be ``\r`` noise),
    and only for the primary tensor-parallel rank (``primary``)."""
    from tqdm import tqdm

    return tqdm(iterable, disable=None if primary else True, dynamic_ncols=True, **kw)


def keep_torch_out() -> None:
    """In a process that never runs a model (tokenizer, scheduler): transformers imports torch
    whenever it is installed, for tokenizers too (0.7 s and ~100 MB a process); with None for
    it in ``sys.modules``, transformers finds no torch and any other import of it fails loudly.
    ``allow_torch`` lets a library that needs it (the grammar backend) load it after all."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # (its "PyTorch was not found" line)


def allow_torch() -> None:
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]


def resolve_device(device: str = "auto", gpu: int | None = None) -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is taken literally. ``gpu``: the
    index of a CUDA device that names none (else the current one)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but no CUDA device is available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device() if gpu is None else gpu)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"GPU {dev.index} was asked for; {torch.cuda.device_count()} are visible")
    return dev


def resolve_dtype(dtype: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' follows the checkpoint on GPU and uses float32 on CPU (bf16 matmuls are slow there)."""
    import torch

    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return getattr(torch, _DTYPES[dtype])
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, _DTYPES.get(str(config_dtype).replace("torch.", ""), "bfloat16"))


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``markers``: text
    a stream must hold back, as the next piece may complete the marker."""
    markers = list(markers)
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


@functools.cache
def has_module(name: str) -> bool:
    """Whether an optional package (flashinfer, triton) imports; asked once per process."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, copied into ``out`` when the caller gave one (a fixed buffer)."""
    return result if out is None else out.copy_(result)


def divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


def init_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="[%(asctime)s %(processName)s %(levelname)s] %(message)s",
        datefmt="%H:%M:%S",
    )


def context_overflow(limit: int, prompt: int, new: int = 0) -> str:
    """The 400 text for a request over the context length, in the words SGLang's clients (and
    tools that classify provider errors) look for."""
    asked = f"{prompt} prompt tokens + {new} new tokens" if new else f"the prompt has {prompt} tokens"
    return f"Requested token count exceeds the model's maximum context length of {limit} tokens: {asked}"


def hidden_state_rows(data: bytes, hidden_size: int, prompt_tokens: int) -> list[Any]:
    """float32 [positions, hidden] bytes (prompt positions first, then one per output token but
    the last) in SGLang's ``meta_info["hidden_states"]`` layout: the prompt's rows as one list of
    rows, then each output token's row."""
    from array import array

    flat = array("f", data)
    rows = [flat[i : i + hidden_size].tolist() for i in range(0, len(flat), hidden_size)]
    return [rows[:prompt_tokens], *rows[prompt_tokens:]]


def last_hidden_state(data: bytes, hidden_size: int) -> list[float]:
    """The last row of float32 [positions, hidden] bytes: the hidden state that gave the last
    token (the chat and completions routes' ``hidden_states``)."""
    from array import array

    return array("f", data[-4 * hidden_size :]).tolist() if data else []


def routed_experts_array(meta_info: dict[str, Any], num_layers: int, top_k: int) -> Any:
    """A result's ``meta_info["routed_experts"]`` (base64 of int32) as a numpy array [positions,
    layers, k]: position p's expert ids in each layer (-1 in dense layers), for every position
    the model computed (the prompt and the outputs but the last)."""
    import base64

    import numpy as np

    flat = np.frombuffer(base64.b64decode(meta_info["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, num_layers, top_k)
