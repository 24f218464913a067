"""Property-based fuzzing of the public surface with hypothesis: results or documented refusals, never a crash.

The property, for every generated input: the call returns a result that satisfies the API's
invariants (generated lengths within ``max_new_tokens``, a known finish reason, ``prompt_tokens``
equal to the encoded prompt, chunks joining to the result, the KV cache buffer at the same
address, a fixed greedy prompt still giving the tokens a fresh engine gives), or it raises one of
the documented error types (ValueError and its subclasses ArtifactError/WrongType/ChatTemplateError;
RuntimeError for a call the engine's current state refuses) with a non-empty message. Never
another exception type, a hang or a crash of the process.

Covered: prompts (arbitrary Unicode text, id lists of any length and element type, bytes, None,
nested lists, numpy arrays), SamplingParams fields and ``from_dict``, random interleavings of
prefill/decode/session append/generate/rewind/generate calls (a RuleBasedStateMachine), random CLI
argument vectors to ``kvforge.tools.cli.main`` in-process (argparse's SystemExit(2) is a documented
outcome), random manifest mutations and random byte flips in artifact files.

Profiles (tests/conftest.py): ``ci`` (default, bounded, derandomized) and ``long``
(``HYPOTHESIS_PROFILE=long``, ``scripts/fuzz.sh``).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from kvforge.graphs.manifest import ArtifactError  # noqa: E402
from kvforge.runtime import Engine, SamplingParams  # noqa: E402
from kvforge.runtime.generation import FINISH_REASONS  # noqa: E402
from kvforge.runtime.ort_backend import GraphRunError  # noqa: E402
from kvforge.runtime.sampling import GenerationDefaults, Sampler  # noqa: E402
from tests.helpers import corrupt_head_size  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy overflow/nan in the sampler: a bug

REFUSALS = (ValueError, RuntimeError)  # ArtifactError, WrongType, ChatTemplateError are ValueErrors
GOOD = [1, 17, 42, 99, 5]


def examples(share: float) -> int:
    """This test's examples: a share of the profile's ``max_examples`` (ci: 100; long: 2000)."""
    return max(5, int(settings.default.max_examples * share))


def refused(error: BaseException) -> None:
    """A documented refusal: a ValueError/RuntimeError with a message (anything else re-raises).
    A GraphRunError is not one: on an intact artifact, ONNX Runtime failing means the engine let
    through what the graph cannot run."""
    if not isinstance(error, REFUSALS) or isinstance(error, GraphRunError):
        raise error
    assert str(error).strip(), f"{type(error).__name__} without a message"


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact, threads=1) as e:
        yield e


@pytest.fixture(scope="module")
def reference(llama_artifact):
    """A fresh engine's greedy tokens for GOOD (the state-leak check)."""
    with Engine.load(llama_artifact, threads=1) as e:
        return e.generate([GOOD], max_new_tokens=4)[0].token_ids


# ------------------------------------------------------------------------------------------ strategies

ANY_SCALAR = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=383),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.sampled_from([np.int64(3), np.int32(7), np.uint8(1), np.float32(2.0), np.bool_(True)]),
)
ID_LIST = st.lists(st.integers(min_value=0, max_value=383), min_size=0, max_size=120)
SHORT_IDS = st.lists(st.integers(min_value=0, max_value=383), min_size=1, max_size=12)
PROMPT = st.one_of(
    st.text(max_size=60),  # arbitrary Unicode: surrogates, control characters, emoji, ...
    ID_LIST,
    st.lists(ANY_SCALAR, max_size=8),
    st.lists(st.lists(st.integers(0, 383), max_size=3), max_size=3),
    st.binary(max_size=8),
    st.none(),
    ID_LIST.map(lambda ids: np.array(ids, dtype=np.int64)),
    st.lists(st.floats(0, 383), min_size=1, max_size=4).map(np.array),
    st.tuples(st.integers(0, 383), st.integers(0, 383)),
    ANY_SCALAR,
)
COUNT = st.one_of(st.integers(-3, 6), st.floats(-1, 6), st.booleans(), st.none(), st.text(max_size=2), st.just(10**30))


def check_result(engine: Engine, prompt, result, max_new_tokens) -> None:
    assert 1 <= len(result.token_ids) <= max_new_tokens
    assert result.finish_reason in FINISH_REASONS and result.finish_reason != "cancelled"
    assert result.prompt_tokens == len(engine.encode(prompt))
    assert all(isinstance(t, int) and 0 <= t < engine.vocab_size for t in result.token_ids)
    if result.finish_reason == "length":
        assert len(result.token_ids) == max_new_tokens or result.prompt_tokens + len(result.token_ids) >= engine.max_seq


# ------------------------------------------------------------------------------------------ prompts


@settings(max_examples=examples(1.0))
@given(prompt=PROMPT, max_new_tokens=COUNT)
def test_generate_any_prompt(engine, reference, prompt, max_new_tokens):
    pointer = engine.cache.buffer.ctypes.data
    try:
        [result] = engine.generate([prompt], max_new_tokens=max_new_tokens)
    except BaseException as e:
        refused(e)
    else:
        check_result(engine, prompt, result, max_new_tokens)
    assert engine.cache.buffer.ctypes.data == pointer
    assert engine.generate([GOOD], max_new_tokens=4)[0].token_ids == reference


@settings(max_examples=examples(0.5))
@given(prompt=PROMPT, max_new_tokens=st.integers(1, 4), stop=st.one_of(st.none(), st.text(max_size=3)))
def test_stream_any_prompt_joins_to_generate(engine, prompt, max_new_tokens, stop):
    try:
        chunks = list(engine.stream(prompt, max_new_tokens=max_new_tokens, stop=stop))
    except BaseException as e:
        refused(e)
        return
    [result] = engine.generate([prompt], max_new_tokens=max_new_tokens, stop=stop)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert chunks[-1].finish_reason == result.finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])


@settings(max_examples=examples(0.5))
@given(prompts=st.one_of(st.lists(PROMPT, max_size=6), PROMPT))
def test_generate_any_batch(engine, prompts):
    try:
        results = engine.generate(prompts, max_new_tokens=2)
    except BaseException as e:
        refused(e)
        return
    assert len(results) == len(prompts)
    for p, r in zip(prompts, results):
        check_result(engine, p, r, 2)


# ------------------------------------------------------------------------------------------ sampling

FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 50),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 2),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.sampled_from([np.float32(0.5), np.int64(3), np.float64("nan")]),
)
FIELDS = [
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
]


@settings(max_examples=examples(2.0))
@given(
    values=st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=4)), FIELD_VALUES, max_size=5),
    logits=st.lists(st.floats(-30, 30, width=32), min_size=8, max_size=8),
    seen=st.lists(st.integers(0, 7), max_size=5),
)
def test_sampling_params_from_any_dict(values, logits, seen):
    try:
        params = SamplingParams.from_dict(values)
    except BaseException as e:
        refused(e)
        assert isinstance(e, ValueError)
        return
    resolved = params.resolve(GenerationDefaults())
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(resolved, name)
        assert value is None or (isinstance(value, float) and np.isfinite(value))
    sampler = Sampler(resolved, list(seen), 8)
    token = int(sampler(np.array(logits, dtype=np.float32)))
    assert 0 <= token < 8


@settings(max_examples=examples(0.5))
@given(
    values=st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=4),
    stop=st.one_of(st.none(), st.text(max_size=4), st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3)),
)
def test_generate_with_any_sampling(engine, values, stop):
    try:
        [result] = engine.generate([GOOD], max_new_tokens=3, sampling=values, stop=stop)
    except BaseException as e:
        refused(e)
        return
    check_result(engine, GOOD, result, 3)
    if values.get("logprobs") is not None:
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)


# ------------------------------------------------------------------------------------------ step API and sessions


class EngineCalls(RuleBasedStateMachine):
    """Random interleavings of the step API, sessions and generate on one engine, valid and invalid.

    Model: nothing; the invariants are the API's own (refusal types, cache address, a fixed
    greedy prompt's tokens after any sequence of calls)."""

    engine: Engine
    reference: list[int]

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list = []
        self.pointer = self.engine.cache.buffer.ctypes.data

    def attempt(self, fn):
        try:
            return fn()
        except BaseException as e:
            refused(e)
            return None

    @rule(
        rows=st.one_of(
            st.lists(SHORT_IDS, min_size=1, max_size=3),
            st.lists(st.one_of(ID_LIST, st.lists(ANY_SCALAR, max_size=3)), max_size=5),
        ),
        start=st.booleans(),
    )
    def prefill(self, rows, start):
        starts = [len(r) % 7 for r in rows] if start else None
        logits = self.attempt(lambda: self.engine.prefill(rows, starts))
        if logits is not None:
            assert logits.shape == (len(rows), self.engine.vocab_size)

    @rule(data=st.data(), valid=st.booleans())
    def decode(self, data, valid):
        batch = self.engine.batch
        if valid:  # one in-vocabulary id per row of the current batch
            tokens = data.draw(st.lists(st.integers(0, 383), min_size=batch, max_size=batch), label="tokens")
        else:
            tokens = data.draw(st.one_of(st.lists(st.integers(-1, 400), max_size=5), PROMPT), label="tokens")
        logits = self.attempt(lambda: self.engine.decode(tokens))
        if logits is not None:
            assert logits.shape == (batch, self.engine.vocab_size)

    @rule(rows=st.lists(SHORT_IDS, min_size=1, max_size=2), steps=st.integers(1, 4))
    def prefill_then_decode(self, rows, steps):
        """A valid step sequence: its greedy tokens equal generate's for the same prompts."""
        logits = self.attempt(lambda: self.engine.prefill(rows))
        if logits is None:
            return
        tokens = [int(t) for t in logits.argmax(-1)]
        got = [[t] for t in tokens]
        for _ in range(steps - 1):
            logits = self.attempt(lambda tokens=tokens: self.engine.decode(tokens))
            if logits is None:  # a row's cache is full
                return
            tokens = [int(t) for t in logits.argmax(-1)]
            for row, t in zip(got, tokens):
                row.append(t)
        expected = self.engine.generate(rows, max_new_tokens=steps)
        for row, result in zip(got, expected):
            assert row[: len(result.token_ids)] == result.token_ids

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 3), prompt=SHORT_IDS, n=st.integers(1, 3))
    def session_turn(self, i, prompt, n):
        s = self.sessions[i % len(self.sessions)]
        if self.attempt(lambda: s.append(prompt)) is not None:
            before = s.tokens
            result = self.attempt(lambda: s.generate(max_new_tokens=n))
            if result is not None:
                assert s.tokens == before + result.token_ids and 1 <= len(result.token_ids) <= n

    @rule(prompt=PROMPT, n=st.integers(1, 3))
    def generate(self, prompt, n):
        result = self.attempt(lambda: self.engine.generate([prompt], max_new_tokens=n))
        if result is not None:
            check_result(self.engine, prompt, result[0], n)

    @precondition(lambda self: len(self.sessions) < 2)  # leave rows to the step API and generate
    @rule()
    def open_session(self):
        session = self.attempt(self.engine.session)
        if session is not None:
            self.sessions.append(session)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 3), prompt=st.one_of(SHORT_IDS, PROMPT))
    def session_append(self, i, prompt):
        s = self.sessions[i % len(self.sessions)]
        before = s.tokens
        ids = self.attempt(lambda: s.append(prompt))
        assert s.tokens == (before + ids if ids is not None else before)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 3), n=st.one_of(st.integers(1, 3), COUNT))
    def session_generate(self, i, n):
        s = self.sessions[i % len(self.sessions)]
        before = s.tokens
        result = self.attempt(lambda: s.generate(max_new_tokens=n))
        if result is not None:
            assert s.tokens == before + result.token_ids and result.prompt_tokens == len(before)
            assert 1 <= len(result.token_ids) <= n
        else:
            assert s.tokens == before

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 3), n=st.one_of(st.integers(0, 4), st.integers(-2, 130), st.floats(0, 3), st.none()))
    def session_rewind(self, i, n):
        s = self.sessions[i % len(self.sessions)]
        before = s.tokens
        if self.attempt(lambda: s.rewind(n)) is None and not (isinstance(n, int) and 0 <= n <= len(before)):
            assert s.tokens == before
        else:
            assert s.tokens == before[: len(before) - n]
            assert s.cached <= len(s.tokens)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 3))
    def close_session(self, i):
        self.sessions.pop(i % len(self.sessions)).close()

    @invariant()
    def cache_never_moves(self):
        assert self.engine.cache.buffer.ctypes.data == self.pointer

    def teardown(self):
        for s in self.sessions:
            s.close()
        # After any sequence of calls, a fixed greedy prompt gives a fresh engine's tokens.
        assert self.engine.generate([GOOD], max_new_tokens=4)[0].token_ids == self.reference


def test_random_interleavings_of_steps_and_sessions(engine, reference):
    EngineCalls.engine, EngineCalls.reference = engine, reference
    run = settings(
        max_examples=examples(0.5),
        stateful_step_count=12,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    hypothesis.stateful.run_state_machine_as_test(EngineCalls, settings=run)


@pytest.fixture(scope="module")
def solo(engine):
    """Each scheduler-fuzz prompt's greedy tokens alone (8 new tokens)."""
    return {i: engine.generate([p], max_new_tokens=8)[0].token_ids for i, p in enumerate(SCHED_PROMPTS)}


SCHED_PROMPTS = [[1, 17, 42, 99, 5], [3, 4, 5], [7] * 40, "The for statement", [200, 201], [9, 8, 7, 6, 5, 4]]


@settings(max_examples=examples(0.25))
@given(
    plan=st.lists(
        st.tuples(st.integers(0, len(SCHED_PROMPTS) - 1), st.one_of(st.none(), st.floats(0, 0.02))),
        min_size=1,
        max_size=8,
    ),
    chunk=st.one_of(st.none(), st.integers(1, 16)),
)
def test_scheduler_with_random_cancellations(engine, solo, reference, plan, chunk):
    """Requests submitted to a scheduler and cancelled at random points (before admission, while
    prefilling, while decoding, or never): every handle finishes; an uncancelled one has its solo
    greedy tokens; a cancelled one a prefix of them (or all, if it finished first); afterwards the
    engine's rows are free and a fixed prompt gives a fresh engine's tokens."""
    import time

    with engine.scheduler(prefill_chunk=chunk) as sched:
        handles = []
        for index, delay in plan:
            handles.append((index, delay, sched.submit(SCHED_PROMPTS[index], max_new_tokens=8)))
        for _, delay, handle in handles:
            if delay is not None:
                time.sleep(delay)
                handle.cancel()
        results = [(index, delay, h.result(timeout=60)) for index, delay, h in handles]
    for index, delay, result in results:
        expected = solo[index]
        if delay is None:
            assert result.token_ids == expected and result.finish_reason != "cancelled"
        else:
            assert result.token_ids == expected[: len(result.token_ids)]
            assert result.finish_reason in FINISH_REASONS
    assert engine._rows_owner is None
    assert engine.generate([GOOD], max_new_tokens=4)[0].token_ids == reference


# ------------------------------------------------------------------------------------------ HTTP bodies


@pytest.fixture(scope="module")
def http(llama_chat_artifact):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvforge.tools.serve.app import build_app
    from kvforge.tools.serve.serving import ModelServer

    server = ModelServer.load(llama_chat_artifact, threads=1, model_name="m")
    with TestClient(build_app(server)) as client:
        yield server, client


BODY_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 6),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-2, 400), max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["0", "5", "99999", "-1", "x"]), st.integers(-150, 150), max_size=2),
    st.fixed_dictionaries({"type": st.sampled_from(["content", "text"]), "content": st.text(max_size=8)}),
)
COMPLETION_FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "logprobs",
    "echo",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "best_of",
    "suffix",
    "model",
]
CHAT_FIELDS = [
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "tools",
    "response_format",
    "model",
    "logit_bias",
    "prediction",
    "modalities",
    "audio",
    "tool_choice",
    "function_call",
    "metadata",
    "stream_options",
    "unknown_field",
]
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "robot"]),
            "content": st.one_of(st.text(max_size=20), st.none()),
        }
    ),
    max_size=3,
)


@settings(max_examples=examples(1.0))
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    data=st.data(),
)
def test_http_bodies(http, route, data):
    """Random request bodies: a 200 with choices that keep the limits, or OpenAI's error object
    with a 4xx status and a message; never a 500 (a server error) for what the client sent."""
    server, client = http
    chat = route.endswith("chat/completions")
    base = (
        {"model": "m", "messages": data.draw(MESSAGES, label="messages")}
        if chat
        else {"model": "m", "prompt": data.draw(st.one_of(st.text(max_size=20), BODY_VALUES), label="prompt")}
    )
    extra = data.draw(
        st.dictionaries(st.sampled_from(CHAT_FIELDS if chat else COMPLETION_FIELDS), BODY_VALUES, max_size=3)
    )
    body = {**base, **extra}
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2  # bounded generation
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    r = client.post(route, json=body)
    assert r.status_code in (200, 400, 429), (body, r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
        return
    if body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
        return
    answer = r.json()
    assert answer["choices"] and all(c["finish_reason"] in FINISH_REASONS for c in answer["choices"])
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= server.max_seq * len(
        answer["choices"]
    )


# ------------------------------------------------------------------------------------------ CLI


ARTIFACT = "<artifact>"  # replaced by the session artifact's path
CLI_WORDS = st.one_of(
    st.sampled_from(["generate", "inspect", "plan", "build", "compile", "nonsense", "--help", "-h"]),
    st.sampled_from(
        [
            "--max-new-tokens",
            "--temperature",
            "--top-k",
            "--top-p",
            "--min-p",
            "--seed",
            "--stop",
            "--threads",
            "--repetition-penalty",
            "--presence-penalty",
            "--max-batch",
            "--max-seq",
            "--max-prompt",
            "--dtype",
            "--gpu-memory",
            "--json",
            "-o",
            "--target",
            "--lowering",
            "--quantize",
        ]
    ),
    st.sampled_from([ARTIFACT, "/nonexistent/kvforge", "", "-", "float16", "tensorrt", "1GiB", "x" * 5]),
    st.sampled_from(["0", "1", "2", "-1", "2.5", "nan", "inf", "1e400", "99999999999999999999", "0x10"]),
    st.text(max_size=6),
)


@settings(max_examples=examples(1.5))
@given(
    words=st.tuples(
        st.sampled_from([[], ["generate", ARTIFACT, "The"], ["inspect", ARTIFACT], ["plan", ARTIFACT]]),
        st.lists(CLI_WORDS, max_size=6),
    ).map(lambda t: t[0] + t[1])
)
def test_random_cli_vectors(llama_artifact, words):
    """Random argument vectors (the cheap subcommands: generate, inspect, plan, build, and compile
    of a missing directory) run in-process: exit 0, 1 or 2, an error line for 2, no traceback."""
    from kvforge.tools.cli import main

    argv = [str(llama_artifact) if w == ARTIFACT else w for w in words]
    if argv[:1] == ["compile"]:
        argv = [w if w != str(llama_artifact) else "/nonexistent/kvforge" for w in argv]  # never compile for real
    if argv[:1] == ["generate"]:
        argv = [*argv, "--max-new-tokens", "2"]  # bounded output
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            code = e.code
    assert code in (0, 1, 2), (argv, code, err.getvalue())
    if code == 2:
        assert "error" in err.getvalue(), (argv, err.getvalue())
    assert "Traceback" not in err.getvalue()


# ------------------------------------------------------------------------------------------ artifacts


@pytest.fixture(scope="module")
def scratch(llama_artifact, tmp_path_factory) -> Path:
    """A private copy of the artifact, restored file by file after each example."""
    out = tmp_path_factory.mktemp("fuzz") / "art"
    shutil.copytree(llama_artifact, out)
    return out


@contextlib.contextmanager
def restored(root: Path, name: str):
    original = (root / name).read_bytes()
    try:
        yield root / name
    finally:
        (root / name).write_bytes(original)


def load_and_run(root: Path, verify: bool) -> None:
    """Load the artifact; if it loads, a short generation must run (or be refused)."""
    try:
        engine = Engine.load(root, threads=1, verify=verify)
    except BaseException as e:
        refused(e)
        assert isinstance(e, ValueError), f"Engine.load raised {type(e).__name__}: {e}"
        return
    with engine:
        try:
            [result] = engine.generate([GOOD], max_new_tokens=2)
        except BaseException as e:
            # A graph corrupted but still loadable (verify=False) may fail when it runs: GraphRunError.
            documented = ValueError if verify else (ValueError, GraphRunError)
            assert isinstance(e, documented) and str(e), f"generate on a loaded artifact raised {type(e).__name__}: {e}"
        else:
            assert 1 <= len(result.token_ids) <= 2


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6,
)


def paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, (*prefix, i))


@settings(max_examples=examples(1.5))
@given(data=st.data(), action=st.sampled_from(["replace", "delete"]), value=JSON)
def test_manifest_mutations(scratch, data, action, value):
    manifest = json.loads((scratch / "manifest.json").read_text())
    path = data.draw(st.sampled_from([p for p in paths(manifest) if p]), label="path")
    node = manifest
    for key in path[:-1]:
        node = node[key]
    if action == "delete":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with restored(scratch, "manifest.json") as file:
        file.write_text(json.dumps(manifest))
        load_and_run(scratch, verify=False)


FILES = ["manifest.json", "tokenizer.json", "generation_config.json", "prefill.ort.onnx", "weights.data"]


@settings(max_examples=examples(1.0))
@given(
    name=st.sampled_from(FILES),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3),
    verify=st.booleans(),
)
def test_byte_flips(scratch, name, flips, verify):
    with restored(scratch, name) as file:
        data = bytearray(file.read_bytes())
        for where, xor in flips:
            data[int(where * len(data))] ^= xor
        file.write_bytes(bytes(data))
        load_and_run(scratch, verify=verify)


def _set(path, value):
    def mutate(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


# What the fuzzing found raising TypeError/AttributeError (before check_schema), plus neighbours.
MANIFEST_REGRESSIONS = [
    (("graphs", "prefill", "file"), None, "graphs.prefill.file is None"),
    (("graphs",), None, "graphs is None, expected an object"),
    (("model", "vocab_size"), None, "model.vocab_size is None, expected a positive integer"),
    (("model", "num_kv_heads"), None, "model.num_kv_heads is None"),
    (("model", "num_layers"), None, "model.num_layers is None"),
    (("limits", "max_seq"), "96", "limits.max_seq is '96'"),
    (("limits", "max_batch"), 2**40, "kv_cache is [2, 2, 4, 2, 96, 16]"),
    (("weights", "file"), "../../etc/passwd", "a file name inside the artifact directory"),
    (("model", "vocab_size"), 383, "kv_cache"),  # not in the cache shape: caught by the graph's logits dim
    (("engines",), {"tensorrt": {"plan_file": 3}}, "engines.tensorrt is malformed"),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), MANIFEST_REGRESSIONS, ids=[str(r[0]) for r in MANIFEST_REGRESSIONS]
)
def test_manifest_refusals_are_artifact_errors(scratch, path, value, message):
    """Each manifest mutation the fuzzing found crashing is now an ArtifactError naming the field."""
    data = json.loads((scratch / "manifest.json").read_text())
    _set(path, value)(data)
    with restored(scratch, "manifest.json") as file:
        file.write_text(json.dumps(data))
        with pytest.raises(ArtifactError) as info:
            Engine.load(scratch, verify=False)
    if path == ("model", "vocab_size") and value == 383:
        message = "logits has shape ['batch', 384], but the manifest says 383"
    assert message in str(info.value)


def test_a_loadable_but_corrupted_graph_fails_with_graph_run_error(scratch):
    """Found by the long byte-flip run (scripts/fuzz.sh): a flip in a Reshape constant of
    prefill.ort.onnx loads with verify=False, then ORT failed mid-generate with its own RuntimeError;
    now a GraphRunError saying what it means, and the engine's rows are released."""
    with restored(scratch, "prefill.ort.onnx") as file:
        corrupt_head_size(file)
        with Engine.load(scratch, threads=1, verify=False) as engine:
            with pytest.raises(GraphRunError, match="ONNX Runtime failed running the prefill graph .*verify=True"):
                engine.generate([GOOD], max_new_tokens=2)
            assert engine._rows_owner is None  # released: a scheduler or stream could take the rows


def test_multi_row_continuation_on_gqa_is_refused_before_it_runs(engine):
    """Found by the state-machine fuzzing: prefill of 2 rows of 2 tokens at start > 0 reached ORT's
    GroupQueryAttention, which fails mid-run; now a ValueError before anything runs. One row, or
    one token per row, still runs."""
    engine.prefill([[1, 2, 3, 4], [5, 6, 7, 8]])
    engine.last_bindings.clear()
    with pytest.raises(ValueError, match="continues cached sequences .* one row at a time"):
        engine.prefill([[1, 2], [3, 4]], start=[4, 4])
    assert engine.last_bindings == {}
    assert engine.prefill([[1], [3]], start=[4, 4]).shape == (2, engine.vocab_size)
    assert engine.prefill([[1, 2]], start=[4]).shape == (1, engine.vocab_size)


@pytest.mark.parametrize("name", ["prefill.ort.onnx", "tokenizer.json"])
def test_corrupted_graph_or_tokenizer_without_verify_is_an_artifact_error(scratch, name):
    """Found by the byte-flip fuzzing: with verify=False, ORT's InvalidProtobuf and the tokenizers
    library's bare Exception escaped Engine.load."""
    with restored(scratch, name) as file:
        data = bytearray(file.read_bytes())
        data[0] ^= 1
        file.write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match="corrupted") as info:
            Engine.load(scratch, verify=False)
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e39),
        ("temperature", 1e-40),
        ("temperature", 10**400),
        ("repetition_penalty", 1e39),
        ("repetition_penalty", 1e-40),
        ("top_p", 10**400),
    ],
)
def test_sampling_values_float32_cannot_hold_are_refused(field, value):
    """Found by the sampling fuzzing: repetition_penalty=3.4e38+ overflowed the sampler's float32
    arithmetic (RuntimeWarning, inf logits) and an int too large for a float raised OverflowError."""
    with pytest.raises(ValueError, match=f"{field}=.* is not accepted"):
        SamplingParams(**{field: value})
