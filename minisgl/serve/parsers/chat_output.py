"""One chat choice's answer text as OpenAI message parts: reasoning, content and tool calls.

The text passes the reasoning parser (with ``--reasoning-parser``), then the tool-call parser
(when the request has tools). A streamed choice turns each update into a delta; a whole choice
is one delta of all its text, so both give the same message.
"""

from __future__ import annotations

from typing import Any

from minisgl.serve.api.protocol import ToolPlan
from minisgl.serve.parsers.reasoning import ReasoningParser
from minisgl.serve.parsers.tool_calls import ToolCallParser, deltas


class ChatOutput:
    def __init__(self, plan: ToolPlan, reasoning_parser: str | None, stream_reasoning: bool = True):
        self.plan = plan
        self.reasoning = ReasoningParser(reasoning_parser, stream_reasoning) if reasoning_parser else None
        self.tools = ToolCallParser(plan.fmt, plan.name) if plan.fmt else None
        self.called = False

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields of this piece of the answer (``final``: the answer ends with it)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        calls: list[dict[str, Any]] = []
        if self.tools:
            events = self.tools.feed(content) + (self.tools.finish() if final else [])
            content, calls = deltas(events)
        self.called |= bool(calls)
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as a chat message."""
        parts = self.delta(text, True)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in parts.get("tool_calls", [])]
        message: dict[str, Any] = {"role": "assistant", "content": parts.get("content", None if calls else "")}
        if self.reasoning:
            message["reasoning_content"] = parts.get("reasoning_content")
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's reason: "tool_calls" when the model chose to call (a named choice says "stop")."""
        return "tool_calls" if reason == "stop" and self.called and self.plan.fmt != "named" else reason
