"""OpenAI's Responses API (/v1/responses) on the real model: the same answers as the chat route,
whole and streamed, conversations continued by previous_response_id, function calls, and the
OpenAI Agents SDK's default agent loop (a tool call, its result, the final answer)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import running_server
from tests.test_server import idle_and_clean

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path):
    with running_server(smollm2_gguf, "--max-total-tokens", "16384", "--dtype", "float32") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def _chat(client, messages: list[dict], **kw) -> tuple[str, int]:
    r = client.chat.completions.create(model="default", messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


def _items(output) -> list[dict]:
    """Output items without their fresh ids."""
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in output]


def test_text_whole_and_streamed_equal_the_chat_route(server, client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    text, prompt_tokens = _chat(client, messages, max_tokens=12)
    r = client.responses.create(
        model="default", instructions="Answer briefly.", input="Name a color.", max_output_tokens=12, temperature=0
    )
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    events = list(
        client.responses.create(
            model="default",
            instructions="Answer briefly.",
            input="Name a color.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{r.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert _items(events[-1].response.output) == _items(r.output)
    idle_and_clean(server)


def test_the_openai_audit_passes_against_one_server(server):
    """scripts/openai_audit.py: every case of the official client (models, completions, chat,
    tools, structured output, the Responses API, refusals) passes; test_router runs it through
    --dp-size 2."""
    from scripts.openai_audit import Audit, build

    results = build(Audit(server.url)).run()
    assert len(results) >= 50 and all(v == "ok" for v in results.values()), {
        k: v for k, v in results.items() if v != "ok"
    }
    idle_and_clean(server)


def test_previous_response_id_continues_the_conversation(server, client):
    """The second turn sees the first turn's input and answer (not its instructions): the same
    text and prompt as the chat route given the whole history; stored responses can be read back
    and deleted; store=false keeps nothing."""
    first = client.responses.create(
        model="default", instructions="Be terse.", input="Say hello.", max_output_tokens=10, temperature=0
    )
    second = client.responses.create(
        model="default", input="Now say goodbye.", previous_response_id=first.id, max_output_tokens=10, temperature=0
    )
    history = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Now say goodbye."},
    ]
    assert (second.output_text, second.usage.input_tokens) == _chat(client, history, max_tokens=10)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    r = httpx.post(
        f"{server.url}/v1/responses",
        timeout=30,
        json={"model": "default", "input": "x", "previous_response_id": first.id, "max_output_tokens": 2},
    )
    assert r.status_code == 400 and "previous_response_id" in r.text
    unstored = client.responses.create(model="default", input="x", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}", timeout=10).status_code == 404
    idle_and_clean(server)


def test_function_calls_forced_whole_and_streamed(server, client):
    import jsonschema

    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = dict(
            model="default",
            input="What is the weather in Lima?",
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=60,
            temperature=0,
        )
        r = client.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r
        assert calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        events = list(client.responses.create(stream=True, **kw))
        assert _items(events[-1].response.output) == _items(r.output)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == calls[0].arguments
    idle_and_clean(server)


def test_the_agents_sdk_runs_a_tool_round_trip(server):
    """The Agents SDK's default model class (the Responses API): tool_choice required makes the
    model call the tool, the SDK runs it and sends the result back (a function_call_output
    item), and the model's answer ends the run; streamed runs end the same way."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(
        model="default", openai_client=AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    )
    agent = Agent(
        name="weather",
        instructions="You are a helpful assistant.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0),
    )

    async def both():
        whole = await Runner.run(agent, "What is the weather in Lima?", max_turns=3)
        streamed = Runner.run_streamed(agent, "What is the weather in Lima?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(both())
    assert [type(i) for i in whole.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert len(cities) == 2 and cities[0] == cities[1] and len(whole.raw_responses) == 2
    assert isinstance(whole.final_output, str) and whole.final_output
    assert streamed.final_output == whole.final_output
    idle_and_clean(server)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"tool_choice": {"type": "file_search"}, "tools": TOOLS}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        # OpenAI's limits on stored fields: 4 MB of metadata once grew the API process by 570 MB
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": 5}}, "metadata"),
        ({"user": "u" * 257}, "user"),
        ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"include": ["message.output_text.tokens"]}, "include"),
    ],
)
def test_bad_bodies_are_refused_by_name(server, body, param):
    r = httpx.post(
        f"{server.url}/v1/responses",
        timeout=30,
        json={"model": "default", "input": "hi", "max_output_tokens": 4, **body},
    )
    assert r.status_code == 400 and param in r.text, r.text


def test_whole_and_streamed_items_come_from_one_path():
    """A whole answer's items are those its stream ends with, however the text is split; an
    answer of reasoning only still ends with a (empty) message."""
    from minisgl.serve.api.protocol import ToolPlan
    from minisgl.serve.api.responses import _Events
    from minisgl.serve.parsers.chat_output import ChatOutput

    def items(pieces: list[str]) -> list[dict]:
        out, stream = ChatOutput(ToolPlan(), "qwen3"), _Events()
        for i, piece in enumerate(pieces):
            stream.delta(out.delta(piece, i == len(pieces) - 1))
        stream.finish()
        return [{k: v for k, v in it.items() if k != "id"} for it in stream.items]

    for text in ("<think>plan</think>Paris.", "<think>only thinking</think>"):
        whole = items([text])
        assert whole == items([text[:5], text[5:12], text[12:]])
        assert [it["type"] for it in whole] == ["reasoning", "message"]


def test_output_text_logprobs_are_its_tokens_only():
    """With a reasoning parser the output_text's logprobs are those of the tokens after the
    reasoning, however the updates split the tokens; each token once."""
    from minisgl.serve.api.protocol import ToolPlan
    from minisgl.serve.api.responses import _Events
    from minisgl.serve.parsers.chat_output import ChatOutput
    from minisgl.wire.requests import TokenLogprob

    pieces = ["<think>", "pl", "an", "</think>", "Par", "is", "."]
    lps = [TokenLogprob(i, t, -0.1 * i, [(i, t, -0.1 * i)]) for i, t in enumerate(pieces)]

    def logprobs(cuts: list[int]) -> list[str]:
        out, stream = ChatOutput(ToolPlan(), "qwen3"), _Events(logprobs=True)
        for a, b in zip([0, *cuts], [*cuts, len(lps)]):
            stream.delta(out.delta("".join(pieces[a:b]), b == len(lps)), lps[a:b])
        stream.finish()
        message = next(it for it in stream.items if it["type"] == "message")
        assert message["content"][0]["text"] == "Paris."
        got = message["content"][0]["logprobs"]
        assert [g["logprob"] for g in got] == [-0.1 * i for i in (4, 5, 6)]
        assert all(g["top_logprobs"][0]["token"] == g["token"] for g in got)
        return [g["token"] for g in got]

    for cuts in ([], [1, 2, 3, 4, 5, 6], [3, 5], [4], [6]):
        assert logprobs(cuts) == ["Par", "is", "."], cuts


def test_output_text_logprobs_equal_the_chat_routes(server, client):
    """include: ["message.output_text.logprobs"] gives the output_text the chat route's logprobs
    for the same greedy answer, whole and streamed; without it they stay empty."""
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    body = {"model": "default", "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}
    asked = {**body, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/responses", json=asked, timeout=60).json()
    part = r["output"][0]["content"][0]
    assert part["text"] == chat.choices[0].message.content and r["top_logprobs"] == 2
    got = [(t["token"], t["logprob"], [a["token"] for a in t["top_logprobs"]]) for t in part["logprobs"]]
    assert [g[0] for g in got] == [w[0] for w in want] and [g[2] for g in got] == [w[2] for w in want]
    assert max(abs(g[1] - w[1]) for g, w in zip(got, want)) < 1e-4
    events = list(client.responses.create(**{**asked, "stream": True}))
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == [t.token for t in done.logprobs] == [w[0] for w in want]
    plain = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    idle_and_clean(server)


def test_a_background_response_is_read_until_it_ends_and_can_be_cancelled(server, client):
    """background: the response comes back in progress and a GET reads it until it ends, with
    the answer a foreground request gets; a follow-up may not continue it before then. A cancel
    ends a running one (stored cancelled); a finished one stays as it is."""
    import time

    base = {"model": "default", "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}
    want = httpx.post(f"{server.url}/v1/responses", json=base, timeout=60).json()
    r = httpx.post(f"{server.url}/v1/responses", json={**base, "background": True}, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "in_progress" and r.json()["background"] is True
    rid = r.json()["id"]
    deadline = time.monotonic() + 60
    while (got := httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).json())["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got["status"] == want["status"] and got["output"][0]["content"] == want["output"][0]["content"]
    done = httpx.post(f"{server.url}/v1/responses/{rid}/cancel", timeout=10).json()
    assert done["status"] == want["status"]
    # A long greedy answer, cancelled while it runs; a follow-up meanwhile is refused.
    long = {**base, "input": "Count from one to one thousand.", "max_output_tokens": 2000, "background": True}
    rid = httpx.post(f"{server.url}/v1/responses", json=long, timeout=60).json()["id"]
    follow = httpx.post(f"{server.url}/v1/responses", json={**base, "previous_response_id": rid}, timeout=60)
    assert follow.status_code == 400 and "in progress" in follow.text
    cancelled = httpx.post(f"{server.url}/v1/responses/{rid}/cancel", timeout=60).json()
    assert cancelled["status"] == "cancelled"
    assert httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).json()["status"] == "cancelled"
    plain = httpx.post(f"{server.url}/v1/responses", json=base, timeout=60).json()["id"]
    r = httpx.post(f"{server.url}/v1/responses/{plain}/cancel", timeout=10)
    assert r.status_code == 400 and "background" in r.text
    idle_and_clean(server)


def test_stored_responses_belong_to_their_tenant(server, client):
    """A response stored under one cache_salt is found by neither another salt's
    previous_response_id nor a GET or DELETE without that salt."""
    base = {"model": "default", "input": "Say hi.", "max_output_tokens": 3, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/responses", json={**base, "cache_salt": "tenant-a"}, timeout=60)
    rid = r.json()["id"]
    for salt in (None, "tenant-b"):
        follow = {**base, "previous_response_id": rid, **({"cache_salt": salt} if salt else {})}
        r = httpx.post(f"{server.url}/v1/responses", json=follow, timeout=60)
        assert r.status_code == 400 and "previous_response_id" in r.text
    assert httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).status_code == 404
    assert httpx.delete(f"{server.url}/v1/responses/{rid}?cache_salt=tenant-b", timeout=10).status_code == 404
    got = httpx.get(f"{server.url}/v1/responses/{rid}?cache_salt=tenant-a", timeout=10)
    assert got.status_code == 200 and got.json()["id"] == rid
    follow = {**base, "previous_response_id": rid, "cache_salt": "tenant-a"}
    assert httpx.post(f"{server.url}/v1/responses", json=follow, timeout=60).status_code == 200
    assert httpx.delete(f"{server.url}/v1/responses/{rid}?cache_salt=tenant-a", timeout=10).status_code == 200
    idle_and_clean(server)


def test_an_aborted_response_says_cancelled_and_is_not_stored(server):
    import threading
    import time

    out: list[httpx.Response] = []
    # Greedy, so the answer surely outlasts the abort (sampled, it could end within the 0.3 s)
    body = {
        "model": "default",
        "input": "Count from 1 to 1000, one number a line.",
        "max_output_tokens": 1500,
        "temperature": 0,
    }
    t = threading.Thread(
        target=lambda: out.append(httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 30
    while server.server_info()["active_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    r = httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=10)
    assert r.json() == {"aborted_count": 1}  # a count: other clients' ids are not shown
    t.join(60)
    response = out[0].json()
    assert response["status"] == "cancelled", response["status"]
    assert httpx.get(f"{server.url}/v1/responses/{response['id']}", timeout=10).status_code == 404
    idle_and_clean(server)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_store_keeps_within_its_bounds(tmp_path, kind):
    """Both stores drop the oldest past the byte bound (and the count), find a response only
    under its salt, and give back what was put; two handles on one SQLite file share it."""
    from minisgl.serve.api.protocol import ChatMessageIn
    from minisgl.serve.api.response_store import ResponseStore, Stored

    def make():
        return ResponseStore(":memory:" if kind == "memory" else str(tmp_path / "r.sqlite"), 4, 1000)

    store = make()
    messages = [ChatMessageIn("user", "hi"), ChatMessageIn("assistant", "hello")]
    for i in range(10):
        store.put(f"r{i}", Stored({"id": f"r{i}"}, messages, f"r{i - 1}", "salt" if i == 9 else None, 300))
    assert [i for i in range(10) if store.get(f"r{i}", "salt" if i == 9 else None)] == [7, 8, 9]
    assert store.get("r9", None) is None and store.get("r8", "salt") is None
    got = store.get("r8", None)
    assert (got.response, got.messages, got.previous, got.size) == ({"id": "r8"}, messages, "r7", 300)
    store.pop("r8")
    assert store.get("r8", None) is None
    for i in range(20, 26):  # the count bound: 4 at most
        store.put(f"r{i}", Stored({}, [], None, None, 1))
    assert [i for i in range(20, 26) if store.get(f"r{i}", None)] == [22, 23, 24, 25]
    if kind == "sqlite":  # another process's handle on the same file sees the same responses
        assert make().get("r25", None) is not None


def test_processes_opening_one_new_store_at_once_all_start(tmp_path):
    """The --dp-size replicas open the shared file together; switching it to WAL answers
    'locked' at once to all but one, which must not stop a replica from starting."""
    import subprocess
    import sys

    path = tmp_path / "r.sqlite"
    code = (
        "import sys, time\n"
        "from minisgl.serve.api.response_store import ResponseStore\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
        "ResponseStore(sys.argv[1]).close()\n"
    )
    start = str(time.time() + 1.5)  # every process past its imports, then all at once
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), start], stderr=subprocess.PIPE) for _ in range(8)]
    errors = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, errors


def test_truncation_auto_leaves_out_the_oldest_messages_until_the_prompt_fits(server):
    """A conversation that with its max_output_tokens does not fit the context (8192 tokens): a
    400 with truncation "disabled" (OpenAI's default), an answer with "auto"."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Note {i}: " + "the river runs past the mill " * 12}
        for i in range(8)
    ]
    body = {
        "model": "default",
        "instructions": "Answer briefly.",
        "input": turns + [{"role": "user", "content": "Say hello."}],
        "max_output_tokens": 7900,
        "temperature": 0,
        "stop": [" ", "\n", "."],
    }
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 400 and "context" in r.text, r.text
    r = httpx.post(f"{server.url}/v1/responses", json={**body, "truncation": "auto"}, timeout=120)
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["truncation"] == "auto" and 0 < response["usage"]["input_tokens"] <= 8192 - 7900
    idle_and_clean(server)


def test_truncation_keeps_system_messages_the_last_message_and_calls_with_their_results():
    """``fit_chat`` (one token per character of content here): the fewest oldest messages left
    out, the leading system message and the last message kept, no tool result without its call."""
    from minisgl.serve.tokenizer.chat import fit_chat

    def encode(messages: list[dict]) -> list[int]:
        return [0] * sum(len(m["content"]) for m in messages)

    chat = [
        {"role": "system", "content": "s" * 5},
        {"role": "user", "content": "u" * 10},
        {"role": "assistant", "content": "a" * 10, "tool_calls": [{}]},
        {"role": "tool", "content": "t" * 10},
        {"role": "user", "content": "v" * 10},
        {"role": "assistant", "content": "b" * 10},
        {"role": "user", "content": "w" * 10},
    ]
    assert len(fit_chat(chat, encode, lambda n: n <= 65)) == 65  # fits whole
    assert len(fit_chat(chat, encode, lambda n: n <= 60)) == 55  # from the call on
    assert len(fit_chat(chat, encode, lambda n: n <= 54)) == 35  # from "v": the call goes with its result
    assert len(fit_chat(chat, encode, lambda n: n <= 15)) == 15  # the system message and the last one
    assert len(fit_chat(chat, encode, lambda n: n <= 14)) == 15  # nothing fits: the shortest, refused by the caller
