"""runtime/sampling.py: the sampler gives transformers' distributions, draws reproducibly, reports logprobs.

Proves: (1) the probabilities the Sampler draws from equal those of transformers' own logits
processors, built by transformers' ``_get_logits_processor`` (so in its order), on the same logits and
prompt/generated ids, for each processor alone and all combined, float32 and float16 logits; the kept
token sets are identical and the probabilities agree within 1e-6 + 1e-5·p (presence/frequency
penalties, absent from transformers, are applied in the reference with vLLM's arithmetic right after the
repetition penalty); the same at V=32768, where top-k/top-p take their fast paths, and with many exact
ties at the top-k threshold; (2) temperature 0 is argmax (lowest id on ties) of the penalised logits; (3) a seed
gives the same tokens alone or interleaved with other requests, one RNG draw per sampled token, and
different seeds differ; (4) empirical frequencies of 20000 draws match the distribution within 5
standard errors and excluded tokens are never drawn; (5) logprobs are the raw log-softmax (numpy
reference, 1e-5) with the k most likely alternatives; (6) GenerationDefaults.from_artifact reads
generation_config.json as transformers' GenerationConfig + generate's global defaults; (7) each invalid
parameter raises ValueError naming the parameter, the value and what is accepted, and unknown keys in
``from_dict`` and bad generation_config.json values are refused by name; (8) ``logit_bias`` adds its
bias before every other processor, as transformers' ``SequenceBiasLogitsProcessor`` (first in its
order, as in vLLM's sampler) does: same distributions alone and with penalties and warpers; +100
forces and -100 forbids a token under greedy decoding; a biased greedy sampler is not "plain
greedy", allocates nothing per step, and ids outside the vocabulary or biases outside [-100, 100]
are refused by name.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from transformers.generation.utils import GenerationMixin

from kvforge.runtime import GenerationDefaults, Sampler, SamplingParams, TokenLogprob

V = 512
ATOL, RTOL = 1e-6, 1e-5


class _Processors(GenerationMixin):
    """Just enough of a decoder-only model for transformers' ``_get_logits_processor``."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(is_encoder_decoder=False)


def hf_distribution(params: SamplingParams, logits: np.ndarray, prompt: list[int], generated: list[int]) -> np.ndarray:
    """transformers' sampling distribution ``[V]`` float64 for ``params`` (resolved, temperature > 0)."""
    cfg = GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p if params.min_p > 0 else None,
        repetition_penalty=params.repetition_penalty,
        sequence_bias={(t,): b for t, b in params.logit_bias.items()} if params.logit_bias else None,
    )
    processors = _Processors()._get_logits_processor(
        generation_config=cfg, input_ids_seq_length=len(prompt), device="cpu"
    )
    input_ids = torch.tensor([prompt + generated])
    scores = torch.from_numpy(logits).to(torch.float32)[None]  # generate: logits[:, -1].to(float32)
    if not any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in processors):
        scores = _openai_penalties(params, scores, generated)
    for proc in processors:
        scores = proc(input_ids, scores)
        if isinstance(proc, RepetitionPenaltyLogitsProcessor):
            scores = _openai_penalties(params, scores, generated)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


def _openai_penalties(params: SamplingParams, scores: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """vLLM's apply_penalties after its repetition penalty: frequency then presence, over generated ids."""
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=scores.shape[-1]).to(torch.float32)
    scores = scores - params.frequency_penalty * counts
    return scores - params.presence_penalty * (counts > 0).to(torch.float32)


def ours(params: SamplingParams, logits: np.ndarray, prompt: list[int], generated: list[int]) -> np.ndarray:
    s = Sampler(params, prompt, V)
    for t in generated:
        s.record(t)
    return s.distribution(logits)


def random_case(seed: int, dtype) -> tuple[np.ndarray, list[int], list[int]]:
    rng = np.random.default_rng(seed)
    if dtype == np.float16:
        # distinct float16 values: ties would let torch's unstable sort cut a tie group differently
        logits = rng.permutation(np.linspace(-9.0, 7.0, V)).astype(np.float16)
    else:
        logits = (rng.standard_normal(V) * 2.5).astype(np.float32)
    prompt = rng.integers(0, V, 12).tolist()
    generated = rng.integers(0, V, 9).tolist() + [int(np.argmax(logits))] * 2  # the top token repeated
    return logits, prompt, generated


CASES = {
    "temperature<1": dict(temperature=0.6),
    "temperature>1": dict(temperature=1.7),
    "repetition>1": dict(temperature=1.0, repetition_penalty=1.3),
    "repetition<1": dict(temperature=1.0, repetition_penalty=0.7),
    "top_k": dict(temperature=1.0, top_k=17),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_p_small": dict(temperature=1.0, top_p=0.05),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "presence": dict(temperature=1.0, presence_penalty=1.5),
    "frequency": dict(temperature=1.0, frequency_penalty=-0.7),
    "all": dict(
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.4,
        frequency_penalty=0.3,
    ),
    "all_top_p_before_min_p": dict(temperature=1.3, top_k=0, top_p=0.7, min_p=0.2, repetition_penalty=0.9),
    "logit_bias": dict(temperature=1.0, logit_bias={3: 5.0, 7: -30.0, 11: 2.5, 500: -3}),
    "logit_bias_all": dict(
        temperature=0.8,
        top_k=30,
        top_p=0.9,
        repetition_penalty=1.3,  # the bias first, then the penalties (vLLM and transformers agree)
        presence_penalty=0.5,
        frequency_penalty=0.2,
        logit_bias={"20": 4.0, 21: -4.0, 22: 30},
    ),
}
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_equals_transformers_processors(case, dtype):
    params = SamplingParams(**{**OFF, **CASES[case]})
    for seed in range(3):
        logits, prompt, generated = random_case(seed, dtype)
        ref = hf_distribution(params, logits, prompt, generated)
        got = ours(params, logits, prompt, generated)
        kept_ref, kept_got = ref > 0, got > 0
        diff = np.flatnonzero(kept_ref != kept_got)
        assert diff.size == 0, (
            f"{case}: kept sets differ at ids {diff[:10]} (ref p={ref[diff[:10]]}, ours={got[diff[:10]]})"
        )
        excess = np.abs(got - ref) - (ATOL + RTOL * ref)
        worst = int(np.argmax(excess))
        assert excess[worst] <= 0, f"{case}: p[{worst}] {got[worst]:.9g} vs transformers {ref[worst]:.9g}"
        if case in ("top_k", "top_p", "top_p_small", "min_p", "all"):
            assert kept_got.sum() < V, f"{case} filtered nothing: the case does not test the filter"


LARGE_CASES = {
    "top_k": dict(temperature=0.8, top_k=40),
    "top_k_large": dict(temperature=0.8, top_k=3000),
    "top_p_peaky": dict(temperature=0.7, top_p=0.9),
    "top_p_flat": dict(temperature=3.0, top_p=0.95),
    "top_p_min_p": dict(temperature=1.0, top_p=0.6, min_p=0.02, repetition_penalty=1.3),
}


@pytest.mark.parametrize("case", list(LARGE_CASES))
def test_large_vocabulary_fast_paths_equal_transformers(case):
    """At V=32768 top-k and top-p select from a subsample / a candidate nucleus instead of sorting
    everything (or fall back to the full sort for a flat distribution): same kept set, same p."""
    n_vocab = 32768
    params = SamplingParams(**{**OFF, **LARGE_CASES[case]})
    rng = np.random.default_rng(5)
    for _ in range(2):
        logits = (rng.standard_normal(n_vocab) * 3).astype(np.float32)
        prompt = rng.integers(0, n_vocab, 50).tolist()
        s = Sampler(params, prompt, n_vocab)
        got = s.distribution(logits)
        ref = hf_distribution(params, logits, prompt, [])
        assert np.array_equal(got > 0, ref > 0), f"{case}: kept {int((got > 0).sum())} vs {int((ref > 0).sum())}"
        assert np.all(np.abs(got - ref) <= ATOL + RTOL * ref), case
        assert 1 < (got > 0).sum() < n_vocab


def test_top_k_keeps_ties_like_transformers():
    """Logits with many exact ties (float16 rounding of a coarse grid): every token tied with the
    k-th largest is kept, on both the subsample path (large V, small k) and the full partition."""
    rng = np.random.default_rng(11)
    for n_vocab, k in ((32768, 7), (32768, 300), (512, 100), (512, 3)):
        logits = rng.integers(-40, 40, n_vocab).astype(np.float16) / np.float16(8)
        params = SamplingParams(**{**OFF, "temperature": 1.0, "top_k": k})
        got = Sampler(params, [], n_vocab).distribution(logits)
        ref = hf_distribution(params, logits, [0], [])
        assert np.array_equal(got > 0, ref > 0) and (got > 0).sum() > k, (n_vocab, k)
        assert np.all(np.abs(got - ref) <= ATOL + RTOL * ref)


def test_greedy_is_argmax_of_penalised_logits_lowest_id_on_ties():
    logits = np.zeros(V, dtype=np.float32)
    logits[[7, 3, 300]] = 5.0
    s = Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=5), [], V)
    assert s.plain_greedy
    assert s(logits) == 3 and s(logits.astype(np.float16)) == 3
    assert s.rng.bit_generator.state == Sampler(s.params, [], V).rng.bit_generator.state  # greedy draws nothing
    # With a repetition penalty on id 3 (from the prompt), transformers' greedy processors pick 7.
    params = SamplingParams(temperature=0.0, top_k=50, top_p=0.5, min_p=0.0, repetition_penalty=1.5)
    s = Sampler(params, [3], V)
    assert not s.plain_greedy
    scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[3]]), torch.from_numpy(logits)[None])
    assert s(logits) == int(torch.argmax(scores)) == 7
    assert s(logits) == 300  # 3 and 7 are both penalised now


def test_plain_greedy_only_without_penalties_and_logprobs():
    base = dict(temperature=0.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    assert Sampler(SamplingParams(**base), [], V).plain_greedy
    for extra in (
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.1),
        dict(logit_bias={1: 0.5}),
    ):
        assert not Sampler(SamplingParams(**{**base, **extra}), [], V).plain_greedy, extra
    assert not Sampler(SamplingParams(**base, logprobs=0), [], V).plain_greedy
    assert not Sampler(SamplingParams(**{**base, "temperature": 0.5}), [], V).plain_greedy


SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, repetition_penalty=1.1, seed=1234)


def _logits_sequence(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(99)
    return [rng.standard_normal(V).astype(np.float32) for _ in range(n)]


def test_seed_reproducible_alone_and_interleaved():
    steps = _logits_sequence(40)
    alone = Sampler(SAMPLED, [1, 2, 3], V)
    alone_tokens = [alone(x) for x in steps]
    # The same request beside two others (their own seeds and logits) in a "batch": same tokens.
    a = Sampler(SAMPLED, [1, 2, 3], V)
    b = Sampler(SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=7), [], V)
    c = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0), [], V)
    batched = []
    for x in steps:
        b(x[::-1].copy())
        batched.append(a(x))
        c(x)
    assert batched == alone_tokens
    other = Sampler(SamplingParams(**{**SAMPLED.__dict__, "seed": 1235}), [1, 2, 3], V)
    assert [other(x) for x in steps] != alone_tokens


def test_one_rng_draw_per_sampled_token():
    s = Sampler(SAMPLED, [], V)
    for x in _logits_sequence(13):
        s(x)
    expected = np.random.Generator(np.random.PCG64(SAMPLED.seed))
    expected.random(13)
    assert s.rng.random() == expected.random()


def test_empirical_frequencies_match_distribution():
    """20000 draws; each frequency within 5 standard errors of p; excluded tokens never drawn."""
    n_vocab, n = 8, 20000
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 3.0, -4.0], dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.97, min_p=0.0, repetition_penalty=1.0, seed=0)
    s = Sampler(params, [], n_vocab)
    p = s.distribution(logits)
    counts = np.bincount([s(logits) for _ in range(n)], minlength=n_vocab)
    assert np.all(counts[p == 0] == 0)
    assert (p > 0).sum() == 4  # top_k=5 keeps five; top_p=0.97 then drops the fifth (p=0.019 < 0.03)
    freq = counts / n
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) <= 5 * se + 1e-12), f"freq {freq} vs p {p}"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_logprobs_are_raw_log_softmax_with_top_k(dtype):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=1.0, min_p=0.0, repetition_penalty=1.2, seed=3, logprobs=5)
    s = Sampler(params, [4, 5], V)
    steps = [x.astype(dtype) for x in _logits_sequence(6)]
    tokens = [s(x) for x in steps]
    assert len(s.logprobs) == len(steps)
    for x, tok, lp in zip(steps, tokens, s.logprobs):
        ref = _log_softmax(x)
        assert isinstance(lp, TokenLogprob) and lp.token_id == tok
        assert abs(lp.logprob - ref[tok]) <= 1e-5
        want = sorted(range(V), key=lambda i: (-ref[i], i))[:5]
        assert [t for t, _ in lp.top] == want
        assert max(abs(v - ref[t]) for t, v in lp.top) <= 1e-5
    zero = Sampler(SamplingParams(**{**params.__dict__, "logprobs": 0, "temperature": 0.0}), [], V)
    tok = zero(steps[0])
    assert zero.logprobs[0].top == [] and tok == int(np.argmax(steps[0]))
    assert abs(zero.logprobs[0].logprob - _log_softmax(steps[0]).max()) <= 1e-5
    off = Sampler(SamplingParams(**{**params.__dict__, "logprobs": None}), [], V)
    off(steps[0])
    assert off.logprobs == []


GEN_CONFIGS = {
    "sampling": {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]},
    "greedy": {"do_sample": False, "bos_token_id": 0, "eos_token_id": 0},
    "all_fields": {"do_sample": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "temperature": 1.2},
    "nulls": {"do_sample": True, "temperature": None, "top_k": None},
    "empty": {},
}


@pytest.mark.parametrize("name", list(GEN_CONFIGS))
def test_generation_defaults_read_as_transformers(tmp_path, name):
    (tmp_path / "generation_config.json").write_text(json.dumps(GEN_CONFIGS[name]))
    hf = GenerationConfig.from_pretrained(tmp_path)
    global_defaults = GenerationConfig._get_default_generation_params()  # what generate fills unset fields with
    got = GenerationDefaults.from_artifact(tmp_path)
    for f in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        want = getattr(hf, f)
        if want is None:
            want = global_defaults.get(f)
        assert getattr(got, f) == want, f"{f}: {getattr(got, f)} vs transformers {want}"
    resolved = SamplingParams().resolve(got)
    assert resolved.resolved
    assert resolved.temperature == (got.temperature if got.do_sample else 0.0)


def test_generation_defaults_refuse_bad_files(tmp_path):
    path = tmp_path / "generation_config.json"
    for content, message in (
        ({"do_sample": True, "top_p": 1.5}, "top_p=1.5 is not accepted"),
        ({"temperature": -1}, "temperature=-1 is not accepted"),
        ({"top_k": "many"}, "top_k='many' is not accepted"),
        ({"do_sample": "yes"}, "do_sample='yes' must be true or false"),
    ):
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError) as e:
            GenerationDefaults.from_artifact(tmp_path)
        assert str(path) in str(e.value) and message in str(e.value), str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        GenerationDefaults.from_artifact(tmp_path)


def test_generation_defaults_without_file_and_resolve(tmp_path):
    d = GenerationDefaults.from_artifact(tmp_path)
    assert d == GenerationDefaults()
    r = SamplingParams(top_p=0.5).resolve(d)
    assert (r.temperature, r.top_k, r.top_p, r.min_p, r.repetition_penalty) == (0.0, 50, 0.5, 0.0, 1.0)
    sampling = GenerationDefaults(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.1)
    r = SamplingParams(temperature=0.3).resolve(sampling)
    assert (r.temperature, r.top_k, r.top_p, r.min_p) == (0.3, 20, 0.95, 0.1)
    assert SamplingParams(temperature=0.7).resolve(d).temperature == 0.7  # explicit temperature samples
    assert SamplingParams().resolve(sampling).temperature == 0.6
    with pytest.raises(ValueError, match="resolve"):
        Sampler(SamplingParams(), [], V)
    with pytest.raises(ValueError, match=r"logits must be one row of shape \(512,\), got \(511,\)"):
        Sampler(SamplingParams().resolve(d), [], V)(np.zeros(V - 1, dtype=np.float32))


BAD = [
    (dict(temperature=-0.5), "temperature=-0.5", "finite number >= 0"),
    (dict(temperature=math.nan), "temperature=nan", "finite number >= 0"),
    (dict(temperature=math.inf), "temperature=inf", "finite number >= 0"),
    (dict(temperature="0.7"), "temperature='0.7'", "finite number >= 0"),
    (dict(top_p=0.0), "top_p=0.0", "in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5", "in (0, 1]"),
    (dict(top_p=math.nan), "top_p=nan", "in (0, 1]"),
    (dict(top_k=-1), "top_k=-1", "an int >= 0"),
    (dict(top_k=5.0), "top_k=5.0", "an int >= 0"),
    (dict(top_k=True), "top_k=True", "an int >= 0"),
    (dict(min_p=-0.1), "min_p=-0.1", "in [0, 1]"),
    (dict(min_p=1.01), "min_p=1.01", "in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0", "> 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty=-1.0", "> 0"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5", "in [-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty=-2.01", "in [-2, 2]"),
    (dict(frequency_penalty=None), "frequency_penalty=None", "in [-2, 2]"),
    (dict(logprobs=-1), "logprobs=-1", "an int in [0, 20]"),
    (dict(logprobs=21), "logprobs=21", "an int in [0, 20]"),
    (dict(logprobs=True), "logprobs=True", "an int in [0, 20]"),
    (dict(logprobs=2.0), "logprobs=2.0", "an int in [0, 20]"),
    (dict(seed=1.5), "seed=1.5", "an int >= 0"),
    (dict(seed=False), "seed=False", "an int >= 0"),
    (dict(seed=-3), "seed=-3", "an int >= 0"),
]


@pytest.mark.parametrize(("kwargs", "named", "accepted"), BAD, ids=[b[1] for b in BAD])
def test_invalid_parameters_name_parameter_value_and_accepted(kwargs, named, accepted):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert named in str(e.value) and accepted in str(e.value), str(e.value)


def test_valid_edges_and_normalisation():
    p = SamplingParams(temperature=0, top_k=0, top_p=1, min_p=1, repetition_penalty=2, presence_penalty=-2, seed=0)
    assert isinstance(p.temperature, float) and p.temperature == 0.0 and isinstance(p.top_p, float)
    assert SamplingParams(logprobs=20, frequency_penalty=2).logprobs == 20
    assert SamplingParams(top_k=np.int64(4), temperature=np.float32(0.5)).top_k == 4


def test_from_dict_refuses_unknown_keys():
    assert SamplingParams.from_dict({"temperature": 0.5, "seed": 3}) == SamplingParams(temperature=0.5, seed=3)
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.1, "beams": 2})
    msg = str(e.value)
    assert "unknown sampling parameter(s) beams, top_q" in msg and "accepted: temperature, top_k" in msg
    with pytest.raises(ValueError, match="top_p=2"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(ValueError, match="must be a mapping"):
        SamplingParams.from_dict([("temperature", 1.0)])


# ------------------------------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_forbids_under_greedy():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    top = int(np.argmax(logits))
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    forced = Sampler(SamplingParams(**greedy, logit_bias={5: 100}), [], V)
    forbidden = Sampler(SamplingParams(**greedy, logit_bias={top: -100}), [], V)
    assert not forced.plain_greedy and not forbidden.plain_greedy
    second = int(np.argsort(logits)[-2])
    for _ in range(3):  # the bias holds at every step
        assert forced(logits) == 5
        assert forbidden(logits) == second
    # Sampling too: a -100 token is never drawn, a +100 one always.
    sampled = dict(greedy, temperature=1.0)
    s = Sampler(SamplingParams(**sampled, logit_bias={top: -100}, seed=1), [], V)
    assert top not in {s(logits) for _ in range(200)}
    s = Sampler(SamplingParams(**sampled, logit_bias={9: 100}, seed=1), [], V)
    assert {s(logits) for _ in range(50)} == {9}


def test_logit_bias_keeps_logprobs_raw():
    """Logprobs stay those of the model's raw distribution (vLLM's raw_logprobs), bias excluded."""
    logits = np.linspace(-2, 2, V).astype(np.float32)
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, logprobs=1)
    s = Sampler(replace(params, logit_bias={0: 100}), [], V)
    assert s(logits) == 0
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert abs(s.logprobs[0].logprob - raw[0]) < 1e-5 and s.logprobs[0].top[0][0] == V - 1


def test_biased_greedy_step_allocates_nothing():
    """A greedy row with a bias adds its dense bias row in place on the sampler's scratch row: a
    step allocates no array (tracemalloc sees numpy's allocations)."""
    n_vocab = 32768
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    s = Sampler(SamplingParams(**greedy, logit_bias={1: 100.0, 2: -50.0}), [], n_vocab)
    s(logits)  # warm-up
    tracemalloc.start()
    try:
        for _ in range(20):
            assert s(logits) == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096, f"a biased greedy step allocated {peak} bytes (a logits row is {n_vocab * 4})"


BAD_BIAS = [
    ({"x": 1.0}, "logit_bias has the key 'x'", "token ids"),
    ({-1: 1.0}, "logit_bias has the key -1", "token ids"),
    ({True: 1.0}, "logit_bias has the key True", "token ids"),
    ({"1.5": 1.0}, "logit_bias has the key '1.5'", "token ids"),
    ({3: 100.5}, "logit_bias[3]=100.5", "in [-100, 100]"),
    ({3: -101}, "logit_bias[3]=-101", "in [-100, 100]"),
    ({3: math.nan}, "logit_bias[3]=nan", "in [-100, 100]"),
    ({3: "5"}, "logit_bias[3]='5'", "in [-100, 100]"),
    ([(3, 1.0)], "logit_bias=[(3, 1.0)]", "a mapping of token id -> bias"),
]


@pytest.mark.parametrize(("bias", "named", "accepted"), BAD_BIAS, ids=[b[1] for b in BAD_BIAS])
def test_logit_bias_refused_by_name(bias, named, accepted):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias)
    assert named in str(e.value) and accepted in str(e.value), str(e.value)


def test_logit_bias_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={"7": 1, np.int64(8): np.float32(-2.5)})
    assert p.logit_bias == {7: 1.0, 8: -2.5} and isinstance(p.logit_bias[7], float)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.from_dict({"logit_bias": {"3": 5}}).logit_bias == {3: 5.0}  # JSON keys are strings
    hash(p)  # still hashable (the bias is compared, not hashed)
    resolved = p.resolve(GenerationDefaults())
    with pytest.raises(ValueError, match=rf"logit_bias has token id {V} outside the vocabulary \[0, {V}\)"):
        Sampler(replace(resolved, logit_bias={V: 1.0, 2: 1.0}), [], V)
