"""Structured output on the real SmolLM2-135M-Instruct (opt in: ``-m real_model``; the HF directory in
the ``smollm2_dir`` fixture: ``make smollm2`` or ``KVFORGE_SMOLLM2``; compiled once per module, ~1 min).

Proves: on a real 49,152-token vocabulary, every output constrained by the runtime tests' schema
corpus parses and validates (greedy and seeded, one batch); when the model already answers with
JSON that a schema allows, the constrained greedy tokens equal the unconstrained ones (the
unconstrained run ends with eos, the constrained one the token before, when the grammar completes).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvforge.runtime import Engine, SamplingParams
from tests.runtime.test_constraints import CORPUS

pytestmark = pytest.mark.real_model
pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def engine(smollm2_dir, tmp_path_factory):
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    compile_model(smollm2_dir, out, max_batch=4, max_seq=512, score_graph=False, progress=None)
    with Engine.load(out, threads=2) as e:
        yield e


def _ask(engine: Engine, text: str) -> list[int]:
    return engine.chat_prompt([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_schema_corpus_on_smollm2(engine, name):
    schema = CORPUS[name]
    prompt = _ask(engine, f"Answer with a JSON value that follows this JSON schema: {json.dumps(schema)}")
    sampling = [SamplingParams(temperature=0.0, json_schema=schema)] + [
        SamplingParams(temperature=0.8, seed=s, json_schema=schema) for s in range(3)
    ]
    for r in engine.generate([prompt] * 4, max_new_tokens=200, sampling=sampling):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)


def test_followed_schema_keeps_greedy_tokens(engine):
    prompt = _ask(
        engine,
        'Give me a JSON object with keys "name" and "age" for a person called Bob aged 30. Answer with JSON only.',
    )
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    [free] = engine.generate([prompt], max_new_tokens=60, sampling=SamplingParams(temperature=0.0))
    jsonschema.validate(json.loads(free.text), schema)  # the model follows it anyway
    [constrained] = engine.generate(
        [prompt], max_new_tokens=60, sampling=SamplingParams(temperature=0.0, json_schema=schema)
    )
    n = len(constrained.token_ids)
    assert constrained.finish_reason == "stop" and constrained.token_ids == free.token_ids[:n]
    assert set(free.token_ids[n:]) <= engine.eos_token_ids and len(free.token_ids) - n <= 1
