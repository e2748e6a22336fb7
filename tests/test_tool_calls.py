"""Tool calls and reasoning output: the parsers (whole and split at every point), the chat
template rendering tools, and the OpenAI route with tools, forced choices and --reasoning-parser."""

from __future__ import annotations

import json

import httpx
import pytest

from minisgl.serve.api.errors import BadRequest
from minisgl.serve.parsers.reasoning import ReasoningParser
from minisgl.serve.parsers.tool_calls import ToolCallParser, deltas
from minisgl.serve.tokenizer import load_tokenizer
from minisgl.serve.tokenizer.chat import detect_tool_parser, encode_chat, renders_tools
from tests.server_utils import ServerProcess
from tests.test_server import idle_and_clean

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5]}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ANSWERS = [  # (format, text, content, [(name, arguments)])
    (
        "qwen25",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("add", "{}")],
    ),
    (
        "qwen25",
        "A plain answer that mentions <tool and <tool_ca but calls nothing.  ",
        "A plain answer that mentions <tool and <tool_ca but calls nothing.  ",
        [],
    ),
    ("qwen25", "<tool_call>\nnot a call</tool_call> after", "<tool_call>\nnot a call</tool_call> after", []),
    # A stray tag that fails to parse does not hide a real call after it (whole answers hid it).
    (
        "qwen25",
        '<tool_call>\nnot a call</tool_call> then <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        "<tool_call>\nnot a call</tool_call> then",
        [("add", '{"a": 1}')],
    ),
    ("qwen25", '<tool_call>\n{"name": "add", "arguments": {"a": 1', "", [("add", '{"a": 1')]),  # cut by max_tokens
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": "x\\"}"}}</tool_call>\n\nDone.',
        "Done.",
        [("add", '{"a": "x\\"}"}')],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "f", "parameters": {"x": "a\\"b"}}; {"name": "g", "parameters": {"y": 2}}',
        "",
        [("f", '{"x": "a\\"b"}'), ("g", '{"y": 2}')],
    ),
    ("llama3", '{"name": "f", "arguments": {}}', "", [("f", "{}")]),
    ("llama3", 'Hello {"name": 1}', 'Hello {"name": 1}', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("array", '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]', "", [("f", '{"a":1}'), ("g", "{}")]),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]',
        "Sure.",
        [("add", '{"a": 1}'), ("f", "{}")],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"b": "]"}}]', "", [("add", '{"b": "]"}')]),
    ("mistral", "No calls [TOOL here.  ", "No calls [TOOL here.  ", []),
    ("named", '{"a": 1}', "", [("fn", '{"a": 1}')]),
]


def _parse(fmt: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser, events, at = ToolCallParser(fmt, "fn"), [], 0
    for cut in cuts + [len(text)]:
        events += parser.feed(text[at:cut])
        at = cut
    content, calls = deltas(events + parser.finish())
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", ANSWERS)
def test_tool_call_parsers_read_the_same_calls_however_the_text_is_split(fmt, text, content, calls):
    assert _parse(fmt, text, []) == (content, calls)
    for cut in range(len(text) + 1):
        assert _parse(fmt, text, [cut]) == (content, calls), cut
    assert _parse(fmt, text, list(range(1, len(text)))) == (content, calls)


@pytest.mark.parametrize(
    "name,text,reasoning,content",
    [
        (
            "qwen3",
            "<think>\nhmm, 2+2 </thin is 4\n</think>\n\nThe answer is 4.",
            "\nhmm, 2+2 </thin is 4\n",
            "The answer is 4.",
        ),
        ("qwen3", "No thinking here.", "", "No thinking here."),
        ("qwen3", "<think>cut short", "cut short", ""),
        ("deepseek-r1", "reasoning</think>\nanswer", "reasoning", "answer"),
        ("qwen3-thinking", "<think>x</think>y", "x", "y"),
    ],
)
def test_reasoning_parser_splits_the_same_however_the_text_is_split(name, text, reasoning, content):
    for stream_reasoning in (True, False):
        for cuts in [[], *([k] for k in range(len(text) + 1)), list(range(1, len(text)))]:
            parser, got, at = ReasoningParser(name, stream_reasoning), ["", ""], 0
            for cut in cuts + [len(text)]:
                r, c = parser.feed(text[at:cut])
                got, at = [got[0] + r, got[1] + c], cut
            r, c = parser.finish()
            assert [got[0] + r, got[1] + c] == [reasoning, content], (cuts, stream_reasoning)


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call them as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_LIKE = (
    '{% if tools %}Respond with {"name": function name, "parameters": arguments} or <|python_tag|>.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


def test_chat_templates_render_tools_natively_or_in_the_system_message(tiny_llama):
    plain = load_tokenizer(tiny_llama)  # its template ignores tools
    qwen = load_tokenizer(tiny_llama, QWEN_LIKE)
    llama = load_tokenizer(tiny_llama, LLAMA_LIKE)
    assert (renders_tools(plain), renders_tools(qwen), renders_tools(llama)) == (False, True, True)
    assert [detect_tool_parser(t) for t in (plain, qwen, llama)] == ["qwen25", "qwen25", "llama3"]
    for tok in (plain, qwen):
        text = tok.decode(encode_chat(tok, HISTORY, TOOLS))
        assert '"name": "get_weather"' in text and "Today's weather in a city" in text  # the tools, once
        assert text.count("Today's weather") == 1
        # The past call is shown with its arguments as an object, not as a quoted JSON string.
        assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
        assert "-3 C, snow" in text
    assert "Today's weather" not in plain.decode(encode_chat(plain, HISTORY))  # no tools: nothing added


def test_mistral_templates_are_read_with_the_mistral_parser(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    tok.chat_template = (
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
        "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
    )
    assert detect_tool_parser(tok) == "mistral"


def test_chat_template_kwargs_are_template_variables_only(tiny_llama):
    """A client may set template variables, never the template itself or how it is applied."""
    tok = load_tokenizer(tiny_llama)
    assert encode_chat(tok, HISTORY, None, {"enable_thinking": False}) == encode_chat(tok, HISTORY)
    for key, value in (
        ("chat_template", "{% for i in range(10**9) %}x{% endfor %}"),
        ("tokenize", False),
        ("add_generation_prompt", False),
        ("tools", []),
    ):
        with pytest.raises(ValueError, match=key):
            encode_chat(tok, HISTORY, None, {key: value})


def test_a_final_message_is_left_open_to_be_continued(tiny_llama):
    """continue_final_message: the conversation ends inside its last message (an assistant's
    start), where an answered one closes it and opens a new turn."""
    tok = load_tokenizer(tiny_llama)
    start = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    left_open = tok.decode(encode_chat(tok, start, continue_final=True))
    assert left_open.endswith("My favourite color is")
    assert left_open.startswith(tok.decode(encode_chat(tok, start[:1])))  # (the turn it continues)
    assert not tok.decode(encode_chat(tok, start)).endswith("My favourite color is")


def test_rendering_a_template_is_time_bound(tiny_llama):
    """A template whose work grows with a client's variable stops at its time bound with a
    ValueError naming it (the API's 400); the next conversation renders as before."""
    import time

    from minisgl.serve.tokenizer.chat import TemplateTimeout

    tok = load_tokenizer(tiny_llama)
    want = encode_chat(tok, HISTORY)
    template = tok.chat_template
    tok.chat_template = "{% for i in range(n) %}{% for j in range(n) %}x{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateTimeout, match="chat template took longer than 0.5 s"):
        encode_chat(tok, HISTORY, None, {"n": 100000}, timeout=0.5)
    assert time.monotonic() - start < 5
    tok.chat_template = template
    assert encode_chat(tok, HISTORY) == want


def test_reasoning_effort_reaches_templates_that_take_it(tiny_llama):
    """OpenAI's reasoning_effort is a template variable (gpt-oss's templates read it); others
    render as without it; chat_template_kwargs may still set it."""
    import msgspec

    from minisgl.serve.api.protocol import ChatCompletionRequest

    body = msgspec.json.decode(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}',
        type=ChatCompletionRequest,
    )
    # (as SGLang: an effort but "none" also turns thinking on, for the templates that read either name)
    assert body.template_kwargs() == {"reasoning_effort": "high", "thinking": True, "enable_thinking": True}
    tok = load_tokenizer(tiny_llama)
    assert encode_chat(tok, HISTORY, None, body.template_kwargs()) == encode_chat(tok, HISTORY)
    tok.chat_template = "{{ reasoning_effort | default('unset') }}:{{ messages[-1]['content'] }}"
    assert tok.decode(encode_chat(tok, HISTORY, None, body.template_kwargs())).startswith("high:")
    body.chat_template_kwargs = {"reasoning_effort": "low"}
    assert tok.decode(encode_chat(tok, HISTORY, None, body.template_kwargs())).startswith("low:")
    # SGLang's reasoning object: its effort wins; enabled alone turns thinking on; "none" turns it off
    body.chat_template_kwargs = None
    body.reasoning = {"effort": "none"}
    assert body.template_kwargs() == {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
    body.reasoning_effort, body.reasoning = None, {"enabled": "true"}
    assert body.template_kwargs() == {"thinking": True, "enable_thinking": True}
    body.chat_template_kwargs = {"enable_thinking": False}  # the caller's own value wins
    assert body.template_kwargs() == {"enable_thinking": False, "thinking": True}
    for bad in ({"effort": "extreme"}, {"effort": 1.5}, {"effort": True}):
        body.reasoning = bad
        with pytest.raises(BadRequest, match="reasoning.effort"):
            body.template_kwargs()


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_llama, "--max-total-tokens", "16384", "--reasoning-parser", "qwen3")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _streamed(client, **kw) -> tuple[dict, str | None]:
    """A streamed chat's message, put together as the openai client's users do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
    return {"content": content, "reasoning": reasoning, "calls": [calls[k] for k in sorted(calls)]}, finish


def _whole(message) -> dict:
    return {
        "content": message.content or "",
        "reasoning": getattr(message, "reasoning_content", None) or "",
        "calls": [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []
        ],
    }


def test_forced_tool_calls_over_the_openai_client(server):
    """tool_choice "required" and a named function: calls that validate against the tools'
    schemas, streamed deltas that add up to the whole answer, OpenAI's finish reasons."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Lima, in C?"}]
    for choice, finish in [("required", "tool_calls"), ({"type": "function", "function": {"name": "add"}}, "stop")]:
        for parallel in (True, False):
            kw = dict(
                model="default",
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=120,
                temperature=0,
                parallel_tool_calls=parallel,
            )
            r = client.chat.completions.create(**kw)
            whole = _whole(r.choices[0].message)
            # (with parallel calls a random model may go on calling until max_tokens: the calls made are kept)
            assert r.choices[0].finish_reason in ({finish, "length"} if parallel else {finish}), r
            assert whole["content"] == "" and whole["calls"], whole
            assert len(whole["calls"]) == 1 or parallel
            for call in whole["calls"]:
                assert call["id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
            if isinstance(choice, dict):
                assert [c["name"] for c in whole["calls"]] == ["add"]
            streamed, streamed_finish = _streamed(client, **kw)
            assert streamed_finish == r.choices[0].finish_reason
            strip = lambda m: {**m, "calls": [{**c, "id": None} for c in m["calls"]]}  # noqa: E731 (ids are fresh)
            assert strip(streamed) == strip(whole)
    idle_and_clean(server)


# A parameter schema as pydantic writes it: models under $defs, referenced by $ref, one recursive.
PYDANTIC_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "title": "Booking",
            "properties": {
                "guest": {"$ref": "#/$defs/Person"},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["guest", "nights"],
            "$defs": {
                "Person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 12},
                        "friend": {"anyOf": [{"$ref": "#/$defs/Person"}, {"type": "null"}]},
                    },
                    "required": ["name", "friend"],
                }
            },
        },
    },
}


def test_required_schema_rebases_pydantic_references():
    """tool_choice "required" nests each tool's parameters in one schema: their $defs move to the
    root under the tool's prefix and their $refs follow, so validators and xgrammar resolve them
    (400 "Cannot find field $defs" before)."""
    import jsonschema
    import xgrammar

    from minisgl.serve.parsers.tool_calls import required_schema

    schema = required_schema([TOOLS[0], PYDANTIC_TOOL], parallel=True)
    call = {
        "name": "book",
        "parameters": {"guest": {"name": "Ana", "friend": {"name": "Bo", "friend": None}}, "nights": 2},
    }
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{**call, "parameters": {"guest": {"name": 3, "friend": None}, "nights": 2}}], schema)
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # compiles


def test_forced_choice_with_pydantic_parameters(server):
    """Over HTTP, one call, with references but no recursion (a recursive schema, or parallel
    calls, let a random model go on until max_tokens cuts the call)."""
    import jsonschema
    import openai

    params = json.loads(json.dumps(PYDANTIC_TOOL["function"]["parameters"]))
    params["$defs"]["Person"]["properties"]["friend"] = {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]}
    params["$defs"]["Pet"] = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}},
        "required": ["kind"],
        "additionalProperties": False,
    }
    params["$defs"]["Person"]["additionalProperties"] = False
    params["additionalProperties"] = False
    tool = {"type": "function", "function": {"name": "book", "parameters": params}}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Book a room"}],
            tools=[tool],
            tool_choice=choice,
            max_tokens=300,
            temperature=0,
            parallel_tool_calls=False,
        )  # one call: a bounded answer
        assert r.choices[0].finish_reason != "length", r
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "book"
        jsonschema.validate(json.loads(calls[0].function.arguments), params)
    idle_and_clean(server)


def test_tools_in_the_history_and_auto_choice(server):
    """A conversation with a past call and its result is accepted; with tool_choice auto a
    model that answers in words gets content, no calls; "none" sends the tools nowhere."""
    base = {"model": "default", "messages": HISTORY, "max_tokens": 8, "temperature": 0}
    usage = {}
    for choice in ("auto", "none"):
        r = httpx.post(
            f"{server.url}/v1/chat/completions", json={**base, "tools": TOOLS, "tool_choice": choice}, timeout=60
        )
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg.get("tool_calls") is None and isinstance(msg["content"], str)
        usage[choice] = r.json()["usage"]["prompt_tokens"]
    assert usage["auto"] > usage["none"]  # the tools were described to the model only with auto
    idle_and_clean(server)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_refused_by_name(server, body, param):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=30,
        json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    )
    assert r.status_code == 400 and param in r.text, r.text


def test_reasoning_parser_separates_thinking(server):
    """--reasoning-parser qwen3: <think>...</think> goes to reasoning_content, streamed or not
    (the regex makes the tiny model think); separate_reasoning false keeps it in the content."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    kw = dict(
        model="default",
        messages=[{"role": "user", "content": "Think first."}],
        max_tokens=40,
        temperature=0,
        extra_body={"regex": "<think>[a-z]{2,8}</think>[a-z]{2,8}"},
    )
    whole = _whole(client.chat.completions.create(**kw).choices[0].message)
    assert whole["reasoning"] and whole["content"] and "<think>" not in whole["content"] + whole["reasoning"]
    assert _streamed(client, **kw)[0] == whole
    for stream_reasoning in (True, False):
        body = {**kw["extra_body"], "stream_reasoning": stream_reasoning}
        assert _streamed(client, **{**kw, "extra_body": body})[0] == whole
    joined = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}})
    assert joined.choices[0].message.content == f"<think>{whole['reasoning']}</think>{whole['content']}"
    free = client.chat.completions.create(**{**kw, "extra_body": {"regex": "[a-z ]{4,12}"}}).choices[0].message
    assert free.content and not getattr(free, "reasoning_content", None)
    idle_and_clean(server)
