"""benchmarks/spec_peers.py's summary arithmetic on hand-made rounds (no model, no timing): medians over
rounds, each drafting row's ratio and token identity against its own plain row, the mean ratio per
prompt kind, the batch ratio, and kvforge's drafting row over llama.cpp's prompt lookup."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def sp():
    return load_benchmark("spec_peers")


def _round(speeds, tokens, batch=None):
    r = {"prompts": [{"tokens": t, "tok_s": s, "ttft_s": 0.1} for s, t in zip(speeds, tokens)]}
    if batch is not None:
        r["batch"] = {"tok_s": batch, "tokens": [[1]]}
    return r


def test_summary_of_two_rows_and_a_peer(sp):
    kinds = ["grounded", "grounded", "open"]
    same, other = [[1, 2], [3], [4, 5]], [[1, 2], [9], [4, 5]]
    rows = {
        "kvforge int4 plain": sp.combine([_round([10, 10, 20], same, 100), _round([30, 10, 20], same, 140)]),
        "kvforge int4 ngram": sp.combine([_round([40, 30, 19], same, 150), _round([40, 30, 19], other, 150)]),
        "llama.cpp Q4_1 plain": sp.combine([_round([10, 10, 10], same)]),
        "llama.cpp Q4_1 lookup 10": sp.combine([_round([20, 10, 10], other)]),
    }
    plain = rows["kvforge int4 plain"]
    assert [p["tok_s"] for p in plain["prompts"]] == [20, 10, 20]  # medians over the rounds
    assert plain["batch"]["tok_s"] == 120
    assert not rows["kvforge int4 ngram"]["prompts"][1]["same_every_round"]
    pairs = {"kvforge int4 ngram": "kvforge int4 plain", "llama.cpp Q4_1 lookup 10": "llama.cpp Q4_1 plain"}
    sp.compare(rows, pairs)
    assert [p["ratio"] for p in rows["kvforge int4 ngram"]["prompts"]] == [2.0, 3.0, 0.95]
    assert [p["identical"] for p in rows["llama.cpp Q4_1 lookup 10"]["prompts"]] == [True, False, True]
    summary = sp.summarize(rows, pairs, kinds)
    ngram = summary["drafting"]["kvforge int4 ngram"]
    assert ngram["mean_ratio"] == {"grounded": 2.5, "open": 0.95}
    assert ngram["identical"] == {"grounded": True, "open": True}
    assert ngram["batch_ratio"] == 150 / 120
    assert summary["drafting"]["llama.cpp Q4_1 lookup 10"]["identical"] == {"grounded": False, "open": True}
    versus = summary["versus"]["kvforge int4 ngram / llama.cpp Q4_1 lookup 10"]
    assert versus["per_prompt"] == [2.0, 3.0, 1.9]
    assert versus["mean"] == {"grounded": 2.5, "open": 1.9}
    assert "kvforge int4 exact ngram / llama.cpp Q4_1 lookup 10" not in summary["versus"]  # no such row: left out


def test_a_failed_row_is_left_out(sp):
    rows = {"kvforge fp32 plain": {"error": "boom"}, "kvforge fp32 ngram": sp.combine([_round([5], [[1]])])}
    pairs = {"kvforge fp32 ngram": "kvforge fp32 plain"}
    sp.compare(rows, pairs)
    assert "ratio" not in rows["kvforge fp32 ngram"]["prompts"][0]
    assert sp.summarize(rows, pairs, ["open"]) == {"drafting": {}, "versus": {}}
