"""Structured output in the runtime (runtime/constraints.py and its hooks), on the bundled model.

Proves: every output constrained by a JSON schema of the corpus (nested objects, arrays, enums,
bounded numbers, anyOf, string patterns) parses and validates with ``jsonschema``, greedy and
seeded, in ``generate``, ``stream``, ``chat``-free sessions and the scheduler; regex outputs
full-match their regex and Lark outputs are in their language; ``json_object`` gives a JSON
object; a grammar that completes ends the request with ``stop`` and ``max_new_tokens`` before that
gives ``length`` with the partial text; in a mixed scheduler batch the unconstrained rows give
exactly their unconstrained tokens; when the model would follow the constraint anyway the greedy
tokens equal the unconstrained ones; bad schemas, regexes and grammars are ValueErrors naming the
field and the problem, before anything runs; the mask, rollback and validate verbs agree with the
grammar; and without llguidance a constrained request names the ``structured`` extra.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from kvforge.runtime import Engine, SamplingParams

pytest.importorskip("llguidance")

PROMPTS = ["The for statement", "A list is a mutable", "Exceptions are", "The import system"]

CORPUS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "owner"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "level": {"enum": ["low", "high", 3]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["age", "ratio", "count"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}, {"enum": ["x"]}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[a-z]{1,4}$"},
        },
        "required": ["zip", "code"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": -5, "maximum": 5}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    with Engine.load(tiny_artifact, threads=1) as e:
        yield e


def _valid(text: str, schema: dict) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    if isinstance(value, dict) and "properties" in schema:  # keys come in the schema's order (llguidance's rule)
        assert list(value) == [k for k in schema["properties"] if k in value], text


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_schema_corpus_validates_greedy_and_seeded(engine, name):
    schema = CORPUS[name]
    sampling = [SamplingParams(temperature=0.0, json_schema=schema)] + [
        SamplingParams(temperature=1.0, seed=s, json_schema=schema) for s in range(3)
    ]
    results = engine.generate(PROMPTS, max_new_tokens=160, sampling=sampling)
    for r in results:
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        _valid(r.text, schema)


def test_json_schema_as_text_and_json_object(engine):
    as_text = SamplingParams(temperature=0.0, json_schema=json.dumps(CORPUS["nested"]))
    assert as_text.json_schema == CORPUS["nested"]  # JSON text is parsed once, at construction
    [r, obj] = engine.generate(
        PROMPTS[:2], max_new_tokens=160, sampling=[as_text, SamplingParams(temperature=0.7, seed=1, json_object=True)]
    )
    _valid(r.text, CORPUS["nested"])
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text


def test_regex_and_lark(engine):
    regex = r"(yes|no): [0-9]{2,4}"
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "bye"\nname: /[a-z]{1,6}/'
    results = engine.generate(
        PROMPTS[:3],
        max_new_tokens=40,
        sampling=[
            SamplingParams(temperature=0.0, regex=regex),
            SamplingParams(temperature=1.0, seed=7, regex=regex),
            SamplingParams(temperature=1.0, seed=3, grammar=lark),
        ],
    )
    assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
    assert re.fullmatch(regex, results[0].text) and re.fullmatch(regex, results[1].text)
    assert re.fullmatch(r"(hello|bye) [a-z]{1,6}!", results[2].text), results[2].text


def test_length_gives_partial_text(engine):
    [r] = engine.generate(PROMPTS[:1], max_new_tokens=4, sampling=SamplingParams(json_schema=CORPUS["nested"]))
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    assert r.text == engine.tokenizer.decode(r.token_ids) and r.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_followed_constraint_keeps_greedy_tokens(engine):
    """A regex that is exactly the model's own greedy text: every greedy token is allowed, so the
    tokens are the unconstrained ones; the grammar completes there (stop, not length)."""
    free = engine.generate(PROMPTS, max_new_tokens=12, sampling=SamplingParams(temperature=0.0))
    sampling = [SamplingParams(temperature=0.0, regex=re.escape(r.text)) for r in free]
    constrained = engine.generate(PROMPTS, max_new_tokens=40, sampling=sampling)
    for f, c in zip(free, constrained):
        assert c.token_ids == f.token_ids and c.finish_reason == "stop"


def test_mixed_scheduler_batch(engine):
    """Unconstrained rows next to constrained ones give exactly their unconstrained tokens."""
    free = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)]
    alone = engine.generate(PROMPTS[:2], max_new_tokens=24, sampling=free)
    schema = CORPUS["array_enum"]
    with engine.scheduler() as sched:
        handles = [
            sched.submit(PROMPTS[2], 160, SamplingParams(temperature=0.0, json_schema=schema)),
            sched.submit(PROMPTS[0], 24, free[0]),
            sched.submit(PROMPTS[3], 160, SamplingParams(temperature=1.0, seed=2, json_schema=schema)),
            sched.submit(PROMPTS[1], 24, free[1]),
        ]
        results = [h.result() for h in handles]
    assert results[1].token_ids == alone[0].token_ids and results[3].token_ids == alone[1].token_ids
    for r in (results[0], results[2]):
        _valid(r.text, schema)


def test_stream_and_session(engine):
    sp = SamplingParams(temperature=1.0, seed=11, json_schema=CORPUS["string_pattern"])
    chunks = list(engine.stream(PROMPTS[0], max_new_tokens=120, sampling=sp))
    [whole] = engine.generate(PROMPTS[:1], max_new_tokens=120, sampling=sp)
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == "stop"
    _valid(whole.text, CORPUS["string_pattern"])
    with engine.session() as s:
        s.append(PROMPTS[1])
        first = s.generate(120, sampling=sp)
        s.append(" and then")
        second = s.generate(120, sampling=SamplingParams(temperature=0.0, regex="[0-9]{3}"))
    _valid(first.text, CORPUS["string_pattern"])
    assert re.fullmatch("[0-9]{3}", second.text) and second.finish_reason == "stop"


def test_unconstrained_rows_carry_nothing(engine):
    gen = engine.request([1, 2, 3], 4, SamplingParams(temperature=0.0))
    assert gen.constraint is None and gen.sampler.plain_greedy  # the batch's argmax serves it
    gen = engine.request([1, 2, 3], 4, SamplingParams(temperature=0.0, regex="a+"))
    assert gen.constraint is not None and not gen.sampler.plain_greedy


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": {"type": "objectx"}}, "json_schema is not accepted: .*objectx"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": [1, 2]}, "json_schema must be a JSON Schema"),
        ({"regex": "a(b"}, "regex is not accepted: .*unclosed group"),
        ({"grammar": "start: foo"}, 'grammar is not accepted: .*unknown name: "foo"'),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": 1}, "json_object=1 is not accepted"),
        ({"regex": "a", "json_object": True}, "regex and json_object are all set; a request takes at most one"),
    ],
)
def test_bad_constraints_refused_before_anything_runs(engine, fields, message):
    with pytest.raises(ValueError, match=f"(?s){message}"):
        SamplingParams(**fields)
    with pytest.raises(ValueError, match=f"(?s){message}"):
        engine.generate(PROMPTS[:1], max_new_tokens=2, sampling=fields)  # a dict of fields, as a request body
    with engine.scheduler() as sched, pytest.raises(ValueError, match=f"(?s){message}"):
        sched.submit(PROMPTS[0], 2, fields)


def test_mask_accept_rollback_validate(engine):
    c = engine.grammars.new("regex", "ab(c|d)")
    tok = engine.tokenizer
    ids = [tok.token_to_id(t) for t in ("a", "b", "c", "d")]
    logits = np.random.default_rng(0).standard_normal(engine.vocab_size).astype(np.float32)

    def allowed() -> set[int]:
        masked = c.mask(logits)
        bits = np.unpackbits(c.bitmask.view(np.uint8), bitorder="little")[: engine.vocab_size].astype(bool)
        assert np.array_equal(masked[bits], logits[bits]) and np.isneginf(masked[~bits]).all()  # exact, -inf
        return set(np.flatnonzero(bits).tolist())

    assert ids[0] in allowed() and ids[1] not in allowed()
    before = allowed()
    assert c.validate([ids[0], ids[1], ids[3]]) == 3 and c.validate([ids[1]]) == 0
    assert c.accept([ids[0], ids[1]]) and not c.is_terminated
    after = allowed()
    assert {ids[2], ids[3]} <= after and ids[0] not in after
    c.rollback(2)
    assert allowed() == before and c.accepted == 0
    assert c.accept([ids[0], ids[1], ids[2]]) and c.is_terminated
    word = c.fill_mask()[ids[2] >> 5]
    assert not (int(word) >> (ids[2] & 31)) & 1  # nothing more but eos
    with pytest.raises(ValueError, match="cannot roll back 4 tokens: 3 accepted"):
        c.rollback(4)


def test_without_llguidance_names_the_extra():
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "from kvforge.runtime import SamplingParams\n"
        "SamplingParams()\n"
        "try:\n    SamplingParams(regex='a')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'kvforge[structured]'" in out


def test_warm_builds_the_tokenizer_off_the_calling_thread(tiny_artifact):
    """A server warms the grammar tokenizer at start-up, so its first constrained request does not
    build it on the event loop; without a tokenizer.json there is nothing to warm."""
    from kvforge.runtime.constraints import GrammarFactory

    factory = GrammarFactory(tiny_artifact / "tokenizer.json", 4096, [0])
    thread = factory.warm()
    assert thread is not None and thread.name == "kvforge-grammar-warm"
    thread.join(30)
    assert factory._tok is not None
    assert factory.tokenizer() is factory._tok  # built once
    assert GrammarFactory(None, 4096, [0]).warm() is None
