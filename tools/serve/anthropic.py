"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a
translation of the chat-completions path: one runner, another front door.

A Messages request becomes an OpenAI :class:`~.protocol.ChatCompletionRequest` (:func:`to_chat`),
which :mod:`.chat` prepares, runs and parses exactly as it does its own: the same chat template,
tool rendering, grammar for forced tools, stop strings and prefix cache. The chat answer is then
translated back: a whole :class:`~.protocol.ChatCompletionResponse` into a Message
(:func:`full`), and the chat stream's chunks into Anthropic's server-sent events (:func:`stream`).

Request -> chat:

- ``system`` (a string, or text blocks joined with no separator as vLLM and llama.cpp join them;
  a Claude Code ``x-anthropic-billing-header`` block, which changes on every request and would
  defeat the prefix cache, is dropped as vLLM drops it) -> a first ``system`` message;
- a ``user`` turn's text blocks -> ``user`` content, each ``tool_result`` block -> a ``tool``
  message (``tool_call_id`` = ``tool_use_id``; its text, or its text blocks joined), in block
  order; an ``assistant`` turn's text -> content and its ``tool_use`` blocks -> ``tool_calls``
  (``input`` as JSON arguments); ``thinking`` blocks sent back as history are dropped;
- ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function /
  ``none``, ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``stop_sequences`` -> ``stop``, ``max_tokens``, ``temperature``, ``top_p`` as they are;
  ``top_k`` (which chat lacks) is set on the prepared sequences' SamplingParams;
  ``output_config.format`` (``json_schema``) -> ``response_format``.

Chat -> Message: text -> a ``text`` block, each call -> a ``tool_use`` block (``input`` the parsed
arguments); ``finish_reason`` ``stop`` -> ``end_turn`` (``stop_sequence`` when a stop string
matched, named in ``stop_sequence``), ``length`` -> ``max_tokens``, ``tool_calls`` -> ``tool_use``.
``usage`` follows Anthropic's accounting: ``input_tokens`` are the prompt tokens prefilled,
``cache_read_input_tokens`` those taken from the prefix cache (their sum is the prompt), and
``cache_creation_input_tokens`` is 0 (the cache fills itself, nothing is billed).

Errors on these routes are Anthropic's error object (:func:`error_response`): ``{"type": "error",
"error": {"type", "message"}, "request_id"}`` with a ``request-id`` header; an unknown model is a
404 ``not_found_error``, a full queue or a draining server a 529 ``overloaded_error``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvforge.tools.serve import chat
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import Flight, ModelServer, ServingError

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system block

# Fields of Anthropic's schema kvforge accepts and ignores -> what the server does (docs/serving.md says
# the same); ``metadata`` and ``service_tier`` are counted under chat's names (:mod:`.fields`).
IGNORED: dict[str, str] = {
    "cache_control": "nothing: the prefix cache needs no breakpoints (block-level cache_control likewise)",
    "diagnostics": "nothing: no cache-miss diagnostics are returned",
    "inference_geo": "nothing: inference runs where the server runs",
    "speed": "nothing: one speed",
    "thinking": "nothing: no extended-thinking switch; a model's own reasoning text is part of its answer",
    "context_management": "nothing: the history is sent as it is, nothing is cleared server-side",
    "output_config.effort": "nothing: no effort switch",
}


# ----------------------------------------------------------------------------------------- requests


class Message(BaseModel):
    """One turn; extra keys are accepted and unused (as chat's messages)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(p.RequestModel):
    # https://docs.anthropic.com/en/api/messages; every body field of the ``anthropic`` package's
    # ``MessageCreateParams`` (plus the sampling fields older clients send). Content blocks stay
    # dicts: :func:`to_chat` checks each with a message naming it.
    model: str
    messages: list[Message]
    max_tokens: int  # required, as Anthropic requires it
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format (json_schema) implemented; effort ignored
    metadata: dict[str, Any] | None = None  # ignored
    service_tier: str | None = None  # ignored
    cache_control: dict[str, Any] | None = None  # ignored
    diagnostics: dict[str, Any] | None = None  # ignored
    inference_geo: str | None = None  # ignored
    speed: str | None = None  # ignored
    thinking: dict[str, Any] | None = None  # ignored
    context_management: dict[str, Any] | None = None  # ignored
    container: str | dict[str, Any] | None = None  # refused unless null: no code-execution containers
    mcp_servers: list[dict[str, Any]] | None = None  # refused unless empty: no MCP connector


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None  # not part of count_tokens' body; accepted and unused


# ---------------------------------------------------------------------------------------- responses


class Usage(p.ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    service_tier: str = "standard"


class MessageResponse(p.ResponseModel):
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


# ------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def serves(path: str) -> bool:
    """Whether ``path`` is one of this API's (its errors are Anthropic's)."""
    return path == ROUTES[0] or path.startswith(ROUTES[0] + "/")


def error_response(error: ServingError) -> JSONResponse:
    """``error`` as Anthropic's error object: an unknown model is a 404, a full queue or a draining
    server 529 (Anthropic's "overloaded"), other statuses as they are."""
    status = error.status
    if error.code == "model_not_found":
        status = 404
    elif error.code in ("queue_full", "draining"):
        status = 529
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    body = {"type": "error", "error": {"type": kind, "message": error.message}, "request_id": request_id}
    return JSONResponse(body, status_code=status, headers={"request-id": request_id})


# ------------------------------------------------------------------------------------ request -> chat


def _refuse(message: str) -> ServingError:
    return ServingError(message, param=None, code="invalid_value")


def _text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _refuse(f"{where} is a text block without a string 'text'; send {{'type': 'text', 'text': ...}}")
    return text


def _system(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise _refuse(f"system[{i}] has type {block.get('type')!r}; system takes a string or text blocks")
        text = _text(block, f"system[{i}]")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _tool_result(block: dict, where: str) -> dict:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise _refuse(f"{where} is a tool_result without a string 'tool_use_id'")
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _refuse(f"{where}.content[{j}] has type {kind!r}; this server takes text tool results only")
            parts.append(_text(part, f"{where}.content[{j}]"))
        content = "".join(parts)
    elif not isinstance(content, str):
        raise _refuse(f"{where}.content must be a string or text blocks")
    return {"role": "tool", "content": content, "tool_call_id": use_id}


def _tool_call(block: dict, where: str) -> dict:
    name, use_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(use_id, str) or not isinstance(arguments, dict):
        raise _refuse(f"{where} is a tool_use block without a string 'id', a string 'name' and an object 'input'")
    return {"id": use_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as chat messages (see the module docstring)."""
    out: list[dict] = []
    system = _system(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(message.content):
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(_text(block, where))
            elif kind == "tool_result" and message.role == "user":
                if texts:  # text before a result stays before it
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append(_tool_result(block, where))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append(_tool_call(block, where))
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # a previous answer's reasoning, as clients send it back: not re-read
            else:
                takes = "text and tool_use" if message.role == "assistant" else "text and tool_result"
                raise _refuse(
                    f"{where} has type {kind!r}; this server takes {takes} blocks in a {message.role} message "
                    "(text only: no images or documents)"
                )
        if message.role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            raise _refuse(
                f"tools[{i}] ({tool.get('type') or tool.get('name')!r}) is not a client tool; this server runs no "
                "server tools: send {'name': ..., 'description': ..., 'input_schema': {...}}"
            )
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, tools: list[dict] | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        names = [t["function"]["name"] for t in tools or []]
        if choice.get("name") not in names:
            raise _refuse(
                f"tool_choice names tool {choice.get('name')!r}, which is not among the tools ({', '.join(names)})"
            )
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in mapped:
        raise _refuse(
            f"tool_choice type {kind!r} is not one of 'auto', 'any', 'tool' (with 'name') or 'none'; "
            "send {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} or {'type': 'none'}"
        )
    return mapped[kind], parallel


def _response_format(config: dict[str, Any] | None) -> dict | None:
    spec = (config or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise _refuse("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"], "strict": True}}


def to_chat(req: MessagesRequest) -> p.ChatCompletionRequest:
    """The chat-completions request that runs ``req`` (400 for what this server cannot honour)."""
    if req.container is not None:
        raise _refuse("'container' (code execution) is not supported: this server runs no tools itself; remove it")
    if req.mcp_servers:
        raise _refuse("'mcp_servers' is not supported: this server connects to no MCP server; remove it")
    tools = _tools(req.tools)
    tool_choice, parallel = _tool_choice(req.tool_choice, tools)
    messages = [p.ChatMessage(**m) for m in _chat_messages(req)]
    return p.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(req.output_config),
        stream=req.stream,
        stream_options=p.StreamOptions(include_usage=True) if req.stream else None,
    )


def ignored_fields(req: MessagesRequest) -> list[str]:
    """The :data:`IGNORED` fields ``req`` sets."""
    out = [name for name in IGNORED if "." not in name and getattr(req, name) is not None]
    if (req.output_config or {}).get("effort") is not None:
        out.append("output_config.effort")
    return out


@dataclass
class Prepared:
    """A Messages request prepared as chat: the chat request and chat's own preparation."""

    request: p.ChatCompletionRequest
    chat: chat.Prepared

    @property
    def sequences(self):
        return self.chat.sequences


def prepare(server: ModelServer, req: MessagesRequest) -> Prepared:
    request = to_chat(req)
    prep = chat.prepare(server, request)
    if req.top_k is not None:
        try:
            prep.sequences = [replace(s, sampling=replace(s.sampling, top_k=req.top_k)) for s in prep.sequences]
        except ValueError as e:
            raise ServingError(str(e), param="top_k", code="invalid_value") from e
    for name in ignored_fields(req):
        server.metrics.ignored_fields.labels(field=name).inc()
    return Prepared(request, prep)


def count_tokens(server: ModelServer, req: CountTokensRequest) -> dict[str, int]:
    """``{"input_tokens": N}``: the prompt :func:`prepare` would build (N = input_tokens +
    cache_read_input_tokens of the same request sent to ``/v1/messages``)."""
    request = to_chat(req.model_copy(update={"stream": False}))
    return {"input_tokens": chat.prepare(server, request).prompt_tokens}


# ------------------------------------------------------------------------------------ chat -> Message


def _stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (``{}`` when the model wrote no object)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: p.UsageInfo | dict) -> Usage:
    if isinstance(usage, dict):
        usage = p.UsageInfo.model_validate(usage)
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Usage(
        input_tokens=usage.prompt_tokens - cached,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


async def full(server: ModelServer, req: MessagesRequest, prep: Prepared, flight: Flight) -> MessageResponse:
    answer = await chat.full(server, prep.request, prep.chat, flight)
    choice = answer.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or []:
        content.append(
            {"type": "tool_use", "id": call.id, "name": call.function.name, "input": _input(call.function.arguments)}
        )
    stop_string = choice.stop_reason if isinstance(choice.stop_reason, str) else None
    return MessageResponse(
        model=server.model_name,
        content=content,
        stop_reason=_stop_reason(choice.finish_reason, stop_string),
        stop_sequence=stop_string if choice.finish_reason == "stop" else None,  # (a call ends with none)
        usage=_usage(answer.usage),
    )


def event(kind: str, body: dict[str, Any]) -> str:
    """One server-sent event as Anthropic writes them: its type as ``event:`` and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


class _Blocks:
    """The content blocks of a streamed message: opens, deltas and closes as chat deltas come."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text" or "tool_use": the open block's type

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.open = kind
        out.append(event("content_block_start", {"index": self.count, "content_block": block}))
        return out

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.count, "delta": delta})

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [event("content_block_stop", {"index": self.count - 1})]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        """Events for one chat ``delta`` (content and tool-call pieces)."""
        out = []
        if delta.get("content"):
            if self.open != "text":
                out += self.start("text", {"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a new call
                block = {"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}}
                out += self.start("tool_use", block)
            if fn.get("arguments") and self.open == "tool_use":
                out.append(self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out


async def stream(server: ModelServer, req: MessagesRequest, prep: Prepared, flight: Flight) -> AsyncIterator[str]:
    """Anthropic's events from chat's stream: ``message_start``; per block ``content_block_start``,
    its deltas (``text_delta`` / ``input_json_delta``), ``content_block_stop`` (a ``ping`` after the
    first start); ``message_delta`` (stop reason, usage); ``message_stop``. A failure is an ``error``
    event ending the stream."""
    message = MessageResponse(
        model=server.model_name, content=[], usage=Usage(input_tokens=prep.chat.prompt_tokens, output_tokens=0)
    )
    yield event("message_start", {"message": message.model_dump()})
    blocks, pinged = _Blocks(), False
    finish, stop_string, usage = None, None, None
    async with contextlib.aclosing(chat.stream(server, prep.request, prep.chat, flight)) as lines:
        async for line in lines:  # chat's chunks, each "data: {json}\n\n", then "data: [DONE]"
            data = line.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # chat's error object: the runtime failed (500), or a worker refused (400)
                kind = "api_error" if chunk["error"].get("type") == "internal_error" else "invalid_request_error"
                yield event("error", {"error": {"type": kind, "message": chunk["error"].get("message")}})
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                for text in blocks.feed(choice.get("delta") or {}):
                    yield text
                    if not pinged:  # as Anthropic does: one ping after the first block starts
                        pinged = True
                        yield event("ping", {})
                finish = choice.get("finish_reason") or finish
                if isinstance(choice.get("stop_reason"), str):
                    stop_string = choice["stop_reason"]
    for text in blocks.stop():
        yield text
    if not pinged:
        yield event("ping", {})
    final = _usage(usage) if usage else Usage(input_tokens=prep.chat.prompt_tokens, output_tokens=0)
    stop_string = stop_string if finish == "stop" else None
    delta = {"stop_reason": _stop_reason(finish, stop_string), "stop_sequence": stop_string}
    yield event("message_delta", {"delta": delta, "usage": final.model_dump(exclude={"service_tier"})})
    yield event("message_stop", {})
