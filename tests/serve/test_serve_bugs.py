"""The bugs of issue 40 ("Bugs found"), each fixed against the real server (the bundled model with a
ChatML template, uvicorn on a free port, the official ``openai`` client).

Proves: (1) ``top_logprobs: 20`` with a grammar (``json_schema``, ``json_object``, a forced tool) on
chat and completions, whole and streamed, answers 200 with only possible tokens among the top ones
(fewer than 20 where the grammar allows fewer), every logprob finite and never null, the stream's
equal to the whole answer's; the runtime's top logprobs leave out ``-inf`` tokens; (2) a forced
tool call cut by ``max_tokens`` answers the calls that closed, no ``<tool_call>`` markup in
``content``, ``finish_reason: "length"``, whole and streamed; (3) a forced tool whose parameters
schema lacks ``additionalProperties`` gets a closed call (``closed_objects`` closes each object
that lists properties, keeps what a schema says, never touches ``const``/``enum`` values);
(4) ``parallel_tool_calls`` unset with ``tool_choice: "required"`` writes one call and stops
(``finish_reason: "tool_calls"``), ``true`` allows more; (5) ``ignore_eos`` runs to ``max_tokens``
past the eos, ``min_tokens`` forbids the eos (and stop strings) until that many tokens, equal to
the runtime's ``SamplingParams``, more than ``max_tokens`` is a 400, and
``stream_options.continuous_usage_stats`` puts the usage so far on every chunk; (6) an exception
in any route (whole, streamed, ``GET /v1/models``) is OpenAI's error object (500, ``server_error``)
with the request id in the message and the ``x-request-id`` header (the client's own id kept),
logged with its traceback and counted in ``kvforge_unexpected_errors_total`` and
``kvforge_requests_total{status="500"}``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import replace

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.sampling import Sampler
from kvforge.tools.serve import app as serve_app
from kvforge.tools.serve import chat, completions, parsers, structured
from kvforge.tools.serve import protocol as p
from tests.conftest import CHATML_TEMPLATE
from tests.tools.test_serve import KEY, MODEL, metric, post, running, sse_events

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# LangChain's bind_tools form: no additionalProperties anywhere.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOSED = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # what the grammar writes


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    """The bundled model's artifact with a ChatML chat template (copied; nothing recompiled)."""
    out = tmp_path_factory.mktemp("tiny-chat-bugs") / "artifact"
    shutil.copytree(tiny_artifact, out)
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def served(chat_artifact):
    with running(chat_artifact, max_queue=8) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def engine(chat_artifact):
    with Engine.load(chat_artifact, threads=1) as e:
        yield e


# ------------------------------------------------------------------ 1. logprobs with a grammar


def _check_top(entries: list[tuple[float, list[float]]]) -> None:
    """(chosen logprob, top logprobs) per token: finite, sorted, at most 20; some position has fewer."""
    for chosen, top in entries:
        assert chosen is not None and math.isfinite(chosen)
        assert 1 <= len(top) <= 20 and all(math.isfinite(v) for v in top)
        assert top == sorted(top, reverse=True) and chosen == pytest.approx(top[0])  # greedy: the top one
    assert any(len(top) < 20 for _, top in entries), "the grammar never narrowed the choice: nothing tested"


def _chat_entries(content) -> list[tuple[float, list[float]]]:
    return [(t.logprob, [a.logprob for a in t.top_logprobs]) for t in content]


GRAMMARS = {
    "json_schema": dict(response_format=PERSON_FORMAT),
    "json_object": dict(response_format={"type": "json_object"}),
    "forced_tool": dict(tools=[WEATHER], tool_choice="required"),
}


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_chat_top_logprobs_20_with_a_grammar_whole_and_streamed(client, grammar):
    common = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, logprobs=True, top_logprobs=20)
    r = client.chat.completions.create(**common, **GRAMMARS[grammar])
    content = r.choices[0].logprobs.content
    _check_top(_chat_entries(content))
    if grammar == "json_schema":
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = []
    for chunk in client.chat.completions.create(**common, **GRAMMARS[grammar], stream=True):
        for c in chunk.choices:
            streamed.extend(c.logprobs.content if c.logprobs and c.logprobs.content else [])
    assert _chat_entries(streamed) == _chat_entries(content)  # never null, equal to the whole answer's


def test_completions_logprobs_20_with_a_grammar_whole_and_streamed(client, served):
    common = dict(
        model=MODEL, prompt="The for statement", max_tokens=60, temperature=0, logprobs=20,
        extra_body={"response_format": PERSON_FORMAT},
    )  # fmt: skip
    r = client.completions.create(**common)
    lp = r.choices[0].logprobs
    entries = [(v, sorted(top.values(), reverse=True)) for v, top in zip(lp.token_logprobs, lp.top_logprobs)]
    _check_top(entries)
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    # The raw stream: no null logprob, no -Infinity/NaN token in the JSON text.
    body = {k: v for k, v in common.items() if k != "extra_body"} | common["extra_body"] | {"stream": True}
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", served[0] + "/v1/completions", json=body, headers=auth) as s:
        lines = list(s.iter_lines())
    assert s.status_code == 200 and not any("Infinity" in line or "NaN" in line for line in lines)
    events = [e for e in sse_events(lines) if e != "[DONE]"]
    got = []
    for e in events:
        for c in e["choices"]:
            if c["logprobs"]:
                got.extend(zip(c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]))
    assert [v for v, _ in got] == lp.token_logprobs and None not in [v for v, _ in got]
    assert [top for _, top in got] == lp.top_logprobs


def test_runtime_top_logprobs_leave_out_impossible_tokens():
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, logprobs=5)
    logits = np.full(16, -np.inf, dtype=np.float32)
    logits[[3, 7]] = [1.0, 2.0]  # a grammar allows two tokens
    sampler = Sampler(params, [], 16)
    assert sampler(logits) == 7
    [entry] = sampler.logprobs
    assert [t for t, _ in entry.top] == [7, 3] and all(math.isfinite(v) for _, v in entry.top)
    assert entry.logprob == pytest.approx(entry.top[0][1])


# ------------------------------------------------------------------ 2-4. forced tool calls


def test_forced_call_cut_by_max_tokens_returns_the_closed_calls(client):
    # parallel_tool_calls true: the grammar lets this weak model call again and again until `length`.
    common = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=120,
        temperature=0,
    )  # fmt: skip  (one call takes this model ~95 tokens: the second is cut)
    r = client.chat.completions.create(**common)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), CLOSED)
    streamed, text, finish = {}, "", None
    for chunk in client.chat.completions.create(**common, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:  # the first piece names the call, the rest add arguments
                name, arguments = streamed.get(d.index, (None, ""))
                streamed[d.index] = (name or d.function.name, arguments + (d.function.arguments or ""))
    assert finish == "length" and text == ""  # no `<tool_call>{...` markup as content
    # Streamed, arguments go out as they are generated: the closed calls equal the whole answer's,
    # and the cut call (its pieces sent before the cut) is a prefix that does not parse.
    whole = [(c.function.name, c.function.arguments) for c in calls]
    assert [streamed[i] for i in sorted(streamed)][: len(whole)] == whole
    for _, arguments in [streamed[i] for i in sorted(streamed)][len(whole) :]:
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)
    # Cut inside the first call: no call, no content.
    r = client.chat.completions.create(**{**common, "max_tokens": 6})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None and r.choices[0].message.tool_calls is None


def test_forced_parse_drops_an_unclosed_block():
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "argu'
    content, calls = structured.parse_output(text, forced=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["f"]
    assert structured.parse_output(text)[0].strip().startswith("<tool_call>")  # auto: kept as the model wrote it
    stream = parsers.ChatFormat().output(parse_calls=True, forced=True).stream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert [d.content for d in deltas if d.content] == []  # no markup as content, streamed either
    assert {d.index for d in deltas if d.index is not None} == {0}  # the cut block never got as far as its arguments
    assert [c.complete for c in stream.calls] == [True]  # and the whole answer drops it


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_forced_tool_without_additional_properties_closes(client, served, tool_choice):
    # Neither additionalProperties nor parallel_tool_calls: LangChain's bind_tools(..., tool_choice=...).
    # A model keen on more keys (logit_bias +100 on ","): an open object would take key after key
    # until `length` and no call would come back; the closed one ends after "unit".
    [comma] = served[1].encode(",", special=False)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, max_tokens=200, temperature=0,
        logit_bias={str(comma): 100},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls  # parallel_tool_calls unset: one call, then the output ends
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, CLOSED)
    assert set(args) == {"city", "unit"}


def test_parallel_tool_calls_true_allows_several(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", parallel_tool_calls=True,
        max_tokens=240, temperature=0,
    )  # fmt: skip
    assert len(r.choices[0].message.tool_calls) > 1  # this model, let go on, calls again


def test_closed_objects_rule():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},  # a parameter named "properties" is not a schema map
            "point": {"$ref": "#/$defs/Point"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object"},  # a free-form dict: no properties listed, stays open
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "either": {"anyOf": [{"type": "object", "properties": {"b": {}}}, {"type": "null"}]},
            "const": {"const": {"type": "object", "properties": {}}},
        },
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    out = structured.closed_objects(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    props = out["properties"]
    assert props["properties"] == {"type": "string"}
    assert out["$defs"]["Point"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["extra"] and props["open"]["additionalProperties"] is True
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["const"] == schema["properties"]["const"]  # values are not schemas
    assert structured.closed_objects({"type": "object"}) == {"type": "object", "additionalProperties": False}


# ------------------------------------------------------------------ 5. ignore_eos, min_tokens, usage


def test_ignore_eos_and_min_tokens(client, engine):
    # This model rarely ends on its own: logit_bias +100 on the eos makes it the greedy choice at every step.
    [eos] = sorted(engine.eos_token_ids)
    bias = {str(eos): 100}
    greedy = SamplingParams(temperature=0.0, logit_bias={eos: 100})
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, logit_bias=bias)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1  # the eos ends it
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, logit_bias=bias, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20  # eos after eos, not an end
    expected = engine.chat(messages, max_new_tokens=20, sampling=replace(greedy, ignore_eos=True))
    assert expected.token_ids == [eos] * 20 and r.choices[0].message.content == expected.text == ""
    # min_tokens=7: the eos is forbidden for 7 tokens (the plain greedy ones), then drawn.
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, logit_bias=bias, extra_body={"min_tokens": 7}
    )
    expected = engine.chat(messages, max_new_tokens=20, sampling=replace(greedy, min_tokens=7))
    plain = engine.chat(messages, max_new_tokens=7, sampling=SamplingParams(temperature=0.0))
    assert expected.token_ids == [*plain.token_ids, eos] and expected.finish_reason == "stop"
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected.text == plain.text
    # Completions take both too.
    for extra, tokens, reason in (({"ignore_eos": True}, 12, "length"), ({"min_tokens": 5}, 6, "stop")):
        r = client.completions.create(
            model=MODEL, prompt="The for statement", max_tokens=12, temperature=0, logit_bias=bias, extra_body=extra
        )
        assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (tokens, reason), extra


def test_min_tokens_holds_stop_strings_and_is_checked(served, engine):
    base = SamplingParams(temperature=0.0)
    free = engine.generate(["The for statement"], max_new_tokens=20, sampling=base)[0]
    stop = free.text.strip().split()[1]  # a word the answer writes early
    early = engine.generate(["The for statement"], max_new_tokens=20, sampling=base, stop=[stop])[0]
    assert early.stop_string == stop
    late = engine.generate(
        ["The for statement"], max_new_tokens=20, sampling=SamplingParams(temperature=0.0, min_tokens=18), stop=[stop]
    )[0]
    assert len(late.token_ids) >= 18 and late.text.startswith(early.text + stop)
    r = post(served[0], "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "min_tokens=5 is more than max_tokens=4" in r.json()["error"]["message"]
    for bad in ({"min_tokens": -1}, {"ignore_eos": "yes"}):
        r = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


def test_min_tokens_yields_to_a_finished_grammar():
    # Only eos (id 0) allowed (the output's grammar is complete): the eos is drawn, not refused.
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, min_tokens=3)
    sampler = Sampler(params, [], 8, eos_token_ids=[0])
    logits = np.array([5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    assert not sampler.plain_greedy and sampler(logits) == 1  # eos forbidden for the first 3 draws
    only_eos = np.full(8, -np.inf, dtype=np.float32)
    only_eos[0] = 0.0
    assert sampler(only_eos) == 0


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_on_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True, stream_options=options
            )
        )
    else:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt="The for statement", max_tokens=12, temperature=0, stream=True,
                stream_options=options,
            )
        )  # fmt: skip
    assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 2
    prompt = chunks[-1].usage.prompt_tokens
    for c in chunks:
        assert c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens


# ------------------------------------------------------------------ 6. the catch-all


def _boom(*args, **kwargs):
    raise RuntimeError("kaboom")


async def _boom_stream(server, req, prep, flight):
    yield "data: {}\n\n"
    raise RuntimeError("kaboom mid-stream")


def test_unexpected_exceptions_are_error_objects_with_a_request_id(served, client, monkeypatch, caplog):
    url, _ = served
    before = httpx.get(url + "/metrics").text
    monkeypatch.setattr(chat, "full", _boom)
    with caplog.at_level(logging.ERROR, logger="kvforge.serve"), pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    error = info.value
    assert error.status_code == 500 and error.request_id and error.request_id.startswith("req_")
    body = error.response.json()["error"]
    assert body["type"] == "server_error" and body["code"] == "internal_error"
    assert "RuntimeError: kaboom" in body["message"] and error.request_id in body["message"]
    [record] = [r for r in caplog.records if error.request_id in r.getMessage()]
    assert record.exc_info and "kaboom" in str(record.exc_info[1])  # logged with its traceback
    # The client's own request id is kept; a route outside chat too.
    monkeypatch.setattr(completions, "prepare", _boom)
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": "mine-42"}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
    assert r.status_code == 500 and r.headers["x-request-id"] == "mine-42" and "mine-42" in r.json()["error"]["message"]
    monkeypatch.setattr(p, "ModelList", _boom)
    r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"].startswith("req_")
    # Streamed: the error is the last event before [DONE].
    monkeypatch.setattr(chat, "stream", _boom_stream)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}) as s:
        events = sse_events(s.iter_lines())
        request_id = s.headers["x-request-id"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "kaboom mid-stream" in events[-2]["error"]["message"] and request_id in events[-2]["error"]["message"]
    after = httpx.get(url + "/metrics").text
    for route, count in (("/v1/chat/completions", 2), ("/v1/completions", 1), ("/v1/models", 1)):
        got = metric(after, "kvforge_unexpected_errors_total", route=route)
        assert got == metric(before, "kvforge_unexpected_errors_total", route=route) + count, route
    got = metric(after, "kvforge_requests_total", route="/v1/models", status="500")
    assert got == metric(before, "kvforge_requests_total", route="/v1/models", status="500") + 1
    # Every answer carries a request id; the shape is chosen by route.
    assert httpx.get(url + "/health").headers["x-request-id"].startswith("req_")
    assert serve_app.error_shape_for("/v1/chat/completions") is serve_app.openai_error
