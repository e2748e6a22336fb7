"""Tool calls in model output: parsed as the text streams in, in the formats checkpoints use.

A parser reads the answer's text piece by piece and turns it into events: plain content, the
start of a call (its name), and pieces of a call's arguments. Streamed responses send each
event as an OpenAI delta as it comes; whole responses gather the same events, so the two agree
by construction. Every format wraps the same call object, ``{"name": ..., "arguments": {...}}``
(Llama 3 says ``"parameters"``), read here once:

- ``qwen25`` (Qwen2.5, Qwen3, Hermes, and the prompt this server writes for templates that do
  not render tools): ``<tool_call>`` object ``</tool_call>``, content around them;
- ``llama3``: the whole answer is one or more objects (``;`` between), optionally after
  ``<|python_tag|>``; an answer that does not start with an object is content;
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of call objects (Mistral's
  v3 tokenizer format, the one SGLang's ``mistral`` parser reads);
- ``array``: a JSON array of objects, what ``tool_choice: "required"`` is constrained to;
- ``named``: the whole answer is one function's arguments (``tool_choice`` naming a function).

Arguments stream as the model writes them: the raw text of the arguments object is valid JSON
once complete. Text that leaves a format's shape is given back as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import regex

from minisgl.utils import partial_suffix

PARSERS = ("llama3", "qwen25", "qwen", "hermes", "mistral")  # --tool-call-parser: SGLang's names
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
# A call object up to the first brace of its arguments. Matched with partial=True: a prefix of
# it is "still possible", anything else is not a call.
_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


@dataclass
class Event:
    kind: str  # "content", "call" (a call starts: its name), "args" (more of a call's arguments)
    text: str
    index: int = -1  # the call's position in the answer


def _match(pattern: Any, text: str) -> str:
    """ "full" when ``pattern`` matches at the start of ``text``, "partial" when text is a prefix
    of a match, else "fail"."""
    m = pattern.match(text, partial=True)
    return "fail" if m is None else "partial" if m.partial else "full"


class _Call:
    """One call object being read: its head (name) first, then its arguments, then its brace."""

    def __init__(self) -> None:
        self.buf = ""  # the object's text so far
        self.name: str | None = None
        self.pos = 0  # where the arguments scan has reached in buf
        self.depth = 0
        self.in_string = self.escaped = False
        self.args_end: int | None = None

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """Reads ``text``; returns the state ("fail", "open" or "done") and what it learned:
        ("call", name) once, then ("args", piece) as the arguments grow."""
        self.buf += text
        out: list[tuple[str, str]] = []
        if self.name is None:
            m = _HEAD.match(self.buf, partial=True)
            if m is None:
                return "fail", out
            if m.partial:
                return "open", out
            try:
                self.name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return "fail", out
            self.pos = m.end() - 1  # at the arguments' opening brace
            out.append(("call", self.name))
        if self.args_end is None:
            start = self.pos
            self._scan()
            end = self.args_end if self.args_end is not None else self.pos
            if end > start:
                out.append(("args", self.buf[start:end]))
        if self.args_end is None:
            return "open", out
        state = _match(_TAIL, self.buf[self.args_end :])
        return ("done" if state == "full" else "open" if state == "partial" else "fail"), out

    def _scan(self) -> None:
        """Advances over the arguments object, tracking strings and nesting, to its end."""
        buf = self.buf
        while self.pos < len(buf):
            c = buf[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.args_end = self.pos
                    return

    @property
    def rest(self) -> str:
        """Text after the call's closing brace."""
        assert self.args_end is not None
        m = _TAIL.match(self.buf, self.args_end)
        return self.buf[m.end() :] if m else ""


_TAIL = regex.compile(r"\s*\}")


class ToolCallParser:
    """Turns an answer's text into content and tool-call events, piece by piece. Whitespace
    next to a call is not content, however the text was split, so streamed and whole answers
    give the same events."""

    def __init__(self, fmt: str, name: str | None = None):
        self.fmt = "qwen25" if fmt in ("qwen", "hermes") else fmt
        if self.fmt not in ("qwen25", "llama3", "mistral", "array", "named"):
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.name = name  # the function of the "named" format
        self.pending = ""  # text read but not yet turned into events
        self.call: _Call | None = None
        self.given_back = ""  # text before the call object (<tool_call>), content if it fails
        self.calls = 0
        self.lead = False  # a call just ended: leading whitespace is not content
        # start, text, head (a call is due), call, after (a call ended), plain (no calls: all content), done
        self.state = "start"

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while self.pending and self.state != "done" and self._step(events):
            pass
        if self.state == "done":
            self.pending = ""
        return events

    def finish(self) -> list[Event]:
        """The answer ended: held-back text that never became a call is content."""
        events: list[Event] = []
        if self.state == "call" and self.call is not None and self.call.name is None:
            events.append(Event("content", self.given_back + self.call.buf))
        elif self.state in ("start", "text", "plain") and self.pending and (self.calls == 0 or self.pending.strip()):
            events.append(Event("content", self.pending))
        self.pending, self.state = "", "done"
        return events

    def _step(self, events: list[Event]) -> bool:
        """Consumes some of ``pending``; False when it must wait for more text."""
        if self.fmt == "named":
            if self.state == "start":
                events.append(Event("call", self.name or "", 0))
                self.calls, self.state = 1, "call"
            events.append(Event("args", self.pending, 0))
            self.pending = ""
            return False
        if self.state == "call":
            return self._read_call(events)
        if self.state == "plain":  # the answer is not calls: all of it is content
            events.append(Event("content", self.pending))
            self.pending = ""
            return False
        return {"qwen25": self._qwen, "llama3": self._llama, "mistral": self._mistral, "array": self._array}[self.fmt](
            events
        )

    def _open(self, given_back: str, body: str) -> bool:
        self.call, self.given_back, self.pending, self.state = _Call(), given_back, body, "call"
        return True

    def _read_call(self, events: list[Event]) -> bool:
        assert self.call is not None
        text, self.pending = self.pending, ""
        state, learned = self.call.feed(text)
        events += [Event(kind, value, self.calls) for kind, value in learned]
        if state == "open":
            return False
        if state == "fail" and self.call.name is None:  # not a call after all: its opening is content,
            # and its text is read again as text (a whole answer's may hold a real call further on)
            events.append(Event("content", self.given_back))
            self.pending, self.call = self.call.buf, None
            self.state = "text" if self.fmt == "qwen25" else "plain"
            return True
        self.calls += 1
        if state == "fail":  # a call whose end is malformed: it ends there, and so does the answer
            self.state = "done"
            return False
        self.pending, self.state, self.call = self.call.rest, "after", None
        return True

    def _qwen(self, events: list[Event]) -> bool:
        if self.state == "after":  # </tool_call> closes a call
            state = _match(_QWEN_END, self.pending)
            if state == "partial":
                return False
            if state == "full":
                self.pending = self.pending[_QWEN_END.match(self.pending).end() :]
            self.state, self.lead = "text", True
        if self.lead:  # whitespace right after a call is not content
            self.pending = self.pending.lstrip()
            if not self.pending:
                return False
            self.lead = False
        rest = self._content_until(QWEN_OPEN, events)
        return False if rest is None else self._open(QWEN_OPEN, rest)

    def _content_until(self, marker: str, events: list[Event]) -> str | None:
        """Content up to ``marker`` (whitespace before it is not content), then the text after
        it; None while it has not come, holding back trailing whitespace (it may come before the
        marker) and a partial marker."""
        at = self.pending.find(marker)
        if at >= 0:
            before = self.pending[:at].rstrip()
            if before:
                events.append(Event("content", before))
            return self.pending[at + len(marker) :]
        keep = partial_suffix(self.pending, [marker])
        out = self.pending[: len(self.pending) - keep].rstrip()
        if out:
            events.append(Event("content", out))
        self.pending, self.state = self.pending[len(out) :], "text"
        return None

    def _llama(self, events: list[Event]) -> bool:
        body = self.pending.lstrip()
        if self.state == "after" and body.startswith(";"):
            body = body[1:].lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].lstrip()
        if not body or "<|python_tag|>".startswith(body) or (self.state == "after" and body == ";"):
            return False
        if body.startswith("{"):
            return self._open(self.pending[: len(self.pending) - len(body)], body)
        self.state = "plain" if self.calls == 0 else "done"  # text after calls is not part of them
        return self.calls == 0

    def _mistral(self, events: list[Event]) -> bool:
        """Content up to ``[TOOL_CALLS]``, then the array format reads the calls."""
        rest = self._content_until(MISTRAL_CALLS, events)
        if rest is None:
            return False
        self.pending, self.fmt, self.state = rest, "array", "start"
        return True

    def _array(self, events: list[Event]) -> bool:
        body = self.pending.lstrip()
        if not body:
            return False
        if self.state == "start":
            if not body.startswith("["):
                self.state = "plain"
                return True
            self.pending, self.state = body[1:], "head"
            return True
        if body[0] == "]" or (self.state == "after" and body[0] != ","):
            self.state = "done"
            return False
        if self.state == "after":
            body = body[1:].lstrip()
            if not body:
                self.pending, self.state = "", "head"
                return False
        return self._open("", body)


_QWEN_END = regex.compile(r"\s*</tool_call>")


def deltas(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """Events as OpenAI message parts: the content and the tool_calls entries (a call's first
    entry has its id, type and name; later ones add arguments). For a whole answer's events that
    is one complete entry per call; for a streamed update's, its delta."""
    content, calls = "", []
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "call":
            calls.append(
                {
                    "index": e.index,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": e.text, "arguments": ""},
                }
            )
        elif calls and calls[-1]["index"] == e.index:
            calls[-1]["function"]["arguments"] += e.text
        else:
            calls.append({"index": e.index, "function": {"arguments": e.text}})
    return content, calls


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema ``tool_choice: "required"`` constrains the answer to: a list of one or
    more calls of the given tools (one when parallel_tool_calls is false). Each tool's parameter
    schema moves inside it, so its references are rebased: its ``$defs``/``definitions`` (as
    pydantic writes them) go to the root under the tool's own prefix, ``#...`` pointers to its
    new place."""
    items, defs = [], {}
    for i, t in enumerate(tools):
        params = t["function"].get("parameters") or {"type": "object"}
        at = f"#/items/anyOf/{i}/properties/parameters"
        local = {**params.get("definitions", {}), **params.get("$defs", {})}
        params = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
        defs.update({f"t{i}_{name}": _rebase(d, i, at) for name, d in local.items()})
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": _rebase(params, i, at)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebase(node: Any, tool: int, at: str) -> Any:
    """A copy of a tool's schema ``node`` whose ``$ref`` pointers work from the combined root."""
    if isinstance(node, list):
        return [_rebase(x, tool, at) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase(v, tool, at) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                out["$ref"] = f"#/$defs/t{tool}_{ref[len(prefix) :]}"
                break
        else:
            out["$ref"] = at + ref[1:]
    return out
