"""Windowed perplexity (kvforge.tools.perplexity), the pipeline benchmarks/quality.py runs: the
windows score every token after the first exactly once (non-overlapping windows: as ``compare``
always did), and on the bundled trained model a text longer than the artifact's max_seq scored
through score.onnx gives transformers' own perplexity (its ``labels`` loss, the unscored
positions masked with -100) within rel 1e-5, non-overlapping and strided."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.compile import compile_model
from kvforge.runtime import Engine
from kvforge.tools import compare
from kvforge.tools import perplexity as ppl

MODEL = Path(__file__).resolve().parents[2] / "models" / "kvforge-tiny"
MAX_SEQ = 64


def test_non_overlapping_windows_skip_each_windows_first_token():
    plan = ppl.windows(10, 4)
    assert [(w.start, w.end, w.first) for w in plan] == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert ppl.windows(9, 4)[-1] == ppl.Window(4, 8, 5)  # a last window of one token scores nothing


@pytest.mark.parametrize(("n", "window", "stride"), [(10, 4, 2), (100, 16, 5), (17, 16, 1), (5, 8, 3), (33, 8, 8)])
def test_strided_windows_score_every_token_once(n, window, stride):
    plan = ppl.windows(n, window, stride)
    scored = [t for w in plan for t in range(w.first, w.end)]
    if stride < window:
        assert scored == list(range(1, n))  # every token but the first, once, in order
    assert all(w.end - w.start <= window and w.start < w.first < w.end for w in plan)
    assert all(w.start == i * stride for i, w in enumerate(plan))


def test_window_arguments_are_checked():
    with pytest.raises(ValueError, match="stride must lie in 1..window=4, got 5"):
        ppl.windows(10, 4, 5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ppl.windows(10, 1)


def test_window_nll_is_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 11)).astype(np.float32)
    ids = list(rng.integers(0, 11, 20))
    w = ppl.Window(start=10, end=16, first=12)
    expected = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits[1:5]).double(), torch.tensor(ids[12:16]), reduction="none"
    )
    np.testing.assert_allclose(ppl.window_nll(logits, ids, w), expected.numpy(), rtol=1e-12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ppl") / "art"
    compile_model(MODEL, out, max_batch=1, max_seq=MAX_SEQ, optimize=False, progress=None)
    reference = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager").eval()
    with Engine.load(out, threads=1) as engine:
        ids = engine.encode(compare.load_text(None))
        yield engine, reference, ids


def _transformers_ppl(model, ids: list[int], plan: list[ppl.Window]) -> float:
    total, count = 0.0, 0
    for w in plan:
        chunk = torch.tensor([ids[w.start : w.end]])
        labels = chunk.clone()
        labels[0, : w.first - w.start] = -100  # context only
        with torch.no_grad():
            loss = model(chunk, labels=labels).loss
        total, count = total + float(loss) * w.scored, count + w.scored
    return math.exp(total / count)


@pytest.mark.parametrize("stride", [MAX_SEQ, 24])
def test_score_graph_perplexity_is_transformers_own(tiny, stride):
    engine, reference, ids = tiny
    assert len(ids) > 4 * MAX_SEQ  # several windows
    plan = ppl.windows(len(ids), MAX_SEQ, stride)
    nll = np.concatenate([ppl.window_nll(engine.score([ids[w.start : w.end]])[0], ids, w) for w in plan])
    assert len(nll) == sum(w.scored for w in plan)
    ours, theirs = ppl.perplexity(nll), _transformers_ppl(reference, ids, plan)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert 1.0 < ours < 0.1 * engine.manifest.model.vocab_size  # trained: far below a random model (~vocab)
