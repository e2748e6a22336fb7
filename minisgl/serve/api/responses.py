"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A body becomes a chat request (``responses_request``) and runs as one; its answer, read by the
chat route's ``ChatOutput`` (reasoning, content, tool calls), goes back as output items: a
``reasoning`` item, a ``message`` with its ``output_text``, and one ``function_call`` per call.
Streamed, the same items arrive as the typed events the openai client and the Agents SDK read
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``). Responses are stored (``store``, on by default), the latest
``MAX_STORED`` of them within ``MAX_STORED_BYTES``, so ``previous_response_id`` continues a
conversation: each stored response keeps its own input and output messages and the id of the one
it continued. A stored response belongs to its request's ``cache_salt`` (the tenant): only a
request or a GET / DELETE (``?cache_salt=``) with the same salt finds it. With ``truncation:
"auto"`` the tokenizer leaves out the oldest messages until the prompt fits (``chat.fit_chat``).
With ``include: ["message.output_text.logprobs"]`` the output_text carries its tokens' logprobs
(``TextLogprobs``: reasoning and tool-call tokens are not part of it). With ``background`` the
response comes back at once, in progress, and is stored again when it ends (completed,
incomplete, cancelled by ``POST /v1/responses/{id}/cancel``, or failed); a GET reads it meanwhile.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minisgl.serve.api.base import Run, merge, read_body
from minisgl.serve.api.errors import BadRequest
from minisgl.serve.api.fields import RESPONSES
from minisgl.serve.api.openai import OpenAIRoutes, _openai_logprob, _usage
from minisgl.serve.api.protocol import ChatMessageIn, FunctionCallIn, ToolCallIn
from minisgl.serve.api.response_store import MAX_STORED, ResponseStore, Stored
from minisgl.serve.api.responses_request import ResponsesRequest
from minisgl.serve.parsers.chat_output import ChatOutput
from minisgl.wire.requests import TokenLogprob

_encoder = msgspec.json.Encoder()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item() -> dict[str, Any]:
    return {
        "type": "message",
        "id": _id("msg"),
        "status": "in_progress",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
    }


def _reasoning_item() -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}


def _call_item(call_id: str, name: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": "",
        "status": "in_progress",
    }


def _answer(items: list[dict[str, Any]]) -> ChatMessageIn:
    """The output items as the assistant message a continuation's prompt shows."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [
        ToolCallIn(FunctionCallIn(it["name"], it["arguments"]), id=it["call_id"])
        for it in items
        if it["type"] == "function_call"
    ]
    return ChatMessageIn("assistant", text or None, tool_calls=calls or None)


class TextLogprobs:
    """Which tokens make up the output_text, whose logprobs go with it. The answer is its tokens'
    texts joined; the output_text (the chat content) is one stretch of it, after any reasoning
    and before any tool call: found once where its first characters follow the reasoning text,
    then each content delta covers the next characters, and the tokens that overlap them are
    that delta's (each token once)."""

    def __init__(self) -> None:
        self.text = ""  # every token's text so far, joined
        self.ends: list[int] = []  # where each token's text ends in it
        self.lps: list[TokenLogprob] = []
        self.start: int | None = None  # where the output_text begins in ``text``
        self.shown = 0  # output_text characters handed out
        self.taken = 0  # tokens looked at

    def add(self, lps: list[TokenLogprob]) -> None:
        for lp in lps:
            self.text += lp.text
            self.ends.append(len(self.text))
            self.lps.append(lp)

    def take(self, content: str, reasoning: str) -> list[dict[str, Any]]:
        """The logprobs of the tokens behind the output_text's next characters ``content``;
        ``reasoning``: the reasoning text so far."""
        if self.start is None:
            at = self.text.find(reasoning) if reasoning else -1
            after = at + len(reasoning) if at >= 0 else 0
            found = self.text.find(content, after)
            self.start = found if found >= 0 else after
        self.shown += len(content)
        end, out = self.start + self.shown, []
        while self.taken < len(self.lps):
            lp, stop = self.lps[self.taken], self.ends[self.taken]
            begin = stop - len(lp.text)
            if begin > end or (begin == end and lp.text):  # past these characters
                break
            if stop > self.start or (not lp.text and begin >= self.start):
                out.append(_openai_logprob(lp))
            self.taken += 1
        return out


class _Events:
    """A streamed answer's deltas as Responses events, items opened and closed in order; with
    ``logprobs`` each output_text delta carries its tokens' logprobs (``TextLogprobs``)."""

    def __init__(self, logprobs: bool = False) -> None:
        self.logprobs = TextLogprobs() if logprobs else None
        self.reasoning = ""  # all reasoning text so far
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed

    def event(self, kind: str, **data: Any) -> bytes:
        payload = _encoder.encode({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def open_item(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = item
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={**item["content"][0], "text": ""},
                )
            )
        return out

    def delta(self, delta: dict[str, Any], tokens: list[TokenLogprob] = ()) -> list[bytes]:
        """The events of one chat delta (``ChatOutput.delta``) and of the ``tokens`` behind it."""
        if self.logprobs is not None:
            self.logprobs.add(tokens)
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            out += self._call(call)
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == "reasoning" else self.open_item(_reasoning_item())
        self.open["content"][0]["text"] += text
        self.reasoning += text
        return out + [
            self.event(
                "response.reasoning_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
            )
        ]

    def _text(self, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == "message" else self.open_item(_message_item())
        part = self.open["content"][0]
        part["text"] += text
        logprobs = self.logprobs.take(text, self.reasoning) if self.logprobs else []
        part["logprobs"] += logprobs
        return out + [
            self.event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        ]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        function = call["function"]
        out = self.open_item(_call_item(call["id"], function["name"])) if "id" in call else []  # a call starts
        self.open["arguments"] += function["arguments"]
        if function["arguments"]:
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items),
                    delta=function["arguments"],
                )
            )
        return out

    def finish(self) -> list[bytes]:
        """End the answer: close its last item; one with neither a message nor a call gets an
        empty message."""
        items = self.items + ([self.open] if self.open is not None else [])
        out = [] if any(it["type"] != "reasoning" for it in items) else self.open_item(_message_item())
        return out + self.close()

    def close(self) -> list[bytes]:
        """Finish the item being streamed."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.items), []
        if item["type"] == "reasoning":
            out.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        elif item["type"] == "message":
            item["status"] = "completed"
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            out.append(
                self.event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        else:
            item["status"] = "completed"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out


class ResponsesRoutes(OpenAIRoutes):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stored = ResponseStore(self.args.responses_store or ":memory:")
        self._background: dict[str, tuple[list[Run], asyncio.Task]] = {}  # running, by response id

    def _history(self, previous: str | None, salt: str | None) -> list[ChatMessageIn]:
        """The messages of the responses ``previous`` continues, oldest first."""
        chain: list[list[ChatMessageIn]] = []
        while previous is not None:
            stored = self.stored.get(previous, salt)
            if stored is None:
                raise BadRequest(
                    f"previous_response_id {previous!r} is not a stored response (this server keeps "
                    f"the latest {MAX_STORED})",
                    param="previous_response_id",
                )
            if stored.response["status"] == "in_progress":
                raise BadRequest(f"response {previous!r} is still in progress", param="previous_response_id")
            chain.append(stored.messages)
            previous = stored.previous
        return [m for messages in reversed(chain) for m in messages]

    def _head(self, body: ResponsesRequest, rid: str) -> dict[str, Any]:
        fmt = body.text.format if body.text and body.text.format else None
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": body.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": [msgspec.to_builtins(t) for t in body.tools or []],
            "text": {"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
            "reasoning": msgspec.to_builtins(body.reasoning) if body.reasoning else None,
            "metadata": body.metadata or {},
            "store": body.store,
            "background": body.background,
            "truncation": body.truncation,
            "top_logprobs": body.top_logprobs,
            "user": body.user,
            "usage": None,
        }

    def _finish(
        self,
        body: ResponsesRequest,
        response: dict[str, Any],
        run: Run,
        items: list[dict[str, Any]],
        own: list[ChatMessageIn],
    ) -> dict[str, Any]:
        """Fill in the finished response; store it if asked."""
        usage = _usage([run])
        incomplete = run.finish_reason == "length"
        status = "incomplete" if incomplete else "cancelled" if run.finish_reason == "abort" else "completed"
        response.update(
            status=status,
            output=items,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        )
        if body.store and (status != "cancelled" or body.background):  # a GET finds a cancelled one
            self._store(body, response, own + [_answer(items)])
        return response

    def _store(self, body: ResponsesRequest, response: dict[str, Any], messages: list[ChatMessageIn]) -> None:
        size = len(_encoder.encode(response)) + len(_encoder.encode(messages))
        self.stored.put(response["id"], Stored(response, messages, body.previous_response_id, body.cache_salt, size))

    @staticmethod
    def _whole(body: ResponsesRequest, run: Run, output: ChatOutput) -> list[dict[str, Any]]:
        """A finished answer's output items: those its stream would end with."""
        whole = _Events(body.logprobs)
        whole.delta(output.delta(run.text, True), run.logprobs)
        whole.finish()
        return whole.items

    async def _run_background(
        self, body: ResponsesRequest, response: dict[str, Any], run: Run, output: ChatOutput, own: list[ChatMessageIn]
    ) -> None:
        """Wait for a background response's answer and store how it ended."""
        try:
            await run.wait()
            self._finish(body, response, run, self._whole(body, run, output), own)
        except Exception as e:  # the engine failed it: stored as failed, as OpenAI reports one
            response.update(status="failed", error={"code": "server_error", "message": str(e)})
            self._store(body, response, own)
        finally:
            self._background.pop(response["id"], None)

    async def responses(self, request: Request) -> Response:
        body: ResponsesRequest = await read_body(request, ResponsesRequest, self.args, RESPONSES)
        own = body.messages()
        chat = body.chat(self._history(body.previous_response_id, body.cache_salt) + own)
        rid = _id("resp")
        runs, outputs = await self._chat_runs(chat, rid, truncate=body.truncation == "auto")
        run, output = runs[0], outputs[0]
        response = self._head(body, rid)
        if body.background:
            self._store(body, response, own)
            task = asyncio.create_task(self._run_background(body, response, run, output, own))
            self._background[rid] = (runs, task)
            return JSONResponse(response)
        if not body.stream:
            if not await self._collect(runs, request):
                return Response(status_code=499)
            return JSONResponse(self._finish(body, response, run, self._whole(body, run, output), own))

        async def events() -> AsyncIterator[bytes]:
            stream = _Events(body.logprobs)
            yield stream.event("response.created", response=dict(response))
            yield stream.event("response.in_progress", response=dict(response))
            async for _, upd in merge(runs):
                for chunk in stream.delta(output.delta(upd.text, upd.finish_reason is not None), upd.logprobs):
                    yield chunk
            for chunk in stream.finish():
                yield chunk
            done = self._finish(body, response, run, stream.items, own)
            kind = "response.completed" if done["status"] == "completed" else f"response.{done['status']}"
            yield stream.event(kind, response=done)

        return self._stream(runs, events())

    def _stored(self, request: Request) -> Stored:
        rid = request.path_params["response_id"]
        stored = self.stored.get(rid, request.query_params.get("cache_salt"))
        if stored is None:
            raise BadRequest(f"no stored response has the id {rid!r}", status=404, param="response_id")
        return stored

    async def get_response(self, request: Request) -> Response:
        return JSONResponse(self._stored(request).response)

    async def cancel_response(self, request: Request) -> Response:
        """End a background response (its answer so far stays, status cancelled); one that has
        ended already comes back as it is."""
        stored = self._stored(request)
        if not stored.response.get("background"):
            raise BadRequest("only background responses can be cancelled", param="response_id")
        running = self._background.get(stored.response["id"])
        if running is not None:
            runs, task = running
            for r in runs:
                r.abort()
            await asyncio.shield(task)  # until it is stored as cancelled
        return JSONResponse(self._stored(request).response)

    async def delete_response(self, request: Request) -> Response:
        rid = self._stored(request).response["id"]
        self.stored.pop(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
