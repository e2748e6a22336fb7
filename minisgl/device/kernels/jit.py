"""Compile the CUDA sources of ``kernels/csrc`` at run time with tvm-ffi and cache them on disk.

The sources live in the repository's top-level ``kernels/csrc``; an installed package carries
them as ``minisgl.device.kernels.csrc`` (the build maps that folder there), and a source checkout
reads them where they are.

tvm-ffi builds a small kernel in seconds (torch's cpp_extension takes about a minute) and keeps
the shared library under ``~/.cache/tvm-ffi`` (or ``$TVM_FFI_CACHE_DIR``), so later runs only load it.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def csrc_dir() -> Path:
    """The CUDA sources: the installed package's copy, else the checkout's top-level folder."""
    installed = Path(__file__).resolve().parent / "csrc"
    return installed if any(installed.glob("*.cu")) else Path(__file__).resolve().parents[3] / "kernels" / "csrc"


@functools.cache
def load_module(name: str) -> Any:
    """Load ``csrc/<name>.cu`` (compiling it if its cached build is missing or stale)."""
    import tvm_ffi.cpp

    source = csrc_dir() / f"{name}.cu"
    if not source.is_file():
        raise FileNotFoundError(f"CUDA source {source} not found (the package was installed without it)")
    start = time.perf_counter()
    module = tvm_ffi.cpp.load(f"minisgl_{name}", cuda_files=[str(source)], extra_cuda_cflags=["-O3", "--use_fast_math"])
    logger.info("kernel %s ready in %.2f s", name, time.perf_counter() - start)
    return module
