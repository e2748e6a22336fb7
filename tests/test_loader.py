"""Checkpoint loading: local folders, sharded files, dummy weights, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minisgl.checkpoint.locate import resolve_model_path
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.config.args import EngineArgs
from minisgl.device.models.loader import safetensors_files
from minisgl.device.tiny_model import make_tiny_model
from minisgl.device.worker.model_runner import ModelRunner
from tests.helpers import prefill_batch


def runner_for(path, **kw) -> ModelRunner:
    kw.setdefault("device", "cpu")
    return ModelRunner(EngineArgs(model=str(path), max_total_tokens=2048, max_running_requests=4, **kw))


def logits_of(runner: ModelRunner) -> torch.Tensor:
    return runner.forward(prefill_batch(runner, [[1, 2, 3, 4, 5]]))


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_models):
    sharded = make_tiny_model("qwen3", tmp_path / "sharded", seed=0, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    torch.testing.assert_close(logits_of(runner_for(sharded)), logits_of(runner_for(tiny_models["qwen3"])))


def test_dummy_weights_need_no_weight_files(tmp_path, tiny_llama):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder)
    a = logits_of(runner_for(folder, load_format="dummy"))
    b = logits_of(runner_for(folder, load_format="dummy"))
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_bfloat16_runs_on_cpu(tiny_llama):
    runner = runner_for(tiny_llama, dtype="bfloat16")
    assert runner.kv_cache.buffer.dtype == torch.bfloat16
    assert torch.isfinite(logits_of(runner)).all()


def test_rope_scaling_is_read_from_either_format(tiny_llama):
    raw = json.loads((tiny_llama / "config.json").read_text())
    new_style = ModelConfig.from_dict(raw)
    old = dict(raw)
    rope = dict(old.pop("rope_parameters"))
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = rope
    assert ModelConfig.from_dict(old) == new_style
    assert new_style.rope_scaling["rope_type"] == "llama3"


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./no/such/folder")


def test_unreachable_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="hub"):
        resolve_model_path("minisgl-tests/does-not-exist")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        runner_for(tmp_path)


def test_missing_weights(tmp_path, tiny_llama):
    shutil.copy(tiny_llama / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        runner_for(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    sharded = make_tiny_model("llama", tmp_path / "m", max_shard_size="100KB")
    victim = safetensors_files(sharded)[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        runner_for(sharded)


def test_unsupported_architecture(tmp_path, tiny_llama):
    raw = json.loads((tiny_llama / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        runner_for(tmp_path)


def test_config_missing_a_field(tmp_path, tiny_llama):
    raw = json.loads((tiny_llama / "config.json").read_text())
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hidden_size"):
        runner_for(tmp_path)


def test_checkpoint_with_a_foreign_tensor(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="model.extra.weight"):
        runner_for(tmp_path / "m")


def test_checkpoint_missing_a_tensor(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 weights: model.norm.weight"):
        runner_for(tmp_path / "m")


@pytest.mark.parametrize("bad", [dict(dtype="int8"), dict(load_format="pt"), dict(page_size=0), dict(device="tpu")])
def test_bad_engine_arguments(tiny_llama, bad):
    with pytest.raises((ValueError, RuntimeError)):
        runner_for(tiny_llama, **bad)
