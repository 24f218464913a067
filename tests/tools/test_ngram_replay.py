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
    # matches and every draft after it is right. The first call drafts 3 (the most expected tokens per
    # call cost at the starting rate 0.6), every later one k = 4 (5 tokens a call); the last call is
    # cut to the 4 tokens left.
    assert widths == [1, 1, 1, 4, 5, 5, 5, 5, 4]
    assert (calls, cost) == (9, 9.0)
    widths = []
    assert nr.replay(prompt, output, 8, lambda w: widths.append(w) or 1.0) == (7, 7.0)
    assert widths == [1, 1, 1, 4, 8, 9, 7]  # 3 drafts, then 7 (rate 0.8), then k 8; the rest (6) last


def test_rejected_drafts_cost_by_width(nr):
    prompt, output = [5, 6, 7, 8, 9] * 2, [5, 1, 2, 3, 4]  # after 5 the prompt says 6 7 8 9, the output 1
    widths = []
    calls, cost = nr.replay(prompt, output, 4, lambda w: widths.append(w) or 1.0 + 0.1 * (w - 1))
    # 3 drafts (the 4 tokens left: the fed one and 3), none accepted; then nothing to match.
    assert widths == [4, 1, 1, 1]
    assert calls == 4 and cost == pytest.approx(1.3 + 3)


def test_batch_replay_every_row_pays_the_width(nr):
    passage = list(range(100, 140))
    prompt = [7, 8, *passage, 9]
    copying, own = [1, 2, *passage[:30]], list(range(500, 510))  # one row copies, one drafts nothing
    outputs, prompts = [copying, own], [prompt, prompt]
    # Calls cost the same whatever their shape: plain decoding takes one call per token of the longer
    # row (31); with drafts the copying row's calls are its batch-1 replay's (9, as above), and the
    # other row's 9 tokens fit in them.
    flat = lambda rows, width: 1.0  # noqa: E731
    assert nr.replay_batch(prompts, outputs, 4, flat, "plain") == 31.0
    assert nr.replay_batch(prompts, outputs, 4, flat, "oracle") == 9.0
    assert nr.replay_batch(prompts, outputs, 4, flat, "loop") == 9.0
    # Wide calls dear (each row pays every position): plain is 9 two-row steps + 22 one-row steps;
    # the oracle's width is never worse than plain's or the loop's rule.
    dear = lambda rows, width: rows * (1 + 0.5 * (width - 1))  # noqa: E731
    plain = nr.replay_batch(prompts, outputs, 4, dear, "plain")
    assert plain == 9 * 2 + 22 * 1
    assert nr.replay_batch(prompts, outputs, 4, dear, "oracle") < min(
        plain, nr.replay_batch(prompts, outputs, 4, dear, "loop")
    )


def test_interpolated_cost(nr):
    cost = nr.interpolate({1: 1.0, 3: 1.4, 9: 2.6})
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.2) and cost(6) == pytest.approx(2.0)
    assert cost(18) == pytest.approx(5.2)  # past the last width: proportional to it
    costs = nr.row_costs({(1, 1): 1.0, (1, 3): 1.4, (2, 1): 1.2, (2, 3): 2.0})
    assert costs(1, 2) == pytest.approx(1.2) and costs(2, 2) == pytest.approx(1.6)
