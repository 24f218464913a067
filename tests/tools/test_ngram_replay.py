"""benchmarks/ngram_replay.py's replay on hand-made token lists (no model): which drafts the runtime's
ngram drafter proposes and the output accepts, how many verify calls that takes, and their cost."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def nr():
    return load_benchmark("ngram_replay")


def test_copied_output_takes_fewer_calls_as_k_grows(nr):
    passage = list(range(100, 140))  # 40 distinct tokens
    prompt, output = [7, 8, *passage, 9], [1, 2, *passage[:30]]  # the answer copies after 2 tokens
    widths = []
    calls, cost = nr.replay(prompt, output, 4, lambda w: widths.append(w) or 1.0)
    # Fed 1, 2, passage[0]: no bigram of the prompt ends there, plain steps. Fed passage[1]: (p0, p1)
    # matches and every draft after it is right: 4 drafts a call (k), 5 tokens; the last call is cut
    # to the 3 tokens left.
    assert widths == [1, 1, 1, 5, 5, 5, 5, 5, 3]
    assert (calls, cost) == (9, 9.0)
    widths = []
    assert nr.replay(prompt, output, 8, lambda w: widths.append(w) or 1.0) == (7, 7.0)
    assert widths == [1, 1, 1, 9, 9, 9, 1]  # k 8; the last token is a plain step (no room for a draft)


def test_rejected_drafts_pause_and_cost_by_width(nr):
    prompt, output = [5, 6, 7, 8, 9] * 2, [5, 1, 2, 3, 4]  # after 5 the prompt says 6 7 8 9, the output 1
    widths = []
    calls, cost = nr.replay(prompt, output, 4, lambda w: widths.append(w) or 1.0 + 0.1 * (w - 1))
    # 3 drafts (the 4 tokens left: the fed one and 3), none accepted; then the pause, nothing to match.
    assert widths == [4, 1, 1, 1]
    assert calls == 4 and cost == pytest.approx(1.3 + 3)


def test_interpolated_cost(nr):
    cost = nr.interpolate({1: 1.0, 3: 1.4, 9: 2.6})
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.2) and cost(6) == pytest.approx(2.0)
    assert cost(18) == pytest.approx(5.2)  # past the last width: proportional to it
