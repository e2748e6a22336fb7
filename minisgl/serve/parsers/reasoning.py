"""Reasoning models' thinking, separated from the answer as the text streams in.

Qwen3 and DeepSeek-R1 write ``<think>...</think>`` before the answer; ``--reasoning-parser``
moves it into ``reasoning_content`` (SGLang's and vLLM's field). With ``qwen3`` an answer is
reasoning only when it opens with ``<think>`` (no thinking when ``enable_thinking`` is off);
``deepseek-r1`` and ``qwen3-thinking`` start in reasoning, because their templates open the
tag in the prompt. Streamed and whole answers go through the same steps, so they agree.
"""

from __future__ import annotations

from minisgl.utils import partial_suffix

PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")
OPEN, CLOSE = "<think>", "</think>"


def starts_in_reasoning(name: str) -> bool:
    """Whether the parser's models start their answer thinking (the template opened the tag)."""
    return name != "qwen3"


class ReasoningParser:
    """Splits text into (reasoning, content) pieces, piece by piece."""

    def __init__(self, name: str, stream_reasoning: bool = True):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
        self.forced = starts_in_reasoning(name)
        self.stream_reasoning = stream_reasoning  # false: the reasoning goes out whole, when it ends
        self.state = "start"  # start, reasoning, content
        self.pending = ""
        self.held = ""  # reasoning kept back while stream_reasoning is off

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        if self.state == "start":
            body = self.pending.lstrip()
            if OPEN.startswith(body) and len(body) < len(OPEN):
                return "", ""  # may still become <think>
            if body.startswith(OPEN):
                self.pending, self.state = body[len(OPEN) :], "reasoning"
            else:
                self.state = "reasoning" if self.forced else "content"
        if self.state == "reasoning":
            at = self.pending.find(CLOSE)
            if at < 0:
                keep = partial_suffix(self.pending, [CLOSE])
                reasoning, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return self._reasoning(reasoning, False), ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(CLOSE) :].lstrip()
            self.state = "content" if self.pending else "lead"
            reasoning = self._reasoning(reasoning, True)
        if self.state == "lead":  # whitespace after </think> is not content
            self.pending = self.pending.lstrip()
            if not self.pending:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held back goes out (unfinished thinking stays reasoning)."""
        pending, self.pending = self.pending, ""
        if self.state == "reasoning":
            return self._reasoning(pending, True), ""
        if self.state == "start":
            return ("", pending) if not self.forced else (self._reasoning(pending, True), "")
        return self._reasoning("", True), pending if self.state == "content" else ""

    def _reasoning(self, text: str, ended: bool) -> str:
        if self.stream_reasoning:
            return text
        self.held += text
        if not ended:
            return ""
        out, self.held = self.held, ""
        return out
