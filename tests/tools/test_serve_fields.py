"""Every field of OpenAI's request schemas, as the official ``openai`` client sends them, against a
real server (tests/tools/test_serve.py's ``running``).

Proves: (1) the request models declare every field of the installed ``openai`` package's
``completion_create_params`` TypedDicts (derived from them, so a new client version's fields fail
here until they are handled), and each field is implemented, ignored or refused-unless-a-no-op;
(2) a request with every documented field at once goes through the official client on both routes
and answers exactly what the same request without the ignored fields answers; (3) each ignored field
is in docs/serving.md's table and counted in ``kvforge_ignored_fields_total{field}``; (4) a field outside
the schema is ignored, logged as a warning and named in ``x-kvforge-ignored-fields`` (whole and
streamed), and ``--strict-fields`` (``build_app(strict_fields=True)`` and the CLI) refuses it with a
400 naming it; (5) values kvforge cannot honour (audio, tools, a JSON response format, ``suffix``)
are 400s naming the field while their no-op values pass; (6) ``logit_bias`` +100 forces and -100
forbids a token on both routes, equal to the runtime's ``SamplingParams(logit_bias=...)``, and an
out-of-vocabulary id or a bias outside [-100, 100] is a 400; (7) a chat ``prediction`` (right, half
right, wrong; a string or text parts) leaves the output identical and reports
``completion_tokens_details``; (8) every response (whole and streamed, both routes, ``/v1/models``)
parses into the client's types with nothing in ``model_extra`` but vLLM's documented ``stop_reason``
and ``max_model_len``; a JSON null means a field's default.
"""

from __future__ import annotations

import logging
import signal
import typing
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionPredictionContentParam,
    ChatCompletionStreamOptionsParam,
)
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel

from kvforge.runtime import SamplingParams
from kvforge.tools.cli import build_parser
from kvforge.tools.serve import fields, serving
from kvforge.tools.serve import protocol as p
from tests.tools.test_serve import KEY, MESSAGES, MODEL, PROMPTS, free_port, metric, post, running, start_cli_server

SERVING_DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
# vLLM's documented extensions (reasoning_content: docs/serving.md), and kvforge's usage.speculative (README)
VENDOR_FIELDS = {"stop_reason", "max_model_len", "speculative", "reasoning_content", "prompt_logprobs"}

# Fields that change generation (each mapped to the runtime or the response).
IMPLEMENTED = {
    "chat": {
        "messages",
        "model",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
    },
    "completions": {
        "model",
        "prompt",
        "best_of",  # = n only
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
    },
}
# kvforge's own fields beyond OpenAI's schema (as vLLM's completions take response_format too), and
# vLLM's extensions (docs/serving.md's table of them, checked below).
VLLM_EXTENSIONS = {"ignore_eos", "min_tokens", "stream_options.continuous_usage_stats"}
EXTENSIONS = {
    "chat": {"ignore_eos", "min_tokens", "chat_template_kwargs"},
    "completions": {"response_format", "ignore_eos", "min_tokens", "prompt_logprobs"},
}
# Fields refused with a 400 unless set to their no-op value.
REFUSED = {
    "chat": {"audio", "function_call", "functions"},
    "completions": {"suffix"},
}


def openai_fields(module) -> set[str]:
    """The request fields of one route in the installed client (streaming and not)."""
    names = set()
    for typed in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming):
        names |= set(typing.get_type_hints(typed))
    return names


ROUTES = {
    "chat": (chat_params, p.ChatCompletionRequest),
    "completions": (completion_params, p.CompletionRequest),
}

# The API reference's fields, every one at once (values a client would send; the no-op value for
# the fields kvforge refuses otherwise). seed + temperature > 0: a reproducible sampled answer.
CHAT_EVERYTHING = {
    "messages": MESSAGES,
    "model": MODEL,
    "audio": None,
    "frequency_penalty": 0.3,
    "function_call": "none",
    "functions": [],
    "logit_bias": {"7": 2.5, "11": -100},
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 10,
    "max_tokens": 10,
    "metadata": {"team": "docs"},
    "modalities": ["text"],
    "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "A list is a mutable sequence."},
    "presence_penalty": 0.2,
    "prompt_cache_key": "session-1",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "user-1234",
    "seed": 11,
    "service_tier": "auto",
    "stop": ["\n\n\n"],
    "store": False,
    "stream": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.8,
    "tool_choice": "none",
    "tools": [],
    "top_p": 0.95,
    "user": "user-1234",
    "verbosity": "medium",
    "web_search_options": {"search_context_size": "low"},
}
COMPLETION_EVERYTHING = {
    "model": MODEL,
    "prompt": PROMPTS[0],
    "best_of": 3,
    "echo": True,
    "frequency_penalty": 0.3,
    "logit_bias": {"7": 2.5, "11": -100},
    "logprobs": None,  # echo with logprobs asks for prompt logprobs (a score graph: tests/serve/test_eval_api.py)
    "max_tokens": 10,
    "n": 2,
    "presence_penalty": 0.2,
    "seed": 11,
    "stop": ["\n\n\n"],
    "stream": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "suffix": None,
    "temperature": 0.8,
    "top_p": 0.95,
    "user": "user-1234",
}


@pytest.fixture(scope="module")
def served(llama_chat_artifact):
    with running(llama_chat_artifact, max_queue=4) as (url, server):
        yield url, server


def assert_no_lost_fields(obj, where: str = "response") -> None:
    """Nothing in any ``model_extra`` of a parsed client object but the vendor fields."""
    if isinstance(obj, BaseModel):
        extra = set(obj.model_extra or {}) - VENDOR_FIELDS
        assert not extra, f"{where} ({type(obj).__name__}) has fields the client's type lacks: {sorted(extra)}"
        for name in type(obj).model_fields:
            assert_no_lost_fields(getattr(obj, name), f"{where}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            assert_no_lost_fields(item, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            assert_no_lost_fields(item, f"{where}[{key!r}]")


def without(request: dict, names) -> dict:
    return {k: v for k, v in request.items() if k not in names}


# ------------------------------------------------------------------------------------ the schema


@pytest.mark.parametrize("route", list(ROUTES))
def test_request_models_declare_every_openai_field(route):
    module, model = ROUTES[route]
    theirs = openai_fields(module)
    ours = set(model.model_fields)
    assert theirs - ours == set(), f"/{route}: the openai client has fields the server does not declare"
    ignored = {name for name in fields.IGNORED if "." not in name} & theirs
    groups = [IMPLEMENTED[route], REFUSED[route], ignored]
    for name in sorted(theirs):
        assert sum(name in g for g in groups) == 1, f"{name}: not in exactly one of implemented/refused/ignored"
    extra = ours - theirs - EXTENSIONS[route]
    assert extra == set(), f"/{route}: fields the openai client does not have: {sorted(extra)}"
    everything = CHAT_EVERYTHING if route == "chat" else COMPLETION_EVERYTHING
    assert set(everything) == theirs, "the every-field request must set every field"
    assert set(typing.get_type_hints(ChatCompletionStreamOptionsParam)) <= set(p.StreamOptions.model_fields)
    assert set(typing.get_type_hints(ChatCompletionPredictionContentParam)) <= set(p.PredictionContent.model_fields)


def test_every_message_role_of_the_client_is_accepted():
    ours = set(typing.get_args(p.ChatMessage.model_fields["role"].annotation))
    for message in typing.get_args(ChatCompletionMessageParam):
        [role] = typing.get_args(typing.get_type_hints(message)["role"])
        assert role in ours, f"{message.__name__}: role {role!r} refused"
        fields_of = set(typing.get_type_hints(message))
        msg = p.ChatMessage.model_validate({k: None for k in fields_of} | {"role": role, "content": "x"})
        assert set(msg.model_dump()) >= fields_of  # every key kept (extra keys allowed), none refused


def test_each_ignored_field_is_in_the_serving_doc_table():
    text = SERVING_DOC.read_text(encoding="utf-8")
    for name, what in fields.IGNORED.items():
        assert f"| `{name}` |" in text, f"docs/serving.md lacks the ignored field {name}"
        assert what, name
    for name in VLLM_EXTENSIONS:  # implemented (tests/serve/test_serve_bugs.py), and documented
        assert f"| `{name}` |" in text, f"docs/serving.md lacks vLLM's extension {name}"
        model = p.StreamOptions if name.startswith("stream_options.") else p.ChatCompletionRequest
        assert name.split(".")[-1] in model.model_fields, name


# ------------------------------------------------------------------------------- all at once


def test_chat_with_every_field_answers_as_without_the_ignored_ones(client, served, engine):
    url, _ = served
    before = httpx.get(url + "/metrics").text
    r = client.chat.completions.create(**CHAT_EVERYTHING)
    assert_no_lost_fields(r)
    # Without the ignored and no-op fields, and without the prediction: the same answer.
    plain = without(CHAT_EVERYTHING, set(fields.IGNORED) | REFUSED["chat"] | {"prediction", "stream_options"})
    ref = client.chat.completions.create(**plain)
    assert [c.message.content for c in r.choices] == [c.message.content for c in ref.choices]
    assert r.choices[0].message.content != r.choices[1].message.content or r.choices[0].finish_reason == "stop"
    # The second request may take its prompt from the prefix cache: cached_tokens differs, not the counts.
    details = {"completion_tokens_details", "prompt_tokens_details"}
    assert r.usage.model_dump(exclude=details) == ref.usage.model_dump(exclude=details)
    # The runtime's answer for the implemented fields (choice 0: seed 11).
    expected = engine.chat(
        MESSAGES,
        max_new_tokens=10,
        sampling=SamplingParams(
            temperature=0.8,
            top_p=0.95,
            seed=11,
            presence_penalty=0.2,
            frequency_penalty=0.3,
            logprobs=2,
            logit_bias={7: 2.5, 11: -100},
        ),
        stop=["\n\n\n"],
    )
    assert r.choices[0].message.content == expected.text
    assert [t.token for t in r.choices[0].logprobs.content] == [
        engine.tokenizer.decode([t]) for t in expected.token_ids
    ]
    after = httpx.get(url + "/metrics").text
    for name in fields.ignored_fields(p.ChatCompletionRequest.model_validate(CHAT_EVERYTHING)):
        assert metric(after, "kvforge_ignored_fields_total", field=name) == 1 + metric(
            before, "kvforge_ignored_fields_total", field=name
        ), name


def test_completions_with_every_field_answers_as_without_the_ignored_ones(client, engine):
    r = client.completions.create(**COMPLETION_EVERYTHING)
    assert_no_lost_fields(r)
    ref = client.completions.create(**without(COMPLETION_EVERYTHING, {"user", "stream_options", "suffix"}))
    assert [c.text for c in r.choices] == [c.text for c in ref.choices]
    params = SamplingParams(
        temperature=0.8, top_p=0.95, presence_penalty=0.2, frequency_penalty=0.3, logit_bias={7: 2.5, 11: -100}
    )
    best, candidates = best_of(engine, PROMPTS[0], params, seed=11, k=3, n=2, max_new_tokens=10, stop=["\n\n\n"])
    assert [c.text for c in r.choices] == [PROMPTS[0] + b.text for b in best]  # echo
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)


def best_of(engine, prompt, params, *, seed, k, n, **kw):
    """The runtime's k seeded candidates (seed + j) and the n with the highest mean logprob."""
    candidates = [
        engine.generate([prompt], sampling=replace(params, seed=seed + j, logprobs=0), **kw)[0] for j in range(k)
    ]
    mean = [sum(lp.logprob for lp in c.logprobs) / len(c.logprobs) for c in candidates]
    order = sorted(range(k), key=lambda j: (-mean[j], j))
    return [candidates[j] for j in order[:n]], candidates


def test_best_of_returns_the_n_best_candidates(client, engine):
    params = SamplingParams(temperature=1.2)
    best, candidates = best_of(engine, PROMPTS[1], params, seed=3, k=4, n=2, max_new_tokens=8)
    assert len({c.text for c in candidates}) > 2  # the ranking has something to choose from
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.2, seed=3, best_of=4, n=2, logprobs=1
    )
    assert [c.text for c in r.choices] == [b.text for b in best] and [c.index for c in r.choices] == [0, 1]
    assert [c.logprobs.token_logprobs for c in r.choices] == [[lp.logprob for lp in b.logprobs] for b in best]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)


def test_every_ignored_field_is_counted(served):
    url, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    body |= {k: v for k, v in CHAT_EVERYTHING.items() if k in fields.IGNORED}
    body["stream_options"] = {"include_obfuscation": True}
    before = httpx.get(url + "/metrics").text
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert fields.IGNORED_HEADER not in r.headers  # documented fields are not "unknown"
    after = httpx.get(url + "/metrics").text
    for name in fields.IGNORED:
        got = metric(after, "kvforge_ignored_fields_total", field=name)
        assert got == metric(before, "kvforge_ignored_fields_total", field=name) + 1, name


def test_null_means_the_default(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    nulls = {"n": None, "echo": None, "stream": None, "frequency_penalty": None, "presence_penalty": None}
    a, b = post(url, "/v1/completions", body), post(url, "/v1/completions", body | nulls)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"] == b.json()["choices"]


# --------------------------------------------------------------------------- unknown fields


def test_unknown_fields_are_ignored_warned_and_named(served, caplog):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    before = httpx.get(url + "/metrics").text
    with caplog.at_level(logging.WARNING, logger="kvforge.serve"):
        r = post(url, "/v1/completions", body | {"frobnicate": 1, "stream_options": {"include_usage": True, "x": 2}})
    assert r.status_code == 200, r.text
    assert r.headers[fields.IGNORED_HEADER] == "frobnicate, stream_options.x"
    assert r.json()["choices"] == post(url, "/v1/completions", body).json()["choices"]
    assert any("frobnicate" in m and "--strict-fields" in m for m in caplog.messages), caplog.messages
    after = httpx.get(url + "/metrics").text
    assert metric(after, "kvforge_unknown_fields_total") == metric(before, "kvforge_unknown_fields_total") + 2
    # Streamed chat too; a name with control characters is escaped, not written raw into the header.
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True, "top_k": 5, "a\nb": 1}
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {KEY}"}) as s:
        assert s.status_code == 200 and s.headers[fields.IGNORED_HEADER] == "top_k, a\\nb"
        assert list(s.iter_lines())[-2] == "data: [DONE]"


def test_strict_fields_refuses_unknown_fields(llama_chat_artifact):
    with running(llama_chat_artifact, max_queue=0, strict_fields=True) as (url, _):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = post(url, "/v1/completions", body | {"frobnicate": 1})
        error = r.json()["error"]
        assert r.status_code == 400 and "unknown field 'frobnicate': remove it" in error["message"]
        assert "--strict-fields" in error["message"]
        assert error["param"] == "frobnicate" and error["code"] == "unknown_field"
        r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream_options": {"y": 1}})
        assert r.status_code == 400 and "'stream_options.y'" in r.json()["error"]["message"]
        # Documented fields, ignored ones included, still pass.
        assert post(url, "/v1/completions", body | {"user": "u", "logit_bias": {"3": 1}}).status_code == 200


def test_cli_strict_fields_flag(llama_chat_artifact):
    assert build_parser().parse_args(["serve", "out", "--strict-fields"]).strict_fields
    assert not build_parser().parse_args(["serve", "out"]).strict_fields
    port = free_port()
    proc = start_cli_server([str(llama_chat_artifact), "--strict-fields", "--threads", "1"], port)
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"model": Path(llama_chat_artifact).name, "prompt": "hi", "max_tokens": 2, "frobnicate": 1}
        r = post(url, "/v1/completions", body, key=None)
        assert r.status_code == 400 and "unknown field 'frobnicate'" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# ------------------------------------------------------------------------------ refused values


REFUSALS = [
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "['audio']"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
    ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "g"}}]}, "tools[0]", "'function'"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "functions: []"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call", "deprecated"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", ""),
    ("/v1/chat/completions", {"prediction": {"type": "draft", "content": "x"}}, "prediction", "'content'"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": [{"type": "image"}]}}, "prediction", ""),
    ("/v1/completions", {"suffix": "}"}, "suffix", "fill-in-the-middle"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "logprobs", "no score graph"),  # compiled without one
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of", "best_of=1 is less than n=2"),
    ("/v1/completions", {"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
]


@pytest.mark.parametrize(
    ("route", "extra", "param", "words"), REFUSALS, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSALS)]
)
def test_values_kvforge_cannot_honour_are_400_naming_the_field(served, route, extra, param, words):
    url, _ = served
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": "hi"}
    r = post(url, route, base | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_no_op_values_pass(served):
    url, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    ref = post(url, "/v1/chat/completions", body).json()["choices"]
    no_ops = {
        "tools": [],
        "tool_choice": "none",
        "functions": [],
        "function_call": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "audio": None,
        "parallel_tool_calls": True,
    }
    r = post(url, "/v1/chat/completions", body | no_ops)
    assert r.status_code == 200 and r.json()["choices"] == ref, r.text
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "suffix": "", "best_of": 1})
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------------- logit_bias


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, **extra)


def test_logit_bias_forces_and_forbids_on_both_routes(client, engine):
    [plain] = engine.generate(PROMPTS[:1], max_new_tokens=6, sampling=greedy())
    first = plain.token_ids[0]
    forced = next(t for t in range(100, 200) if t not in engine.eos_token_ids and t != first)
    for bias, check in (
        ({forced: 100}, lambda ids: ids == [forced] * 6),
        ({first: -100}, lambda ids: first not in ids),
    ):
        [expected] = engine.generate(PROMPTS[:1], max_new_tokens=6, sampling=greedy(logit_bias=bias))
        assert check(expected.token_ids), (bias, expected.token_ids)
        wire = {str(t): b for t, b in bias.items()}
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias=wire)
        assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.token_ids)
        streamed = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias=wire, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
        chat_expected = engine.chat(MESSAGES, max_new_tokens=6, sampling=greedy(logit_bias=bias))
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logit_bias=wire, logprobs=True
        )
        ids = [engine.tokenizer.encode(t.token, add_special_tokens=False) for t in r.choices[0].logprobs.content]
        assert r.choices[0].message.content == chat_expected.text and check(chat_expected.token_ids)
        assert len(ids) == len(chat_expected.token_ids)


BIAS_ERRORS = [
    ({"999999": 5}, "outside this model's vocabulary [0, "),
    ({"-1": 5}, "logit_bias has the key '-1'"),
    ({"abc": 5}, "logit_bias has the key 'abc'"),
    ({"3": 101}, "logit_bias[3]=101"),
    ({"3": -100.5}, "in [-100, 100]"),
]


@pytest.mark.parametrize(("bias", "words"), BIAS_ERRORS, ids=[b[1][:24] for b in BIAS_ERRORS])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_bad_ids_and_values_are_400(served, engine, route, bias, words):
    url, _ = served
    body = {"model": MODEL, "max_tokens": 2, "logit_bias": bias}
    body |= {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": "hi"}
    r = post(url, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and words in error["message"], error
    if "vocabulary" in words:
        assert f"[0, {engine.vocab_size})" in error["message"]


# -------------------------------------------------------------------------------- predictions


def test_prediction_leaves_the_output_identical(client, engine):
    expected = engine.chat(MESSAGES, max_new_tokens=16, sampling=greedy())
    half = expected.text[: len(expected.text) // 2] + " something else entirely"
    predictions = {
        "right": expected.text,
        "half right": half,
        "wrong": "def f(x):\n    return x * 2\n",
        "parts": [{"type": "text", "text": expected.text[:5]}, {"type": "text", "text": expected.text[5:]}],
        "empty": "",
    }
    for what, content in predictions.items():
        for stream in (False, True):
            kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
            kw["prediction"] = {"type": "content", "content": content}
            if stream:
                chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                u = chunks[-1].usage
            else:
                r = client.chat.completions.create(**kw)
                assert_no_lost_fields(r)
                text, u = r.choices[0].message.content, r.usage
            assert text == expected.text, (what, stream)
            assert u.completion_tokens == len(expected.token_ids)
            details = u.completion_tokens_details
            accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
            assert isinstance(accepted, int) and isinstance(rejected, int) and accepted >= 0 and rejected >= 0
            # serve's default speculative="prediction" verified the draft (the text re-tokenized: not
            # always the answer's own ids on this random model, so some tokens are rejected)
            if what == "right":
                assert accepted >= 1, (stream, accepted, rejected)


def test_with_prediction_is_the_one_hand_over():
    params = SamplingParams(temperature=0.0)
    assert serving.with_prediction(params, []) is params
    handed = serving.with_prediction(params, [5, 6, 7])
    assert handed.prediction == (5, 6, 7) and handed.temperature == 0.0


# ------------------------------------------------------------------------ responses as types


def test_every_response_parses_into_the_clients_types(client):
    assert_no_lost_fields(client.models.list())
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=1)
    assert_no_lost_fields(client.chat.completions.create(**chat))
    for chunk in client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}):
        assert_no_lost_fields(chunk, "chunk")
    text = dict(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, n=2, logprobs=1, stop=["\n"])
    assert_no_lost_fields(client.completions.create(**text))
    for chunk in client.completions.create(**text, stream=True, stream_options={"include_usage": True}):
        assert_no_lost_fields(chunk, "chunk")
