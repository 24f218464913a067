"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) in the server.

Proves: the request declares every field of the ``openai`` package's ``ResponseCreateParams``;
input items (messages, function calls, their outputs) become the chat messages they mean; the
store keeps the most recently used responses and answers 404 for the others. Against the real
server (the bundled model with a ChatML template, uvicorn on a free port, the official ``openai``
client): ``responses.create`` answers what the same chat completion answers (text, usage,
``incomplete`` at ``max_output_tokens``) in a body that validates as openai's ``Response``; a
forced or named tool gives ``function_call`` items whose arguments parse and validate, and a
``function_call_output`` fed back renders as chat's tool message; ``responses.stream`` sends
OpenAI's event sequence, numbered, with deltas that join to the final text or arguments;
``responses.parse`` fills a pydantic model; ``previous_response_id`` chains through the store with
a prefix-cache hit, ``GET``/``DELETE`` work and unknown ids are 404s in OpenAI's error form; bad
requests are 400s naming the Responses field. The openai-agents SDK's default (Responses) model
runs an ``Agent`` with a function tool end to end: the tool runs with parsed arguments, its output
goes back to the model, and the structured final output comes back (``Runner.run`` and
``Runner.run_streamed``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from kvforge.tools.serve import protocol as p
from kvforge.tools.serve import responses
from kvforge.tools.serve.serving import ServingError
from tests.conftest import CHATML_TEMPLATE
from tests.tools.test_serve import KEY, MODEL, metric, post, running

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTION = "What is a list?"
INSTRUCTIONS = "Be brief."
GREEDY = dict(model=MODEL, temperature=0)
PERSON_FORMAT = {"type": "json_schema", "name": "person", "strict": True}
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}


# ------------------------------------------------------------------------------ translation


def test_request_declares_every_openai_field():
    declared = set(responses.ResponsesRequest.model_fields)
    missing = set(ResponseCreateParamsBase.__annotations__) - declared
    assert not missing, f"ResponsesRequest lacks openai's fields {sorted(missing)}"
    assert {"stream", "seed", "stop"} <= declared


def test_input_items_become_chat_messages():
    assert responses.input_messages("hi") == [{"role": "user", "content": "hi"}]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    text = [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": text},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call,
        {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert responses.input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": fn},
                {"id": "call_2", "type": "function", "function": {**fn, "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "Rain", "tool_call_id": "call_2"},
    ]
    assert responses.input_messages([call])[0] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": fn}],
    }
    cases = [
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "input[0].content[0]",
            "text only",
        ),
        ([{"type": "web_search_call", "id": "ws"}], "input[0].type", "'web_search_call'"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id", "call_id is required"),
        ([{"role": "tool", "content": "x"}], "input[0].role", "got 'tool'"),
    ]
    for items, param, words in cases:
        with pytest.raises(ServingError, match=words) as info:
            responses.input_messages(items)
        assert info.value.param == param and info.value.status == 400


def test_store_keeps_the_most_recently_used():
    store = responses.ResponseStore(limit=2)
    for name in "abc":
        if name == "c":
            store.get("a")  # read: now more recent than b
        store.put(name, responses.Stored({"id": name}, []))
    assert len(store) == 2 and store.get("a").response == {"id": "a"} and store.get("c").response == {"id": "c"}
    with pytest.raises(ServingError, match="'b' not found") as info:
        store.get("b", param="previous_response_id")
    assert (info.value.status, info.value.param, info.value.code) == (404, "previous_response_id", "response_not_found")
    assert store.delete("a") == {"id": "a", "object": "response", "deleted": True}
    with pytest.raises(ServingError):
        store.delete("a")
    with pytest.raises(ValueError, match="at least 1"):
        responses.ResponseStore(limit=0)


def test_chat_answer_becomes_output_items():
    call = p.ToolCall(id="call_1", function=p.FunctionCall(name="f", arguments='{"x": 1}'))

    def items(**message):
        choice = p.ChatCompletionResponseChoice(index=0, message=p.ChatResponseMessage(**message))
        return [item.model_dump() for item in responses.output_items(choice)]

    out = items(content="Hi.", tool_calls=[call], reasoning_content="Think.")  # a reasoning parser's field
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "Think."}] and out[0]["id"].startswith("rs_")
    assert out[1]["content"][0]["text"] == "Hi." and out[2]["call_id"] == "call_1" and out[2]["name"] == "f"
    assert [i["type"] for i in items(content=None, tool_calls=[call])] == ["function_call"]
    assert items(content="")[0]["content"][0]["text"] == ""  # no text nor call: one empty message


def test_chat_chunks_become_stream_events():
    """Reasoning, text and two calls (arguments in pieces) from chat chunks: each item opened,
    filled and closed in order, numbered, every event openai's typed event."""
    head = responses.ResponseObject(id="resp_1", created_at=0, status="in_progress", model=MODEL)
    stream = responses.EventStream(head, logprobs=False)

    def delta(**fields):
        return {"choices": [{"index": 0, "delta": fields}]}

    def call(index, **function):
        return {"index": index, "id": f"call_{index}" if "name" in function else None, "function": function}

    chunks = [
        delta(role="assistant", content=""),
        delta(reasoning_content="Let me "),
        delta(reasoning_content="see."),
        delta(content="Checking."),
        delta(tool_calls=[call(0, name="f", arguments='{"x":')]),
        delta(tool_calls=[call(0, arguments=" 1}")]),
        delta(tool_calls=[call(1, name="g", arguments="{}")]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
    ]
    events = [stream.lifecycle("response.created")]
    for chunk in chunks:
        events += stream.chunk(chunk)
    events += stream.close(empty_message=True)
    bodies = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [e.split("\n", 1)[0] for e in events] == [f"event: {b['type']}" for b in bodies]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    added, done = "response.output_item.added", "response.output_item.done"
    assert [b["type"] for b in bodies] == [
        "response.created",
        *(added, "response.reasoning_text.delta", "response.reasoning_text.delta"),
        *("response.reasoning_text.done", done),
        *(added, "response.content_part.added", "response.output_text.delta", "response.output_text.done"),
        *("response.content_part.done", done),
        *(added, "response.function_call_arguments.delta", "response.function_call_arguments.delta"),
        *("response.function_call_arguments.done", done),
        *(added, "response.function_call_arguments.delta", "response.function_call_arguments.done", done),
    ]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for body in bodies:
        adapter.validate_python(body)
    assert [b["output_index"] for b in bodies if b["type"] == done] == [0, 1, 2, 3]
    output = [item.model_dump() for item in stream.output]
    assert [(i["type"], i["status"]) for i in output] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ]
    assert output[0]["content"][0]["text"] == "Let me see." and output[1]["content"][0]["text"] == "Checking."
    assert (output[2]["call_id"], output[2]["arguments"]) == ("call_0", '{"x": 1}') and output[3]["name"] == "g"
    assert stream.finish_reason == "tool_calls" and stream.usage.input_tokens == 5 and stream.usage.total_tokens == 12


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def served(tiny_artifact, tmp_path_factory):
    """The bundled model with a ChatML chat template (copied; nothing recompiled), served."""
    out = tmp_path_factory.mktemp("tiny-chat-responses") / "artifact"
    shutil.copytree(tiny_artifact, out)
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    with running(out, max_queue=8) as (url, server):
        yield url, server


def chat_answer(client, messages, max_tokens, **kwargs):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def test_create_answers_what_chat_answers(served, client):
    r = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24, **GREEDY)
    c = chat_answer(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 24)
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert c.choices[0].finish_reason == "length"  # this model rarely stops by itself
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.id.startswith("resp_") and r.instructions == INSTRUCTIONS and r.max_output_tokens == 24
    # a stop string (kvforge's extension) ends it as chat's does: completed
    r = client.responses.create(input=QUESTION, max_output_tokens=60, extra_body={"stop": ["."]}, **GREEDY)
    c = chat_answer(client, [{"role": "user", "content": QUESTION}], 60, stop=["."])
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output_text == c.choices[0].message.content
    # the raw body validates strictly against openai's Response model
    body = {"input": QUESTION, "max_output_tokens": 4, "metadata": {"k": "v"}, **GREEDY}
    raw = post(served[0], "/v1/responses", body).json()
    parsed = Response.model_validate(raw, strict=False)
    assert parsed.object == "response" and parsed.metadata == {"k": "v"} and parsed.usage.output_tokens == 4


def test_logprobs_with_include(client):
    r = client.responses.create(
        input=QUESTION, max_output_tokens=5, include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY
    )
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 5 and "".join(lp.token for lp in logprobs) == r.output_text
    for lp in logprobs:
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token  # greedy: the top one


@pytest.mark.parametrize(
    ("tool_choice", "name"), [("required", None), ({"type": "function", "name": "get_time"}, "get_time")]
)
def test_forced_tool_call_and_its_output_fed_back(client, tool_choice, name):
    r = client.responses.create(
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=140,
        **GREEDY,
    )
    assert r.status == "completed" and r.tool_choice is not None
    [call] = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert name is None or call.name == name
    # the call and its output fed back: the prompt chat renders for the same history
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    again = client.responses.create(input=items, tools=TOOLS, max_output_tokens=12, **GREEDY)
    fn = {"name": call.name, "arguments": call.arguments}
    messages = [
        items[0],
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    c = chat_answer(client, messages, 12, tools=chat_tools)
    assert again.usage.input_tokens == c.usage.prompt_tokens
    assert again.output_text == (c.choices[0].message.content or "")


def event_types(events) -> list[str]:
    """The event types, with each run of deltas folded into one ``...delta+``."""
    out = []
    for e in events:
        kind = e.type + "+" if e.type.endswith(".delta") else e.type
        if not (out and out[-1] == kind and kind.endswith("+")):
            out.append(kind)
    return out


def test_stream_text_event_by_event(client):
    kwargs = dict(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=60, extra_body={"stop": ["."]}, **GREEDY)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert event_types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta+",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == final.output_text == whole.output_text
    assert events[-2].item.status == "completed" and events[-2].item.content[0].text == text
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    # cut by max_output_tokens: the last event is response.incomplete
    with client.responses.stream(input=QUESTION, max_output_tokens=3, **GREEDY) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.usage.output_tokens == 3


def test_stream_tool_call_event_by_event(client):
    kwargs = dict(
        input="What time is it?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=140,
        **GREEDY,
    )
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert event_types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta+",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_time" and added.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == done.arguments == whole.output[0].arguments
    assert done.call_id == added.call_id and final.output[0].arguments == arguments
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])


def test_stream_events_validate_as_openai_types(served):
    """The raw stream: an ``event:`` line per event, each body openai's typed event, no [DONE]."""
    body = {"input": QUESTION, "max_output_tokens": 3, "stream": True, **GREEDY}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{served[0]}/v1/responses", json=body, headers=headers) as r:
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data) and [d["type"] for d in data] == names
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in data:
        assert type(adapter.validate_python(event)).__name__.startswith("Response"), event


def test_parse_fills_a_pydantic_model(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=99)

    r = client.responses.parse(input="Describe a person.", text_format=Person, max_output_tokens=150, **GREEDY)
    assert isinstance(r.output_parsed, Person) and 0 <= r.output_parsed.age <= 99
    json_object = {"format": {"type": "json_object"}}
    seeded = dict(model=MODEL, temperature=0.8, extra_body={"seed": 2})  # seed: kvforge's extension
    r = client.responses.create(input="A JSON object.", text=json_object, max_output_tokens=200, **seeded)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict) and json.loads(r.output_text)


def test_store_chain_get_delete_and_404(served, client):
    first = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8, **GREEDY)
    second = client.responses.create(
        input="And a tuple?", instructions=INSTRUCTIONS, previous_response_id=first.id, max_output_tokens=8, **GREEDY
    )
    conversation = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a tuple?"},
    ]
    c = chat_answer(client, conversation, 8)
    assert second.previous_response_id == first.id and second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens
    # the chained prompt starts with the first one, which the prefix cache kept (16-token blocks)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "response_not_found" and first.id in info.value.body["message"]
    r = post(served[0], "/v1/responses", {"input": "x", "previous_response_id": first.id, **GREEDY})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(input=QUESTION, max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # a response chained onto the second continues its conversation (the first's turn included)
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, max_output_tokens=2, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    metrics = httpx.get(f"{served[0]}/metrics").text
    assert metric(metrics, "kvforge_requests_total", route="/v1/responses/{id}", status="404") >= 2
    assert metric(metrics, "kvforge_requests_total", route="/v1/responses", status="200") >= 3


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "function tools only"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]", "flat form"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice", "must be 'auto'"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "'xml' is not supported"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs a 'schema'"),
        ({"text": {"format": {**PERSON_FORMAT, "schema": {"type": 3}}}}, "text.format", "json_schema"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, "input[0].content[0]", "text only"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "lower max_output_tokens"),
        ({"top_logprobs": 2}, "top_logprobs", "include"),
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"model": "gpt-5"}, "model", "does not exist"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(served, body, param, words):
    r = post(served[0], "/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error


# ------------------------------------------------------------------------------ openai-agents


def test_openai_agents_runs_an_agent_with_a_function_tool(served):
    """The SDK's default model is its Responses model. Turn 1 is forced to call the tool; the tool
    then disables itself (``is_enabled``), so turn 2 (the call and its output fed back) answers with
    the structured final output, constrained by the ``json_schema`` text format the SDK sends."""
    agents = pytest.importorskip("agents")

    class Report(pydantic.BaseModel):
        city: Literal["Paris", "London"]
        sunny: bool

    calls: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """Weather of a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=MODEL,  # a name: the default provider gives its default model, the Responses one
        tools=[get_weather],
        output_type=Report,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=150
        ),
    )
    provider = agents.OpenAIProvider(openai_client=client)
    assert isinstance(provider.get_model(MODEL), agents.OpenAIResponsesModel)  # the SDK's default
    run = agents.RunConfig(model_provider=provider, tracing_disabled=True)

    async def both() -> tuple:
        whole = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3, run_config=run)
        calls.clear()  # the tool enabled again, for the streamed run (the SDK streams the Responses events)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3, run_config=run)
        kinds = [event.type async for event in streamed.stream_events()]
        return whole, streamed, kinds

    result, streamed, event_kinds = asyncio.run(both())
    assert calls == ["Paris"]  # the tool ran once, with the arguments parsed by the SDK
    for r in (result, streamed):
        kinds = [item.type for item in r.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
        assert r.new_items[1].output == "Sunny in Paris"
        assert isinstance(r.final_output, Report) and r.final_output.city == "Paris"
        assert len(r.raw_responses) == 2 and all(raw.usage.input_tokens > 0 for raw in r.raw_responses)
    assert streamed.final_output == result.final_output and "raw_response_event" in event_kinds
