"""Structured output and tool calls in the server (tools/serve/structured.py and its hooks).

Proves: ``<tool_call>`` blocks parse into OpenAI tool calls (single, parallel, with content around,
a malformed block kept as content), and the incremental parser fed one character at a time gives
what the whole-text parser gives; a template that reads ``tools`` gets them as transformers passes
them and one that ignores them gets them in the system message; against the real server (the
bundled model, uvicorn on a free port, the official ``openai`` client): ``response_format``
``json_schema`` and ``json_object`` in chat and completions give JSON that validates, the client's
``chat.completions.parse`` fills a pydantic model, ``tool_choice`` ``required`` and a named function
give valid calls with ``finish_reason: "tool_calls"`` (whole and streamed, the streamed calls equal
to the whole ones), ``none`` gives none, and a bad schema, regex, tool or tool_choice is a 400 naming
the field and the problem before anything runs.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import jsonschema
import pydantic
import pytest

from kvforge.runtime.chat import ChatTemplate
from kvforge.tools.serve import parsers, structured
from kvforge.tools.serve.serving import ServingError
from tests.conftest import CHATML_TEMPLATE
from tests.tools.test_serve import KEY, MODEL, running

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------------------ parsing


def test_parse_single_parallel_and_content():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    content, calls = structured.parse_output(one)
    assert content is None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    two = "Let me check.\n" + one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    content, calls = structured.parse_output(two)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    bad = "<tool_call>not json</tool_call> and <tool_ text"
    assert structured.parse_output(bad) == (bad, [])
    assert structured.parse_output("plain <b>text</b>") == ("plain <b>text</b>", [])


def test_streamed_parsing_equals_whole():
    text = (
        'Sure <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call> done <tool_c'
    )
    whole_content, whole_calls = structured.parse_output(text)
    stream = parsers.ChatFormat().output(parse_calls=True).stream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    content = "".join(d.content for d in deltas if d.content)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is not None:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments or ""
    assert content == whole_content == "Sure done <tool_c"
    assert [{"name": n, "arguments": a} for n, a in calls.values()] == [c["function"] for c in whole_calls]


def test_plan_refusals():
    cases = [
        (dict(response_format={"type": "xml"}), "response_format", "type 'xml' is not supported"),
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema must be"),
        (dict(tools=[{"type": "function"}]), "tools[0]", "tools[0] must be"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "must be 'auto'"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(ServingError, match=re.escape(message)) as info:
            structured.plan(kwargs.pop("response_format", None), **kwargs)
        assert info.value.param == param
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    with pytest.raises(ServingError, match=r"tools\[0\] \(f\) parameters: json_schema is not accepted") as info:
        structured.plan(None, [bad_tool])
    assert info.value.param == "tools[0].function.parameters"


def test_tools_reach_the_template():
    reads = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}")
    ignores = ChatTemplate(CHATML_TEMPLATE)
    plan = structured.plan(None, TOOLS, "auto")
    messages, tools = structured.chat_messages([dict(m) for m in MESSAGES], [None], plan, reads)
    assert tools == TOOLS and reads.render(messages, tools=tools).startswith("[get_weather][get_time]")
    messages, tools = structured.chat_messages([dict(m) for m in MESSAGES], [None], plan, ignores)
    assert tools is None and messages[0]["role"] == "system" and '"name": "get_time"' in messages[0]["content"]
    assert messages[1] == MESSAGES[0]


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    """The bundled model's artifact with a ChatML chat template (copied; nothing recompiled)."""
    out = tmp_path_factory.mktemp("tiny-chat") / "artifact"
    shutil.copytree(tiny_artifact, out)
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def served(chat_artifact):
    with running(chat_artifact, max_queue=8) as (url, server):
        yield url, server


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_and_completions_response_format(client):
    for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=3, n=2)):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=120, response_format=_schema_format(PERSON), **kwargs
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8, seed=1, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL, prompt="The for statement", max_tokens=120, extra_body={"response_format": _schema_format(PERSON)}
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_openai_parse_with_pydantic(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=99)
        role: str = pydantic.Field(pattern="^(admin|user)$")

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=150, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99 and person.role in ("admin", "user")


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])],
)
def test_forced_tool_calls_whole_and_streamed(client, tool_choice, names):
    # One call (parallel_tool_calls false): this weak model, let free, calls again and again until `length`.
    common = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=140, parallel_tool_calls=False
    )
    r = client.chat.completions.create(temperature=0, **common)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if names is not None:
        assert [c.function.name for c in choice.message.tool_calls] == names
    streamed, finish, pieces = {}, None, 0
    for chunk in client.chat.completions.create(temperature=0, stream=True, **common):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:  # the name first, then the arguments as generated
                name, args = streamed.get(d.index, (None, ""))
                streamed[d.index] = (name or d.function.name, args + (d.function.arguments or ""))
                pieces += bool(d.function.arguments)
    assert finish == "tool_calls"
    assert pieces > len(streamed), "the arguments arrive in pieces as they are generated, not whole at the end"
    assert [streamed[i] for i in sorted(streamed)] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_tool_choice_none_and_auto(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=140,
        temperature=0,
        response_format=_schema_format(PERSON),
        parallel_tool_calls=False,
    )  # auto with a schema: the schema's JSON or one tool call
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1
        jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), SCHEMAS[m.tool_calls[0].function.name])
    else:
        jsonschema.validate(json.loads(m.content), PERSON)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": _schema_format({"type": "objectx"})}, "response_format", "json_schema is not accepted"),
        ({"response_format": {"type": "regex", "regex": "a(b"}}, "response_format", "unclosed group"),
        ({"response_format": {"type": "grammar", "grammar": "start: nope"}}, "response_format", 'unknown name: "nope"'),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "tools[0]", "f"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "'x'"),
    ],
)
def test_bad_requests_are_400(served, body, param, message):
    r = httpx.post(
        f"{served[0]}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"].startswith(param)
