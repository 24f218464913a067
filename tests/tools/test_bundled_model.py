"""The bundled, trained model (models/kvforge-tiny): it loads with plain transformers and writes
readable text, and kvforge's greedy output equals transformers' on it, one prompt at a time and
in a ragged batch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvforge.compile import compile_model
from kvforge.runtime import Engine
from tests.helpers import hf_greedy

MODEL = Path(__file__).resolve().parents[2] / "models" / "kvforge-tiny"
PROMPTS = ["The for statement", "A list is", "Exceptions are", "The return value of the function", "If the"]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(MODEL).eval(), AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundled") / "art"
    compile_model(MODEL, out, max_batch=4, max_seq=128, score_graph=False, progress=None)
    with Engine.load(out) as engine:
        yield engine


def test_model_files_and_size():
    names = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in MODEL.iterdir()) <= 25 * 2**20


def test_transformers_writes_readable_text(reference):
    model, tokenizer = reference
    ids = tokenizer("The for statement", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "a", "is", "of", "to", "in", "and", "be", "an", "are", "for", "statement", "if", "or"}
    assert len(words) >= 15, text
    assert sum(w.lower() in common for w in words) >= 4, f"not English-like: {text!r}"


def test_kvforge_tokenizer_matches_transformers(engine, reference):
    _, tokenizer = reference
    for prompt in PROMPTS:
        assert engine.tokenizer.encode(prompt) == tokenizer(prompt).input_ids


def test_greedy_equals_transformers_one_by_one_and_batched(engine, reference):
    model, tokenizer = reference
    expected = [hf_greedy(model, tokenizer(p).input_ids, 40) for p in PROMPTS]
    alone = [engine.generate([p], max_new_tokens=40)[0] for p in PROMPTS]
    batched = engine.generate(PROMPTS, max_new_tokens=40)  # 5 prompts: a ragged batch of 4, then 1
    for prompt, want, one, row in zip(PROMPTS, expected, alone, batched):
        assert one.token_ids == want, prompt
        assert row.token_ids == want, prompt
        assert one.text == tokenizer.decode(want, skip_special_tokens=True)


def test_tied_lm_head_is_packed_and_the_lookup_reads_rows(engine):
    """The model ties its lm_head to the embedding table. In the ORT-optimized graph the Gemm reads
    a view of the table's bytes in weights.data (an initializer of its own, which ORT packs) and
    the Gather reads the table, which the engine holds row by row (kvforge.runtime.embedding_rows):
    after a generation, only the rows looked up are loaded. The portable graph keeps the plain
    Gather + Gemm on one initializer."""
    import onnx

    engine.generate(PROMPTS[:1], max_new_tokens=8)
    for name in ("prefill.ort.onnx", "prefill.onnx"):
        graph = onnx.load(str(engine.artifact_dir / name), load_external_data=False).graph
        inits = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
        tables = {i.name for i in graph.initializer if list(i.dims) == [4096, 256]}  # vocab x hidden
        gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] in tables)
        gemm = next(n for n in graph.node if n.op_type == "Gemm")
        if name == "prefill.ort.onnx":
            assert gemm.input[1] != gather.input[0] and not [n for n in graph.node if n.op_type == "Identity"]
            view, table = inits[gemm.input[1]], inits[gather.input[0]]
            assert (view["offset"], view["length"]) == (table["offset"], table["length"])
            [rows] = engine.backend.embedding_rows.values()
            assert rows.offset == int(table["offset"]) and rows.array.shape == (4096, 256)
            assert 0 < rows.loaded_count < 4096 // 4
        else:
            assert gemm.input[1] == gather.input[0]
