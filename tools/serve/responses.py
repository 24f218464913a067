"""``POST /v1/responses``: OpenAI's Responses API as a front door to the chat-completions path.

A Responses request is translated into a :class:`~.protocol.ChatCompletionRequest` and run by
:mod:`.chat` (same template rendering, tool grammar, structured output, sampling and scheduler);
the chat answer (whole, or its stream of chunks) is translated back into a Response object (or
Responses' stream events). Nothing here generates.

Translation (request):

- ``instructions`` -> a first ``system`` message (not carried over by ``previous_response_id``,
  as OpenAI documents);
- ``input``: a string is one ``user`` message; a list holds items: ``message`` (roles ``user``,
  ``assistant``, ``system``, ``developer`` -> ``system``; content a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts), ``function_call`` (joined to the assistant turn before it
  as its ``tool_calls``), ``function_call_output`` (a ``tool`` message); ``reasoning`` items are
  dropped (nothing renders them yet); any other item (images, files, built-in tools,
  ``item_reference``) is a 400 naming it;
- ``tools``: the flat function form ``{"type": "function", "name", "description", "parameters",
  "strict"}``; ``tool_choice``: ``auto`` / ``none`` / ``required`` / ``{"type": "function",
  "name"}`` / ``{"type": "allowed_tools", "mode", "tools"}`` (the tools are narrowed to those);
- ``text.format`` (``text`` / ``json_object`` / ``json_schema`` with ``name``, ``schema``,
  ``strict``) -> ``response_format``; ``max_output_tokens`` -> ``max_completion_tokens``;
  ``temperature``, ``top_p``, ``parallel_tool_calls`` as they are; ``top_logprobs`` with ``include:
  ["message.output_text.logprobs"]`` -> logprobs on the ``output_text`` parts; ``reasoning.effort``
  -> ``reasoning_effort``; kvforge extensions ``seed`` and ``stop`` as in chat.

Translation (answer): chat's ``reasoning_content`` (where a reasoning parser separates it) -> a
``reasoning`` item; the message's text -> one ``message`` item with one ``output_text`` part;
each tool call -> a ``function_call`` item (``call_id`` = the chat call's id); ``finish_reason``
``length`` -> ``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``;
``usage`` -> ``input_tokens`` (with ``input_tokens_details.cached_tokens``: prompt tokens taken
from the prefix cache), ``output_tokens``, ``total_tokens``.

Streaming sends OpenAI's event sequence, each event with a ``sequence_number``: ``response.created``,
``response.in_progress``; per output item ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, or for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, or for reasoning ``response.reasoning_text.delta``...,
``response.reasoning_text.done``; ``response.output_item.done``; finally
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``; ``error`` then
``response.failed`` when generation fails).

Stored responses (:class:`ResponseStore`): unless ``store: false``, each finished response is kept
in memory (at most :data:`STORE_LIMIT`, least recently used evicted first) with its conversation
(the input messages and its output), for ``GET``/``DELETE /v1/responses/{id}`` and for
``previous_response_id``: a chained request renders the whole conversation again (previous
input, previous output, new input), so its prompt starts with the previous prompt and the prefix
cache serves it. An unknown, evicted, deleted or unstored id is a 404. The store is per process
(per Ray replica).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvforge.tools.serve import chat
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import Flight, ModelServer, SeqRequest, ServingError

STORE_LIMIT = 1024  # stored responses per process; the least recently used beyond it are evicted
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# field -> what the server does with it (docs/serving.md says the same).
IGNORED: dict[str, str] = {
    "user": "nothing: no per-user accounting",
    "safety_identifier": "nothing: no per-user accounting",
    "service_tier": "one tier: every request is scheduled alike",
    "prompt_cache_key": "nothing: the prefix cache needs no routing key",
    "prompt_cache_options": "nothing: no cache breakpoints or lifetimes to set",
    "prompt_cache_retention": "nothing: no cache lifetimes to set",
    "max_tool_calls": "nothing: it bounds built-in tools, which this server does not run",
    "context_management": "nothing: no server-side compaction",
    "moderation": "nothing: no moderation model is run",
    "image": "nothing: text only",
    "access_programs": "nothing",
    "background_options": "nothing: no background mode",
    "stream_options": "nothing: stream events carry no obfuscation padding",
}


# ------------------------------------------------------------------------------------- request


class ResponsesRequest(p.RequestModel):
    # https://platform.openai.com/docs/api-reference/responses/create; every field of the openai
    # package's ResponseCreateParams is declared (tests/serve/test_responses.py checks).
    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" honoured; others have nothing to add
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None  # echoed and stored
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # effort -> chat's reasoning_effort
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str | None = None  # "disabled" (and "auto": too long an input is a 400 either way)
    # refused unless null/false: no background runs, conversations or stored prompts here
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # ignored (IGNORED)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # kvforge extensions (as in chat)
    seed: int | None = None
    stop: str | list[str] | None = None


# ------------------------------------------------------------------------------------- response


class InputTokensDetails(p.ResponseModel):
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    cache_write_tokens: int = 0  # not counted: the prefix pool stores finished requests' blocks on its own


class OutputTokensDetails(p.ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(p.ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(p.ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(p.ResponseModel):
    id: str = Field(default_factory=lambda: _item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText]


class FunctionCallItem(p.ResponseModel):
    id: str = Field(default_factory=lambda: _item_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: str = "completed"
    call_id: str
    name: str
    arguments: str  # JSON text


class ReasoningText(p.ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(p.ResponseModel):
    """The model's reasoning (chat's ``reasoning_content``, where a reasoning parser separates it)."""

    id: str = Field(default_factory=lambda: _item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: str = "completed"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class ResponseObject(p.ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str  # "in_progress", "completed", "incomplete", "failed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    user: str | None = None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------- store


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object as answered
    messages: list[dict[str, Any]]  # its conversation as chat messages (input and output, no instructions)


class ResponseStore:
    """Finished responses by id, at most ``limit``; reading one makes it the most recently used,
    and the least recently used beyond ``limit`` are evicted. Used from the event loop only."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"the response store holds at least 1 response, got limit={limit}")
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response, or a 404 in OpenAI's error form (``param`` names the request field)."""
        stored = self._items.get(response_id)
        if stored is None:
            raise ServingError(
                f"response with id {response_id!r} not found: it was never stored (store: false), was deleted, or "
                f"was evicted (this server keeps the {self.limit} most recently used responses, in memory, per "
                "process); send the whole conversation as input instead",
                status=404,
                param=param,
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> dict[str, Any]:
        self.get(response_id)
        del self._items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}


# ----------------------------------------------------------------------------------- translation


def _refused(name: str, message: str) -> ServingError:
    return ServingError(message, param=name, code="unsupported")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ServingError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(part.get(key), str):
            raise ServingError(
                f"{where}[{j}] is a content part of type {kind!r}; this server takes text only (parts "
                "{'type': 'input_text', 'text': ...})",
                param=f"{where}[{j}]",
            )
        texts.append(part[key])
    return "".join(texts)


def _required(item: Mapping, key: str, where: str) -> Any:
    if not isinstance(item.get(key), str):
        raise ServingError(f"{where}.{key} is required (a string) in a {item.get('type')} item", param=f"{where}.{key}")
    return item[key]


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (``role``, ``content``, and ``tool_calls`` / ``tool_call_id`` where they apply)
    of a Responses ``input``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ServingError(
                    f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                    param=f"{where}.role",
                )
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _required(item, "call_id", where),
                "type": "function",
                "function": {"name": _required(item, "name", where), "arguments": _required(item, "arguments", where)},
            }
            if messages and messages[-1]["role"] == "assistant":  # the same assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            message = {"role": "tool", "content": _text(item.get("output"), f"{where}.output")}
            if isinstance(item.get("call_id"), str):
                message["tool_call_id"] = item["call_id"]
            messages.append(message)
        elif kind == "reasoning":
            continue  # the model's own reasoning: nothing renders it back yet
        else:
            raise ServingError(
                f"{where} is an item of type {kind!r}; this server takes 'message', 'function_call' and "
                "'function_call_output' items (and drops 'reasoning' items)",
                param=f"{where}.type",
                code="unsupported",
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat's ``{"type": "function", "function": {...}}``."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _refused(
                f"tools[{i}]",
                f"tools[{i}] has type {tool.get('type')!r}; this server runs function tools only ({{'type': "
                "'function', 'name': ..., 'parameters': {...}}}): built-in tools (web search, file search, code "
                "interpreter, ...) are not available",
            )
        if not isinstance(tool.get("name"), str):
            raise ServingError(
                f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}} (the Responses "
                "API's flat form, not chat's {'function': {...}})",
                param=f"tools[{i}]",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict] | None) -> tuple[Any, list | None]:
    """(chat's tool_choice, the tools it may call) for a Responses ``tool_choice``."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, Mapping)}
        narrowed = [t for t in tools or [] if t["function"]["name"] in allowed]
        if not narrowed:
            raise ServingError("tool_choice allowed_tools names none of the tools", param="tool_choice")
        return choice["mode"], narrowed
    raise ServingError(
        "tool_choice must be 'auto', 'none', 'required', {'type': 'function', 'name': ...} or "
        "{'type': 'allowed_tools', 'mode': 'auto'|'required', 'tools': [...]} (built-in tools are not available)",
        param="tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
        raise ServingError(
            f"text.format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema' "
            "({'type': 'json_schema', 'name': ..., 'schema': {...}, 'strict': true})",
            param="text.format",
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), Mapping):
        raise ServingError(
            "text.format json_schema needs a 'schema' object: {'type': 'json_schema', 'name': ..., 'schema': {...}}",
            param="text.format.schema",
        )
    spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}
    return {"type": "json_schema", "json_schema": spec}


def _check_refused(req: ResponsesRequest) -> None:
    if req.background:
        raise _refused("background", "background responses are not supported: remove 'background' (or set false)")
    if req.conversation is not None:
        raise _refused(
            "conversation",
            "conversations are not stored by this server: chain responses with previous_response_id, or send the "
            "whole conversation as input",
        )
    if req.prompt is not None:
        raise _refused("prompt", "stored prompt templates are not available here: send instructions and input")
    if req.truncation not in (None, "disabled", "auto"):
        raise ServingError(f"truncation must be 'disabled' or 'auto', got {req.truncation!r}", param="truncation")
    if req.top_logprobs is not None and LOGPROBS_INCLUDE not in (req.include or []):
        raise ServingError(
            f"top_logprobs needs include: ['{LOGPROBS_INCLUDE}'] to return them; add it or drop top_logprobs",
            param="top_logprobs",
        )


# chat's field names in its error messages and params -> this API's
_RENAMES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "the rendered messages": "the rendered input",
    "messages": "input",
}


def _renamed(error: ServingError) -> ServingError:
    message, param = error.message, error.param
    for old, new in _RENAMES.items():
        message = message.replace(old, new)
        if param is not None and param.startswith(old):
            param = new + param[len(old) :]
    if param is not None and param.startswith("tools[") and param.endswith(".function.parameters"):
        param = param.replace(".function.parameters", ".parameters")
    return ServingError(message, status=error.status, type=error.type, param=param, code=error.code)


def ignored_fields(req: ResponsesRequest) -> list[str]:
    """The :data:`IGNORED` fields this request sets (counted in ``kvforge_ignored_fields_total``)."""
    return [name for name in IGNORED if getattr(req, name) is not None]


# ---------------------------------------------------------------------------------------- handler


@dataclass
class Prepared:
    """A Responses request translated: the chat request and its preparation, the conversation so
    far (chat messages without the instructions) and the Response object's fixed fields."""

    chat_request: p.ChatCompletionRequest
    inner: chat.Prepared
    messages: list[dict[str, Any]]
    head: ResponseObject
    logprobs: bool

    @property
    def sequences(self) -> list[SeqRequest]:
        return self.inner.sequences


class ResponsesHandler:
    """The ``/v1/responses`` handler for :func:`.app.build_app`'s ``respond``: ``prepare`` turns the
    request into a chat request, ``full``/``stream`` turn the chat answer into a Response (and store
    it)."""

    ignored_fields = staticmethod(ignored_fields)

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def prepare(self, server: ModelServer, req: ResponsesRequest) -> Prepared:
        server.check_model(req.model)
        _check_refused(req)
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, param="previous_response_id").messages
        messages = history + input_messages(req.input)
        tools = _chat_tools(req.tools)
        tool_choice, tools = _chat_tool_choice(req.tool_choice, tools)
        logprobs = LOGPROBS_INCLUDE in (req.include or [])
        body = {
            "model": req.model,
            "messages": ([{"role": "system", "content": req.instructions}] if req.instructions else []) + messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": req.stop,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text),
            "logprobs": logprobs,
            "top_logprobs": (req.top_logprobs or 0) if logprobs else None,
            "reasoning_effort": (req.reasoning or {}).get("effort"),
            "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
        request = p.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
        try:
            inner = chat.prepare(server, request)
        except ServingError as e:
            raise _renamed(e) from e
        head = ResponseObject(
            id=_item_id("resp"),
            created_at=int(time.time()),
            status="in_progress",
            model=server.model_name,
            instructions=req.instructions,
            metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            top_logprobs=req.top_logprobs,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            tool_choice=req.tool_choice or "auto",
            tools=[{"parameters": None, "strict": None, **t} for t in req.tools or []],
            text={"format": {"type": "text"}, **(req.text or {})},
            reasoning=req.reasoning,
            truncation=req.truncation or "disabled",
            store=req.store,
            user=req.user,
        )
        return Prepared(request, inner, messages, head, logprobs)

    async def full(self, server: ModelServer, req: ResponsesRequest, prep: Prepared, flight: Flight) -> ResponseObject:
        answer = await chat.full(server, prep.chat_request, prep.inner, flight)
        choice = answer.choices[0]
        return self._finish(prep, output_items(choice), choice.finish_reason, _usage(answer.usage))

    async def stream(
        self, server: ModelServer, req: ResponsesRequest, prep: Prepared, flight: Flight
    ) -> AsyncIterator[str]:
        events = EventStream(prep.head, prep.logprobs)
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        async with contextlib.aclosing(chat.stream(server, prep.chat_request, prep.inner, flight)) as chunks:
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    for event in events.failed(chunk["error"]):
                        yield event
                    return
                for event in events.chunk(chunk):
                    yield event
        for event in events.close(empty_message=True):
            yield event
        response = self._finish(prep, events.output, events.finish_reason, events.usage)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield events.emit(kind, response=response.model_dump())

    def _finish(
        self, prep: Prepared, output: list, finish_reason: str | None, usage: ResponseUsage | None
    ) -> ResponseObject:
        """The finished Response; stored with its conversation unless ``store`` is false."""
        incomplete = finish_reason == "length"
        response = prep.head.model_copy(
            update={
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output,
                "usage": usage,
            }
        )
        if prep.head.store:
            self.store.put(response.id, Stored(response.model_dump(), prep.messages + _output_messages(output)))
        return response


def output_items(choice: p.ChatCompletionResponseChoice) -> list[OutputItem]:
    """A whole chat answer's output items: its reasoning (if a parser separated any), its text (also
    when empty, unless it only calls tools), a ``function_call`` per tool call."""
    message, output = choice.message, []
    reasoning = (message.model_extra or {}).get("reasoning_content") or getattr(message, "reasoning_content", None)
    if reasoning:
        output.append(ReasoningItem(content=[ReasoningText(text=reasoning)]))
    if message.content or not message.tool_calls:
        logprobs = [_logprob(lp) for lp in choice.logprobs.content or []] if choice.logprobs else None
        output.append(OutputMessage(content=[OutputText(text=message.content or "", logprobs=logprobs)]))
    for call in message.tool_calls or []:
        output.append(FunctionCallItem(call_id=call.id, name=call.function.name, arguments=call.function.arguments))
    return output


def _output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as chat messages (one assistant turn), to chain a later request onto."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def _usage(usage: p.UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
        total_tokens=usage.total_tokens,
    )


def _logprob(lp: Any) -> dict[str, Any]:
    """One chat logprob (model or dict) as Responses' ``{token, bytes, logprob, top_logprobs}``."""
    lp = lp.model_dump() if isinstance(lp, p.ResponseModel) else lp
    top = [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]} for t in lp.get("top_logprobs") or []]
    return {"token": lp["token"], "bytes": lp["bytes"], "logprob": lp["logprob"], "top_logprobs": top}


class EventStream:
    """Responses' stream events for one answer, numbered from 0, made from chat's stream chunks
    (:meth:`chunk`); keeps the output items as they close, the finish reason and the usage. One
    item is open at a time: reasoning text opens a reasoning item, text a message item, a new tool
    call a function_call item; the open item's ``output_index`` is ``len(self.output)``."""

    def __init__(self, head: ResponseObject, logprobs: bool) -> None:
        self.head, self.logprobs = head, logprobs
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.open_call: int | None = None  # the chat call index of an open function_call item
        self.finish_reason: str | None = None
        self.usage: ResponseUsage | None = None

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str) -> str:
        return self.emit(kind, response=self.head.model_dump())

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat completion chunk (a parsed ``ChatCompletionStreamResponse``)."""
        out = []
        if chunk.get("usage"):
            self.usage = _usage(p.UsageInfo.model_validate(chunk["usage"]))
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.reasoning(delta["reasoning_content"])
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content") if self.logprobs else None
                out += self.text(delta["content"], [_logprob(lp) for lp in logprobs or []])
            for call in delta.get("tool_calls") or []:
                out += self.call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _at(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": len(self.output)}

    def _added(self, item: OutputItem) -> str:
        self.open = item
        return self.emit("response.output_item.added", output_index=len(self.output), item=item.model_dump())

    def reasoning(self, delta: str) -> list[str]:
        out = []
        if not isinstance(self.open, ReasoningItem):
            out += self.close()
            out.append(self._added(ReasoningItem(status="in_progress", content=[ReasoningText(text="")])))
        item = self.open
        item.content[0].text += delta
        out.append(self.emit("response.reasoning_text.delta", **self._at(item), content_index=0, delta=delta))
        return out

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        out = []
        if not isinstance(self.open, OutputMessage):
            out += self.close()
            message = OutputMessage(status="in_progress", content=[])
            out.append(self._added(message))
            message.content.append(OutputText(text="", logprobs=[] if self.logprobs else None))
            part = message.content[0].model_dump()
            out.append(self.emit("response.content_part.added", **self._at(message), content_index=0, part=part))
        message = self.open
        part = message.content[0]
        part.text += delta
        if self.logprobs:
            part.logprobs += logprobs
        where = self._at(message)
        out.append(self.emit("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=logprobs))
        return out

    def call(self, delta: dict[str, Any]) -> list[str]:
        """Events for one chat ``tool_calls`` delta (its first names the call; arguments may come in pieces)."""
        out = []
        function = delta.get("function") or {}
        if self.open_call != delta["index"]:
            out += self.close()
            item = FunctionCallItem(status="in_progress", call_id=delta["id"], name=function["name"], arguments="")
            out.append(self._added(item))
            self.open_call = delta["index"]
        call = self.open
        if function.get("arguments"):
            piece = function["arguments"]
            call.arguments += piece
            out.append(self.emit("response.function_call_arguments.delta", **self._at(call), delta=piece))
        return out

    def close(self, empty_message: bool = False) -> list[str]:
        """Close the open item; ``empty_message``: at the end, an answer with no text nor call gets an
        empty message."""
        out = []
        answered = any(isinstance(item, (OutputMessage, FunctionCallItem)) for item in [*self.output, self.open])
        if empty_message and not answered:
            out += self.text("", [])
        item, self.open, self.open_call = self.open, None, None
        if item is None:
            return out
        where = self._at(item)
        if isinstance(item, ReasoningItem):
            text = item.content[0].text
            out.append(self.emit("response.reasoning_text.done", **where, content_index=0, text=text))
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            done = dict(text=part.text, logprobs=part.logprobs or [])
            out.append(self.emit("response.output_text.done", **where, content_index=0, **done))
            out.append(self.emit("response.content_part.done", **where, content_index=0, part=part.model_dump()))
        else:
            out.append(self.emit("response.function_call_arguments.done", **where, arguments=item.arguments))
        item.status = "completed"
        out.append(self.emit("response.output_item.done", output_index=len(self.output), item=item.model_dump()))
        self.output.append(item)
        return out

    def failed(self, error: dict[str, Any]) -> list[str]:
        """``error`` (chat's error object) as an ``error`` event and ``response.failed``."""
        message = error.get("message", "")
        out = [self.emit("error", code=error.get("code"), message=message, param=error.get("param"))]
        update = {"status": "failed", "output": self.output, "error": {"code": "server_error", "message": message}}
        out.append(self.emit("response.failed", response=self.head.model_copy(update=update).model_dump()))
        return out
