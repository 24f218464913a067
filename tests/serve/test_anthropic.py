"""Anthropic's Messages API (tools/serve/anthropic.py), driven over real HTTP by the official
``anthropic`` SDK (and httpx for the raw wire) against the bundled model with a ChatML template.

Proves: ``messages.create`` answers what chat completions answers for the same conversation (text,
system as a string or text blocks, ``stop_sequences`` -> ``stop_sequence``, ``max_tokens`` ->
``max_tokens``), with Anthropic's usage (``input_tokens`` + ``cache_read_input_tokens`` = the
prompt, the cache read on a resent conversation); ``tools`` with ``tool_choice`` ``any`` / ``tool``
give ``ToolUseBlock``s whose ``input`` is a dict valid under the schema, and a ``tool_result`` fed
back runs; ``messages.stream`` sends Anthropic's events in Anthropic's order (message_start,
content_block_start, ping, deltas, content_block_stop, message_delta, message_stop), its text
deltas join to the final message and its ``input_json_delta``s to the tool input, both equal to the
whole answer; ``count_tokens`` is the prompt length the server tokenizes; errors are Anthropic's
error object, parsed by the SDK as ``BadRequestError`` / ``AuthenticationError`` / ``NotFoundError``
/ ``OverloadedError`` with the server's message; ``x-api-key`` is honoured like the bearer key.
The translation alone: blocks become chat messages in block order (tool results as tool turns,
calls as the assistant's tool_calls, thinking and Claude Code's billing block dropped), and a
failure mid-stream is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import typing
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from kvforge.tools.serve import anthropic as messages_api
from kvforge.tools.serve import chat
from kvforge.tools.serve.serving import ServingError
from tests.conftest import CHATML_TEMPLATE
from tests.tools.test_serve import KEY, MODEL, metric, running

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")

GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more; the API still takes it
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM = "You answer questions about Python in one short sentence."
QUESTION = [{"role": "user", "content": "What is a list?"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------------- the translation alone


def _request(**body) -> messages_api.MessagesRequest:
    return messages_api.MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, **body})


def test_messages_become_chat_messages_in_block_order():
    req = _request(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=123;"},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "text", "text": "And Rome?"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        top_p=0.9,
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"},
    )
    out = messages_api.to_chat(req)
    dumped = [{"role": m.role, "content": m.content, **(m.model_extra or {})} for m in out.messages]
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert dumped == [
        {"role": "system", "content": "Be brief."},  # the per-request billing block is dropped
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},  # thinking dropped
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And Rome?"},
    ]
    assert out.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather of a city",
            },
        }
    ]
    assert (out.tool_choice, out.parallel_tool_calls) == ("required", False)
    assert (out.max_tokens, out.stop, out.top_p, out.stream) == (8, ["\n\n"], 0.9, False)
    assert out.response_format["json_schema"]["schema"] == {"type": "object"}
    assert messages_api.ignored_fields(req) == ["output_config.effort"]
    named = messages_api.to_chat(
        _request(messages=QUESTION, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    )
    assert (
        named.tool_choice == {"type": "function", "function": {"name": "get_time"}}
        and named.parallel_tool_calls is None
    )


def test_request_models_declare_every_field_of_the_sdk():
    from anthropic.types import message_count_tokens_params as count_params
    from anthropic.types import message_create_params as create_params

    headers = {"user_profile_id", "workspace_id"}  # the SDK sends these as headers, not in the body
    theirs = set()
    for typed in (create_params.MessageCreateParamsStreaming, create_params.MessageCreateParamsNonStreaming):
        theirs |= set(typing.get_type_hints(typed)) - headers
    ours = set(messages_api.MessagesRequest.model_fields)
    assert theirs - ours == set(), "the anthropic SDK has request fields the server does not declare"
    # Fields older clients and the API still take, which SDK 2.x no longer lists.
    assert ours - theirs <= {"temperature", "top_p", "top_k", "context_management", "mcp_servers"}
    counted = set(typing.get_type_hints(count_params.MessageCountTokensParams)) - headers
    assert counted - set(messages_api.CountTokensRequest.model_fields) == set()
    ignored = {name for name in messages_api.IGNORED if "." not in name} | {"metadata", "service_tier"}
    refused = {"container", "mcp_servers"}
    assert ignored & refused == set() and (ignored | refused) <= ours
    text = Path(__file__).resolve().parents[2].joinpath("docs", "serving.md").read_text(encoding="utf-8")
    for name in ignored | refused:
        assert f"`{name}`" in text.split("## Anthropic Messages API")[1], f"docs/serving.md lacks {name}"


def test_a_failure_mid_stream_is_an_error_event(monkeypatch):
    failure = ServingError("generation failed: boom", status=500, type="internal_error")

    async def failing(server, request, prep, flight):  # chat's stream when the runtime fails mid-answer
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
        yield f"data: {json.dumps(failure.body())}\n\n"
        yield "data: [DONE]\n\n"

    monkeypatch.setattr(chat, "stream", failing)
    prep = messages_api.Prepared(request=None, chat=SimpleNamespace(prompt_tokens=5))

    async def run():
        req = _request(messages=QUESTION, stream=True)
        return [e async for e in messages_api.stream(SimpleNamespace(model_name=MODEL), req, prep, None)]

    events = [e.split("\n")[0].removeprefix("event: ") for e in asyncio.run(run())]
    assert events == ["message_start", "content_block_start", "ping", "content_block_delta", "error"]
    last = json.loads(asyncio.run(run())[-1].split("\n")[1].removeprefix("data: "))
    assert last == {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}}


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    """The bundled model's artifact with a ChatML chat template (copied; nothing recompiled)."""
    out = tmp_path_factory.mktemp("tiny-anthropic") / "artifact"
    shutil.copytree(tiny_artifact, out)
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def served(chat_artifact):
    with running(chat_artifact, max_queue=4) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _prompt_tokens(server, messages) -> int:
    """The prompt the server builds for chat ``messages``: its template, no special tokens added."""
    return len(server.encode(server.chat_template.render(messages, add_generation_prompt=True), special=False))


# ------------------------------------------------------------------------------------------ text


def test_text_and_system_equal_chat_completions(claude, client, served):
    expected = _chat(client, [{"role": "system", "content": SYSTEM}, *QUESTION], max_tokens=12)
    blocks = [{"type": "text", "text": SYSTEM[:20]}, {"type": "text", "text": SYSTEM[20:]}]
    for system in (SYSTEM, blocks):
        m = claude.messages.create(model=MODEL, max_tokens=12, system=system, messages=QUESTION, extra_body=GREEDY)
        assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
        [block] = m.content
        assert isinstance(block, anthropic.types.TextBlock) and block.text == expected.choices[0].message.content
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.choices[0].finish_reason]
        assert m.stop_sequence is None
        assert m.usage.output_tokens == expected.usage.completion_tokens
        # Anthropic's accounting: what was prefilled plus what the prefix cache gave is the prompt.
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == expected.usage.prompt_tokens
        assert m.usage.cache_creation_input_tokens == 0
        assert not m.model_extra and not m.usage.model_extra and not block.model_extra  # the SDK's types exactly
    assert m.usage.cache_read_input_tokens >= 16  # the third identical prompt: its blocks come from the cache
    text = httpx.get(served[0] + "/metrics").text
    assert metric(text, "kvforge_requests_total", route="/v1/messages", status="200") >= 2


def test_max_tokens_and_stop_sequences(claude):
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    whole = claude.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY).content[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert len(whole) > 6 and stop.strip() and whole.index(stop) > 0, whole
    m = claude.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == whole[: whole.index(stop)]


# ----------------------------------------------------------------------------------------- tools


def test_tool_choice_any_and_tool_give_valid_tool_use_and_results_feed_back(claude, served):
    m = claude.messages.create(
        model=MODEL,
        max_tokens=140,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if isinstance(b, anthropic.types.ToolUseBlock)]
    assert len(uses) == 1 and isinstance(uses[0].input, dict) and uses[0].id
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])

    named = claude.messages.create(
        model=MODEL, max_tokens=140, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}
    )
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    jsonschema.validate(named.content[-1].input, SCHEMAS["get_time"])

    # The call and its result sent back, as an agent loop does; the model answers in text.
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C, sunny"}]},
    ]
    answer = claude.messages.create(
        model=MODEL, max_tokens=8, messages=history, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    # What the model read: the call as a Hermes block in the assistant turn, the result as a tool turn.
    counted = claude.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    call = json.dumps({"name": uses[0].name, "arguments": uses[0].input})
    rendered = [
        *ASK_WEATHER,
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": "18 C, sunny"},
    ]
    assert counted.input_tokens == _prompt_tokens(served[1], rendered)


def test_count_tokens_is_the_prompt_the_server_tokenizes(claude, client, served):
    n = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION).input_tokens
    assert n == _prompt_tokens(served[1], [{"role": "system", "content": SYSTEM}, *QUESTION])
    assert n == _chat(client, [{"role": "system", "content": SYSTEM}, *QUESTION], max_tokens=1).usage.prompt_tokens
    with_tools = claude.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=TOOLS).input_tokens
    assert with_tools > _prompt_tokens(served[1], ASK_WEATHER) + 50  # the tools ride in a system message


# --------------------------------------------------------------------------------------- streams


def _raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed /v1/messages."""
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def test_stream_text_event_by_event(claude, served):
    whole = claude.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    events = _raw_events(
        served[0], {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "messages": QUESTION, **GREEDY}
    )
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    pieces = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in pieces)
    assert "".join(d["text"] for d in pieces) == whole.content[0].text
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens

    # The SDK's stream helper: its text stream and final message are the whole answer's.
    with claude.messages.stream(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == whole.content[0].text == message.content[0].text
    assert message.stop_reason == whole.stop_reason
    assert message.usage.output_tokens == whole.usage.output_tokens
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt


def test_stream_tool_use_input_json_deltas(claude, served):
    body = {
        "model": MODEL,
        "max_tokens": 140,
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        **GREEDY,
    }
    whole = claude.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    events = _raw_events(served[0], body)
    starts = [data for name, data in events if name == "content_block_start"]
    uses = [s for s in starts if s["content_block"]["type"] == "tool_use"]
    assert len(uses) == 1 and uses[0]["content_block"]["input"] == {}
    index = uses[0]["index"]
    partial = "".join(
        d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == index
    )
    [expected] = [b for b in whole.content if b.type == "tool_use"]
    assert json.loads(partial) == expected.input and uses[0]["content_block"]["name"] == expected.name
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    with claude.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as stream:
        seen = [e.type for e in stream]
        message = stream.get_final_message()
    assert "input_json" in seen and message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, use.input) == (expected.name, expected.input)


# ---------------------------------------------------------------------------------------- errors


def test_errors_are_anthropic_errors(claude, served):
    url, server = served
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=1000, messages=QUESTION)
    assert "lower max_tokens" in e.value.api_message and e.value.type == "invalid_request_error"
    assert e.value.request_id and e.value.request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError, match="this server takes text and tool_result blocks"):
        image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=QUESTION, tools=TOOLS, tool_choice={"type": "tool", "name": "x"}
        )
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus-5", max_tokens=4, messages=QUESTION)
    assert "model 'claude-opus-5' does not exist" in e.value.api_message and e.value.type == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-opus-5", messages=QUESTION)
    wrong = anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError, match="missing or wrong API key") as e:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert e.value.type == "authentication_error"
    server.draining = True
    try:
        with pytest.raises(anthropic.OverloadedError, match="shutting down"):
            claude.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    finally:
        server.draining = False

    # The raw wire: validation errors (max_tokens is required) in Anthropic's shape; x-api-key works.
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": QUESTION}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.headers["request-id"] == r.json()["request_id"]
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "field 'max_tokens' is required"},
        "request_id": r.headers["request-id"],
    }
    r = httpx.get(url + "/v1/messages/batches", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 1},
        headers={"x-api-key": KEY},
    )
    assert r.status_code == 200  # x-api-key on the OpenAI routes too; their errors stay OpenAI's:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "x", "messages": QUESTION}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found" and "type" not in r.json()
