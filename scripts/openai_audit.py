"""The official ``openai`` client against a running server: one named case per thing a client
does (models, completions, chat, tools, structured output, the Responses API, errors), each
checked by its result, not only its status.

    python scripts/openai_audit.py --url http://127.0.0.1:30000

Prints one JSON object, case name -> "ok" or the failure; exits 1 when a case fails. Run it
against one server and through ``--dp-size 2`` (the smg router) to compare the two. Greedy cases
compare answers across calls, so a router that spreads calls over replicas must see the same
tokens from each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import httpx
import openai

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "adult": {"type": "boolean"}},
    "required": ["name", "adult"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Name a color."}]


class Audit:
    def __init__(self, url: str):
        self.url = url
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.cases: dict[str, Callable[[], None]] = {}

    def case(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.cases[fn.__name__] = fn
        return fn

    def chat(self, **kw):
        kw = {"model": self.model, "messages": ASK, "temperature": 0, "max_tokens": 8, **kw}
        return self.client.chat.completions.create(**kw)

    def complete(self, **kw):
        kw = {"model": self.model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8, **kw}
        return self.client.completions.create(**kw)

    def respond(self, **kw):
        kw = {"model": self.model, "input": "Name a color.", "temperature": 0, "max_output_tokens": 8, **kw}
        return self.client.responses.create(**kw)

    def refused(self, call: Callable[[], object], status: int = 400) -> None:
        try:
            call()
        except openai.APIStatusError as e:
            assert e.status_code == status, (e.status_code, e.message)
            return
        raise AssertionError(f"expected {status}, got an answer")

    def run(self) -> dict[str, str]:
        results = {}
        for name, fn in self.cases.items():
            try:
                fn()
                results[name] = "ok"
            except Exception as e:  # a failing case is reported, the others still run
                results[name] = f"{type(e).__name__}: {e}"[:500]
        return results


def build(a: Audit) -> Audit:
    c = a.case

    @c
    def models_list():
        assert a.model and all(m.object == "model" for m in a.client.models.list().data)

    @c
    def models_retrieve():
        assert a.client.models.retrieve(a.model).id == a.model

    @c
    def completion_basic():
        r = a.complete()
        assert r.choices[0].text and r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"

    @c
    def completion_deterministic():
        assert a.complete().choices[0].text == a.complete().choices[0].text

    @c
    def completion_stop():
        full = a.complete(max_tokens=16).choices[0].text
        word = full.split()[1] if len(full.split()) > 1 else full.strip()
        r = a.complete(max_tokens=16, stop=[word])
        assert word not in r.choices[0].text and r.choices[0].finish_reason == "stop", (full, r.choices[0].text)

    @c
    def completion_n():
        r = a.complete(n=2, temperature=1.0, seed=1)
        assert [ch.index for ch in r.choices] == [0, 1]

    @c
    def completion_batch():
        r = a.complete(prompt=["One", "Two", "Three"], max_tokens=2)
        assert sorted(ch.index for ch in r.choices) == [0, 1, 2]

    @c
    def completion_token_ids():
        r = a.complete(prompt=[1, 2, 3, 4], max_tokens=2)
        assert r.usage.prompt_tokens == 4

    @c
    def completion_echo():
        r = a.complete(echo=True, max_tokens=2)
        assert r.choices[0].text.startswith("The capital of France is")

    @c
    def completion_logprobs():
        r = a.complete(logprobs=2, max_tokens=3)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) >= 1 for t in lp.top_logprobs)

    @c
    def completion_stream():
        text = "".join(ch.choices[0].text for ch in a.complete(stream=True) if ch.choices)
        assert text == a.complete().choices[0].text

    @c
    def completion_stream_usage():
        chunks = list(a.complete(stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    @c
    def completion_seeded_sampling():
        kw = dict(temperature=1.0, seed=7, max_tokens=8)
        assert a.complete(**kw).choices[0].text == a.complete(**kw).choices[0].text

    @c
    def chat_basic():
        r = a.chat()
        m = r.choices[0].message
        assert m.role == "assistant" and m.content and r.usage.total_tokens == r.usage.prompt_tokens + 8

    @c
    def chat_system_prompt():
        # (a template may add its own system prompt when none is given: only a change is certain)
        r = a.chat(messages=[{"role": "system", "content": "Answer in one word."}, *ASK])
        assert r.usage.prompt_tokens != a.chat().usage.prompt_tokens

    @c
    def chat_multi_turn():
        first = a.chat().choices[0].message.content
        r = a.chat(messages=[*ASK, {"role": "assistant", "content": first}, {"role": "user", "content": "Another."}])
        assert r.choices[0].message.content

    @c
    def chat_stream():
        chunks = list(a.chat(stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant" and text == a.chat().choices[0].message.content

    @c
    def chat_stream_usage():
        chunks = list(a.chat(stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices

    @c
    def chat_n():
        r = a.chat(n=3, temperature=1.0, seed=3)
        assert [ch.index for ch in r.choices] == [0, 1, 2]

    @c
    def chat_max_completion_tokens():
        r = a.chat(max_tokens=None, max_completion_tokens=3)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"

    @c
    def chat_stop():
        full = a.chat(max_tokens=16).choices[0].message.content
        r = a.chat(max_tokens=16, stop=[full[2:5]])
        assert full[2:5] not in (r.choices[0].message.content or "")

    @c
    def chat_logprobs():
        r = a.chat(logprobs=True, top_logprobs=3, max_tokens=4)
        content = r.choices[0].logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0 for t in content)

    @c
    def completion_logit_bias():
        first = a.complete(max_tokens=1).choices[0].text
        r = a.complete(max_tokens=1, logit_bias={str(_first_token(a)): -100})
        assert r.choices[0].text != first

    @c
    def chat_penalties():
        r = a.chat(presence_penalty=1.5, frequency_penalty=1.0, max_tokens=16)
        assert r.usage.completion_tokens >= 1

    @c
    def chat_seeded_sampling():
        kw = dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=12)
        assert a.chat(**kw).choices[0].message.content == a.chat(**kw).choices[0].message.content

    @c
    def chat_json_object():
        r = a.chat(
            messages=[{"role": "user", "content": "Give a JSON object with a key 'a'."}],
            response_format={"type": "json_object"},
            max_tokens=48,
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)

    @c
    def chat_json_schema():
        r = a.chat(
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            max_tokens=256,
        )
        person = json.loads(r.choices[0].message.content)
        assert set(person) == {"name", "adult"} and isinstance(person["adult"], bool)

    @c
    def chat_parse_structured():
        r = a.client.chat.completions.create(
            model=a.model,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
            max_tokens=256,
            temperature=0,
        )
        assert json.loads(r.choices[0].message.content)["name"]

    @c
    def chat_tool_required():
        r = a.chat(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=64,
        )
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        assert r.choices[0].finish_reason == "tool_calls"

    @c
    def chat_tool_named():
        r = a.chat(
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
        )
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"

    @c
    def chat_tool_auto():
        r = a.chat(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], max_tokens=32)
        m = r.choices[0].message
        assert m.content is not None or m.tool_calls

    @c
    def chat_tool_none():
        r = a.chat(tools=[WEATHER], tool_choice="none", max_tokens=8)
        assert not r.choices[0].message.tool_calls

    @c
    def chat_tool_result_turn():
        fn = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
        call = {"id": "call_1", "type": "function", "function": fn}
        r = a.chat(
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
            ],
            tools=[WEATHER],
            max_tokens=16,
        )
        assert r.choices[0].message.content is not None

    @c
    def chat_tool_stream():
        chunks = list(
            a.chat(
                messages=[{"role": "user", "content": "Weather in Rome?"}],
                tools=[WEATHER],
                tool_choice="required",
                max_tokens=64,
                stream=True,
            )
        )
        args = "".join(
            tc.function.arguments or ""
            for ch in chunks
            if ch.choices
            for tc in ch.choices[0].delta.tool_calls or []
            if tc.function and tc.index == 0
        )
        assert "city" in json.loads(args)

    @c
    def chat_user_and_metadata_fields():
        assert a.chat(user="u-1", store=False).choices[0].message.content

    @c
    def chat_empty_messages_refused():
        a.refused(lambda: a.chat(messages=[]))

    @c
    def chat_bad_temperature_refused():
        a.refused(lambda: a.chat(temperature=-1))

    @c
    def chat_bad_n_refused():
        a.refused(lambda: a.chat(n=0))

    @c
    def chat_negative_max_tokens_refused():
        a.refused(lambda: a.chat(max_tokens=-5))

    @c
    def chat_overlong_prompt_refused():
        a.refused(lambda: a.chat(messages=[{"role": "user", "content": "word " * 200_000}]))

    @c
    def completion_bad_top_p_refused():
        a.refused(lambda: a.complete(top_p=1.5))

    @c
    def responses_basic():
        r = a.respond()
        assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens == 8

    @c
    def responses_matches_chat():
        assert a.respond().output_text == a.chat().choices[0].message.content

    @c
    def responses_instructions():
        r = a.respond(instructions="Answer in one word.")
        assert r.usage.input_tokens != a.respond().usage.input_tokens

    @c
    def responses_stream():
        events = list(a.respond(stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        assert text == a.respond().output_text

    @c
    def responses_previous_response_id():
        first = a.respond(input="My name is Ada.")
        r = a.respond(input="What is my name?", previous_response_id=first.id)
        assert r.usage.input_tokens > first.usage.input_tokens

    @c
    def responses_chain_of_three():
        r1 = a.respond(input="One.")
        r2 = a.respond(input="Two.", previous_response_id=r1.id)
        r3 = a.respond(input="Three.", previous_response_id=r2.id)
        assert r3.usage.input_tokens > r2.usage.input_tokens > r1.usage.input_tokens

    @c
    def responses_unknown_previous_refused():
        a.refused(lambda: a.respond(previous_response_id="resp_does_not_exist"))

    @c
    def responses_retrieve():
        r = a.respond()
        assert a.client.responses.retrieve(r.id).id == r.id

    @c
    def responses_delete():
        r = a.respond()
        a.client.responses.delete(r.id)
        a.refused(lambda: a.client.responses.retrieve(r.id), 404)

    @c
    def responses_function_call():
        tool = {"type": "function", **WEATHER["function"]}
        r = a.respond(input="Weather in Oslo?", tools=[tool], tool_choice="required", max_output_tokens=64)
        call = next(item for item in r.output if item.type == "function_call")
        assert call.name == "get_weather" and "city" in json.loads(call.arguments)

    @c
    def responses_json_schema():
        fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
        r = a.respond(input="Invent a person.", text=fmt, max_output_tokens=256)
        assert set(json.loads(r.output_text)) == {"name", "adult"}

    @c
    def responses_message_list_input():
        r = a.respond(input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}])
        assert r.output_text == a.respond().output_text

    return a


def _first_token(a: Audit) -> int:
    """The id of the greedy first token after ``complete``'s prompt, from SGLang's /generate."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = httpx.post(f"{a.url}/generate", json={"model": a.model, **body}, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    results = build(Audit(ap.parse_args().url.rstrip("/"))).run()
    print(json.dumps(results))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
