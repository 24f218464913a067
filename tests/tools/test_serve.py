"""The OpenAI-compatible server, driven over real HTTP by the official ``openai`` client (and httpx
for raw requests).

Proves: greedy completions and chat (whole and streamed) equal ``Engine.generate``/``Engine.chat``
on the same inputs, with exact ``usage``; ``n``, seeds, stop strings and logprobs map to the
runtime's; every bad input answers OpenAI's error object with the right status and a message that
says what to change (400 malformed JSON / unknown model / invalid values / too long a prompt, 401
key, 404 route, 429 full queue, 503 draining); a client that disconnects mid-stream has its
sequence cancelled and its row freed; ``/metrics`` counts what was served; SIGTERM drains (the
running stream completes) and the process exits 0.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvforge.runtime import Engine, SamplingParams
from kvforge.tools.serve.app import REPLICA_HEADER, build_app
from kvforge.tools.serve.runner import DrainingServer
from kvforge.tools.serve.serving import ModelServer
from tests.helpers import KEY

MODEL = "tiny-chat"
PROMPTS = ["The for statement", "A list is a mutable"]
GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli_server(args: list[str], port: int, timeout: float = 60.0) -> subprocess.Popen:
    """``python -m kvforge.tools.cli serve ARGS --port PORT`` in a process of its own (stdout and
    stderr piped, as text), returned once its ``/health`` answers 200; fails with its output if it
    exits or is not up within ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "kvforge.tools.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        time.sleep(0.1)


def stream_joins_to(client, prompt: str, expected) -> list:
    """Stream a greedy completion of ``prompt`` (16 tokens, usage included) and check it joins to
    ``expected`` (a GenerationResult) with one finish reason, the usage's count last; the chunks."""
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.finish_reason]  # (disaggregated: the prefill side's "handoff" never shows)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    return chunks


@contextlib.contextmanager
def running(artifact: Path, *, strict_fields: bool = False, **server_options):
    """A real uvicorn server on a free port in a background thread; yields (base_url, ModelServer)."""
    server = ModelServer.load(artifact, threads=1, model_name=MODEL, **server_options)
    with serving(server, strict_fields=strict_fields) as url:
        yield url, server


@contextlib.contextmanager
def serving(server, **app_options):
    """``server`` (a ModelServer, or anything offering its surface) behind the real app and uvicorn
    on a free port, in a background thread; yields the base URL; closes the server after."""
    port = free_port()
    app = build_app(server, api_key=KEY, **app_options)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    web = uvicorn.Server(config)
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not web.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        web.should_exit = True
        thread.join(timeout=30)
        server.close()


@pytest.fixture(scope="module")
def served(llama_chat_artifact):
    with running(llama_chat_artifact, max_queue=4) as (url, server):
        yield url, server


def post(url: str, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={**headers, "content-type": "application/json"}, **kw)
    return httpx.post(url + path, json=body, headers=headers, **kw)


def sse_events(lines) -> list:
    """The JSON bodies of ``data:`` lines, and the terminator string itself."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from the Prometheus exposition text (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------------------------------- routes


def test_models_health_and_replica_header(served, client, engine):
    url, server = served
    [card] = client.models.list().data
    assert card.id == MODEL and card.owned_by == "kvforge" and card.max_model_len == engine.max_seq
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == MODEL
    assert r.headers[REPLICA_HEADER] == server.replica_id == r.json()["replica"]


def test_completions_greedy_equal_generate_with_exact_usage(client, engine):
    expected = engine.generate(PROMPTS, max_new_tokens=12, sampling=GREEDY)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.finish_reason for e in expected]
    prompt_tokens = sum(len(engine.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(e.token_ids) for e in expected)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens


def test_completions_stream_joins_to_the_whole_answer(served, client, engine):
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=16, sampling=GREEDY)
    chunks = stream_joins_to(client, PROMPTS[0], expected)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == expected.prompt_tokens
    # The wire format: data lines of JSON, ending with data: [DONE].
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", served[0] + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])


def test_chat_greedy_equals_engine_chat_whole_and_streamed(client, engine):
    expected = engine.chat(MESSAGES, max_new_tokens=12, sampling=GREEDY)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == expected.prompt_tokens == len(engine.chat_prompt(MESSAGES))
    assert r.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    prompt = len(engine.chat_prompt(MESSAGES))
    assert r.usage.prompt_tokens == prompt
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == engine.max_seq - prompt


def test_n_choices_are_seeded_independent_requests(client, engine):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=7, n=2)
    expected = [
        engine.generate(PROMPTS[:1], max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=7 + j))[0]
        for j in range(2)
    ]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert r.choices[0].text != r.choices[1].text  # seed + j: the choices differ
    assert r.usage.prompt_tokens == expected[0].prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_stop_strings(client, engine):
    [full] = engine.generate(PROMPTS[:1], max_new_tokens=20, sampling=GREEDY)
    stop = full.text[4:7]
    assert len(stop) == 3
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=20, sampling=GREEDY, stop=[stop])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == expected.text == full.text[: full.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens == len(expected.token_ids)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_logprobs_completions_and_chat(client, engine):
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=6, sampling=SamplingParams(temperature=0.0, logprobs=3))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids)
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-6)
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert all(0 < len(top) <= 3 for top in lp.top_logprobs)  # distinct token texts among the top 3
    assert lp.text_offset[0] == len(PROMPTS[0])

    chat = engine.chat(MESSAGES, max_new_tokens=5, sampling=SamplingParams(temperature=0.0, logprobs=2))
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in chat.logprobs], abs=1e-6)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert [a.logprob for c in content for a in c.top_logprobs] == pytest.approx(
        [v for t in chat.logprobs for _, v in t.top], abs=1e-6
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    got = [
        c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
    ]
    assert got == pytest.approx([t.logprob for t in chat.logprobs], abs=1e-6)


def test_token_id_prompts_echo_and_chat_n_stream_with_usage(client, engine):
    ids = [engine.encode(p) for p in PROMPTS]
    expected = engine.generate(ids, max_new_tokens=6, sampling=GREEDY)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [engine.tokenizer.decode(i) + e.text for i, e in zip(ids, expected)]
    assert r.usage.prompt_tokens == sum(map(len, ids))

    chat = engine.chat(MESSAGES, max_new_tokens=6, sampling=GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == chat.text
        assert mine[-1].finish_reason == chat.finish_reason
    assert chunks[-1].usage.prompt_tokens == chat.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 2 * len(chat.token_ids)


# ---------------------------------------------------------------------------------------- errors


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_bad_input_is_400_with_openai_error_object(served, engine):
    url, _ = served
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(post(url, "/v1/completions", b'{"model": "x", "prompt": '), 400, "not valid JSON")
    error = assert_error(post(url, "/v1/completions", {**ok, "model": "gpt-4"}), 400, "'gpt-4' does not exist", MODEL)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert_error(post(url, "/v1/completions", {**ok, "temperature": -1}), 400, "temperature", param="temperature")
    assert_error(post(url, "/v1/completions", {**ok, "top_p": 1.5}), 400, "top_p", "(0, 1]", param="top_p")
    assert_error(post(url, "/v1/completions", {**ok, "n": 0}), 400, "n must be at least 1", param="n")
    assert_error(post(url, "/v1/completions", {**ok, "max_tokens": -1}), 400, "max_tokens", param="max_tokens")
    assert_error(post(url, "/v1/completions", {**ok, "logprobs": 50}), 400, "logprobs", param="logprobs")
    assert_error(post(url, "/v1/completions", {**ok, "stop": [""]}), 400, "stop")
    assert_error(post(url, "/v1/completions", {**ok, "n": "two"}), 400, "'n'", param="n")
    assert_error(post(url, "/v1/completions", {"model": MODEL}), 400, "'prompt' is required")
    assert_error(post(url, "/v1/completions", {**ok, "suffix": "x"}), 400, "'suffix'", "not supported", param="suffix")
    assert_error(post(url, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages is empty")
    chat = {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}
    assert_error(post(url, "/v1/chat/completions", chat), 400, "logprobs: true", param="top_logprobs")
    # Too long for the artifact: the prompt alone, and prompt + max_tokens.
    max_seq = engine.max_seq
    long_prompt = " ".join(["The for statement iterates"] * max_seq)
    assert len(engine.encode(long_prompt)) > max_seq
    error = assert_error(
        post(url, "/v1/completions", {**ok, "prompt": long_prompt}), 400, "--max-seq", f"max_seq={max_seq}"
    )
    assert error["code"] == "context_length_exceeded"
    n = len(engine.encode(PROMPTS[0]))
    error = assert_error(
        post(url, "/v1/completions", {**ok, "prompt": PROMPTS[0], "max_tokens": max_seq}),
        400,
        f"lower max_tokens to at most {max_seq - n}",
        param="max_tokens",
    )
    # Routes and keys.
    assert_error(httpx.get(url + "/v1/nothing"), 404, "Not Found", "/v1/completions")
    assert_error(post(url, "/v1/completions", ok, key=None), 401, "Authorization: Bearer")
    assert_error(post(url, "/v1/completions", ok, key="wrong"), 401, "--api-key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert post(url, "/v1/completions", ok).status_code == 200  # and the server still serves


def test_chat_without_template_is_400(llama_artifact):
    with running(llama_artifact, max_queue=0) as (url, _):
        r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        error = assert_error(r, 400, "has no chat template", "/v1/completions")
        assert error["code"] == "no_chat_template"


def long_prompt_for(engine: Engine, tokens: int) -> str:
    """A prompt whose greedy continuation does not hit eos within ``tokens`` tokens."""
    for prompt in ["The for statement", "A list is", "Functions are defined", "The while loop", "Classes"]:
        [r] = engine.generate([prompt], max_new_tokens=tokens, sampling=GREEDY)
        if r.finish_reason == "length":
            return prompt
    pytest.fail("every candidate prompt meets eos early")


class Gate:
    """Holds the scheduler's thread at the start of its engine call number ``after + 1`` until
    :meth:`open` (wraps the engine's ``backend.run``), so a test can act while a request is
    admitted or mid-generation, whatever the machine's speed. The tiny model makes 80 tokens in
    about 10 ms: no client could otherwise catch a request running."""

    def __init__(self, server: ModelServer, after: int) -> None:
        self.backend, self.after, self.calls = server.engine.backend, after, 0
        self.reached, self._open = threading.Event(), threading.Event()
        self._run = self.backend.run

        def gated(binding):
            self.calls += 1
            if self.calls > self.after and not self._open.is_set():
                self.reached.set()
                assert self._open.wait(60), "the gate was never opened"
            return self._run(binding)

        self.backend.run = gated

    def open(self) -> None:
        self._open.set()
        self.backend.run = self._run

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc) -> None:
        self.open()


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_full_queue_is_429_then_served(llama_chat_artifact, engine):
    rows = engine.max_batch
    with running(llama_chat_artifact, max_queue=0) as (url, server):  # capacity: max_batch sequences
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "n": rows, "stream": True}
        headers = {"authorization": f"Bearer {KEY}"}
        with (
            Gate(server, after=0) as gate,
            httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as r,
        ):
            assert r.status_code == 200 and gate.reached.wait(10)  # every row's sequence admitted, scheduler held
            small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            error = assert_error(post(url, "/v1/completions", small), 429, "at capacity", "retry later")
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            gate.open()
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]) == list(
            range(rows)
        )
        wait_until(lambda: server.in_flight == 0, "the sequences to be released")
        assert post(url, "/v1/completions", small).status_code == 200


def test_client_disconnect_cancels_and_frees_the_row(served, engine):
    url, server = served
    prompt = long_prompt_for(engine, 80)
    before = httpx.get(url + "/metrics").text
    # logprobs: every token makes a chunk (text alone may be held back, e.g. an incomplete UTF-8 character).
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 80, "temperature": 0, "stream": True, "logprobs": 0}
    # Call 1 is the prefill (it makes the first token); the scheduler is held before the first decode step.
    with Gate(server, after=1) as gate:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert len(json.loads(first[6:])["choices"][0]["logprobs"]["tokens"]) == 1 and gate.reached.wait(10)
            assert httpx.get(url + "/health").json()["running"] == 1
        # Disconnected: the server cancels the sequence while the scheduler is held...
        wait_until(lambda: all(h.generation.cancel_requested for h in server.live), "the cancellation")
        assert len(server.live) == 1
    # ...and the scheduler retires it at its next step: the row is free, the request counted as cancelled.
    wait_until(lambda: server.in_flight == 0 and not server.live, "the row to be freed")
    health = httpx.get(url + "/health").json()
    assert (health["running"], health["queued"], health["in_flight"]) == (0, 0, 0)
    after = httpx.get(url + "/metrics").text
    cancelled = metric(after, "kvforge_sequences_finished_total", reason="cancelled")
    assert cancelled == metric(before, "kvforge_sequences_finished_total", reason="cancelled") + 1
    generated = metric(after, "kvforge_generation_tokens_total") - metric(before, "kvforge_generation_tokens_total")
    assert 1 <= generated <= 2  # the prefill's token, and at most the decode step that was held


def test_client_leaving_a_whole_answer_cancels_it(served):
    """Not streamed: the server notices the disconnect while the request waits, and cancels it."""
    url, server = served
    before = httpx.get(url + "/metrics").text
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}
    with Gate(server, after=0) as gate:  # held at the prefill: the answer cannot come
        with pytest.raises(httpx.ReadTimeout):
            post(url, "/v1/completions", body, timeout=httpx.Timeout(10, read=0.5))
        assert gate.reached.is_set()
        wait_until(lambda: server.live and all(h.generation.cancel_requested for h in server.live), "the cancellation")
    wait_until(lambda: server.in_flight == 0 and not server.live, "the row to be freed")
    after = httpx.get(url + "/metrics").text
    cancelled = metric(after, "kvforge_sequences_finished_total", reason="cancelled")
    assert cancelled == metric(before, "kvforge_sequences_finished_total", reason="cancelled") + 1


def test_metrics_count_what_was_served(served, client, engine):
    url, _ = served
    before = httpx.get(url + "/metrics").text
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=5, sampling=GREEDY)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    post(url, "/v1/completions", {"model": "nope", "prompt": "x"})
    after = httpx.get(url + "/metrics").text
    route = "/v1/completions"

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvforge_requests_total", route=route, status="200") == 1
    assert delta("kvforge_requests_total", route=route, status="400") == 1
    assert delta("kvforge_prompt_tokens_total") == expected.prompt_tokens
    assert delta("kvforge_generation_tokens_total") == len(expected.token_ids)
    assert delta("kvforge_sequences_finished_total", reason=expected.finish_reason) == 1
    assert delta("kvforge_time_to_first_token_seconds_count") == 1
    assert delta("kvforge_time_per_output_token_seconds_count") == (1 if len(expected.token_ids) > 1 else 0)
    for gauge in ("kvforge_queue_depth", "kvforge_running_rows", "kvforge_in_flight_sequences"):
        assert f"\n{gauge} 0.0" in after


def test_drain_answers_503_finishes_what_runs_then_stops(llama_chat_artifact, engine):
    """What the first SIGTERM does (DrainingServer.drain), with the scheduler held mid-request."""
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=8, sampling=GREEDY)
    server = ModelServer.load(llama_chat_artifact, threads=1, model_name=MODEL, max_queue=2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    web = DrainingServer(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"), server)
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    wait_until(lambda: web.started, "the server to start", timeout=30)
    results = {}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    with Gate(server, after=0) as gate:
        worker = threading.Thread(target=lambda: results.update(r=post(url, "/v1/completions", body, key=None)))
        worker.start()
        assert gate.reached.wait(10)
        web.drain()
        error = assert_error(post(url, "/v1/completions", body, key=None), 503, "shutting down")
        assert error["code"] == "draining"
        assert httpx.get(url + "/health").json()["status"] == "draining"
        assert thread.is_alive()  # still running: a request is in flight
    worker.join(30)
    thread.join(30)
    assert not thread.is_alive()  # drained, then stopped by itself
    assert results["r"].status_code == 200 and results["r"].json()["choices"][0]["text"] == expected.text
    assert server.closed  # the lifespan closed the scheduler and the engine


def test_sigterm_exits_0_after_answering(llama_chat_artifact, engine):
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=8, sampling=GREEDY)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(llama_chat_artifact), "--threads", "1", "--served-model-name", MODEL, "--log-level", "warning"]
    proc = start_cli_server(args, port)
    try:
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == expected.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
