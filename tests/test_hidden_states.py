"""SGLang's return_hidden_states (--enable-return-hidden-states): the last hidden state (after the
final norm) of every prompt position and every output token but the last, against transformers'
``hidden_states[-1]``; cached prefixes are computed again for them, the routed experts of a MoE
request keep their own start, and the GPU paths (decode graphs, prefill pieces) give the eager
values."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from minisgl.utils import routed_experts_array

PARAMS = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _rows(meta: dict) -> torch.Tensor:
    """SGLang's layout (the prompt's rows, then one row per token) as one [positions, hidden]."""
    first, *rest = meta["hidden_states"]
    return torch.tensor(first + rest)


def _transformers(path, seq: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]


def test_hidden_states_are_transformers_last_layer(tiny_llama):
    from minisgl.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", enable_return_hidden_states=True, max_running_requests=8)
    prefix = list(range(40, 80))
    prompts = [prefix + [300 + i, 9] for i in range(3)]
    first = llm.generate(prompts[:1], PARAMS, return_hidden_states=True)[0]
    # Their prefix is cached (computed again for them), and a request in the same batch asks for nothing.
    rest = llm.generate(prompts[1:] + [[5, 6, 7]], PARAMS, return_hidden_states=True)
    plain = llm.generate([prompts[2]], PARAMS)[0]
    llm.scheduler.check_integrity()
    assert rest[1]["meta_info"]["cached_tokens"] == 0 < plain["meta_info"]["cached_tokens"]
    assert "hidden_states" not in plain["meta_info"]
    assert plain["output_ids"] == rest[1]["output_ids"]
    for prompt, res in zip(prompts, [first, *rest]):
        seq = prompt + res["output_ids"][:-1]
        meta = res["meta_info"]
        assert len(meta["hidden_states"]) == PARAMS["max_new_tokens"] and len(meta["hidden_states"][0]) == len(prompt)
        got = _rows(meta)
        torch.testing.assert_close(got, _transformers(tiny_llama, seq), atol=1e-4, rtol=1e-4)


def test_hidden_states_and_routed_experts_keep_their_own_starts(tiny_models):
    """A MoE request asking for both: hidden states from position 0, routed experts from
    routed_experts_start on, each what it is asked alone."""
    from minisgl.llm import LLM

    path = tiny_models["qwen3_moe"]
    llm = LLM(
        str(path),
        device="cpu",
        enable_return_hidden_states=True,
        enable_return_routed_experts=True,
        max_running_requests=8,
    )
    cfg = llm.runner.config
    prompt = list(range(40, 70))
    both = llm.generate(prompt, PARAMS, return_hidden_states=True, return_routed_experts=True, routed_experts_start=20)
    alone = llm.generate(prompt, PARAMS, return_routed_experts=True, routed_experts_start=20)[0]
    both = both[0]
    assert both["output_ids"] == alone["output_ids"]
    got = routed_experts_array(both["meta_info"], cfg.num_layers, cfg.num_experts_per_tok)
    want = routed_experts_array(alone["meta_info"], cfg.num_layers, cfg.num_experts_per_tok)
    assert got.shape[0] == len(prompt) - 20 + PARAMS["max_new_tokens"] - 1 and (got == want).all()
    torch.testing.assert_close(
        _rows(both["meta_info"]), _transformers(path, prompt + both["output_ids"][:-1]), atol=1e-4, rtol=1e-4
    )


def test_hidden_states_at_tp2_and_under_speculation_equal_one_plain_process(tiny_llama):
    """Two ranks (gloo; rank 0's rows after the final norm's all-reduce) and a speculating
    scheduler (a request returning its states decodes plainly) give the rows of one process
    without speculation."""
    import gc

    from minisgl.llm import LLM

    prompts = [list(range(3, 30)), [7, 8, 9] * 8]

    def rows(**kw) -> list[tuple[list[int], torch.Tensor]]:
        llm = LLM(str(tiny_llama), device="cpu", enable_return_hidden_states=True, max_running_requests=8, **kw)
        out = llm.generate(prompts, PARAMS, return_hidden_states=True)
        del llm
        gc.collect()
        return [(r["output_ids"], _rows(r["meta_info"])) for r in out]

    want = rows()
    for kw in (dict(tp_size=2), dict(speculative_algorithm="NGRAM", page_size=2)):
        for (ids, got), (want_ids, expected) in zip(rows(**kw), want):
            assert ids == want_ids
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_hidden_states_need_the_server_flag(tiny_llama):
    from minisgl.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", max_running_requests=4)
    with pytest.raises(ValueError, match="enable-return-hidden-states"):
        llm.generate([[5, 6, 7]], PARAMS, return_hidden_states=True)


def test_generate_returns_hidden_states(tiny_llama):
    """/generate's return_hidden_states (one flag or one per prompt) gives the offline engine's
    rows; without the server flag it is a 400 naming it."""
    from minisgl.llm import LLM
    from tests.server_utils import running_server

    prompts = [list(range(3, 20)), [7] * 9]
    offline = LLM(str(tiny_llama), device="cpu", enable_return_hidden_states=True, max_running_requests=4)
    want = offline.generate(prompts, PARAMS, return_hidden_states=True)
    body = {"input_ids": prompts, "sampling_params": PARAMS}
    with running_server(tiny_llama, "--enable-return-hidden-states") as srv:
        got = httpx.post(f"{srv.url}/generate", json={**body, "return_hidden_states": True}, timeout=60).json()
        openai = _openai_routes(srv.url, prompts[0])
        some = httpx.post(f"{srv.url}/generate", json={**body, "return_hidden_states": [False, True]}, timeout=60)
        streamed = []
        with httpx.stream(
            "POST", f"{srv.url}/generate", json={**body, "return_hidden_states": True, "stream": True}, timeout=60
        ) as r:
            streamed = [line for line in r.iter_lines() if line.startswith("data: {")]
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        torch.testing.assert_close(_rows(g["meta_info"]), _rows(w["meta_info"]), atol=1e-5, rtol=0)
    last = _rows(want[0]["meta_info"])[-1].tolist()
    for hidden in openai:  # completions and chat, whole and streamed: the row of the last token
        torch.testing.assert_close(torch.tensor(hidden), torch.tensor(last), atol=1e-5, rtol=0)
    some = some.json()
    assert "hidden_states" not in some[0]["meta_info"] and len(some[1]["meta_info"]["hidden_states"]) == 6
    assert sum('"hidden_states"' in line for line in streamed) == len(prompts)  # with the last chunk of each
    with running_server(tiny_llama) as srv:
        r = httpx.post(f"{srv.url}/generate", json={**body, "return_hidden_states": True}, timeout=60)
        assert r.status_code == 400 and "return_hidden_states" in r.text, r.text


def _openai_routes(url: str, prompt: list[int]) -> list[list[float]]:
    """Each choice's hidden_states from /v1/completions and /v1/chat/completions (the same
    prompt ids through the chat route's template are another prompt: only its length is checked),
    whole and streamed; a choice without the field when not asked."""
    body = {"model": "default", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert "hidden_states" not in plain
    body["return_hidden_states"] = True
    out = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["hidden_states"]]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out += [c["choices"][0]["hidden_states"] for c in chunks if "hidden_states" in c["choices"][0]]
    assert len(out) == 2
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    chat["return_hidden_states"] = True
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [
        c["choices"][0]["delta"]["hidden_states"] for c in chunks if "hidden_states" in c["choices"][0]["delta"]
    ]
    assert len(streamed) == 1 and len(streamed[0]) == len(whole["hidden_states"]) == len(out[0])
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hidden_states_on_the_gpu_equal_the_cpu(tmp_path):
    """Decode replayed from CUDA graphs (the hidden rows copied out of the graph) and prefill
    from its pieces give the eager float32 values; bf16 graphs give bf16 eager's."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.llm import LLM

    path = make_tiny_model("llama", tmp_path / "llama-hd128", overrides={"head_dim": 128})
    prompts = [list(range(3, 40)), list(range(100, 190)), [5, 6, 7]]
    runs = {}
    for name, kw in {
        "cpu": dict(device="cpu"),
        "cuda-fp32": dict(device="cuda", dtype="float32", attention_backend="torch"),
        "bf16-eager": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=0, disable_piecewise_cuda_graph=True),
        "bf16-graphs": dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8),
    }.items():
        llm = LLM(str(path), max_running_requests=8, max_total_tokens=4096, enable_return_hidden_states=True, **kw)
        out = llm.generate(prompts, PARAMS, return_hidden_states=True)
        runs[name] = [(r["output_ids"], _rows(r["meta_info"])) for r in out]
        del llm
    for (ids, got), (want_ids, want) in zip(runs["cuda-fp32"], runs["cpu"]):
        assert ids == want_ids
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for (ids, got), (want_ids, want) in zip(runs["bf16-graphs"], runs["bf16-eager"]):
        assert ids == want_ids
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
