"""A body of OpenAI's Responses API, and the chat completion request it means.

The Responses API says what chat completions say in other words: ``instructions`` is the system
message, ``input`` a string or a list of items (messages, the model's earlier ``function_call``
items, the caller's ``function_call_output`` items), tools are flat (``{"type": "function",
"name": ...}``), ``text.format`` is the response format and ``reasoning.effort`` the template's
reasoning effort. ``ResponsesRequest.chat`` rewrites a body as a ``ChatCompletionRequest``, so
sampling, tools, grammars and every check are the chat route's.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    ChatMessageIn,
    Effort,
    FunctionCallIn,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallIn,
)
from minisgl.wire.sampling import Int32, Int64

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_USER = 256
LOGPROBS = "message.output_text.logprobs"
# OpenAI's other ``include`` values name outputs of its built-in tools, images and encrypted
# reasoning, none of which this server produces: accepted, with nothing to add.
INCLUDE = (
    LOGPROBS,
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
)


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's models; inert here


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Effort | None = None
    summary: str | None = None  # OpenAI's summaries of hidden reasoning; ours is shown whole
    generate_summary: str | None = None


class FunctionTool(msgspec.Struct):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[dict[str, Any]]
    model: str = "default"
    lora_path: str | None = None  # SGLang's: a loaded LoRA adapter's name (or model "base:adapter")
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Int32 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # SGLang's sampling extras, as on its other OpenAI routes
    top_k: Int32 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    cache_salt: str | None = None
    # "auto": the oldest messages (of this input and the responses it continues) are left out
    # until the prompt fits the context, instead of a 400
    truncation: Literal["auto", "disabled"] = "disabled"
    # logprobs of the output_text's tokens come with include: ["message.output_text.logprobs"],
    # each with its top_logprobs most likely alternatives
    include: list[str] | None = None
    top_logprobs: Int32 = 0
    # the response comes back at once, in progress; GET /v1/responses/{id} reads it until it ends
    background: bool = False

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    def messages(self) -> list[ChatMessageIn]:
        """``input`` as chat messages (without ``instructions``, which are not carried over to
        a response that continues this one)."""
        if isinstance(self.input, str):
            return [ChatMessageIn("user", self.input)]
        out: list[ChatMessageIn] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param="input")
                out.append(ChatMessageIn(role, _text(item.get("content"), f"{where}.content")))
            elif kind == "function_call":
                call = ToolCallIn(
                    FunctionCallIn(_str(item, "name", where), _str(item, "arguments", where)),
                    id=_str(item, "call_id", where),
                )
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls is not None:
                    last.tool_calls.append(call)  # parallel calls: one assistant message
                else:
                    out.append(ChatMessageIn("assistant", None, tool_calls=[call]))
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output, f"{where}.output")
                out.append(ChatMessageIn("tool", text, tool_call_id=_str(item, "call_id", where)))
            elif kind == "reasoning":
                continue  # the model's earlier thinking: chat templates leave it out of the prompt
            else:
                raise BadRequest(
                    f"{where} has type {kind!r}, which is not supported (message, function_call, "
                    "function_call_output and reasoning items are)",
                    param="input",
                )
        if not out:
            raise BadRequest("input has no message", param="input")
        return out

    def _check_stored_fields(self) -> None:
        """OpenAI's limits on what a response stores besides its messages: at most 16 metadata
        pairs of string keys up to 64 characters and string values up to 512, and a short ``user``."""
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS:
            raise BadRequest(f"metadata has {len(meta)} pairs; at most {MAX_METADATA_PAIRS}", param="metadata")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
                raise BadRequest(
                    f"metadata[{key[:64]!r}]: keys up to {MAX_METADATA_KEY} characters, values strings up to "
                    f"{MAX_METADATA_VALUE}",
                    param="metadata",
                )
        if self.user is not None and len(self.user) > MAX_USER:
            raise BadRequest(f"user is {len(self.user)} characters; at most {MAX_USER}", param="user")

    def chat(self, history: list[ChatMessageIn]) -> ChatCompletionRequest:
        """The chat request this body means, after the ``history`` of the responses it continues."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise BadRequest(f"max_output_tokens must be >= 1, got {self.max_output_tokens}", param="max_output_tokens")
        self._check_stored_fields()
        for value in self.include or []:
            if value not in INCLUDE:
                raise BadRequest(f"include has {value!r}; known values: {', '.join(INCLUDE)}", param="include")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        if self.background and not self.store:
            raise BadRequest("background responses are stored: give store true", param="background")
        if self.background and self.stream:
            raise BadRequest(
                "background responses are not streamed here: poll GET /v1/responses/{id}", param="background"
            )
        messages = ([ChatMessageIn("system", self.instructions)] if self.instructions else []) + history
        return ChatCompletionRequest(
            model=self.model,
            lora_path=self.lora_path,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=self._tools(),
            tool_choice=self._tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._format(),
            reasoning_effort=self.reasoning.effort if self.reasoning else None,
            user=self.user,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop=self.stop,
            seed=self.seed,
            cache_salt=self.cache_salt,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else None,
        )

    def _tools(self) -> list[Tool] | None:
        if not self.tools:
            return None
        tools = []
        for i, t in enumerate(self.tools):
            if t.type != "function":
                raise BadRequest(f"tools[{i}] has type {t.type!r}: only function tools are supported", param="tools")
            if not t.name:
                raise BadRequest(f"tools[{i}] needs a name", param="tools")
            tools.append(Tool(FunctionDef(t.name, t.description, t.parameters, t.strict)))
        return tools

    def _tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest(
                f"tool_choice {choice!r} is not supported: give none, auto, required or "
                '{"type": "function", "name": ...}',
                param="tool_choice",
            )
        return NamedToolChoice(NamedFunction(choice["name"]))

    def _format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat("json_object")
        if fmt.schema is None:
            raise BadRequest("text.format of type json_schema needs a schema", param="text")
        return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name, fmt.schema, fmt.strict, fmt.description))


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{where} has a part of type {kind!r}; only text parts are supported "
                "(this server serves text-only models)",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)
