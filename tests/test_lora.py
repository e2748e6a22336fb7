"""LoRA adapters (--enable-lora, --lora-paths, /load_lora_adapter): each request's tokens equal
transformers' on the base checkpoint with that adapter merged into its weights (fp32), whatever
else its batch holds; the prefix cache never serves one adapter's KV to another; adapters load
and unload while serving; tp=2 and the GPU's graphs give one plain process's tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl.device.tiny_model import make_lora_adapter
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from scripts.hardening_check import damaged_adapters

PARAMS = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [list(range(40, 75)), list(range(100, 118)), [5, 6, 7, 8]]


def merged(model: Path, adapter: Path, out: Path) -> Path:
    """The checkpoint with the adapter folded into its weights: W + scaling * B A."""
    shutil.copytree(model, out, dirs_exist_ok=True)
    weights = load_file(model / "model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, a in lora.items():
        if ".lora_A." in key:
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[name] = weights[name] + scaling * lora[key.replace("lora_A", "lora_B")] @ a
    save_file(weights, out / "model.safetensors")
    return out


def transformers_greedy(path: Path, prompt: list[int], n: int = PARAMS["max_new_tokens"]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a1: every module, rank 8; a2: q, v and down, rank 4, rsLoRA; a3: o and gate/up, rank 2."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": make_lora_adapter(tiny_llama, root / "a1", rank=8, seed=1),
        "a2": make_lora_adapter(
            tiny_llama, root / "a2", ("q_proj", "v_proj", "down_proj"), rank=4, seed=2, use_rslora=True
        ),
        "a3": make_lora_adapter(tiny_llama, root / "a3", ("o_proj", "gate_proj", "up_proj"), rank=2, seed=3),
    }


@pytest.fixture(scope="module")
def references(tiny_llama: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Greedy tokens of each prompt under each adapter (None: the base model), from transformers."""
    root = tmp_path_factory.mktemp("merged")
    paths = {None: tiny_llama, **{name: merged(tiny_llama, path, root / name) for name, path in adapters.items()}}
    return {name: [transformers_greedy(path, p) for p in PROMPTS] for name, path in paths.items()}


def _llm(model: Path, **kw):
    from minisgl.llm import LLM

    return LLM(str(model), device="cpu", dtype="float32", max_running_requests=16, **kw)


def test_a_mixed_batch_gives_each_adapter_transformers_tokens(tiny_llama, adapters, references):
    """Three adapters and the base model in one batch, radix cache on and off, each prompt under
    each: transformers' greedy tokens on the merged checkpoints."""
    llm = _llm(tiny_llama, lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=4)
    names = [None, "a1", "a2", "a3"]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [n for n in names for _ in PROMPTS]
    for radix_off in (False, True):
        llm.reset_scheduler(disable_radix_cache=radix_off)
        out = llm.generate(prompts, PARAMS, lora_path=loras)
        llm.scheduler.check_integrity()
        got = [r["output_ids"] for r in out]
        assert got == [t for n in names for t in references[n]], radix_off
    assert len({tuple(references[n][0]) for n in names}) == 4  # every adapter changes the answer


def test_the_cache_is_never_shared_across_adapters(tiny_llama, adapters, references, tmp_path):
    """A prompt cached under one adapter is no hit for another or for the base model; it is for
    the same adapter; an adapter loaded again under its name starts a tree of its own."""
    llm = _llm(tiny_llama, enable_lora=True, max_loras_per_batch=2)
    assert llm.load_lora_adapter("x", str(adapters["a1"]))[0]
    prompt = PROMPTS[0]

    def cached(lora: str | None) -> tuple[int, list[int]]:
        r = llm.generate([prompt], PARAMS, lora_path=lora)[0]
        return r["meta_info"]["cached_tokens"], r["output_ids"]

    assert cached("x") == (0, references["a1"][0])
    hits, ids = cached("x")
    assert hits > 0 and ids == references["a1"][0]
    assert cached(None) == (0, references[None][0])
    assert llm.unload_lora_adapter("x")[0] and llm.load_lora_adapter("x", str(adapters["a2"]))[0]
    assert cached("x") == (0, references["a2"][0])
    llm.scheduler.check_integrity()


def test_an_unloaded_adapter_no_request_names_frees_its_host_copy_at_once(tiny_llama, adapters):
    """A trainer's load/unload cycles without a request between them: each unload frees the
    adapter's host copy on the workers then, not with some later step."""
    llm = _llm(tiny_llama, enable_lora=True, max_loras_per_batch=2, max_lora_rank=8)
    for i in range(5):
        assert llm.load_lora_adapter(f"v{i}", str(adapters["a1"]))[0]
        assert len(llm.runner.lora_host) == 1
        assert llm.unload_lora_adapter(f"v{i}")[0]
        assert llm.runner.lora_host == {}
    llm.scheduler.check_integrity()


def test_adapters_load_and_unload_while_serving(tiny_llama, adapters, references, tmp_path):
    """More adapters than device slots: requests wait for a slot and every one gets its own
    adapter's tokens; an unloaded adapter serves the requests queued under it, then its host copy
    goes; pinned adapters keep a slot; every refusal says why."""
    llm = _llm(tiny_llama, enable_lora=True, max_loras_per_batch=2, max_loaded_loras=3, max_lora_rank=4)
    sched = llm.scheduler
    assert llm.load_lora_adapter("a2", str(adapters["a2"]))[0]
    ok, message = llm.load_lora_adapter("a1", str(adapters["a1"]))  # rank 8
    assert not ok and "--max-lora-rank 4" in message
    assert llm.load_lora_adapter("a3", str(adapters["a3"]))[0]
    ok, message = llm.load_lora_adapter("a3", str(adapters["a3"]))
    assert not ok and "already loaded" in message
    assert llm.load_lora_adapter("copy", str(adapters["a3"]))[0]  # three adapters, two slots
    ok, message = llm.load_lora_adapter("more", str(adapters["a3"]))
    assert not ok and "--max-loaded-loras" in message
    names = ["a2", "a3", "copy", None, "copy", "a2"]
    out = llm.generate([PROMPTS[i % 2] for i in range(len(names))], PARAMS, lora_path=names)
    want = [references["a3" if n == "copy" else n][i % 2] for i, n in enumerate(names)]
    assert [r["output_ids"] for r in out] == want
    assert sched.loras.slot_users == [0, 0]
    # Unloaded while queued: the request still runs under it; then the host copy goes.
    queued = sched.add_request(PROMPTS[0], msgspec.convert(PARAMS, SamplingParams), RequestOptions(lora="copy"))
    key = queued.lora_key
    assert llm.unload_lora_adapter("copy")[0] and key in llm.runner.lora_host
    with pytest.raises(ValueError, match="no LoRA adapter named 'copy'"):
        llm.generate([PROMPTS[0]], PARAMS, lora_path="copy")
    while not queued.finished:
        sched.step()
    while sched.has_work:
        sched.step()
    assert queued.output_ids == references["a3"][0]
    llm.generate([PROMPTS[1]], PARAMS)  # the next batch carries the drop
    assert key not in llm.runner.lora_host and key not in sched.loras.slot_key
    assert not llm.unload_lora_adapter("copy")[0]
    # Pinned: keeps its slot; at most slots - 1 of them.
    assert llm.unload_lora_adapter("a3")[0]
    assert llm.load_lora_adapter("pin", str(adapters["a3"]), pinned=True)[0]
    ok, message = llm.load_lora_adapter("pin2", str(adapters["a2"]), pinned=True)
    assert not ok and "pinned" in message
    out = llm.generate(PROMPTS[:2] * 2, PARAMS, lora_path=["a2", "pin", "pin", "a2"])
    assert [r["output_ids"] for r in out] == [references[n][i % 2] for i, n in enumerate(["a2", "a3", "a3", "a2"])]
    assert sched.loras.slot_key.count(next(a.key for a in sched.loras.adapters.values() if a.name == "pin")) == 1
    for bad, why in (
        (tmp_path / "missing", "no LoRA adapter at"),
        (tiny_llama, "adapter_config.json"),
    ):
        ok, message = llm.load_lora_adapter("bad", str(bad))
        assert not ok and why in message, message
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["a2"] / "adapter_config.json", pickled)
    assert llm.unload_lora_adapter("a2")[0]
    ok, message = llm.load_lora_adapter("bad", str(pickled))
    assert not ok and "never read" in message
    for folder, why in damaged_adapters(adapters["a3"], tmp_path).items():
        ok, message = llm.load_lora_adapter("bad", folder)
        assert not ok and why in message, (folder[-40:], message)
    out = llm.generate(PROMPTS[:2], PARAMS, lora_path=["pin", None])  # serving on, the loaded ones intact
    assert [r["output_ids"] for r in out] == [references["a3"][0], references[None][1]]
    sched.check_integrity()


def test_lora_needs_the_flag_and_refuses_what_it_cannot_serve(tiny_llama, tiny_models, adapters, tmp_path):
    from minisgl.config.args import EngineArgs
    from minisgl.device.models.lora_adapter import AdapterError, read_adapter

    llm = _llm(tiny_llama)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([PROMPTS[0]], PARAMS, lora_path="a1")
    assert not llm.load_lora_adapter("a1", str(adapters["a1"]))[0]
    with pytest.raises(ValueError, match="max-loaded-loras"):
        EngineArgs(model="m", enable_lora=True, max_loaded_loras=4).validate()
    dora = make_lora_adapter(tiny_llama, tmp_path / "dora", ("q_proj",))
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(str(dora))
    # The experts of a mixture of experts are not adapted: an adapter of its dense layer's MLP is refused there.
    moe = _llm(tiny_models["qwen3_moe"], enable_lora=True, max_loras_per_batch=1)
    attention = make_lora_adapter(tiny_models["qwen3_moe"], tmp_path / "moe-attn", ("q_proj", "o_proj"))
    assert moe.load_lora_adapter("attn", str(attention))[0]
    assert (
        moe.generate([PROMPTS[1]], PARAMS, lora_path="attn")[0]["output_ids"]
        != moe.generate([PROMPTS[1]], PARAMS)[0]["output_ids"]
    )


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_layers_add_their_adapters_to_the_fp8_product(block):
    """An fp8 layer with adapters returns its fp8 product plus each row's adapter applied to the
    input as it arrived: floats as they are, a quantized activation dequantized."""
    from minisgl.device.layers.fp8_scheme import Fp8Scheme
    from minisgl.device.layers.linear import QKVParallelLinear, RowParallelLinear
    from minisgl.device.layers.lora import LoraRows, LoraWeights
    from minisgl.device.layers.quantization import dequantize, fp8_linear, quantize

    gen = torch.Generator().manual_seed(0)
    scheme = Fp8Scheme(block=block)
    rows = LoraRows(16, 2, 8, torch.device("cpu"))
    qkv, down = QKVParallelLinear(320, 64, 4, 2, False, scheme), RowParallelLinear(320, 96, quant=scheme)
    for layer, parts in ((qkv, qkv.local_sizes), (down, [96])):
        for part, size in enumerate(parts):
            w = torch.randn(size, 320, generator=gen)
            layer.weight.weight_loader(layer.weight, w, ("q", "k", "v")[part] if layer is qkv else None)
        layer.lora = LoraWeights(rows, 320, parts, torch.float32, torch.device("cpu"))
        layer.lora.a.copy_(torch.randn(layer.lora.a.shape, generator=gen))
        layer.lora.b.copy_(torch.randn(layer.lora.b.shape, generator=gen))
    x = torch.randn(5, 320, generator=gen)
    rows.set(torch.tensor([0, -1, 1, 1, 0]))
    for layer in (qkv, down):
        for given in (x, quantize(x, block)):
            seen = x if isinstance(given, torch.Tensor) else dequantize(given.data, given.scale, block)
            want = layer.lora.add(seen, fp8_linear(x, layer.weight, layer.weight_scale, None, block))
            torch.testing.assert_close(layer(given), want)
            assert not torch.equal(want, fp8_linear(x, layer.weight, layer.weight_scale, None, block))
    rows.set(torch.full((5,), -1), active=False)
    assert torch.equal(qkv(x), fp8_linear(x, qkv.weight, qkv.weight_scale, None, block))


def test_adapters_on_an_fp8_model(tiny_llama, adapters):
    """--quantization fp8 with adapters: a request of no adapter gets a plain fp8 engine's tokens
    whatever its batch holds, each adapter's request gets the tokens it gets alone, radix on or
    off, and every adapter changes the answer."""
    llm = _llm(
        tiny_llama, quantization="fp8", lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=4
    )
    plain = [r["output_ids"] for r in _llm(tiny_llama, quantization="fp8").generate(PROMPTS, PARAMS)]
    names = [None, "a1", "a2", "a3"]
    alone = {n: [r["output_ids"] for r in llm.generate(PROMPTS, PARAMS, lora_path=n)] for n in names}
    assert alone[None] == plain
    assert len({tuple(alone[n][0]) for n in names}) == 4
    prompts = [p for _ in names for p in PROMPTS]
    loras = [n for n in names for _ in PROMPTS]
    for radix_off in (False, True):
        llm.reset_scheduler(disable_radix_cache=radix_off)
        got = [r["output_ids"] for r in llm.generate(prompts, PARAMS, lora_path=loras)]
        llm.scheduler.check_integrity()
        assert got == [t for n in names for t in alone[n]], radix_off


def _in_memory(adapter: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """An adapter as a trainer holds it: PEFT's named tensors and its config."""
    return load_file(adapter / "adapter_model.safetensors"), json.loads((adapter / "adapter_config.json").read_text())


def test_adapters_from_a_trainers_tensors(tiny_llama, adapters, references):
    """SGLang's load_lora_adapter_from_tensors: in one process the tensors themselves, over
    worker processes (tp=2) the pickled payload through the restricted unpickler; a bad config
    is refused by name."""
    import gc

    for kw in ({}, dict(tp_size=2)):
        llm = _llm(tiny_llama, enable_lora=True, max_loras_per_batch=2, **kw)
        tensors, config = _in_memory(adapters["a2"])
        ok, message = llm.load_lora_adapter_from_tensors("t", tensors, config)
        assert ok, message
        out = llm.generate(PROMPTS, PARAMS, lora_path="t")
        assert [r["output_ids"] for r in out] == references["a2"], kw
        fresh = {k: v.clone() for k, v in tensors.items()}  # (shared-memory tensors travel once)
        ok, message = llm.load_lora_adapter_from_tensors("dora", fresh, {**config, "use_dora": True})
        assert not ok and "DoRA" in message
        del llm
        gc.collect()


def test_lora_at_tp2_and_under_speculation_equals_one_plain_process(tiny_llama, adapters, references):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A (a
    partial sum in the all-reduce): two ranks (gloo) give one process's tokens; so does NGRAM
    speculation (verify rows carry their request's adapter)."""
    import gc

    paths = [f"{n}={p}" for n, p in adapters.items()]
    loras = ["a1", "a2", None]
    for kw in (dict(tp_size=2), dict(speculative_algorithm="NGRAM", page_size=2)):
        llm = _llm(tiny_llama, lora_paths=paths, **kw)
        out = llm.generate(PROMPTS, PARAMS, lora_path=loras)
        assert [r["output_ids"] for r in out] == [references[n][i] for i, n in enumerate(loras)], kw
        del llm
        gc.collect()


def body_a3(prompt: list[int]) -> dict:
    return {"input_ids": prompt, "sampling_params": PARAMS, "lora_path": "a3"}


def test_the_server_serves_adapters_by_every_name(tiny_llama, adapters, references):
    """/generate lora_path (one per prompt), the OpenAI routes' model "base:adapter", the adapter's
    own name and lora_path, /v1/models, and /load_lora_adapter and /unload_lora_adapter."""
    from tests.server_utils import running_server

    with running_server(
        tiny_llama,
        "--served-model-name",
        "tiny",
        "--lora-paths",
        f"a1={adapters['a1']}",
        "--max-loras-per-batch",
        "2",
        "--max-loaded-loras",
        "3",
        "--enable-weight-update-from-tensor",
    ) as srv:
        url = srv.url
        body = {"input_ids": PROMPTS[:2], "sampling_params": PARAMS, "lora_path": ["a1", None]}
        got = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        assert [g["output_ids"] for g in got] == [references["a1"][0], references[None][1]]
        texts = [g["text"] for g in got]
        completion = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        for named in ({"model": "tiny:a1"}, {"model": "a1"}, {"model": "tiny", "lora_path": "a1"}):
            r = httpx.post(f"{url}/v1/completions", json={**completion, **named}, timeout=60).json()
            assert r["choices"][0]["text"] == texts[0], named
        base = httpx.post(f"{url}/v1/completions", json={**completion, "model": "tiny", "lora_path": ""}, timeout=60)
        assert base.json()["choices"][0]["text"] != texts[0]
        both = {**completion, "model": "tiny", "prompt": PROMPTS[:2], "lora_path": ["a1", None]}  # one per prompt
        r = httpx.post(f"{url}/v1/completions", json=both, timeout=60).json()
        assert [c["text"] for c in r["choices"]] == texts
        r = httpx.post(f"{url}/v1/completions", json={**completion, "model": "tiny:nope"}, timeout=60)
        assert r.status_code == 400 and "nope" in r.text
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert models == ["tiny", "a1"]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {
            "a1": str(adapters["a1"]),
            "a2": str(adapters["a2"]),
        }
        got = httpx.post(f"{url}/generate", json={**body, "lora_path": ["a2", "a1"]}, timeout=60).json()
        assert [g["output_ids"] for g in got] == [references["a2"][0], references["a1"][1]]
        # A trainer's tensors (shared memory on this host), SGLang's route and payload.
        from minisgl.device.worker.tensor_payload import encode_named_tensors

        tensors, config = _in_memory(adapters["a3"])
        sent = {"lora_name": "a3", "serialized_tensors": encode_named_tensors(tensors.items()), "config_dict": config}
        r = httpx.post(f"{url}/load_lora_adapter_from_tensors", json=sent, timeout=60)
        assert r.status_code == 200 and r.json()["loaded_adapters"]["a3"] == "<tensors>", r.text
        got = httpx.post(f"{url}/generate", json={**body_a3(PROMPTS[0])}, timeout=60).json()
        assert got["output_ids"] == references["a3"][0]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "a4", "lora_path": str(adapters["a3"])})
        assert r.status_code == 400 and not r.json()["success"] and "--max-loaded-loras" in r.json()["error_message"]
        r = httpx.post(f"{url}/load_lora_adapter_from_tensors", json={**sent, "serialized_tensors": "%%"})
        assert r.status_code == 400 and "serialized_tensors" in r.text
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
        r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a2": str(adapters["a2"])}
        r = httpx.post(f"{url}/generate", json={**body, "lora_path": "a1"}, timeout=60)
        assert r.status_code == 400 and "a1" in r.text
        chat = {"model": "a1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200  # no longer an adapter's name: any model name serves the base model
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 400


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_on_the_gpu_equals_the_cpu(tmp_path):
    """Decode replayed from CUDA graphs and prefill from its pieces (the rows' adapters in a fixed
    buffer) give eager bf16's tokens; float32 on the GPU gives the CPU's. Steps of base requests
    only (the graphs captured without adapters) give a server without LoRA's tokens."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    paths = [
        f"a1={make_lora_adapter(path, tmp_path / 'a1', rank=8, seed=1)}",
        f"a2={make_lora_adapter(path, tmp_path / 'a2', ('q_proj', 'v_proj', 'down_proj'), rank=4, seed=2)}",
    ]
    prompts = [list(range(3, 40)), list(range(100, 190)), [5, 6, 7]] * 2
    loras = ["a1", "a2", None, "a2", None, "a1"]
    runs = {}
    for name, kw in {
        "cpu": dict(device="cpu", dtype="float32"),
        "cuda-fp32": dict(device="cuda", dtype="float32", attention_backend="torch"),
        "bf16-eager": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=0, disable_piecewise_cuda_graph=True),
        "bf16-graphs": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8),
    }.items():
        llm = LLM(str(path), max_running_requests=8, max_total_tokens=4096, lora_paths=paths, **kw)
        runs[name] = [r["output_ids"] for r in llm.generate(prompts, {**PARAMS, "max_new_tokens": 16}, lora_path=loras)]
        runs[name + "-base"] = [r["output_ids"] for r in llm.generate(prompts[:3], {**PARAMS, "max_new_tokens": 16})]
        del llm
    plain = LLM(str(path), max_running_requests=8, max_total_tokens=4096, device="cuda", dtype="bfloat16")
    without = [r["output_ids"] for r in plain.generate(prompts[:3], {**PARAMS, "max_new_tokens": 16})]
    assert runs["cuda-fp32"] == runs["cpu"]
    assert runs["bf16-graphs"] == runs["bf16-eager"]
    assert runs["bf16-graphs-base"] == runs["bf16-eager-base"] == without


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [None, 128])
def test_lora_on_fp8_layers_on_the_gpu(tmp_path, block):
    """FP8 weights (per channel, or 128-column blocks) with adapters, bf16: CUDA graphs give the
    eager tokens, and a batch of no adapter a plain fp8 server's (the norms' fused quantization
    kept: the adapters read its output dequantized)."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM
    from scripts.quantize_checkpoint import convert

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    paths = [
        f"a1={make_lora_adapter(path, tmp_path / 'a1', rank=8, seed=1)}",
        f"a2={make_lora_adapter(path, tmp_path / 'a2', ('q_proj', 'v_proj', 'down_proj'), rank=4, seed=2)}",
    ]
    kw = dict(quantization="fp8")
    if block is not None:  # a block-wise FP8 checkpoint, loaded with no flag
        path, kw = convert(path, tmp_path / "fp8-blocks", "block"), {}
    prompts = [list(range(3, 40)), list(range(100, 190)), [5, 6, 7]] * 2
    loras = ["a1", "a2", None, "a2", None, "a1"]
    params = {**PARAMS, "max_new_tokens": 16}
    common = dict(max_running_requests=8, max_total_tokens=4096, device="cuda", dtype="bfloat16", **kw)
    runs = {}
    for name, graphs in {
        "eager": dict(cuda_graph_max_bs=0, disable_piecewise_cuda_graph=True),
        "graphs": dict(cuda_graph_max_bs=8),
    }.items():
        llm = LLM(str(path), lora_paths=paths, **common, **graphs)
        runs[name] = [r["output_ids"] for r in llm.generate(prompts, params, lora_path=loras)]
        runs[name + "-base"] = [r["output_ids"] for r in llm.generate(prompts, params)]
        del llm
    plain = LLM(str(path), **common)
    without = [r["output_ids"] for r in plain.generate(prompts, params)]
    assert runs["graphs"] == runs["eager"]
    assert runs["graphs-base"] == runs["eager-base"] == without
    assert runs["graphs"][0] != without[0]


def check_lora_kernels() -> None:
    """kernels.lora (under Triton's interpreter on CPU, or on the GPU) against the masked torch
    reference: row counts across tiles, one to three parts, unused slots, rows of no adapter,
    K split across programs."""
    from minisgl.device.kernels.lora import lora_add
    from minisgl.device.layers.lora import LoraRows, LoraWeights
    from minisgl.device.layers.quantization import Fp8Act, dequantize, quantize_torch

    gen = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for T, parts, slots_used in ((1, [64], [1]), (5, [64, 32, 32], [-1, 0, 2]), (37, [96, 96], [0, 2, -1])):
        rows = LoraRows(64, 3, 8, torch.device(dev))
        w = LoraWeights(rows, 600, parts, torch.float32, torch.device(dev))  # K split in 3
        w.a.copy_(torch.randn(w.a.shape, generator=gen))
        w.b.copy_(torch.randn(w.b.shape, generator=gen))
        x = torch.randn(T, 600, generator=gen).to(dev)
        y = torch.randn(T, sum(parts), generator=gen).to(dev)
        row_slots = torch.tensor([slots_used[i % len(slots_used)] for i in range(T)]).to(dev)
        rows.set(row_slots)
        want = y.clone()
        for t in range(T):
            s = int(row_slots[t])
            if s < 0:
                continue
            for p, (start, size) in enumerate(zip(w.offsets, parts)):
                a = w.a[p * 3 * rows.rank + s * rows.rank : p * 3 * rows.rank + (s + 1) * rows.rank]
                want[t, start : start + size] += (
                    x[t] @ a.t() @ w.b[start : start + size, s * rows.rank : (s + 1) * rows.rank].t()
                )
        sorted_slots, order = torch.sort(row_slots, stable=True)
        got = lora_add(x, y.clone(), w.a, w.b, order, sorted_slots, parts, rows.rank)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if dev == "cpu":  # the reference path itself
            torch.testing.assert_close(w.add(x, y.clone()), want, atol=1e-4, rtol=1e-4)
        for block in (None, 128):  # an fp8 activation (scales per row, or per 128 columns) read dequantized
            q, scale = quantize_torch(x, block)
            plain = lora_add(dequantize(q, scale, block), y.clone(), w.a, w.b, order, sorted_slots, parts, rows.rank)
            got = lora_add(q, y.clone(), w.a, w.b, order, sorted_slots, parts, rows.rank, scale, block)
            torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
            assert not torch.equal(got, want)  # (the quantization shows)
            if dev == "cpu":
                reference = w.add(Fp8Act(q, scale, x.dtype), y.clone(), block)
                torch.testing.assert_close(reference, got, atol=1e-4, rtol=1e-4)


def test_lora_kernels_equal_the_reference_interpreted():
    from tests.interpreter import run_interpreted

    run_interpreted("from tests.test_lora import check_lora_kernels; check_lora_kernels()")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_kernels_equal_the_reference_on_the_gpu():
    check_lora_kernels()


def test_a_request_waiting_for_a_slot_gets_one_while_others_keep_coming():
    """Two slots busy with adapters a and b: a request under c waits, the slot with fewer running
    requests takes no more of them, and once it empties c gets it."""
    from minisgl.serve.scheduler.lora import LoraRegistry
    from minisgl.serve.scheduler.request import Req

    reg = LoraRegistry(2)
    keys = {}
    for name in "abc":
        adapter = reg.new(name, f"/{name}")
        reg.add(adapter)
        keys[name] = adapter.key

    def req(name: str) -> Req:
        r = Req(0, [1], SamplingParams(), 0, 8, lora_key=keys[name])
        reg.named(r)
        return r

    running = []
    for name in "aab":
        r = req(name)
        assert reg.place(r)
        reg.hold(r)
        running.append(r)
    waiting = req("c")
    assert not reg.place(waiting) and reg.draining == reg.slot_key.index(keys["b"])
    assert reg.place(req("a"))  # a's slot is not draining
    later_b = req("b")
    assert not reg.place(later_b)  # b's slot drains: no new b request
    reg.let_go(running[2])
    assert not reg.place(later_b)  # empty now, but kept for the request that waits
    assert reg.place(waiting) and reg.slot_key[waiting.lora_slot] == keys["c"] and reg.draining is None
    assert [k for _, k in reg.swaps][-1] == keys["c"]
    # Once no request of the adapter a slot drains for is left (aborted), the draining ends.
    reg.hold(waiting)
    assert not reg.place(later_b) and reg.draining is not None
    for r in (running[2], later_b):
        reg.ended(r)
    assert reg.place(req("a")) and reg.draining is None
