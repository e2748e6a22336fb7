"""The real server (launcher + tokenizer + scheduler + worker processes) on a tiny checkpoint.

One server serves the whole module; every test leaves it idle, and `idle_and_clean` checks that
no request is left and every KV page is free or reclaimable cache.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from minisgl.llm import LLM
from minisgl.wire.sampling import SamplingParams
from tests.server_utils import ServerProcess, running_server

PAGE_SIZE = 4
SYSTEM = "You are a careful assistant. Answer briefly and cite the standard library where useful. " * 3


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    srv = ServerProcess(
        tiny_llama,
        "--page-size",
        str(PAGE_SIZE),
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        "tiny",
        "--profile-dir",
        "/tmp",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_total_tokens=16384)


def greedy(llm: LLM, prompt: str | list[int], n: int, **extra) -> dict:
    return llm.generate(prompt, {"max_new_tokens": n, "temperature": 0.0, **extra})[0]


def idle_and_clean(srv: ServerProcess, timeout: float = 10.0) -> dict:
    """Wait until the server has no requests; then every page must be free or evictable."""
    deadline = time.monotonic() + timeout
    while True:
        s = srv.server_info()["scheduler"]
        if s["running_requests"] == 0 and s["queued_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["running_requests"] == 0 and s["queued_requests"] == 0, s
    assert s["protected_pages"] == 0, s
    assert s["free_pages"] + s["evictable_pages"] == s["total_pages"], s
    return s


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- correctness against the offline API ----------------------------------------------------------


def test_generate_matches_offline(server: ServerProcess, offline: LLM):
    for prompt in ["Hello world", "The quick brown fox"]:
        want = greedy(offline, prompt, 24, ignore_eos=True)
        r = httpx.post(
            f"{server.url}/generate",
            json={
                "text": prompt,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        meta = got["meta_info"]
        assert meta["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        assert meta["completion_tokens"] == 24 and meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["e2e_latency"] > 0
    idle_and_clean(server)


def test_generate_stream_and_input_ids(server: ServerProcess, offline: LLM):
    ids = offline.tokenizer.encode("Streaming with token ids")
    want = greedy(offline, ids, 16, ignore_eos=True)
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        json={
            "input_ids": ids,
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["output_ids"] == want["output_ids"] and last["text"] == want["text"]
    assert len(last["meta_info"]["output_token_logprobs"]) == 16
    assert all(len(top) == 2 for top in last["meta_info"]["output_top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert [lp[1] for lp in last["meta_info"]["output_token_logprobs"]] == want["output_ids"]
    # One event per token, then [DONE]; fewer where tokens queued while the API was busy (joined).
    assert 2 <= len(events) <= 17
    idle_and_clean(server)


def test_openai_client_completions_and_chat(server: ServerProcess, offline: LLM):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]

    want = greedy(offline, "Once upon a time", 20, ignore_eos=True)
    out = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == want["text"] and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    stream = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == want["text"]

    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is a list?"}]
    text = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    want = greedy(offline, ids, 20)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == want["text"]
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(want["output_ids"])
    # the same chat prompt was just served, so all but its last token comes from the cache
    assert usage.prompt_tokens_details.cached_tokens >= len(ids) - PAGE_SIZE
    idle_and_clean(server)


def test_n_choices_logprobs_and_batch_prompts(server: ServerProcess, offline: LLM):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    out = client.completions.create(
        model="tiny",
        prompt=["Alpha", "Beta"],
        n=2,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(["Alpha", "Beta"]):
        want = greedy(offline, prompt, 8, ignore_eos=True)["text"]
        assert out.choices[2 * i].text == want and out.choices[2 * i + 1].text == want
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 8 and len(lp.top_logprobs[0]) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices) == 3
    assert all(len(c.logprobs.content) == len(c.logprobs.content) and c.logprobs.content for c in chat.choices)
    assert all(len(t.top_logprobs) == 2 for c in chat.choices for t in c.logprobs.content)
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    # n > 1: the prompt and its cached tokens count once (they summed over the samples before).
    long_prompt = "A prompt long enough to fill several pages of the cache, " * 3
    for n in (1, 4):
        u = client.completions.create(model="tiny", prompt=long_prompt, n=n, max_tokens=2).usage
        assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens - PAGE_SIZE  # the n=1 run cached it
    idle_and_clean(server)


def test_batch_prompts_start_in_one_step(server: ServerProcess, offline: LLM):
    """The sequences of one request reach the scheduler as one message, so short prompts are
    prefilled in a single step (arriving one by one, each took a step of its own); a name used
    twice within it is refused."""
    prompts = [f"Batch prompt number {i} about rivers" for i in range(6)]
    before = idle_and_clean(server)["prefill_steps"]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert [o["text"] for o in out] == [greedy(offline, p, 4, ignore_eos=True)["text"] for p in prompts]
    assert idle_and_clean(server)["prefill_steps"] == before + 1
    r = httpx.post(f"{server.url}/generate", json={**body, "text": prompts[:2], "rid": ["x", "x"]}, timeout=60)
    assert r.status_code == 400 and "already in use" in r.text
    idle_and_clean(server)


# ---- concurrency and the prefix cache -------------------------------------------------------------


def test_concurrent_streams_share_prefix(server: ServerProcess, offline: LLM):
    httpx.post(f"{server.url}/flush_cache", timeout=30).raise_for_status()
    prompts = [f"{SYSTEM} Question {i}: what does module number {i} do?" for i in range(32)]
    prefix_len = len(offline.tokenizer.encode(SYSTEM))
    wants = offline.generate(prompts, {"max_new_tokens": 16, "temperature": 0.0})

    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        async with client.stream("POST", f"{server.url}/generate", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return events[-2]

    async def all_of_them() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(all_of_them())
    for got, want in zip(results, wants):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert sum(c >= prefix_len - PAGE_SIZE for c in cached) >= 31, cached
    stats = idle_and_clean(server)
    assert stats["prefix_hit_tokens"] > 0


# ---- stop strings ---------------------------------------------------------------------------------


def _split_stop(offline: LLM, prompt: str, n: int) -> tuple[str, str]:
    """A 3-character stop string that straddles a token boundary of the greedy output, found at
    its first occurrence; returns it and the text that must come back (everything before it)."""
    ids = greedy(offline, prompt, n, ignore_eos=True)["output_ids"]
    text = offline.tokenizer.decode(ids)
    for k in range(2, len(ids) - 1):
        b = len(offline.tokenizer.decode(ids[:k]))
        stop = text[b - 1 : b + 2]
        if len(stop) == 3 and stop.strip() and "\ufffd" not in stop and text.find(stop) == b - 1:
            return stop, text[: b - 1]
    raise AssertionError("no usable token boundary in the greedy output")


def test_stop_string_across_tokens(server: ServerProcess, offline: LLM):
    stop, expected = _split_stop(offline, "Hello world", 40)
    body = {
        "text": "Hello world",
        "stream": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]},
    }
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    texts = [e["text"] for e in events[:-1]]
    assert texts[-1] == expected
    assert all(stop not in t for t in texts)
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # no_stop_trim keeps the stop string.
    body["stream"], body["sampling_params"]["no_stop_trim"] = False, True
    kept = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert kept["text"] == expected + stop and kept["meta_info"]["finish_reason"]["matched"] == stop

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello world",
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == expected and chunks[-1].choices[0].finish_reason == "stop"
    # SGLang's matched_stop on OpenAI choices: the stop string, a stop token's id, or null.
    assert chunks[-1].choices[0].model_extra["matched_stop"] == stop
    whole = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=40, temperature=0, stop=stop, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].model_extra["matched_stop"] == stop
    length = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert length.choices[0].finish_reason == "length" and length.choices[0].model_extra["matched_stop"] is None
    first = offline.generate("Hello world", {"max_new_tokens": 1, "temperature": 0})[0]["output_ids"][0]
    by_id = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert by_id.choices[0].model_extra["matched_stop"] == first
    idle_and_clean(server)


# ---- bad input ------------------------------------------------------------------------------------

LONG = list(range(10, 1100))
BAD_REQUESTS = [
    # (path, body, status, words the message must contain)
    ("/generate", b'{"text": "hi"', 400, "malformed JSON"),
    ("/generate", b"", 400, "empty"),
    ("/generate", b"[1, 2]", 400, "must be a JSON object"),
    ("/generate", {"sampling_params": {}}, 400, "exactly one of text or input_ids"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one of text or input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, 400, "$.sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature must be >= 0"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"seed": -5}}, 400, "seed"),
    # (an id past the vocabulary is accepted and never matches: SGLang's own tests send one model's ids to all)
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [-3]}}, 400, "stop_token_ids"),
    ("/generate", {"input_ids": [10**7]}, 400, "input_ids"),
    ("/generate", {"input_ids": []}, 400, "empty"),
    ("/generate", {"text": ""}, 400, "empty"),
    ("/generate", {"input_ids": LONG}, 400, "context length"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5000}}, 400, "context length"),
    ("/generate", {"text": "a", "rid": 5}, 400, "$.rid"),
    ("/v1/completions", {"prompt": "a"}, 400, "missing required field `model`"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "ten"}, 400, "$.max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 0}, 400, "n must be"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": 123}, 400, "prompt must be"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "best_of": 2}, 400, "best_of"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages must not be empty"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "$.messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 3},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "needs logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "not supported",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4096},
        400,
        "context length",
    ),
    # Hostile values: integers past every width, invalid UTF-8, deep nesting, huge inputs.
    ("/generate", {"text": "hello", "sampling_params": {"top_k": 2**63, "max_new_tokens": 4}}, 400, "top_k"),
    ("/generate", {"text": "hello", "sampling_params": {"top_k": 2**64 - 1}}, 400, "top_k"),
    ("/generate", {"input_ids": [2**64 + 5]}, 400, "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2**70}}, 400, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [2**65]}}, 400, "stop_token_ids"),
    ("/generate", {"text": "a", "sampling_params": {"seed": 2**80}}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": [2**64 + 1]}, 400, "prompt must be"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2**64}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 2**63},
        400,
        "top_k",
    ),
    ("/generate", b'{"text": "\xff\xfe bad"}'.replace(b"\\x", b"\\x"), 400, "malformed JSON"),
    ("/generate", b'{"text": "' + bytes([0xFF, 0xFE]) + b'"}', 400, "not valid UTF-8"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested too deeply"),
    ("/generate", {"text": "a", "sampling_params": {"stop": ["x"] * 500}}, 400, "stop takes at most"),
    ("/generate", {"text": "a", "sampling_params": {"stop": "y" * 5000}}, 400, "stop takes at most"),
    ("/generate", {"text": "word " * 8000}, 400, "characters"),
    ("/generate", b'{"text": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 20, "n": 20}, 400, "at most 256"),
]


@pytest.mark.parametrize(
    "path,body,status,words", BAD_REQUESTS, ids=[f"{i}:{b[0]}" for i, b in enumerate(BAD_REQUESTS)]
)
def test_bad_request(server: ServerProcess, path: str, body, status: int, words: str):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words in message, message


def test_server_healthy_after_bad_requests(server: ServerProcess):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    r = httpx.get(f"{server.url}/generate", timeout=10)
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v2/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    idle_and_clean(server)


# ---- disconnects, aborts, info, metrics -----------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_mid_stream_frees_pages(server: ServerProcess):
    aborted = 'minisgl_requests_total{finish_reason="abort"}'
    before = _metric(httpx.get(f"{server.url}/metrics", timeout=10).text, aborted)
    body = {
        "text": "A long story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        busy = server.server_info()["scheduler"]
        assert busy["running_requests"] == 1 and busy["protected_pages"] + busy["free_pages"] < busy["total_pages"]
    # leaving the block closes the connection mid-stream
    idle_and_clean(server)
    after = _metric(httpx.get(f"{server.url}/metrics", timeout=10).text, aborted)
    assert after == before + 1


def test_disconnect_non_streaming_frees_pages(server: ServerProcess):
    body = {"text": "Another long story", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, timeout=0.3)
    idle_and_clean(server)
    time.sleep(0.5)
    assert "never retrieved" not in server.output and "Traceback" not in server.output, server.output


def test_abort_request_by_id(server: ServerProcess):
    body = {
        "text": "Abort me",
        "rid": "victim",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: ") and not events:
                r2 = httpx.post(f"{server.url}/abort_request", json={"rid": "victim"}, timeout=10)
                assert r2.json() == {"aborted": ["victim"]}
            if line.startswith("data: "):
                events.append(line)
        final = json.loads(events[-2][len("data: ") :])
    assert final["meta_info"]["finish_reason"] == {"type": "abort"}
    assert final["meta_info"]["completion_tokens"] < 1000
    idle_and_clean(server)


def test_hostile_requests_leave_no_registration(server: ServerProcess):
    """A request refused after it was named (here: an integer MessagePack cannot carry reached
    the sender before validation did, or any refusal) leaves its rid free for reuse."""
    for _ in range(2):
        r = httpx.post(f"{server.url}/generate", json={"input_ids": [2**64 + 5], "rid": "once"}, timeout=10)
        assert r.status_code == 400
        r = httpx.post(
            f"{server.url}/generate",
            json={"text": "a", "rid": "once", "sampling_params": {"max_new_tokens": 5000}},
            timeout=10,
        )
        assert r.status_code == 400
    assert server.server_info()["active_requests"] == 0
    r = httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=10)
    assert r.json() == {"aborted_count": 0}
    idle_and_clean(server)


def test_reused_rid_never_gets_earlier_tokens(server: ServerProcess):
    """A client rid is only a name: after a stop string or an abort ends a request, the next
    request with the same rid must see only its own tokens."""

    def run(text: str, **params) -> dict:
        body = {"text": text, "rid": "same", "sampling_params": {"temperature": 0, **params}}
        return httpx.post(f"{server.url}/generate", json=body, timeout=60).json()

    ref = run("Tell me about the sea", max_new_tokens=12, ignore_eos=True)
    for trial in range(6):
        stopped = run("Count with me: one two three", max_new_tokens=200, ignore_eos=True, stop=ref["text"][:1] or "e")
        assert stopped["meta_info"]["finish_reason"] is not None
        again = run("Tell me about the sea", max_new_tokens=12, ignore_eos=True)
        assert again["output_ids"] == ref["output_ids"], trial
    idle_and_clean(server)


def test_abort_by_prefix_names_nobody(server: ServerProcess):
    """ "chatcmpl" is a prefix of every chat id, not an id: it aborts nothing. The chat's own id
    aborts its choices."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go on"}],
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "n": 2,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        cid = next(json.loads(x[len("data: ") :])["id"] for x in lines if x.startswith("data: "))
        assert server.server_info()["active_requests"] == 2
        nobody = httpx.post(f"{server.url}/abort_request", json={"rid": "chatcmpl"}, timeout=10)  # (SGLang: 200)
        assert nobody.status_code == 200 and nobody.json() == {"aborted": []}
        r2 = httpx.post(f"{server.url}/abort_request", json={"rid": cid}, timeout=10).json()
        assert r2 == {"aborted": [f"{cid}-0", f"{cid}-1"]}
        finals = [
            c["finish_reason"]
            for x in lines
            if x.startswith("data: {")
            for c in json.loads(x[len("data: ") :])["choices"]
            if c["finish_reason"]
        ]
    assert finals == ["abort", "abort"]
    idle_and_clean(server)


def test_stalled_headers_are_dropped(server: ServerProcess):
    """A client that never finishes its request head is disconnected; finished ones are served."""
    import socket

    from minisgl.serve.api.connections import HEADER_TIMEOUT_S

    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.settimeout(HEADER_TIMEOUT_S + 10)
        start = time.monotonic()
        assert slow.recv(100) == b""  # closed by the server
        assert HEADER_TIMEOUT_S - 1 < time.monotonic() - start < HEADER_TIMEOUT_S + 5
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_info_metrics_and_flush(server: ServerProcess):
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["served_model_name"] == "tiny" and info["is_generation"] and info["context_length"] == 1024
    sinfo = server.server_info()
    assert sinfo["server_args"]["page_size"] == PAGE_SIZE and "api_key" not in sinfo["server_args"]
    # SGLang's top-level keys, as its tests and autoscalers read them
    assert sinfo["page_size"] == PAGE_SIZE and sinfo["model_path"] and sinfo["version"] and "api_key" not in sinfo
    assert sinfo["max_total_num_tokens"] >= 16384 and sinfo["kv_cache_dtype"] == "float32"
    # the launch fields slime's external-engine check compares
    placement = ("pp_size", "ep_size", "base_gpu_id", "gpu_id_step", "enable_memory_saver")
    assert [sinfo[k] for k in placement] == [1, 1, 0, 1, False]
    assert set(sinfo["processes"]) == {"api", "tokenizer", "scheduler", "worker-0"}
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    # SGLang's names and model_name label, as its Grafana dashboard and the smg router read them.
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
        "sglang:time_per_output_token_seconds_bucket",
        "sglang:num_requests_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:num_retracted_requests_total",
        "minisgl_requests_total",
        "minisgl_free_pages",
    ]:
        assert name in text, name
    assert 'sglang:num_running_reqs{model_name="tiny"}' in text
    assert _metric(text, "sglang:generation_tokens_total") > 0
    assert 0 < _metric(text, "sglang:cache_hit_rate") <= 1
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).json() == {"success": True}
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=10).json() == {"success": True}  # vLLM's name
    s = idle_and_clean(server)
    assert s["evictable_pages"] == 0 and s["free_pages"] == s["total_pages"]


def test_start_and_stop_profile(server: ServerProcess, tmp_path: Path):
    """SGLang's profiling routes: a trace and a table per rank, after num_steps or at stop."""
    r = httpx.post(f"{server.url}/start_profile", json={"output_dir": str(tmp_path / "a"), "num_steps": 3}, timeout=10)
    assert r.status_code == 200, r.text
    httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 6}}, timeout=30)
    assert (
        httpx.post(f"{server.url}/start_profile", json={"output_dir": str(tmp_path / "b")}, timeout=10).status_code
        == 200
    )
    httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert httpx.post(f"{server.url}/stop_profile", timeout=10).status_code == 200
    deadline = time.monotonic() + 20
    tables = []
    while time.monotonic() < deadline and len(tables) < 2:
        tables = sorted(tmp_path.glob("*/minisgl-*/rank0.txt"))
        time.sleep(0.2)
    assert [t.parent.parent.name for t in tables] == ["a", "b"]
    assert tables[0].read_text().startswith("3 steps in ") and "aten::mm" in tables[0].read_text()
    assert (tables[0].parent / "rank0.trace.json.gz").stat().st_size > 0
    r = httpx.post(f"{server.url}/start_profile", json={"activities": ["TPU"]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "activities"
    # Traces stay under the server's profile directory (/tmp here): no writing elsewhere.
    for body, param in (
        ({"output_dir": "/etc/minisgl"}, "output_dir"),
        ({"output_dir": "../../etc"}, "output_dir"),
        ({"output_dir": str(tmp_path), "profile_prefix": "../../etc/x"}, "profile_prefix"),
        # a NUL or a control character once reached the worker's makedirs and stopped the server
        ({"profile_prefix": "a\u0000b", "num_steps": 1}, "profile_prefix"),
        ({"output_dir": "a\u0000b"}, "output_dir"),
        ({"output_dir": "a/\nb"}, "output_dir"),
        ({"profile_prefix": "x" * 300}, "profile_prefix"),
    ):
        r = httpx.post(f"{server.url}/start_profile", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    idle_and_clean(server)


def test_limit_flags(tiny_llama: Path):
    """--max-request-bytes, --request-body-timeout, --max-sequences-per-request and the stop
    limits: lowered here, each refusal names its flag; a slow body gets a 408 in time."""
    import socket

    with running_server(
        tiny_llama,
        "--max-request-bytes",
        "2000",
        "--request-body-timeout",
        "1",
        "--max-sequences-per-request",
        "4",
        "--max-stop-strings",
        "2",
        "--max-stop-length",
        "8",
    ) as srv:
        big = httpx.post(f"{srv.url}/generate", json={"text": "a" * 3000}, timeout=30)
        assert big.status_code == 413 and "--max-request-bytes" in big.text
        many = httpx.post(f"{srv.url}/generate", json={"text": ["a"] * 5}, timeout=30)
        assert many.status_code == 400 and "--max-sequences-per-request" in many.text
        for route in ("/start_profile", "/stop_profile"):  # profiling is off without --profile-dir
            r = httpx.post(f"{srv.url}{route}", json={}, timeout=30)
            assert r.status_code == 403 and "--profile-dir" in r.text
        for stop in (["a", "b", "c"], "x" * 9):
            r = httpx.post(f"{srv.url}/generate", json={"text": "a", "sampling_params": {"stop": stop}}, timeout=30)
            assert r.status_code == 400 and "--max-stop" in r.text
        ok = httpx.post(
            f"{srv.url}/generate",
            json={"text": ["a"] * 4, "sampling_params": {"stop": ["a", "b"], "max_new_tokens": 2}},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text

        def partial_body(length: int, sent: bytes) -> tuple[str, float]:
            """The status line of a reply to a body declared ``length`` bytes of which only ``sent``
            arrives, and how long it took."""
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(
                    b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (length, sent)
                )
                start = time.monotonic()
                return s.recv(4096).decode().splitlines()[0], time.monotonic() - start

        status, took = partial_body(100, b'{"text": ')
        assert " 408 " in status and took < 5, status
        # A declared length past the limit: 413 at once, nothing of the body read or awaited.
        status, took = partial_body(999_999_999, b"{")
        assert " 413 " in status and took < 0.9, status


def test_stream_output_sends_disjoint_segments(tiny_llama):
    """--stream-output (SGLang's): each streamed /generate event carries only its new text, ids and
    logprobs; put together they are the whole answer."""
    body = {
        "text": "Hello world",
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    with running_server(tiny_llama, "--max-total-tokens", "4096", "--stream-output") as srv:
        whole = httpx.post(f"{srv.url}/generate", json={**body, "stream": False}, timeout=60).json()
        with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
            events = sse_events(r.iter_lines())[:-1]
    assert len(events) > 1
    assert "".join(e["text"] for e in events) == whole["text"]
    assert sum((e["output_ids"] for e in events), []) == whole["output_ids"]
    logprobs = sum((e["meta_info"]["output_token_logprobs"] for e in events), [])
    assert [t for _, t, _ in logprobs] == whole["output_ids"]


def test_huge_batches_are_counted_before_they_are_built(server: ServerProcess):
    """100,000 prompts in a 0.6 MB body get their 400 at once (they took 13.8 s, while other
    clients waited): sequences are counted before any request is built."""
    for route, body in (
        ("/generate", {"text": ["hi"] * 100_000}),
        ("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 100_000, "max_tokens": 2}),
    ):
        start = time.monotonic()
        r = httpx.post(f"{server.url}{route}", content=json.dumps(body), timeout=30)
        assert r.status_code == 400 and "--max-sequences-per-request" in r.text, (route, r.text[:200])
        assert time.monotonic() - start < 1.0
    idle_and_clean(server)


def test_monitoring_answers_from_the_last_stats_when_the_scheduler_is_busy(tiny_llama):
    """A scheduler that does not answer (SIGSTOP; a long step looks the same): /get_server_info,
    /metrics and /v1/loads answer 200 within seconds from the last stats, saying their age (they
    were 503 after 5 s, and failed scrapes under load); once it resumes the stats are fresh."""
    import os
    import signal

    with running_server(tiny_llama, "--max-total-tokens", "4096") as srv:
        pid = srv.server_info()["processes"]["scheduler"]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
            for route in ("/get_server_info", "/metrics", "/v1/loads"):
                start = time.monotonic()
                r = httpx.get(f"{srv.url}{route}", timeout=30)
                assert r.status_code == 200, (route, r.text)
                assert time.monotonic() - start < 3
            assert srv.server_info()["scheduler"]["stats_age_s"] >= 1.0
            age = [ln for ln in httpx.get(f"{srv.url}/metrics").text.splitlines() if ln.startswith("minisgl_stats_age")]
            assert float(age[0].split()[-1]) >= 1.0
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)
        assert srv.server_info()["scheduler"]["stats_age_s"] < 1.0
        ok = httpx.post(
            f"{srv.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30
        )
        assert ok.status_code == 200
        # OpenMetrics when the scraper asks; SGLang's function timer among the metrics.
        om = httpx.get(f"{srv.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF") and 'func_latency_seconds_count{name="generate"}' in om.text


def test_cache_salt_and_extra_key_keep_tenants_apart(server):
    """Requests with different cache_salt (OpenAI routes) or extra_key (/generate) never share
    cached pages; the same salt shares them as an unsalted request would."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    prompt = [7 + (i * 37) % 400 for i in range(5 * PAGE_SIZE + 3)]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= len(prompt) - PAGE_SIZE
    assert cached("tenant-b") == 0  # the same prompt, another tenant
    assert cached(None) == 0  # nor the unsalted cache
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "extra_key": "tenant-a"}
    r = httpx.post(f"{server.url}/generate", json=body).json()
    assert r["meta_info"]["cached_tokens"] >= len(prompt) - PAGE_SIZE  # extra_key is the same namespace
    r = httpx.post(f"{server.url}/generate", json={**body, "extra_key": "tenant-c"}).json()
    assert r["meta_info"]["cached_tokens"] == 0
    idle_and_clean(server)


def test_skip_tokenizer_init_serves_token_ids_only(tiny_llama, offline):
    """--skip-tokenizer-init: token ids in, the same greedy ids out (no text); a text prompt is
    refused naming the flag, as /tokenize is."""
    prompt = [5 + (i * 13) % 300 for i in range(40)]
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]["output_ids"]
    with running_server(tiny_llama, "--skip-tokenizer-init") as srv:
        r = httpx.post(
            f"{srv.url}/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        )
        assert r.status_code == 200 and r.json()["output_ids"] == want and not r.json()["text"]
        r = httpx.post(f"{srv.url}/generate", json={"text": "hello"})
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.text
        r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "hello"})
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.text


def test_ignored_fields_are_named_in_a_header_and_refused_when_strict(server: ServerProcess, tiny_llama: Path):
    body = {"text": "hi", "max_token": 3, "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-minisgl-ignored-fields"] == "max_token, sampling_params.temprature"
    assert (
        "x-minisgl-ignored-fields"
        not in httpx.post(
            f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30
        ).headers
    )
    with running_server(tiny_llama, "--max-total-tokens", "4096", "--strict-request-fields") as strict:
        r = httpx.post(f"{strict.url}/generate", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"
        assert "--strict-request-fields" in r.json()["error"]["message"]


def test_a_control_call_in_flight_at_shutdown_answers_503():
    """A /get_server_info waiting for the scheduler when the server goes down (a child died)
    ends as a 503 naming the shutdown, not a 500."""
    from minisgl.serve.api.client import SHUTTING_DOWN, EngineClient, EngineError
    from minisgl.wire.ipc import Addresses

    async def scenario() -> EngineError:
        client = EngineClient(Addresses.make())
        call = asyncio.ensure_future(client.control("stats", timeout=30))
        await asyncio.sleep(0.05)
        client.fail_all()
        try:
            await call
        except EngineError as e:
            return e
        raise AssertionError("the call returned")

    e = asyncio.run(scenario())
    assert e.status == 503 and str(e) == SHUTTING_DOWN


def test_a_stream_behind_the_engine_joins_its_queued_updates():
    """Updates queued while the API was busy come out as one (tokens, text and logprobs in
    order, the last finish); an error queued behind tokens comes after them, not instead."""
    from minisgl.serve.api.client import EngineError, RequestStream
    from minisgl.wire.requests import ReqUpdate, TokenLogprob

    def lp(t: int) -> TokenLogprob:
        return TokenLogprob(t, str(t), -0.5)

    async def read(updates: list[ReqUpdate]) -> list[ReqUpdate | str]:
        queue: asyncio.Queue[ReqUpdate] = asyncio.Queue()
        for u in updates:
            queue.put_nowait(u)
        out: list[ReqUpdate | str] = []
        try:
            async for u in RequestStream(None, "r", "0", queue):  # type: ignore[arg-type]
                out.append(u)
        except EngineError as e:
            out.append(str(e))
        return out

    steps = [
        ReqUpdate("0", prompt_tokens=7, cached_tokens=3),
        ReqUpdate("0", "a", [1], [lp(1)], cached_tokens=3),
        ReqUpdate("0", "b", [2], [lp(2)], cached_tokens=3),
        ReqUpdate("0", "", [3], [lp(3)], "stop", cached_tokens=3, matched="c"),
    ]
    (one,) = asyncio.run(read(steps))
    assert isinstance(one, ReqUpdate)
    assert (one.text, one.token_ids, [x.token_id for x in one.logprobs]) == ("ab", [1, 2, 3], [1, 2, 3])
    assert (one.finish_reason, one.matched, one.prompt_tokens, one.cached_tokens) == ("stop", "c", 7, 3)
    out = asyncio.run(read([steps[1], steps[2], ReqUpdate("0", error="boom")]))
    assert isinstance(out[0], ReqUpdate) and out[0].token_ids == [1, 2] and out[1] == "boom"


def test_merged_runs_join_what_queued_while_the_reader_was_busy():
    """Several runs' updates (n > 1): those that queued while the reader was busy come out one
    per run, joined, applied to their run once; a failure comes after the updates before it."""
    from minisgl.serve.api.base import merge
    from minisgl.wire.requests import ReqUpdate

    class Fake:
        def __init__(self, updates: list[ReqUpdate], fail: bool = False):
            self.updates, self.fail, self.applied = updates, fail, []

        async def arrivals(self):  # noqa: ANN202
            for u in self.updates:
                yield u
            if self.fail:
                raise RuntimeError("boom")

        def apply(self, upd: ReqUpdate) -> None:
            self.applied.append(upd)

    async def read(runs: list[Fake]) -> list:
        out: list = []
        try:
            async for i, upd in merge(runs):  # type: ignore[arg-type]
                out.append((i, upd.token_ids, upd.finish_reason))
                await asyncio.sleep(0.01)  # a slow reader: the runs' later updates queue meanwhile
        except RuntimeError as e:
            out.append(str(e))
        return out

    def steps(n: int) -> list[ReqUpdate]:
        last = ReqUpdate("r", "", [n - 1], finish_reason="length")
        return [ReqUpdate("r", str(t), [t]) for t in range(n - 1)] + [last]

    a, b = Fake(steps(4)), Fake(steps(3))
    out = asyncio.run(read([a, b]))
    assert sorted(i for i, *_ in out) == [0, 1]  # everything had arrived at once: one update each
    assert [x.token_ids for x in a.applied] == [[0, 1, 2, 3]] and b.applied[0].finish_reason == "length"
    out = asyncio.run(read([Fake(steps(2)), Fake([ReqUpdate("r", "x", [7])], fail=True)]))
    assert out[-1] == "boom" and (1, [7], None) in out


def test_slow_stop_regexes_do_not_hold_other_clients(server: ServerProcess):
    """One client's 128 slow stop_regex patterns end its own request with a 400 naming
    stop_regex; another client's 4-token request meanwhile answers within a second."""
    import threading

    slow = r"(?:.|\n){0,10}(?:.|\n){0,10}[\ue000\ue001]"
    hostile = {
        "text": "Tell me a long story.",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "stop_regex": [slow] * 128},
    }
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(f"{server.url}/generate", json=hostile, timeout=120)))
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    r = httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and time.monotonic() - start < 1.0, time.monotonic() - start
    t.join(60)
    assert out[0].status_code == 400 and "stop_regex" in out[0].text, out[0].text
    idle_and_clean(server)


def test_score_route_reads_the_label_tokens_after_each_prompt(server: ServerProcess):
    """SGLang's /v1/score: each item's label-token probabilities after query + item (ids and
    text), normalized over the labels with apply_softmax, equal to /generate's token_ids_logprob."""
    import math

    query, items, labels = [5, 6, 7], [[8, 9], [10], [11, 12, 13]], [20, 21, 400]
    r = httpx.post(f"{server.url}/v1/score", json={"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and len(body["scores"]) == 3
    for item, scores in zip(items, body["scores"]):
        gen = {
            "input_ids": query + item,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "token_ids_logprob": labels,
        }
        want = httpx.post(f"{server.url}/generate", json=gen).json()["meta_info"]["output_token_ids_logprobs"][0]
        assert [math.log(p) for p in scores] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
    soft = httpx.post(
        f"{server.url}/v1/score",
        json={"query": "The sky is", "items": [" blue", " green"], "label_token_ids": labels, "apply_softmax": True},
    ).json()["scores"]
    assert all(abs(sum(s) - 1) < 1e-6 for s in soft)
    first = httpx.post(
        f"{server.url}/v1/score", json={"query": [5], "items": [[8]], "label_token_ids": labels, "item_first": True}
    ).json()["scores"][0]
    after = httpx.post(f"{server.url}/v1/score", json={"query": [8], "items": [[5]], "label_token_ids": labels})
    assert first == pytest.approx(after.json()["scores"][0])
    for bad, param in (
        ({"query": [5], "items": [[8]], "label_token_ids": []}, "label_token_ids"),
        ({"query": [5], "items": ["x"], "label_token_ids": [1]}, "items"),
        ({"query": [5], "items": [[8]], "label_token_ids": [10**6]}, "label_token_ids"),
        ({"items": [[8]], "label_token_ids": [1]}, "query"),
    ):
        r = httpx.post(f"{server.url}/v1/score", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    idle_and_clean(server)
