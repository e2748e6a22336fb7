"""Conversations rendered by the checkpoint's chat template, tools included.

The server and the offline API both render chats here, so they send the model the same tokens.
Templates that know tools (Qwen2.5/3, Llama 3.1+) get the OpenAI tool definitions and the
history's calls as they expect them. A template that ignores tools (SmolLM2's, for one) would
leave the model blind to them, so the tools are described in the system message instead, with
the ``<tool_call>`` format the ``qwen25`` parser reads back.
"""

from __future__ import annotations

import inspect
import json
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from minisgl.serve.parsers.tool_calls import QWEN_CLOSE, QWEN_OPEN

# Seconds one conversation may take to render. The template is the checkpoint's, but clients set
# its variables and messages, and a loop over them could hold the one process every request needs.
RENDER_TIMEOUT_S = 10.0


class TemplateTimeout(ValueError):
    """Rendering the chat template ran past its time bound (the request is refused, 400)."""


@contextmanager
def _time_bound(seconds: float) -> Iterator[None]:
    """Interrupt the Python work inside after ``seconds`` (a SIGALRM on the main thread: Jinja
    renders in Python, so it stops between two steps of the template). Elsewhere no bound."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise TemplateTimeout(f"rendering the chat template took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_7f3a", "description": "d", "parameters": {"type": "object", "properties": {}}},
}


def _template_text(tokenizer: Any) -> str:
    template = tokenizer.chat_template or ""
    return template if isinstance(template, str) else json.dumps(template)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows tool definitions to the model (read once per tokenizer)."""
    known = getattr(tokenizer, "_minisgl_renders_tools", None)
    if known is None:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
            )
            known = "probe_tool_7f3a" in text
        except Exception:  # a template that chokes on tools does not render them
            known = False
        tokenizer._minisgl_renders_tools = known
    return known


def detect_tool_parser(tokenizer: Any) -> str | None:
    """The tool-call format of the template's model: ``qwen25`` for ``<tool_call>`` (and for
    templates that ignore tools: this module's own prompt asks for it), ``llama3`` for Llama's
    JSON calls, ``mistral`` for ``[TOOL_CALLS]``, None when the template renders tools in a
    format not known here."""
    if tokenizer is None or not tokenizer.chat_template:
        return None
    if not renders_tools(tokenizer):
        return "qwen25"
    text = _template_text(tokenizer)
    if QWEN_OPEN in text:
        return "qwen25"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    return None


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return (
        "You can call functions to answer. They are described by these JSON schemas:\n<tools>\n"
        f"{lines}\n</tools>\nTo call one or more, answer only with one block per call, each like this:\n"
        f'{QWEN_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{QWEN_CLOSE}'
    )


def _spelled_out(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: the tools described in the system
    message, past calls written into the assistant's text as the model would have written them."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [
                f"{QWEN_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                f"\n{QWEN_CLOSE}"
                for c in calls
            ]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        out.append(m)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{_tools_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": _tools_prompt(tools)})
    return out


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    timeout: float = RENDER_TIMEOUT_S,
    continue_final: bool = False,
) -> list[int]:
    """Token ids of a conversation ready for the assistant's turn (the template adds any special
    tokens itself), or with ``continue_final`` (the API's ``continue_final_message``) left open
    at the end of its last message, which the model goes on writing. A call's arguments are given
    to the template as an object, as templates expect; a tool message's content stays text.
    Rendering longer than ``timeout`` seconds raises ``TemplateTimeout``."""
    messages = [_with_parsed_arguments(m) for m in messages]
    has_calls = any(m.get("tool_calls") for m in messages)
    kwargs = dict(template_kwargs or {})
    # Only template variables: apply_chat_template's own arguments (``chat_template`` above all:
    # a client's Jinja would run in the process every request needs) are refused by name.
    call_args = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"documents", "kwargs"}
    refused = sorted(call_args & set(kwargs))
    if refused:
        raise ValueError(f"chat_template_kwargs may only set template variables, not {', '.join(refused)}")
    if (tools or has_calls) and not renders_tools(tokenizer):
        messages, tools = _spelled_out(messages, tools), None
    if tools:
        kwargs["tools"] = tools
    with _time_bound(timeout):
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **kwargs,
        )
    return tokenizer.encode(text, add_special_tokens=False)


def fit_chat(
    messages: list[dict[str, Any]], encode: Callable[[list[dict[str, Any]]], list[int]], fits: Callable[[int], bool]
) -> list[int]:
    """The conversation with the fewest oldest messages left out for its tokens to fit (the
    Responses API's ``truncation: "auto"``): its leading system messages and its last message
    always stay, and a tool result never stays without the call it answers. Rendered O(log n)
    times (a binary search over where the kept part starts). Returns the last rendering tried
    when nothing fits (the caller refuses it)."""
    ids = encode(messages)
    if fits(len(ids)):
        return ids
    head = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    starts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") != "tool"]
    lo, hi, best = 0, len(starts) - 1, None  # fewer messages dropped at lower indices
    while lo <= hi:
        mid = (lo + hi) // 2
        tried = encode(messages[:head] + messages[starts[mid] :])
        if fits(len(tried)):
            best, hi = tried, mid - 1
        else:
            ids, lo = tried, mid + 1
    return best if best is not None else ids


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message without unset fields, its calls' arguments as objects."""
    message = {k: v for k, v in message.items() if v is not None}
    parsed = []
    for c in message.get("tool_calls") or []:
        args = c["function"].get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass  # not JSON: the template gets the text as the model wrote it
        parsed.append({**c, "function": {**c["function"], "arguments": args}})
    return {**message, "tool_calls": parsed} if parsed else message
