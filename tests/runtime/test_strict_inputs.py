"""Strict inputs: every public entry point refuses what it cannot honour, before anything runs.

Proves, for each bad call (float/bool/None ids, bytes prompts, nested lists, one string where a
list is expected, non-integer counts, a decode with the wrong number of tokens, bad load options):
the error is a ValueError (TypeError too for a wrong type) whose message names the parameter, the
value received and what is accepted; and the engine's state is untouched: no graph ran, the rows,
lengths and batch are as before, and a good call afterwards gives exactly the tokens a fresh
engine gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime import Engine
from kvforge.runtime import validate as check

PROMPT = [1, 17, 42, 99, 5]
GOOD = dict(max_new_tokens=5)


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact, threads=1) as e:
        yield e


@pytest.fixture(scope="module")
def fresh(llama_artifact):
    """What a fresh engine answers to the good calls: generate, the step API, a session turn."""
    with Engine.load(llama_artifact, threads=1) as e:
        return good_calls(e)


def good_calls(engine: Engine) -> dict:
    out = {"generate": engine.generate([PROMPT, "The for statement"], **GOOD)[0].token_ids}
    logits = engine.prefill([PROMPT[:3], PROMPT])
    first = [int(t) for t in logits.argmax(-1)]
    out["decode"] = [int(t) for t in engine.decode(first).argmax(-1)]
    with engine.session() as s:
        s.append(PROMPT)
        out["session"] = s.generate(**GOOD).token_ids
    return out


def state(engine: Engine) -> tuple:
    return (
        engine.batch,
        engine.lengths.tolist(),
        engine._rows_owner,
        sorted(engine._session_rows),
        engine.cache.buffer.ctypes.data,
    )


BAD_CALLS = [
    # (id, call, error, words that must be in the message)
    ("float ids", lambda e: e.generate([[1.5, 2.7]]), TypeError, ["prompts[0][0]=1.5", "float", "token ids"]),
    ("float 2.0 id", lambda e: e.generate([[2.0]]), TypeError, ["prompts[0][0]=2.0"]),
    ("bool id", lambda e: e.generate([[True, 2]]), TypeError, ["prompts[0][0]=True", "bool"]),
    ("numpy bool id", lambda e: e.generate([[np.bool_(True)]]), TypeError, ["prompts[0][0]"]),
    ("None id", lambda e: e.generate([[1, None]]), TypeError, ["prompts[0][1]=None"]),
    ("bytes prompt", lambda e: e.generate([b"abc"]), TypeError, ["prompts[0]=b'abc'", "bytes are not token ids"]),
    ("bytearray prompt", lambda e: e.stream(bytearray(b"ab")), TypeError, ["prompt=bytearray", "bytes"]),
    ("None prompt", lambda e: e.generate([None]), TypeError, ["prompts[0]=None", "a prompt is a string"]),
    ("None prompts", lambda e: e.generate(None), TypeError, ["prompts=None", "a list of prompts"]),
    ("one string", lambda e: e.generate("The for"), TypeError, ["prompts='The for'", "not one string", "wrap it"]),
    ("nested ids", lambda e: e.generate([[[1, 2]]]), TypeError, ["prompts[0][0]=[1, 2]", "nested"]),
    ("float array", lambda e: e.generate([np.array([1.0, 2.0])]), TypeError, ["dtype float64"]),
    ("2-D array prompt", lambda e: e.stream(np.array([[1, 2]])), TypeError, ["ndim 2"]),
    ("1-D array as batch", lambda e: e.generate(np.array([1, 2])), TypeError, ["1-D array is one prompt"]),
    ("set prompt", lambda e: e.stream({1, 2}), TypeError, ["prompt={1, 2}", "set"]),
    ("max_new_tokens 2.5", lambda e: e.generate([PROMPT], max_new_tokens=2.5), TypeError, ["max_new_tokens", "2.5"]),
    ("max_new_tokens 0", lambda e: e.generate([PROMPT], max_new_tokens=0), ValueError, ["max_new_tokens", "got 0"]),
    ("max_new_tokens str", lambda e: e.stream(PROMPT, max_new_tokens="4"), TypeError, ["max_new_tokens", "'4'"]),
    (
        "huge temperature",
        lambda e: e.generate([PROMPT], sampling={"temperature": 10**400}),
        ValueError,
        ["temperature"],
    ),
    ("stream None", lambda e: e.stream(None), TypeError, ["prompt=None"]),
    ("prefill float", lambda e: e.prefill([[1.5, 2]]), TypeError, ["rows[0][0]=1.5"]),
    ("prefill one row flat", lambda e: e.prefill([1, 2]), TypeError, ["rows=[1, 2]", "wrap it in a list"]),
    ("prefill str row", lambda e: e.prefill(["ab"]), TypeError, ["rows[0]='ab'"]),
    ("prefill start float", lambda e: e.prefill([[1, 2]], start=[0.5]), TypeError, ["start[0]=0.5"]),
    ("prefill start count", lambda e: e.prefill([[1], [2]], start=[0]), ValueError, ["one position per row", "2 rows"]),
    ("score bool", lambda e: e.score([[False]]), TypeError, ["rows[0][0]=False"]),
    # the test prefills one row first: decode's batch is 1
    (
        "decode wrong count",
        lambda e: e.decode([1, 2, 3]),
        ValueError,
        ["tokens=[1, 2, 3]", "current batch, 1", "got 3"],
    ),
    ("decode float", lambda e: e.decode([1.5]), TypeError, ["tokens[0]=1.5"]),
    ("decode huge id", lambda e: e.decode([10**30]), ValueError, ["outside the vocabulary"]),
    ("decode None", lambda e: e.decode(None), TypeError, ["tokens=None"]),
    ("scheduler chunk", lambda e: e.scheduler(prefill_chunk=2.5), TypeError, ["prefill_chunk=2.5"]),
    ("load threads", lambda e: Engine.load(e.artifact_dir, threads=1.5), TypeError, ["threads=1.5"]),
    ("load threads 0", lambda e: Engine.load(e.artifact_dir, threads=0), ValueError, ["threads=0", "positive"]),
    ("load dir None", lambda e: Engine.load(None), TypeError, ["artifact_dir=None", "kvforge compile"]),
    ("load verify 1", lambda e: Engine.load(e.artifact_dir, verify=1), TypeError, ["verify=1", "True or False"]),
    ("load spin_stop", lambda e: Engine.load(e.artifact_dir, spin_stop="yes"), TypeError, ["spin_stop='yes'"]),
]


@pytest.mark.parametrize(("call", "error", "words"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_is_refused_and_changes_nothing(engine, fresh, call, error, words):
    engine.prefill([PROMPT])  # a known state: batch 1, row 0 holds 5 tokens
    before = state(engine)
    engine.last_bindings.clear()
    with pytest.raises(error) as info:
        result = call(engine)
        if hasattr(result, "__next__"):
            next(result)
    assert isinstance(info.value, ValueError), "every refusal is a ValueError (the CLI and server rely on it)"
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert engine.last_bindings == {}, "a graph ran before the refusal"
    assert state(engine) == before
    assert good_calls(engine) == fresh


def test_session_refusals_keep_the_conversation(engine, fresh):
    with engine.session() as s:
        s.append(PROMPT)
        for bad, words in [
            (lambda: s.append(None), ["prompt=None"]),
            (lambda: s.append([1.5]), ["prompt[0]=1.5"]),
            (lambda: s.append(b"xy"), ["bytes"]),
            (lambda: s.append([1], add_special_tokens=1), ["add_special_tokens=1"]),
            (lambda: s.sync([1.5]), ["ids[0]=1.5"]),
            (lambda: s.sync("abc"), ["ids='abc'"]),
            (lambda: s.sync([0, 10**6]), ["ids[1]=1000000", "outside the vocabulary"]),
            (lambda: s.rewind(1.0), ["n_tokens", "1.0"]),
            (lambda: s.rewind(99), ["n_tokens must be an integer in [0, 5]", "99"]),
            (lambda: s.generate(max_new_tokens=2.0), ["max_new_tokens", "2.0"]),
        ]:
            with pytest.raises(ValueError) as info:
                bad()
            assert all(w in str(info.value) for w in words), str(info.value)
            assert s.tokens == PROMPT and s.cached == 0
        s.rewind(np.int64(0))  # numpy ints are accepted
        assert s.generate(**GOOD).token_ids == fresh["session"]


def test_numpy_integers_are_accepted_everywhere(engine, fresh):
    ids = np.array(PROMPT, dtype=np.int32)
    assert engine.generate([ids, "The for statement"], max_new_tokens=np.int64(5))[0].token_ids == fresh["generate"]
    assert [t.token_ids[0] for t in engine.stream(list(map(np.int64, PROMPT)), max_new_tokens=np.uint8(5))] == fresh[
        "generate"
    ]
    logits = engine.prefill(np.array([[*PROMPT[:3], 0, 0], PROMPT])[:, :5].tolist())
    assert logits.shape == (2, engine.vocab_size)


def test_validate_messages_truncate_long_values():
    with pytest.raises(check.WrongType) as info:
        check.token_ids("prompt", [1] * 5000 + [0.5])
    assert "prompt[5000]=0.5" in str(info.value)
    with pytest.raises(check.WrongType) as info:
        check.prompt("prompt", b"x" * 5000)
    assert len(str(info.value)) < 300 and "..." in str(info.value)
    assert check.count("n", np.int16(3)) == 3 and type(check.count("n", np.int16(3))) is int
