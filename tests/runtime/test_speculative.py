"""Speculative decoding (issue 23) is exact: drafts change the number of engine calls, never the output.

Proves, on tiny random models built in-process:

* greedy output with n-gram drafts is token-identical to plain decoding on three cache layouts (GQA
  Llama, MHA GPT-NeoX, sliding-window Mistral) in both lowerings (gqa, onnx), batch 1 and batch 3
  (onnx rows verify in one call; gqa batches take a split step: one batched decode, then batch-1
  verify calls), with drafts accepted; under gqa, batch-3 rows with right predictions verify
  several drafts per call and give the plain greedy tokens (seeded sampling reproduces);
* the prediction drafter re-syncs like a diff after an insertion, a deletion and a replacement
  (exact accepted counts on a constructed prediction, replayed against a known output);
* explicit predictions (``SamplingParams(prediction=...)``): a right, half-right and wrong
  prediction give the plain output; a rejection at the first and at the last drafted position of
  a verify call; the accepted/rejected prediction counts;
* a stop string inside an accepted run cuts there (text, tokens, finish reason and stream chunks as
  plain decoding); a row reaching max_seq mid-draft stops with "length" at the same token;
* with sampling the acceptance rule keeps the target distribution: chi-square tests of the first
  three tokens' distributions with and without drafts over 600 seeds each; seeded runs reproduce;
* the scheduler runs mixed rows (n-gram, speculative=False, sampled, predicted) in one loop;
* a draft model (the same tiny model compiled again) proposes what the target accepts; a draft
  with another tokenizer and a schema-1 artifact are refused with messages saying what to do; a
  draft model's length is the one with the most expected tokens per measured cost (none when its
  tokens cost as much as the target's steps, probes after 16, 32, ... steps);
* ``kvforge bench --speculative``, the server's usage and /metrics report drafted and accepted
  tokens; ``kvforge generate --speculative`` prints the plain continuation, bad values are one-line
  errors.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections import Counter
from dataclasses import replace

import pytest

from kvforge.graphs.manifest import ArtifactError
from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.speculative import SpeculativeConfig, parse_speculative
from kvforge.runtime.speculative.cost import WIDTH_COST
from tests import families

REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
PROMPTS = [REPEAT, [1, 2, 3, 4, 1, 2, 3], list(range(30, 50)) * 2]


@pytest.fixture(scope="session")
def family_artifacts(tmp_path_factory):
    """(family id, lowering) -> artifact of the MHA and sliding-window tiny families (no score graph)."""
    from kvforge.compile import compile_model

    root = tmp_path_factory.mktemp("spec-families")
    out = {}
    for name in ("gpt-neox", "mistral-window"):
        [case] = [c for c in families.CASES if c[0] == name]
        model = families.build(root / name, *case[1:])
        for lowering in ("gqa", "onnx"):
            out[name, lowering] = root / f"{name}-{lowering}"
            compile_model(
                model, out[name, lowering], max_batch=4, max_seq=96, lowering=lowering, score_graph=False, progress=None
            )
    return out


def _artifact(request, family: str, lowering: str):
    if family == "llama":
        return request.getfixturevalue("llama_artifact" if lowering == "gqa" else "llama_onnx_artifact")
    return request.getfixturevalue("family_artifacts")[family, lowering]


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
@pytest.mark.parametrize("family", ["llama", "gpt-neox", "mistral-window"])
def test_greedy_identical_with_ngram_drafts(request, family, lowering):
    out = _artifact(request, family, lowering)
    with Engine.load(out) as plain, Engine.load(out, speculative="ngram:4") as spec:
        want = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=40)]
        batch = spec.generate(PROMPTS, max_new_tokens=40)
        assert [r.token_ids for r in batch] == want
        single = [spec.generate([p], max_new_tokens=40)[0] for p in PROMPTS]
        assert [r.token_ids for r in single] == want
        assert spec.width_cost == WIDTH_COST  # float weights' price of a verify call's token
    assert sum(r.accepted_tokens for r in single) > 0  # drafts were made and accepted
    assert all(r.accepted_tokens <= r.drafted_tokens for r in single)
    # onnx: the rows verify together; gqa: a batched decode checks each row's first draft
    assert sum(r.accepted_tokens for r in batch) > 0


def test_gqa_batch_verifies_rows_one_call_each(llama_artifact):
    """gqa, three rows: a batched decode confirms each row's first draft, then each row verifies
    the rest of its prediction alone; greedy tokens as plain decoding, seeded sampling reproducible."""
    prompts = PROMPTS
    config = SpeculativeConfig(method="prediction", prediction_k=6)
    sampled = [SamplingParams(temperature=0.9, top_k=8, seed=s) for s in range(3)]
    with Engine.load(llama_artifact) as plain, Engine.load(llama_artifact, speculative=config) as spec:
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=30)]
        greedy = [SamplingParams(temperature=0, prediction=w) for w in want]
        got = spec.generate(prompts, max_new_tokens=30, sampling=greedy)
        with_pred = [replace(p, prediction=w) for p, w in zip(sampled, want)]
        runs = [spec.generate(prompts, max_new_tokens=30, sampling=with_pred) for _ in range(2)]
    assert [r.token_ids for r in got] == want
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]  # seeded: reproducible
    assert sum(r.drafted_tokens for r in runs[0]) > 0
    for r in got:  # right predictions: runs of drafts verified per call, not one token per step
        assert r.prediction_rejected == 0 and r.drafted_tokens >= 2 * r.verify_steps
        assert r.verify_steps <= 12


def _replay(drafter, want: list[int], k: int) -> tuple[int, int, int]:
    """Speculative decoding of ``want`` as the target's output (the first token from the prefill):
    ``drafter``'s proposals checked against it, the accepted run and one more token per call.
    Returns (accepted, drafted, calls)."""
    out, accepted, drafted, calls = want[:1], 0, 0, 0
    while len(out) < len(want):
        p = drafter.propose(out, k)[: len(want) - len(out) - 1]
        run = 0
        while run < len(p) and p[run] == want[len(out) + run]:
            run += 1
        accepted, drafted, calls = accepted + run, drafted + len(p), calls + 1
        out = want[: len(out) + run + 1]
    return accepted, drafted, calls


def test_prediction_resyncs_like_a_diff():
    """The prediction holds a block X twice; the output inserts 2 tokens (901, 902) into Y, replaces
    X[8] of X's SECOND copy by 900 and leaves Z[10:13] out. Drafting 32 at a time:

    1. X, Y[:6] accepted (30), the target writes 901 instead of Y[6];
    2-3. 902, then Y[6] written plainly (nothing to match yet);
    4. re-joined after Y[6] (one token, near where the output left): Y[7:], X[:8] accepted (13);
       900 written;
    5. X[9] written plainly;
    6. re-joined at X's second copy (nearest after the anchor; the first occurrence would be the
       first copy, whose continuation is Y, not Z): X[10:], Z[:10] accepted (24); Z[13] written
       where Z[10] was drafted;
    7. re-joined after Z[13] at once (the skip): the last 9 accepted.
    """
    from kvforge.runtime.speculative import PredictionDrafter

    x, y, z = list(range(100, 124)), list(range(200, 212)), list(range(300, 324))
    prediction = [1000, *x, *y, *x, *z]
    want = [1000, *x, *y[:6], 901, 902, *y[6:], *x[:8], 900, *x[9:], *z[:10], *z[13:]]
    accepted, drafted, calls = _replay(PredictionDrafter(prediction), want, 32)
    assert (accepted, calls) == (30 + 13 + 24 + 9, 7)
    assert calls + accepted == len(want) - 1  # each call: its accepted run and one token
    assert drafted - accepted == 2 + 19 + 8  # rejected drafts: only at the three edits


@pytest.fixture(scope="module")
def engines(llama_onnx_artifact):
    config = SpeculativeConfig(method="prediction", prediction_k=4, adaptive=False)
    with Engine.load(llama_onnx_artifact) as plain, Engine.load(llama_onnx_artifact, speculative=config) as spec:
        yield plain, spec


def _greedy(engine, prompt, n, **kw):
    return engine.generate([prompt], max_new_tokens=n, sampling=SamplingParams(temperature=0, **kw))[0]


def test_predictions_right_half_wrong(engines):
    plain, spec = engines
    prompt = [3, 17, 29, 41, 3, 17]
    want = _greedy(plain, prompt, 24).token_ids
    half = want[:12] + [(t + 1) % 384 for t in want[12:]]
    wrong = want[:1] + [(t + 7) % 384 for t in want[1:]]  # right first token: its drafts are proposed
    right = _greedy(spec, prompt, 24, prediction=want)
    assert right.token_ids == want
    # 24 tokens = the prefill's + 4 calls of 4 drafts + 1 + one call of 2 drafts + 1 (max_new_tokens)
    assert right.prediction_accepted == right.drafted_tokens == 18 and right.prediction_rejected == 0
    assert right.verify_steps == 5
    got_half = _greedy(spec, prompt, 24, prediction=half)
    # the right half: tokens 1-4, 6-9 and 11 accepted (0 from the prefill, 5 and 10 the calls' own)
    assert got_half.token_ids == want and 9 <= got_half.prediction_accepted < got_half.drafted_tokens
    got_wrong = _greedy(spec, prompt, 24, prediction=wrong)
    assert got_wrong.token_ids == want and got_wrong.prediction_rejected > 0
    assert _greedy(spec, prompt, 24, prediction=want, speculative=False).drafted_tokens == 0


@pytest.mark.parametrize("where", [1, 4])
def test_rejection_at_first_and_last_drafted_position(engines, where):
    """One verify call of 4 drafts (max_new_tokens 6 = the prefill's token + 4 drafts + 1)."""
    plain, spec = engines
    prompt = [9, 8, 7, 6, 5]
    want = _greedy(plain, prompt, 6).token_ids
    prediction = list(want)
    prediction[where] = (prediction[where] + 1) % 384  # drafted position `where` (1 = first, 4 = last)
    got = _greedy(spec, prompt, 6, prediction=prediction)
    assert got.token_ids == want
    assert got.verify_steps >= 1 and got.drafted_tokens >= 4
    first_call_accepted = where - 1
    assert got.accepted_tokens >= first_call_accepted
    if where == 4:
        assert (got.drafted_tokens, got.accepted_tokens) == (4, 3)


def test_stop_string_inside_an_accepted_run(llama_onnx_artifact):
    config = SpeculativeConfig(method="prediction", prediction_k=8)
    with Engine.load(llama_onnx_artifact) as plain, Engine.load(llama_onnx_artifact, speculative=config) as spec:
        prompt = "Functions are defined with"
        full = plain.generate([prompt], max_new_tokens=30)[0]
        stop = plain.tokenizer.decode(full.token_ids[5:7])
        assert stop.strip() and stop in full.text
        want = plain.generate([prompt], max_new_tokens=30, stop=stop)[0]
        sampling = SamplingParams(temperature=0, prediction=full.token_ids, logprobs=2)
        got = spec.generate([prompt], max_new_tokens=30, stop=stop, sampling=sampling)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_string) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_string,
        )
        assert got.accepted_tokens > len(got.token_ids) - 2  # the stop fell inside an accepted run
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        plain_chunks = list(plain.stream(prompt, 30, stop=stop))
        spec_chunks = list(spec.stream(prompt, 30, SamplingParams(temperature=0, prediction=full.token_ids), stop))
        assert [(c.text, c.token_ids, c.finish_reason) for c in spec_chunks] == [
            (c.text, c.token_ids, c.finish_reason) for c in plain_chunks
        ]


def test_row_reaching_max_seq_mid_draft(engines):
    plain, spec = engines
    prompt = [(7 * i) % 300 + 2 for i in range(90)]  # max_seq 96: 6 positions left
    want = _greedy(plain, prompt, 20)
    assert want.finish_reason == "length" and len(want.token_ids) < 20
    got = _greedy(spec, prompt, 20, prediction=[*want.token_ids, 4, 4, 4, 4])
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert got.accepted_tokens > 0


def test_scheduler_mixed_rows(llama_onnx_artifact):
    prompts = [REPEAT, [1, 2, 3, 4, 1, 2, 3], list(range(30, 50)), [200, 201, 202]]
    with Engine.load(llama_onnx_artifact) as plain:
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=24)]
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7)
    runs = []
    for _ in range(2):
        with Engine.load(llama_onnx_artifact, speculative="ngram:3") as spec, spec.scheduler() as sched:
            handles = [
                sched.submit(prompts[0], 24),
                sched.submit(prompts[1], 24, SamplingParams(speculative=False)),
                sched.submit(prompts[2], 24, sampled),
                sched.submit(prompts[3], 24, SamplingParams(temperature=0, prediction=want[3][:10])),
            ]
            runs.append([h.result(timeout=60) for h in handles])
    first, second = runs
    assert first[0].token_ids == want[0] and first[0].accepted_tokens > 0
    assert first[1].token_ids == want[1] and first[1].drafted_tokens == 0
    assert first[3].token_ids == want[3] and first[3].prediction_accepted >= 9
    assert [r.token_ids for r in first] == [r.token_ids for r in second]  # seeded sampling reproduces


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with ``df`` degrees of freedom (series of the incomplete gamma)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    term = total = 1 / a
    for n in range(1, 2000):
        term *= z / (a + n)
        total += term
        if term < total * 1e-15:
            break
    return max(0.0, 1 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def _homogeneity_p(a: Counter, b: Counter) -> float:
    """Chi-square two-sample test; categories with fewer than 10 samples in all are pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rows = [[a[k] for k in keys] + [sum(a.values()) - sum(a[k] for k in keys)]]
    rows.append([b[k] for k in keys] + [sum(b.values()) - sum(b[k] for k in keys)])
    cols = [c for c in zip(*rows) if sum(c) > 0]
    n = sum(map(sum, cols))
    stat = 0.0
    for r in range(2):
        total = sum(c[r] for c in cols)
        for c in cols:
            expected = total * sum(c) / n
            stat += (c[r] - expected) ** 2 / expected
    return _chi2_sf(stat, len(cols) - 1)


def test_sampling_keeps_the_target_distribution(llama_onnx_artifact):
    """Drafts of the plain greedy continuation (often, not always, what sampling picks) accepted or
    rejected by the rule: the first three tokens keep their distribution (p > 0.001 each; the seeds
    of the two sides differ, so the samples are independent)."""
    prompt = [3, 17, 29, 41, 3, 17]
    n = 600
    config = SpeculativeConfig(method="prediction", prediction_k=2, adaptive=False)
    with Engine.load(llama_onnx_artifact) as plain, Engine.load(llama_onnx_artifact, speculative=config) as spec:
        greedy = _greedy(plain, prompt, 3).token_ids
        base = dict(temperature=1.5, top_k=6, repetition_penalty=1.2)
        without = plain.generate([prompt] * n, 4, [SamplingParams(**base, seed=s) for s in range(n)])
        # Whatever the first token c, the prediction drafts the greedy run's next two tokens after it.
        firsts = sorted({r.token_ids[0] for r in without})
        prediction = [t for c in firsts for t in (c, *greedy[1:3])]
        with_drafts = spec.generate(
            [prompt] * n, 4, [SamplingParams(**base, seed=s + n, prediction=prediction) for s in range(n)]
        )
    assert sum(r.drafted_tokens for r in with_drafts) > n  # every run verified drafts
    accepted = sum(r.accepted_tokens for r in with_drafts)
    assert 0 < accepted < sum(r.drafted_tokens for r in with_drafts)  # both branches of the rule ran
    for position in range(3):
        p = _homogeneity_p(
            Counter(r.token_ids[position] for r in without), Counter(r.token_ids[position] for r in with_drafts)
        )
        assert p > 1e-3, f"token {position}: p = {p:.2g}"
    again = spec_again = None
    with Engine.load(llama_onnx_artifact, speculative=config) as spec:
        params = SamplingParams(**base, seed=3, prediction=prediction)
        again, spec_again = spec.generate([prompt, prompt], 8, [params, params])
    assert again.token_ids == spec_again.token_ids


def test_draft_model_same_tokenizer(llama_artifact, llama_onnx_artifact):
    with Engine.load(llama_onnx_artifact) as plain:
        want = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=20)]
        plain_stop = _spin_stop(plain)
    with Engine.load(llama_onnx_artifact, speculative="draft:3", draft=llama_artifact) as spec:
        got = spec.generate(PROMPTS, max_new_tokens=20)
        # The two engines take turns on the same cores: neither's threads spin once its run ends.
        stops = [_spin_stop(e) for e in (spec, spec.draft_model.engine)]
    assert [r.token_ids for r in got] == want
    assert all(r.accepted_tokens == r.drafted_tokens > 0 for r in got)  # the same model: every draft is right
    assert stops == ["1", "1"] and plain_stop == ""
    with Engine.load(llama_onnx_artifact, speculative="draft:3", draft=llama_artifact, spin_stop=False) as spec:
        assert [_spin_stop(e) for e in (spec, spec.draft_model.engine)] == ["", ""]


def test_draft_model_row_keeps_tokens_across_requests(llama_artifact, llama_onnx_artifact):
    """A chat's next turn (the last prompt, its answer and more) takes the draft row that holds its
    prefix, so the draft prefills only what is new; the tokens are still plain decoding's."""
    first = PROMPTS[2]
    with Engine.load(llama_onnx_artifact) as plain:
        answer = plain.generate([first], max_new_tokens=12)[0].token_ids
        turn = [*first, *answer, 5, 6, 7]
        want = plain.generate([turn], max_new_tokens=12)[0].token_ids
    with Engine.load(llama_onnx_artifact, speculative="draft:3", draft=llama_artifact) as spec:
        draft = spec.draft_model.engine
        starts, prefill = [], draft.prefill_rows

        def spy(rows, at, row):
            starts.append((row, at[0], len(rows[0])))
            return prefill(rows, at, row)

        draft.prefill_rows = spy

        def generate(prompt):
            spec.draft_model.token_s = None  # unmeasured: every step drafts K (these models cost the same)
            return spec.generate([prompt], max_new_tokens=12)[0].token_ids

        assert generate(first) == answer
        row = starts[-1][0]
        assert generate(PROMPTS[0])  # shares nothing with the first: takes an empty row, not the first's
        assert starts[-1][0] != row
        starts.clear()
        assert generate(turn) == want
        turn_starts = list(starts)
        spec.draft_model.forget()  # the rows' tokens dropped: the same turn prefills from 0 again
        starts.clear()
        assert generate(turn) == want
        assert starts[0][1] == 0
    starts = turn_starts
    # The first draft of the turn: its row, written from past the first prompt (the draft cache holds
    # the first prompt and the answer's drafted tokens it was shown).
    assert starts[0][0] == row and starts[0][1] >= len(first)
    assert sum(n for _, _, n in starts) < len(turn)


def _spin_stop(engine) -> str:
    """The ``session.force_spinning_stop`` entry of the engine's step session ("" when unset)."""
    options = engine.backend.sessions[engine.decode_graph].get_session_options()
    try:
        return options.get_session_config_entry("session.force_spinning_stop")
    except Exception:  # ORT raises for a key never set
        return ""


def test_draft_model_length_follows_its_cost():
    """A draft model's row drafts the length with the most expected tokens per cost: none when its
    tokens cost as much as the target's steps (then a probe after 16 steps, 32, ...), several when they
    are cheap and accepted."""
    from kvforge.runtime.speculative import RowDrafting
    from kvforge.runtime.speculative.cost import best_k

    class Echo:
        def propose(self, generated, k):
            return [7] * k

    cost = [1.0]
    row = RowDrafting(Echo(), 8, token_cost=lambda: cost[0])
    proposals = [len(row.propose([1], 8)) for _ in range(48)]
    assert proposals == [0] * 15 + [1] + [0] * 31 + [1]  # 0.6 acceptance at a step's cost: plain, probes
    cost[0] = 0.05
    row.learn(1, 1)  # a recent run of accepted drafts
    row.learn(1, 1)
    assert len(row.propose([1], 8)) == best_k(row.rate, 8, 0.05) >= 4
    assert best_k(0.3, 8, 0.05) <= 2 and best_k(0.9, 8, 0.5) >= 1 and best_k(0.3, 8, 0.5) == 0


def test_ngram_length_follows_the_call_cost():
    """A prompt-lookup row alone in its step drafts the length with the most expected tokens per
    verify-call cost at its per-token acceptance rate: long while drafts are accepted, still long
    after a run breaks late, one token after misses (no pause while that pays), and only once the
    rate says plain decoding is cheaper a one-token draft after pauses of 1, 2, 4, 8, 16 steps; one
    acceptance ends them. In a step of several rows the row keeps the batch rule: the length
    doubles on full acceptance, falls to the accepted count + 1, and a miss pauses it."""
    from kvforge.runtime.speculative import RowDrafting
    from kvforge.runtime.speculative.cost import QUANTIZED_WIDTH_COST, best_k

    class Echo:
        def propose(self, generated, k):
            return [7] * k

    row = RowDrafting(Echo(), 8)
    lengths = []
    for accepted in (3, 7, 2):  # all of 3, all of 7, then 2 of 8 accepted
        lengths.append(len(row.propose([1], 8)))
        row.learn(lengths[-1], accepted)
    assert lengths == [best_k(0.6, 8, 0.0), 7, 8] == [3, 7, 8]
    assert row.rate == pytest.approx(0.5 * 0.9 + 0.5 * 2 / 3)  # a run of 2, then a miss: 2/3 a token
    assert len(row.propose([1], 8)) == best_k(row.rate, 8, 0.0) == 6
    assert len(row.propose([1], 8, alone=False)) == 3  # the batch rule: 2 accepted + 1
    lengths = []
    for _ in range(60):  # nothing accepted from here on
        lengths.append(len(row.propose([1], 8)))
        row.learn(lengths[-1], 0)
    drafts = [i for i, n in enumerate(lengths) if n]
    assert lengths[:4] == [6, 2, 1, 1]  # each miss halves the rate; no pause while drafting pays
    assert [b - a - 1 for a, b in itertools.pairwise(drafts[3:])] == [1, 2, 4, 8, 16, 16]
    assert len(row.propose([1], 8)) == 0  # paused
    row.learn(1, 1)  # an accepted draft (e.g. of another call): the rate is back at ~0.5
    assert row.alone_misses == 0 and len(row.propose([1], 8)) == best_k(row.rate, 8, 0.0) == 3
    assert best_k(0.075, 8, 0.0) == 0 < best_k(0.08, 8, 0.0) == 1  # plain wins below ~the width price

    dear = RowDrafting(Echo(), 8, width_cost=QUANTIZED_WIDTH_COST)  # quantized weights' calls
    assert len(dear.propose([1], 8)) == best_k(0.6, 8, 0.0, QUANTIZED_WIDTH_COST) == 2
    assert best_k(0.14, 8, 0.0, QUANTIZED_WIDTH_COST) == 0 < best_k(0.16, 8, 0.0, QUANTIZED_WIDTH_COST)

    batch = RowDrafting(Echo(), 8)
    assert len(batch.propose([1], 8, alone=False)) == 8  # the batch rule starts at k
    batch.learn(8, 0)
    assert [len(batch.propose([1], 8, alone=False)) for _ in range(2)] == [0, 1]  # a pause, then 1
    batch.learn(1, 1)
    assert len(batch.propose([1], 8, alone=False)) == 2  # doubled


def test_default_draft_lengths():
    """ngram drafts up to 8 tokens unless told (benchmarks/ngram_replay.py), a draft model up to 4."""
    assert parse_speculative("ngram").k == SpeculativeConfig().k == 8
    assert parse_speculative("ngram:3").k == 3 and SpeculativeConfig(k=5).k == 5
    assert parse_speculative("draft", draft="d").k == parse_speculative(None, draft="d").k == 4
    assert parse_speculative("draft:6", draft="d").k == 6
    assert SpeculativeConfig(method="prediction").max_width == 17  # 1 + prediction_k


def test_refusals(llama_onnx_artifact, family_artifacts, tmp_path):
    with pytest.raises(ArtifactError, match="does not share the target's tokenizer"):
        Engine.load(llama_onnx_artifact, draft=family_artifacts["gpt-neox", "onnx"])
    for bad in ("ngram:x", "beam", 3):
        with pytest.raises(ValueError, match="speculative="):
            parse_speculative(bad)
    with pytest.raises(ValueError, match="needs draft=DRAFT_OUT"):
        parse_speculative("draft")
    with pytest.raises(ValueError, match="prediction must be a list of token ids"):
        SamplingParams(prediction="abc")
    old = tmp_path / "old"
    shutil.copytree(llama_onnx_artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["schema_version"] = 1
    del manifest["graphs"]["verify"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="has no verify graph.*recompile"):
        Engine.load(old, speculative="ngram")
    with Engine.load(old) as engine:  # a schema-1 artifact still runs without drafting
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids) == 3


def test_bench_and_metrics_report_drafting(llama_onnx_artifact):
    """``kvforge bench --speculative`` reports acceptance and tokens per call; the server's usage
    does too, and its /metrics counts drafted and accepted tokens (vLLM's names)."""
    import httpx

    from kvforge.tools import bench
    from tests.tools.test_serve import KEY, MODEL, metric, post, running

    options = bench.BenchOptions(prompt_lens=(16,), batch_sizes=(2,), new_tokens=8, repeat=1, warmup=0, threads=1)
    report = bench.run_bench(llama_onnx_artifact, None, replace(options, speculative="ngram"))
    [cell] = report["cells"]
    sp = cell["speculative"]
    assert sp["greedy_tokens_identical"] and sp["tokens_per_target_call"] >= 1.0
    assert "speculative" in bench.format_report(report)
    with running(llama_onnx_artifact, speculative="ngram") as (url, _):
        body = {"model": MODEL, "prompt": REPEAT, "max_tokens": 30, "temperature": 0}
        answer = post(url, "/v1/completions", body)
        assert answer.status_code == 200
        spec_usage = answer.json()["usage"]["speculative"]
        assert spec_usage["accepted_tokens"] > 0 and spec_usage["tokens_per_target_call"] > 1
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    drafted = metric(text, "kvforge_spec_decode_num_draft_tokens_total")
    accepted = metric(text, "kvforge_spec_decode_num_accepted_tokens_total")
    assert drafted >= accepted > 0 and metric(text, "kvforge_spec_decode_num_drafts_total") > 0


def test_cli_generate_with_speculative(llama_artifact, capsys):
    from kvforge.tools.cli import main

    prompt = "Functions are defined with def. Functions are defined with"
    with Engine.load(llama_artifact) as plain:
        [want] = plain.generate([prompt], max_new_tokens=16)
    assert main(["generate", str(llama_artifact), prompt, "--max-new-tokens", "16", "--speculative", "ngram:3"]) == 0
    printed = capsys.readouterr()
    assert printed.out == prompt + want.text + "\n"
    # the gqa artifact's drafting keeps greedy output up to near-ties, and the CLI says so
    assert "speculative decoding on a 'gqa'-lowered artifact keeps greedy output up to near-ties" in printed.err
    assert "compile with --lowering exact" in printed.err
    assert main(["generate", str(llama_artifact), prompt, "--max-new-tokens", "2"]) == 0
    assert "near-ties" not in capsys.readouterr().err  # no drafts asked for: no note
    assert main(["generate", str(llama_artifact), "hi", "--speculative", "ngram:x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: ") and "speculative='ngram:x' is not accepted" in err
    assert main(["generate", str(llama_artifact), "hi", "--speculative", "draft"]) == 2
    assert "needs draft=DRAFT_OUT" in capsys.readouterr().err
