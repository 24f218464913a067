"""Opt-in (``-m real_model``, ``make test-real``): a real model end to end. SmolLM2-135M-Instruct,
converted by ``make smollm2`` (or the directory in ``KVFORGE_SMOLLM2``), compiled with compile's
defaults (float32), answers three questions through ``Engine.chat`` with exactly the tokens of
transformers' greedy ``generate`` on the prompt its ``apply_chat_template`` renders: the same prompt
ids, then the same reply ids, the eos included."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.runtime import Engine, SamplingParams

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir(smollm2_dir) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("smollm2") / "art"
    manifest = compile_model(model_dir, out, max_batch=1, score_graph=False, progress=None)
    assert manifest.parity["greedy_match"], manifest.parity
    with Engine.load(out) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_answers_equal_transformers_greedy(engine, reference, question):
    import torch

    model, tokenizer = reference
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = list(prompt["input_ids"])
    assert engine.chat_prompt(messages) == prompt_ids

    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=2
        )
    expected = generated[0, len(prompt_ids) :].tolist()
    result = engine.chat(messages, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams(temperature=0))
    assert result.token_ids == expected, (tokenizer.decode(result.token_ids), tokenizer.decode(expected))
    assert result.text.strip(), "an empty answer"
