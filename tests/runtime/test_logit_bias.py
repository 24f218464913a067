"""``SamplingParams.logit_bias`` through the engine's in-flight batch loop.

Proves: in one batch, a greedy row with a bias and plain-greedy rows (which the loop argmaxes as a
batch) each produce exactly the tokens they produce alone; +100 on a token makes every generated
token that token, -100 on the plain answer's first token keeps it out of the answer; an id outside
the vocabulary is refused before anything runs, naming the id and the vocabulary.
"""

from __future__ import annotations

import pytest

from kvforge.runtime import Engine, SamplingParams

PROMPTS = ["The for statement", "A list is a mutable", "def main():"]


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact, threads=1) as e:
        yield e


def test_biased_and_plain_greedy_rows_share_a_batch(engine):
    plain = engine.generate(PROMPTS, max_new_tokens=8, sampling=SamplingParams(temperature=0.0))
    first = plain[1].token_ids[0]
    forced = next(t for t in range(50, 500) if t not in engine.eos_token_ids)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={first: -100}),
        SamplingParams(temperature=0.0, logit_bias={forced: 100}),
    ]
    together = engine.generate(PROMPTS, max_new_tokens=8, sampling=params)
    alone = [engine.generate([p], max_new_tokens=8, sampling=s)[0] for p, s in zip(PROMPTS, params, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[0].token_ids == plain[0].token_ids
    assert first not in together[1].token_ids
    assert together[2].token_ids == [forced] * 8


def test_out_of_vocabulary_bias_is_refused(engine):
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias has token id {vocab} outside the vocabulary \[0, {vocab}\)"):
        engine.generate(PROMPTS[:1], max_new_tokens=2, sampling={"temperature": 0, "logit_bias": {vocab: 1.0}})
