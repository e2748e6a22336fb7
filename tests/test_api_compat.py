"""SGLang and OpenAI drop-in: the field policy over every field of both APIs, batched and n-way
/generate, logit_bias, finish reasons, usage and streaming fidelity, info routes."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from minisgl.llm import LLM
from minisgl.serve.api import fields
from minisgl.serve.tokenizer.chat import encode_chat
from tests.server_utils import ServerProcess
from tests.test_server import greedy, idle_and_clean, offline, server, sse_events  # noqa: F401 (fixtures)

BASES = {
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/completions": {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 2,
        "temperature": 0,
    },
    "/v1/responses": {"model": "tiny", "input": "Hello", "max_output_tokens": 2, "temperature": 0},
}
SCHEMAS = {
    "/generate": fields.GENERATE,
    "/v1/completions": fields.COMPLETION,
    "/v1/chat/completions": fields.CHAT,
    "/v1/responses": fields.RESPONSES,
}


def _other(default):
    """A value unlike ``default``, of a type the field plausibly takes."""
    if isinstance(default, tuple):
        return {"type": "json_object"} if isinstance(default[0], dict) else "required"
    return {bool: lambda: not default, int: lambda: default + 1, str: lambda: default + "x"}.get(
        type(default), lambda: "x"
    )()


def _cases() -> list[tuple[str, str, object, bool]]:
    """(route, field path, value, accepted) for every inert and default-only field of each route
    (top level and sampling_params / messages[0])."""
    out = []
    for route, schema in SCHEMAS.items():
        for key in sorted(schema.inert):
            out.append((route, key, "x" if key != "stream_options" else {}, True))
        for key, default in sorted(schema.default_only.items()):
            out.append((route, key, default if not isinstance(default, tuple) else default[0], True))
            out.append((route, key, _other(default), False))
        nested = {
            "/generate": ("sampling_params", fields.SAMPLING),
            "/v1/chat/completions": ("messages", fields.MESSAGE),
        }
        if route in nested:
            where, sub = nested[route]
            for key in sorted(sub.inert):
                out.append((route, f"{where}.{key}", "x", True))
            for key, default in sorted(sub.default_only.items()):
                out.append((route, f"{where}.{key}", default, True))
                out.append((route, f"{where}.{key}", _other(default), False))
    return out


def _with(route: str, path: str, value) -> dict:
    body = json.loads(json.dumps(BASES[route]))
    if "." in path:
        where, key = path.split(".")
        (body[where][0] if isinstance(body[where], list) else body[where])[key] = value
    else:
        body[path] = value
    return body


def test_every_field_is_honoured_accepted_or_refused_by_name(server: ServerProcess):
    """The table test: inert fields and default values answer 200; a result-changing value not
    implemented yet answers 400 naming the field; no field changes results silently."""
    failures = []
    for route, path, value, accepted in _cases():
        r = httpx.post(f"{server.url}{route}", json=_with(route, path, value), timeout=60)
        key = path.split(".")[-1]
        ok = r.status_code == 200 if accepted else (r.status_code == 400 and key in r.json()["error"]["message"])
        if not ok:
            failures.append((route, path, value, r.status_code, r.text[:200]))
    assert not failures, failures
    idle_and_clean(server)


def test_a_predicted_output_is_taken_and_changes_no_token(server: ServerProcess):
    """OpenAI's ``prediction`` (text or text parts) is accepted and changes no answer (it only
    drafts under speculative decoding); a malformed one is a 400 naming it."""
    url, body = f"{server.url}/v1/chat/completions", {**BASES["/v1/chat/completions"], "max_tokens": 6}
    want = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    for content in ("Hello there, how are you?", [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]):
        r = httpx.post(url, json={**body, "prediction": {"type": "content", "content": content}}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
    for bad in (
        {"type": "audio", "content": "x"},
        {"type": "content", "content": 3},
        {"content": [{"type": "image_url"}]},
    ):
        r = httpx.post(url, json={**body, "prediction": bad}, timeout=60)
        assert r.status_code == 400 and "prediction" in r.json()["error"]["message"], (bad, r.text)
    idle_and_clean(server)


def test_continue_final_message_continues_the_assistants_text(server: ServerProcess, offline: LLM):
    """The chat ends inside the assistant's last message and the answer goes on from there: the
    offline engine's greedy tokens after the same rendering."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello! I am"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "continue_final_message": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    ids = encode_chat(offline.tokenizer, messages, continue_final=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy(offline, ids, 6)["text"]
    idle_and_clean(server)


def test_unknown_fields_are_ignored_with_one_warning(server: ServerProcess):
    for _ in range(2):
        for route in BASES:
            r = httpx.post(f"{server.url}{route}", json={**BASES[route], "frobnicate": 1}, timeout=60)
            assert r.status_code == 200, r.text
        body = _with("/generate", "sampling_params.tempurature", 0.5)
        assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200
    warned = [line for line in server.lines if "frobnicate" in line or "tempurature" in line]
    assert len(warned) == 2, warned  # once per field name, not per request or route


def test_smg_router_and_bench_serving_fields(server: ServerProcess, offline: LLM):
    """What the smg router and SGLang's bench_serving add to every /generate."""
    body = {
        "text": "Hello",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "model": "tiny",
        "return_text_in_logprobs": True,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "lora_path": None,
        "stream": False,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy(offline, "Hello", 6, ignore_eos=True)["output_ids"]
    # SGLang's hicache bench_multiturn says "no adapter" with an empty string; an adapter this server
    # has not loaded is refused.
    r = httpx.post(f"{server.url}/generate", json={**body, "lora_path": ""}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/generate", json={**body, "lora_path": "adapter-a"}, timeout=60)
    assert r.status_code == 400 and "lora_path" in r.text, r.text


def test_batched_generate_and_n(server: ServerProcess, offline: LLM):
    prompts = ["Hello world", "The quick brown fox", "Lists and tuples"]
    want = [greedy(offline, p, 8, ignore_eos=True)["output_ids"] for p in prompts]
    params = [{"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}] * 3
    r = httpx.post(f"{server.url}/generate", json={"text": prompts, "sampling_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [g["output_ids"] for g in got] == want and [g["index"] for g in got] == [0, 1, 2]
    ids = [offline.tokenizer.encode(p) for p in prompts]
    body = {"input_ids": ids, "sampling_params": params[0], "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1]}
    assert [last[i]["output_ids"] for i in range(3)] == want
    # n samples of one prompt, seeded: different from each other, reproducible.
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "n": 3, "sampling_seed": 7, "ignore_eos": True}}
    first = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    again = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert len(first) == 3 and [f["output_ids"] for f in first] == [a["output_ids"] for a in again]
    assert len({tuple(f["output_ids"]) for f in first}) > 1
    idle_and_clean(server)


def test_stream_interval(server: ServerProcess, offline: LLM):
    """sampling_params.stream_interval: updates carry that many tokens (the last may carry
    fewer); the tokens are the same."""
    want = greedy(offline, "Hello", 14, ignore_eos=True)["output_ids"]
    body = {
        "text": "Hello",
        "stream": True,
        "sampling_params": {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True, "stream_interval": 4},
    }
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())[:-1]
    # [4, 8, 12, 14]; a stream joins updates that queued while the API was busy, skipping some.
    lens = [len(e["output_ids"]) for e in events]
    assert lens == sorted(set(lens)) and set(lens) <= {4, 8, 12, 14} and events[-1]["output_ids"] == want


def test_logit_bias_and_logprob_text(server: ServerProcess, offline: LLM):
    token = offline.tokenizer.encode(" the")[0]
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "logit_bias": {str(token): 100}}
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": "Hello", "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2},
        timeout=60,
    ).json()
    assert r["output_ids"] == [token] * 5
    assert all(entry[2] is None for entry in r["meta_info"]["output_token_logprobs"])
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": "Hello", "sampling_params": sp, "return_logprob": True, "return_text_in_logprobs": True},
        timeout=60,
    ).json()
    assert [e[2] for e in r["meta_info"]["output_token_logprobs"]] == [offline.tokenizer.decode([token])] * 5
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    out = client.completions.create(
        model="default", prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert out.choices[0].text == offline.tokenizer.decode([token] * 4)
    bad = httpx.post(f"{server.url}/generate", json={"text": "a", "sampling_params": {"logit_bias": {"abc": 1}}})
    assert bad.status_code == 400 and "logit_bias" in bad.text
    idle_and_clean(server)


def test_openai_usage_streaming_and_models(server: ServerProcess):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    one = client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, temperature=0)
    three = client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, n=3)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    # Streamed logprobs: one entry per completion token, also while text is held back.
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=24,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    entries = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs)
    assert entries == chunks[-1].usage.completion_tokens == 24
    # The chat stream's first event carries the role and the first token's text.
    chat = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            logprobs=True,
            extra_body={"ignore_eos": True, "stream_options": {"continuous_usage_stats": True}},
        )
    )
    first = chat[0].choices[0]
    assert first.delta.role == "assistant" and first.logprobs is not None and len(first.logprobs.content) >= 1
    # As SGLang's: every delta has reasoning_content (null without a reasoning parser).
    assert all(c.choices[0].delta.model_extra.get("reasoning_content", "absent") is None for c in chat if c.choices)
    assert sum(len(c.choices[0].logprobs.content) for c in chat if c.choices) == 8
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 8
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server.url}/v1/models/tiny").json()["root"] == "tiny"  # the served id, not a path
    assert httpx.get(f"{server.url}/v1/models/nope").status_code == 404
    # Requests may name any model, as SGLang's clients and tests do (--check-model-name refuses).
    assert client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2).choices[0].text is not None
    for route in ("/server_info", "/model_info", "/version", "/get_model_info", "/get_server_info"):
        assert httpx.get(f"{server.url}{route}").status_code == 200, route
    # The shape the smg router polls (GET /v1/loads?include=core).
    loads = httpx.get(f"{server.url}/v1/loads?include=core").json()["loads"]
    assert len(loads) == 1 and loads[0]["worker_generation"] and loads[0]["num_waiting_reqs"] == 0
    assert 0 <= loads[0]["token_usage"] <= 1 and loads[0]["max_total_num_tokens"] >= 16384
    idle_and_clean(server)


@pytest.mark.parametrize("route", list(BASES))
def test_refusal_names_the_field(server: ServerProcess, route: str):
    r = httpx.post(f"{server.url}{route}", json={**BASES[route], "lora_path": "my-adapter"}, timeout=60)
    assert r.status_code == 400 and "lora_path" in r.text


def _reference_matrix(path, ids: list[int]):
    """Log-probabilities [len(ids), vocab] of the token after each prompt position, from
    transformers (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _reference_logprobs(path, ids: list[int]) -> list[float | None]:
    """Each prompt token's log-probability given the tokens before it, from transformers (fp32)."""
    logprobs = _reference_matrix(path, ids)
    return [None] + [logprobs[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_token_ids_logprob(server: ServerProcess, offline: LLM, tiny_llama):
    """SGLang's token_ids_logprob: the named ids' logprobs at every prompt position (as
    transformers computes them) and every output position; each prompt of a batch keeps its own
    ids in its own order; over the whole vocabulary they sum to 1 and agree with the chosen
    token's logprob."""
    ids = offline.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    full = _reference_matrix(tiny_llama, ids)
    wanted = [[5, 17, ids[1]], [900, 3]]
    body = {
        "input_ids": [ids, ids],
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": wanted,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    for r, w in zip(out, wanted):
        prompt_rows, output_rows = (
            r["meta_info"]["input_token_ids_logprobs"],
            r["meta_info"]["output_token_ids_logprobs"],
        )
        assert prompt_rows[0] is None and len(prompt_rows) == len(ids) and len(output_rows) == 4
        for j, row in list(enumerate(prompt_rows))[1:] + [(len(ids), output_rows[0])]:
            assert [e[1] for e in row] == w
            assert all(abs(e[0] - full[j - 1, t].item()) < 1e-4 for e, t in zip(row, w)), j
        assert all([e[1] for e in row] == w for row in output_rows)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    body = {
        "text": "Hello",
        "return_logprob": True,
        "token_ids_logprob": list(range(vocab)),
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.8, "sampling_seed": 1, "ignore_eos": True},
    }
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
    for row, (chosen_lp, chosen, _) in zip(meta["output_token_ids_logprobs"], meta["output_token_logprobs"]):
        assert abs(math.log(sum(math.exp(e[0]) for e in row))) < 1e-4
        assert abs(row[chosen][0] - chosen_lp) < 1e-5
    too_many = httpx.post(f"{server.url}/generate", json={**body, "token_ids_logprob": [0] * 5000}, timeout=60)
    assert too_many.status_code == 400 and "token_ids_logprob" in too_many.text
    out_of_vocab = httpx.post(f"{server.url}/generate", json={**body, "token_ids_logprob": [vocab]}, timeout=60)
    assert out_of_vocab.status_code == 400 and "token_ids_logprob" in out_of_vocab.text
    idle_and_clean(server)


def test_prompt_logprobs_and_echo_match_transformers(server: ServerProcess, offline: LLM, tiny_llama):
    """/generate's input_token_logprobs and /v1/completions' echo give the prompt's logprobs as
    transformers computes them (fp32, 1e-4), also when the prompt's prefix is cached; echo with
    max_tokens 0 scores a prompt, as lm-eval's loglikelihood requests do."""
    ids = offline.tokenizer.encode("The quick brown fox jumps over the lazy dog, then sleeps.")
    ref = _reference_logprobs(tiny_llama, ids)

    def close(got: list, want: list) -> bool:
        return len(got) == len(want) and all(
            (g is None) == (w is None) and (g is None or abs(g - w) < 1e-4) for g, w in zip(got, want)
        )

    for start in (0, 3, 0):  # the third finds the prompt cached
        body = {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        }
        meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
        entries = meta["input_token_logprobs"]
        assert close([e[0] for e in entries], ref[start:]) and [e[1] for e in entries] == ids[start:]
        tops = meta["input_top_logprobs"]
        assert (tops[0] is None) == (start == 0) and all(len(t) == 2 for t in tops[1:])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    # lm-eval's local-completions loglikelihood request: token ids, echo, logprobs 1, max_tokens 1.
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert close(lp.token_logprobs[: len(ids)], ref) and len(lp.token_logprobs) == len(ids) + 1
    assert lp.top_logprobs[0] is None and len(lp.text_offset) == len(ids) + 1
    chunks = list(
        client.completions.create(
            model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    scored = client.completions.create(model="tiny", prompt="Hello world", max_tokens=0, logprobs=0, echo=True)
    assert scored.choices[0].text == "Hello world" and scored.usage.completion_tokens == 0
    assert len(scored.choices[0].logprobs.token_logprobs) == scored.usage.prompt_tokens
    idle_and_clean(server)


def test_scoring_with_max_new_tokens_zero(server: ServerProcess, offline: LLM, tiny_llama):
    """SGLang's frontend select: a batch of choices with max_new_tokens 0 and prompt logprobs
    runs the prefill, returns the logprobs and generates nothing."""
    texts = ["Is that right? yes", "Is that right? no"]
    body = {
        "text": texts,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 2,
    }
    got = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    for text, r in zip(texts, got):
        ids = offline.tokenizer.encode(text)
        ref = _reference_logprobs(tiny_llama, ids)
        entries = r["meta_info"]["input_token_logprobs"]
        assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert [e[1] for e in entries] == ids[2:] and all(e[2] is not None for e in entries)
        assert max(abs(e[0] - w) for e, w in zip(entries, ref[2:])) < 1e-4
    plain = httpx.post(f"{server.url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 0}}).json()
    assert plain["output_ids"] == [] and plain["meta_info"]["prompt_tokens"] > 0
    idle_and_clean(server)


def test_tokenize_and_detokenize_routes(server: ServerProcess, offline: LLM):
    """SGLang's /tokenize and /detokenize (and their /v1 names): the tokenizer's own ids and
    texts, one or a batch, special tokens as asked; bad values are refused by name."""
    tok = offline.tokenizer
    post = lambda route, body: httpx.post(f"{server.url}{route}", json=body, timeout=30)  # noqa: E731
    one = post("/tokenize", {"prompt": "Hello world"}).json()
    assert one == {"tokens": tok.encode("Hello world"), "count": len(tok.encode("Hello world")), "max_model_len": 1024}
    texts = ["Hello", "big world"]
    many = post("/v1/tokenize", {"prompt": texts, "add_special_tokens": False, "model": "tiny"}).json()
    assert many["tokens"] == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert many["count"] == [len(ids) for ids in many["tokens"]]
    ids = tok.encode("Hello world")
    assert post("/detokenize", {"tokens": ids}).json() == {"text": tok.decode(ids, skip_special_tokens=True)}
    both = post("/v1/detokenize", {"tokens": [ids, ids[1:]], "skip_special_tokens": False}).json()
    assert both == {"text": [tok.decode(ids), tok.decode(ids[1:])]}
    assert post("/detokenize", {"tokens": []}).json() == {"text": ""}
    for route, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {"tokens": [[1], [2, "x"]]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": ["fine", "x" * 40 * 1024]}, "prompt"),  # no prompt of the context holds it
    ]:
        r = post(route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    idle_and_clean(server)


def test_token_in_token_out(server: ServerProcess, offline: LLM):
    """What RL trainers read back to train on the exact tokens: /generate's prompt_token_ids;
    completions' and chat's token_ids and prompt_token_ids (return_token_ids, chat's
    return_prompt_token_ids), whole or streamed chunk by chunk; chat's meta_info (its logprobs
    with logprobs); a chat given its rendered input_ids; cache_salt on /generate; where cached
    tokens came from (sglext)."""
    url = server.url
    prompt_ids = offline.tokenizer.encode("Hello")
    want = greedy(offline, prompt_ids, 6, ignore_eos=True)["output_ids"]
    gen = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json={**gen, "return_prompt_token_ids": True}, timeout=60).json()
    assert r["prompt_token_ids"] == prompt_ids and r["output_ids"] == want
    batch = httpx.post(f"{url}/generate", json={**gen, "text": ["Hello", "Hi"], "return_prompt_token_ids": True})
    assert [b["prompt_token_ids"] for b in batch.json()] == [prompt_ids, offline.tokenizer.encode("Hi")]
    assert "prompt_token_ids" not in httpx.post(f"{url}/generate", json=gen, timeout=60).json()

    comp = {**BASES["/v1/completions"], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=comp, timeout=60).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == want
    with httpx.stream("POST", f"{url}/v1/completions", json={**comp, "stream": True}, timeout=60) as s:
        chunks = [e for e in sse_events(s.iter_lines())[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == want

    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = encode_chat(offline.tokenizer, messages)
    chat_want = greedy(offline, chat_ids, 6, ignore_eos=True)["output_ids"]
    chat = {**BASES["/v1/chat/completions"], "max_tokens": 6, "ignore_eos": True, "logprobs": True}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_prompt_token_ids": True}, timeout=60).json()
    assert r["choices"][0]["prompt_token_ids"] == chat_ids and "token_ids" not in r["choices"][0]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_token_ids": True}, timeout=60).json()
    assert r["choices"][0]["token_ids"] == chat_want and r["prompt_token_ids"] == chat_ids  # (vLLM's place too)
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_meta_info": True}, timeout=60).json()
    meta = r["choices"][0]["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == chat_want
    assert [e[0] for e in meta["output_token_logprobs"]] == [
        lp["logprob"] for lp in r["choices"][0]["logprobs"]["content"]
    ]
    assert meta["prompt_tokens"] == len(chat_ids) and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    body = {**chat, "return_meta_info": True, "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as s:
        chunks = [e for e in sse_events(s.iter_lines())[:-1] if e["choices"]]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == chat_want
    assert chunks[-1]["choices"][0]["meta_info"]["completion_tokens"] == 6
    assert all("meta_info" not in c["choices"][0] for c in chunks[:-1])
    # the rendered prompt's ids instead of the template: the same answer
    other = [{"role": "user", "content": "something else"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "messages": other, "input_ids": chat_ids}, timeout=60)
    assert r.json()["usage"]["prompt_tokens"] == len(chat_ids)
    assert [lp["token"] for lp in r.json()["choices"][0]["logprobs"]["content"]] == [
        offline.tokenizer.decode([t]) for t in chat_want
    ]
    bad = httpx.post(f"{url}/v1/chat/completions", json={**chat, "input_ids": ["x"]}, timeout=60)
    assert bad.status_code == 400 and "input_ids" in bad.text

    # cached tokens: from the device pool (no host tier here); a cache_salt shares none
    body = {**comp, "prompt": "A longer prompt about the cache " * 4, "return_cached_tokens_details": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    details = r["sglext"]["cached_tokens_details"]
    assert details["host"] == 0 and details["device"] == r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    salted = {"text": body["prompt"], "sampling_params": {"max_new_tokens": 1}, "cache_salt": "tenant-b"}
    assert httpx.post(f"{url}/generate", json=salted, timeout=60).json()["meta_info"]["cached_tokens"] == 0
    assert httpx.post(f"{url}/generate", json=salted, timeout=60).json()["meta_info"]["cached_tokens"] > 0
    # routed experts need an MoE model and --enable-return-routed-experts: named in the refusal
    r = httpx.post(f"{url}/v1/completions", json={**comp, "return_routed_experts": True}, timeout=60)
    assert r.status_code == 400 and "routed" in r.text
    idle_and_clean(server)


def test_fill_in_the_middle_suffix(tiny_llama, tmp_path):
    """/v1/completions' suffix: the prompt and suffix around the model's fill-in-the-middle tokens
    (StarCoder's, found in the tokenizer; --completion-template names another format), as the
    offline engine completes that text; refused by name without FIM tokens, with echo, or with
    token-id prompts."""
    from minisgl.device.tiny_model import make_tiny_model
    from minisgl.serve.tokenizer.completion import TEMPLATES, fim_prompt

    star = TEMPLATES["star_coder"]
    path = make_tiny_model("llama", tmp_path / "fim", extra_tokens=(star.prefix, star.suffix, star.middle))
    llm = LLM(str(path), device="cpu", max_total_tokens=4096)
    text = fim_prompt("star_coder", "def add(a, b):\n    ", "\n    return total\n")
    ids = llm.tokenizer.encode(text)
    assert ids[0] == llm.tokenizer.convert_tokens_to_ids(star.prefix)  # its special tokens are single tokens
    want = greedy(llm, ids, 8, ignore_eos=True)["output_ids"]
    body = {"model": "m", "prompt": "def add(a, b):\n    ", "suffix": "\n    return total\n", "max_tokens": 8}
    body.update(temperature=0, ignore_eos=True, return_token_ids=True)
    srv = ServerProcess(path)
    try:
        srv.wait_ready()
        choice = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "suffix": ""}, timeout=60).json()  # "": none
        assert r["choices"][0]["prompt_token_ids"] == llm.tokenizer.encode(body["prompt"])
        for bad in ({"echo": True}, {"prompt": [5, 6, 7]}):
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400 and "suffix" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
    srv = ServerProcess(tiny_llama, "--completion-template", "qwen_coder")  # tokens it lacks: plain text then
    try:
        srv.wait_ready()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        rendered = fim_prompt("qwen_coder", body["prompt"], body["suffix"])
        assert r.json()["choices"][0]["prompt_token_ids"] == LLM(str(tiny_llama), device="cpu").tokenizer.encode(
            rendered
        )
    finally:
        srv.stop()


def test_suffix_without_fim_tokens_is_refused_by_name(server: ServerProcess):
    body = {**BASES["/v1/completions"], "suffix": "tail"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"], r.text
    assert "completion-template" in r.json()["error"]["message"]
    idle_and_clean(server)


def test_return_entropy_is_each_tokens_distributions(server: ServerProcess, offline: LLM, tiny_llama):
    """SGLang's return_entropy: meta_info.output_token_entropy holds, per output token, the
    entropy of the distribution its logprob comes from (transformers' fp32 logits), greedy or
    sampled, alone or beside requests that ask nothing; the server's equal the offline engine's
    (also as disjoint or whole streamed events)."""
    ids = offline.tokenizer.encode("Entropy of the next token")
    params = [
        {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 6, "temperature": 0.9, "seed": 3, "ignore_eos": True},
    ]
    out = offline.generate([ids, ids, ids], params + [params[0]], return_entropy=True)
    for r in out:
        seq = ids + r["output_ids"][:-1]
        logprobs = _reference_matrix(tiny_llama, seq)[len(ids) - 1 :]
        want = -(logprobs.exp() * logprobs).sum(-1)
        got = torch.tensor(r["meta_info"]["output_token_entropy"])
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (got, want)
    plain = offline.generate(ids, params[0])[0]
    assert "output_token_entropy" not in plain["meta_info"] and plain["output_ids"] == out[0]["output_ids"]
    body = {
        "input_ids": ids,
        "sampling_params": {**params[1], "seed": None, "sampling_seed": 3},
        "return_entropy": True,
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert r["output_ids"] == out[1]["output_ids"]
    assert r["meta_info"]["output_token_entropy"] == pytest.approx(
        out[1]["meta_info"]["output_token_entropy"], abs=1e-5
    )
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as s:
        events = sse_events(s.iter_lines())[:-1]
    assert events[-1]["meta_info"]["output_token_entropy"] == r["meta_info"]["output_token_entropy"]
    idle_and_clean(server)


def test_openai_rid_names_the_request(server: ServerProcess):
    """SGLang's rid on the OpenAI routes: the response's id, and /abort_request ends the request
    by it (one per prompt as a list; a list of the wrong length is a 400 naming rid)."""
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": 900, "ignore_eos": True, "stream": True, "rid": "job-7"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: "))
        assert first["id"] == "job-7"
        assert httpx.post(f"{server.url}/abort_request", json={"rid": "job-7"}, timeout=10).json() == {
            "aborted": ["job-7"]
        }
        finals = [e["choices"][0]["finish_reason"] for e in sse_events(lines)[:-1] if e["choices"]]
    assert finals[-1] == "abort"
    body = {**BASES["/v1/completions"], "prompt": ["a", "b"], "rid": ["p1", "p2"]}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["id"] == "p1"
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "rid": ["only-one"]}, timeout=60)
    assert bad.status_code == 400 and "rid" in bad.json()["error"]["message"]
    chat = {**BASES["/v1/chat/completions"], "rid": "chat-9", "n": 2}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()["id"] == "chat-9"
    idle_and_clean(server)


def test_tool_call_arguments_nested_past_the_parser_reach_the_template_as_text():
    """A history's tool-call arguments are parsed for the template when they are JSON; nested
    past the JSON parser's depth they stay the text the client sent (never a server error)."""
    from minisgl.serve.tokenizer.chat import _with_parsed_arguments

    deep = "[" * 30_000 + "]" * 30_000
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": a}} for a in ('{"x": 1}', deep)]
    out = _with_parsed_arguments({"role": "assistant", "content": None, "tool_calls": calls})
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"x": 1}, deep]
