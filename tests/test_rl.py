"""The RL control plane in one process: weight updates from each source, pause modes, memory
release, the cache epochs after an update, and the restricted unpickler of tensor payloads."""

from __future__ import annotations

import base64
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minisgl.device.layers.quantization import dequantize, quantize_weight
from minisgl.device.tiny_model import make_tiny_model
from minisgl.device.worker.tensor_payload import decode_named_tensors, encode_named_tensors
from minisgl.llm import LLM
from minisgl.wire.control import TensorWeights
from minisgl.wire.sampling import SamplingParams
from scripts.hardening_check import damaged_checkpoints
from tests.test_scheduler import CheckedLLM, shared_prefix_prompts, tokens

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"device": "cpu", "max_total_tokens": 8192, "page_size": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B: one architecture, other weights; Q: another architecture."""
    root = tmp_path_factory.mktemp("rl")
    return {
        "A": make_tiny_model("llama", root / "A", seed=0),
        "B": make_tiny_model("llama", root / "B", seed=1),
        "Q": make_tiny_model("qwen3", root / "Q", seed=0),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(groups=3, per_group=3, prefix_len=24, seed=3)


@pytest.fixture(scope="module")
def reference(checkpoints, prompts) -> dict[str, list[list[int]]]:
    """Greedy tokens of a fresh engine on each checkpoint."""
    return {name: tokens(LLM(str(checkpoints[name]), **ENGINE).generate(prompts, GREEDY)) for name in ("A", "B")}


def state_dict(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_each_update_path_gives_the_new_checkpoints_tokens(checkpoints, prompts, reference):
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    assert llm.update_weights_from_disk(str(checkpoints["B"]))[0]
    assert tokens(llm.generate(prompts, GREEDY)) == reference["B"]
    ok, message = llm.update_weights_from_tensor(list(state_dict(checkpoints["A"]).items()))
    assert ok, message
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    # Through the serialized payload the server's workers decode (shared memory on CPU), bucketed.
    payload = base64.b64decode(encode_named_tensors(state_dict(checkpoints["B"]).items(), flattened=True))
    reply = llm.scheduler.control.run_task(TensorWeights([payload], "flattened_bucket"))
    assert reply.ok, reply.message
    assert tokens(llm.generate(prompts, GREEDY)) == reference["B"]
    llm.scheduler.check_integrity()


def test_an_update_never_serves_kv_of_older_weights(checkpoints, prompts, reference):
    """The prompts are cached under A; after the update the same prompts hit nothing (new epoch)
    and give B's tokens, then hit B's own cached prefixes."""
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    llm.generate(prompts, GREEDY)
    assert llm.update_weights_from_disk(str(checkpoints["B"]), flush_cache=False)[0]
    assert llm.scheduler.stats()["evictable_pages"] > 0  # A's pages stay until evicted
    first = llm.generate(prompts, GREEDY)
    assert tokens(first) == reference["B"]
    assert sum(r["meta_info"]["cached_tokens"] for r in first) == sum(  # only B's own group prefixes
        r["meta_info"]["cached_tokens"] for r in LLM(str(checkpoints["B"]), **ENGINE).generate(prompts, GREEDY)
    )
    assert llm.update_weights_from_disk(str(checkpoints["A"]))[0]  # flush_cache: every unheld page freed
    stats = llm.scheduler.stats()
    assert stats["free_pages"] == stats["total_pages"]


def test_refused_updates_leave_the_old_weights(checkpoints, prompts, reference, tmp_path):
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    ok, message = llm.update_weights_from_disk(str(checkpoints["Q"]))
    assert not ok and "architecture" in message
    ok, message = llm.update_weights_from_disk(str(tmp_path / "missing"))
    assert not ok and "missing" in message
    sd = state_dict(checkpoints["B"])
    name = "model.layers.0.mlp.down_proj.weight"
    bad_shape = {**sd, name: sd[name][:, :-1]}
    ok, message = llm.update_weights_from_tensor(list(bad_shape.items()))
    assert not ok and name in message and "shape" in message
    ok, message = llm.update_weights_from_tensor([*sd.items(), ("model.layers.9.nonsense.weight", sd[name])])
    assert not ok and "no place" in message
    # A partial update that passes changes only its tensors: none of these were loaded.
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]


def test_damaged_checkpoints_are_refused_and_the_old_weights_serve(checkpoints, prompts, reference, tmp_path):
    """A checkpoint cut short, with a header larger than its file, a FIFO or a device in its
    place, integer tensors or NaN weights: a refusal naming the problem, the worker alive, A's
    tokens after."""
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    for what, (folder, why) in damaged_checkpoints(checkpoints["B"], tmp_path).items():
        ok, message = llm.update_weights_from_disk(str(folder))
        assert not ok and why in message, (what, message)
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("scheme", ["online", "block"])
def test_fp8_engines_take_float_and_fp8_updates(checkpoints, prompts, tmp_path, scheme):
    """--quantization fp8 quantizes pushed float weights with fresh scales; an engine started
    from a block-wise FP8 checkpoint takes another one: both give a fresh engine's tokens."""
    from scripts.quantize_checkpoint import convert

    if scheme == "online":
        start, new, kw = checkpoints["A"], checkpoints["B"], {"quantization": "fp8"}
    else:
        start, new, kw = (
            convert(checkpoints["A"], tmp_path / "A", "block"),
            convert(checkpoints["B"], tmp_path / "B", "block"),
            {},
        )
    want = tokens(LLM(str(new), **ENGINE, **kw).generate(prompts, GREEDY))
    llm = CheckedLLM(str(start), **ENGINE, **kw)
    assert tokens(llm.generate(prompts, GREEDY)) != want
    assert llm.update_weights_from_disk(str(new))[0]
    assert tokens(llm.generate(prompts, GREEDY)) == want
    if scheme == "online":
        assert llm.update_weights_from_tensor(list(state_dict(checkpoints["A"]).items()))[0]
        assert tokens(llm.generate(prompts, GREEDY)) == tokens(
            LLM(str(start), **ENGINE, **kw).generate(prompts, GREEDY)
        )


def test_a_gguf_engine_takes_its_gguf_file_again(smollm2_gguf, checkpoints):
    """The real model, loaded from its GGUF file, updated from the same file: same tokens;
    a checkpoint of another shape is refused."""
    llm = LLM(str(smollm2_gguf), device="cpu", max_total_tokens=4096)
    prompt = [[1, 504, 3458, 282, 4649, 314]]
    before = tokens(llm.generate(prompt, GREEDY))
    ok, message = llm.update_weights_from_disk(str(smollm2_gguf))
    assert ok, message
    assert tokens(llm.generate(prompt, GREEDY)) == before
    ok, message = llm.update_weights_from_disk(str(checkpoints["A"]))
    assert not ok and "vocab_size" in message


class _Evil:
    def __reduce__(self):
        return os.system, ("touch /tmp/minisgl-pwned",)


def test_the_tensor_payload_decoder_imports_nothing_else(tmp_path):
    marker = Path("/tmp/minisgl-pwned")
    marker.unlink(missing_ok=True)
    for obj in ([("w", _Evil())], _Evil()):
        with pytest.raises(ValueError, match="posix.system|os.system"):
            decode_named_tensors(pickle.dumps(obj))
    assert not marker.exists()
    with pytest.raises(ValueError, match="base64"):
        decode_named_tensors("not base64 at all!")
    with pytest.raises(ValueError, match="load_format"):
        decode_named_tensors(encode_named_tensors([("w", torch.ones(2))]), "safetensors")
    with pytest.raises(ValueError, match="pairs"):
        decode_named_tensors(base64.b64encode(pickle.dumps(5)))
    with pytest.raises(ValueError, match="not a tensor"):  # (a dict of them, as LoRA tensors come, is read too)
        decode_named_tensors(base64.b64encode(pickle.dumps({"a": 1})))
    shared: list = []
    for _ in range(27):  # a list of 2^27 leaves in a few hundred bytes: its text would take gigabytes
        shared = [shared, shared]
    for names in ([(shared, shared)], [("x" * 5000, 1)]):
        payload = pickle.dumps(names, protocol=2)
        with pytest.raises(ValueError, match="tensor name") as refused:
            decode_named_tensors(payload)
        assert len(payload) < 6000 and len(str(refused.value)) < 200
    # Lists nested 200,000 deep (400 kB of opcodes): the unpickler and the checks after it
    # recurse nowhere, so this is a 400, not a RecursionError; the request size bounds the rest.
    deep = b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b"."
    with pytest.raises(ValueError, match="pairs"):
        decode_named_tensors(deep)
    named = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    for flattened in (False, True):
        out = decode_named_tensors(
            encode_named_tensors(named, flattened), "flattened_bucket" if flattened else "direct"
        )
        assert [n for n, _ in out] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(out, named))
    # SGLang's LoRA tensors come as a dict of them.
    from multiprocessing.reduction import ForkingPickler

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(dict(named))
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    out = decode_named_tensors(buf.getvalue())
    assert [n for n, _ in out] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(out, named))


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_keep_every_page_and_request(checkpoints, prompts, reference, mode):
    """Pause with requests mid-decode, update the weights, continue: abort ends them with their
    partial tokens; retract recomputes them under the new weights, so each continues as B would
    from its partial output; in_place keeps their KV. The integrity check runs after every step."""
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    sched = llm.scheduler
    params = SamplingParams(**{**GREEDY, "max_new_tokens": 12})
    reqs = [sched.add_request(p, params) for p in prompts]
    while min(len(r.output_ids) for r in reqs) < 4:
        sched.step()
    held = sched.control.pause(mode)
    assert held == len(prompts) and sched.held
    sched.check_integrity()
    partial = [list(r.output_ids) for r in reqs]
    assert all(p == ref[: len(p)] for p, ref in zip(partial, reference["A"]))
    assert llm.update_weights_from_disk(str(checkpoints["B"]))[0]
    sched.check_integrity()
    for _ in range(3):  # nothing runs while paused
        sched.step()
    assert [r.output_ids for r in reqs] == partial
    sched.control.resume()
    while sched.has_work:
        sched.step()
    sched.check_integrity()
    if mode == "abort":
        assert all(r.finish_reason == "abort" and r.output_ids == p for r, p in zip(reqs, partial))
        return
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in reqs)
    if mode == "retract":  # recomputed under B: B's greedy continuation of prompt + partial output
        fresh_b = LLM(str(checkpoints["B"]), **ENGINE)
        rest = fresh_b.generate(
            [p + out for p, out in zip(prompts, partial)],
            [{**GREEDY, "max_new_tokens": 12 - len(out)} for out in partial],
        )
        assert [r.output_ids[len(p) :] for r, p in zip(reqs, partial)] == tokens(rest)
    stats = sched.stats()
    assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


def test_release_and_resume_give_the_same_tokens(checkpoints, prompts, reference):
    llm = CheckedLLM(str(checkpoints["A"]), **ENGINE)
    llm.generate(prompts, GREEDY)
    sched = llm.scheduler
    reqs = [sched.add_request(p, SamplingParams(**{**GREEDY, "max_new_tokens": 12})) for p in prompts[:2]]
    sched.step()
    ok, message = llm.release_memory_occupation()
    assert not ok and "pause_generation" in message  # requests hold pages
    sched.control.pause("retract")
    ok, message = llm.release_memory_occupation(["kv_cache", "weights"])
    assert ok, message
    assert all(s.nbytes() == 0 for s in (p.untyped_storage() for p in llm.runner.model.parameters()))
    assert llm.runner.kv_cache.buffer.untyped_storage().nbytes() == 0
    ok, message = llm.update_weights_from_disk(str(checkpoints["B"]))
    assert not ok and "released" in message
    sched.control.resume()  # not paused any more, but the memory is still out: nothing runs
    sched.step()
    assert not sched.running
    assert llm.resume_memory_occupation()[0]
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == [
        ref[:12]
        for ref in tokens(LLM(str(checkpoints["A"]), **ENGINE).generate(prompts[:2], {**GREEDY, "max_new_tokens": 12}))
    ]
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    sched.check_integrity()


@pytest.mark.cuda
def test_on_cuda_updates_and_memory_release_keep_graphs_right(tmp_path, prompts):
    """With CUDA graphs (decode and piecewise prefill): an update copied in place is what the
    replayed graphs compute (same tokens as a fresh engine on B), and after a release and
    resume (graphs captured again) the same prompts give the same tokens."""
    a, b = (
        make_tiny_model("llama", tmp_path / name, seed=seed, overrides={"head_dim": 128})
        for name, seed in (("A", 0), ("B", 1))
    )
    cuda = {"device": "cuda", "dtype": "bfloat16", "max_total_tokens": 8192, "page_size": 16}
    fresh_b = tokens(LLM(str(b), **cuda).generate(prompts, GREEDY))
    llm = LLM(str(a), **cuda)
    assert llm.runner.graphs is not None and llm.runner.piecewise is not None
    before = tokens(llm.generate(prompts, GREEDY))
    assert llm.update_weights_from_disk(str(b))[0]
    assert tokens(llm.generate(prompts, GREEDY)) == fresh_b
    held = sum(p.nbytes for p in llm.runner.model.parameters()) + llm.runner.kv_cache.buffer.nbytes
    allocated = torch.cuda.memory_allocated()
    ok, message = llm.release_memory_occupation()
    assert ok, message
    assert llm.runner.graphs is None and allocated - torch.cuda.memory_allocated() >= held
    assert llm.resume_memory_occupation()[0] and llm.runner.graphs is not None
    assert tokens(llm.generate(prompts, GREEDY)) == fresh_b
    assert llm.update_weights_from_tensor(list(state_dict(a).items()))[0]
    assert tokens(llm.generate(prompts, GREEDY)) == before


def check_reads(llm: LLM, folder: Path, rows: int = 3) -> None:
    """Every checkpoint tensor reads back as stored: its first rows, fused parts and shards
    included."""
    for name, tensor in state_dict(folder).items():
        assert llm.get_weights_by_name(name, rows) == tensor[:rows].float().tolist(), name


def test_get_weights_by_name_reads_back_every_tensor(checkpoints, tiny_models):
    """SGLang's get_weights_by_name: each checkpoint tensor's first rows as the model holds them
    (dense, mixtures of experts with a shared expert and biases), the new ones after an update;
    all rows past the end; fp8 weights dequantized; names with no place refused by name."""
    llm = LLM(str(checkpoints["A"]), **ENGINE)
    check_reads(llm, checkpoints["A"])
    embed = state_dict(checkpoints["A"])["model.embed_tokens.weight"]
    assert llm.get_weights_by_name("model.embed_tokens.weight", 10**6) == embed.tolist()
    assert llm.get_weights_by_name("model.norm.weight", 0) == []
    assert llm.update_weights_from_disk(str(checkpoints["B"]))[0]
    check_reads(llm, checkpoints["B"])
    for bad, word in (
        ("model.layers.0.mlp.nope.weight", "no place"),
        ("model.layers.0.mlp.down_proj.weight_scale", "scales"),
    ):
        with pytest.raises(ValueError, match=word):
            llm.get_weights_by_name(bad)
    with pytest.raises(ValueError, match="truncate_size"):
        llm.get_weights_by_name("model.norm.weight", -1)
    for arch in ("qwen3_moe", "qwen2_moe"):
        check_reads(LLM(str(tiny_models[arch]), **ENGINE), tiny_models[arch], rows=2)
    fp8 = LLM(str(checkpoints["A"]), quantization="fp8", **ENGINE)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w = state_dict(checkpoints["A"])[name]
        got = torch.tensor(fp8.get_weights_by_name(name, 10**6))
        assert torch.equal(got, dequantize(*quantize_weight(w, None)))
        assert (got - w).abs().max() <= 0.07 * w.abs().max()


def test_updates_and_release_at_tp2(checkpoints, prompts, reference):
    """Two ranks (worker processes, gloo): each update path reaches both shards (the tensor
    payload once per rank), a refusal on the ranks leaves both old, and release/resume works."""
    llm = LLM(str(checkpoints["A"]), tp_size=2, **ENGINE)
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    assert llm.update_weights_from_disk(str(checkpoints["B"]))[0]
    assert tokens(llm.generate(prompts, GREEDY)) == reference["B"]
    check_reads(llm, checkpoints["B"], rows=40)  # (past one rank's rows: the shards gathered)
    ok, message = llm.update_weights_from_disk(str(checkpoints["Q"]))
    assert not ok and "architecture" in message
    assert llm.update_weights_from_tensor(list(state_dict(checkpoints["A"]).items()), "flattened_bucket")[0]
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    assert llm.release_memory_occupation()[0] and llm.resume_memory_occupation()[0]
    assert tokens(llm.generate(prompts, GREEDY)) == reference["A"]
    llm.runner.close()


def test_client_paths_are_absolute_and_inside_the_update_dirs(tmp_path):
    """What a client may name on the control plane (serve/api/client_paths.py): absolute paths
    only (no '~', relative path or hub id; the served --model by its own name), and with
    --weight-update-dirs only inside them, links resolved, refused without reading anything."""
    from minisgl.config.args import ServerArgs
    from minisgl.serve.api.client_paths import check_client_path
    from minisgl.serve.api.errors import BadRequest

    inside, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    (inside / "link").symlink_to(outside)
    anywhere = ServerArgs(model="org/model")
    confined = ServerArgs(model="org/model", weight_update_dirs=[str(inside)])
    check_client_path("org/model", anywhere, "model_path", served="org/model")
    check_client_path(str(outside / "step1"), anywhere, "model_path")
    check_client_path(str(inside / "step1"), confined, "model_path")
    for path, args, why in (
        ("~/ckpt", anywhere, "absolute path"),
        ("org/other", anywhere, "absolute path"),
        ("ckpts/step1", anywhere, "absolute path"),
        ("/x\x00y", anywhere, "without NUL"),
        (str(outside / "step1"), confined, "outside --weight-update-dirs"),
        (str(inside / "link" / "step1"), confined, "outside --weight-update-dirs"),
        (str(inside / ".." / "elsewhere"), confined, "outside --weight-update-dirs"),
    ):
        with pytest.raises(BadRequest, match=why):
            check_client_path(path, args, "model_path")
