"""Per-request sampling: request parameters, the model's generation defaults, and the sampler.

Input: one row of next-token logits ``[V]`` (float32/float16) per step. Output: the chosen token id,
plus its log-probability and top alternatives when asked. numpy only (no torch, no transformers).

The processors run in transformers' order (``GenerationMixin._get_logits_processor``), each with
transformers' arithmetic, in float32 as transformers does after ``logits.to(torch.float32)``, after
OpenAI's ``logit_bias``, which vLLM applies first:

0. logit bias (OpenAI's ``logit_bias``; not in transformers): ``logit += bias[id]`` for the biased ids,
   before any other processor, where vLLM v1's sampler applies it (with min-tokens, before the
   repetition/frequency/presence penalties and temperature). Applied in greedy mode too. Beside it
   vLLM's ``min_tokens``: the eos ids at ``-inf`` until ``min_tokens`` tokens are generated (unless
   eos is all that is left, as when an output grammar is complete).
1. repetition penalty (``RepetitionPenaltyLogitsProcessor``): for every id in prompt + generated ids,
   ``logit * p`` when the logit is < 0, else ``logit / p``. Applied in greedy mode too.
2. frequency and presence penalties (not in transformers; OpenAI's definition, as vLLM applies them
   right after its repetition penalty and before temperature): over the *generated* ids only,
   ``logit -= frequency_penalty * count``, then ``logit -= presence_penalty * (count > 0)``.
   Applied in greedy mode too.
3. temperature 0: greedy, ``argmax`` of the penalised logits (ties: the lowest id, as np.argmax);
   no processor below runs and nothing is drawn from the RNG.
4. temperature (``TemperatureLogitsWarper``): ``logit / t`` when ``t != 1``.
5. top-k (``TopKLogitsWarper``): keep the tokens whose logit is >= the k-th largest (ties kept).
6. top-p (``TopPLogitsWarper``): sort ascending, softmax, cumulative sum; drop the tokens whose
   cumulative probability is ``<= 1 - top_p``; the most likely token is always kept.
7. min-p (``MinPLogitsWarper``): drop the tokens whose probability is ``< min_p * max probability``.
8. softmax over what is left, one uniform draw from the request's ``numpy.random.Generator(PCG64(seed))``,
   inverse CDF over the kept tokens in increasing id order.

Log-probabilities (``logprobs=k``) are those of the model's raw distribution, ``log_softmax(logits)``
before any processor, which is what the OpenAI API and vLLM return by default (vLLM's
``logprobs_mode="raw_logprobs"``): the chosen token's and the k most likely tokens'.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# The sampler divides and multiplies float32 logits by temperature and repetition_penalty: values
# outside float32's normal range would become 0 or inf there (found by tests/test_fuzz.py).
F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _real(name: str, value: object, accepted: str, ok) -> float:
    """``value`` as a float, or a ValueError naming ``name``, the value and what is accepted."""
    try:
        number = float(value) if _is_real(value) else math.nan
    except OverflowError:  # an int too large for a float (10**400)
        number = math.nan
    if math.isnan(number) or not ok(number):
        raise ValueError(f"{name}={_short(value)} is not accepted: {name} must be {accepted}")
    return number


def _int(name: str, value: object, accepted: str, ok) -> int:
    if not _is_int(value) or not ok(int(value)):
        raise ValueError(f"{name}={_short(value)} is not accepted: {name} must be {accepted}")
    return int(value)


def _logit_bias(value: object) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: bias}``, or a ValueError naming the bad entry. Keys are ints
    >= 0 or their decimal strings (a JSON object's keys are strings); values finite in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"logit_bias={_short(value)} is not accepted: logit_bias must be a mapping of token id -> bias or None"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        if (_is_int(key) and key >= 0) or (isinstance(key, str) and key.isascii() and key.isdigit()):
            token = int(key)
        else:
            raise ValueError(
                f"logit_bias has the key {_short(key)}: logit_bias keys must be token ids (ints >= 0, or their "
                "decimal strings)"
            )
        out[token] = _real(
            f"logit_bias[{token}]",
            bias,
            f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (added to the token's logit)",
            lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
        )
    return out or None


@dataclass(frozen=True)
class GenerationDefaults:
    """What transformers' ``GenerationConfig`` would use for this model when a request leaves a field unset.

    Values from the artifact's ``generation_config.json``, unset (absent or null) fields filled with
    ``GenerationConfig._get_default_generation_params()``'s values, as ``generate`` does.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def from_artifact(cls, artifact_dir: Path) -> GenerationDefaults:
        """Read ``artifact_dir/generation_config.json`` if present (else transformers' global defaults)."""
        path = Path(artifact_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
        base = cls()
        values = {}
        for f in fields(cls):
            v = data.get(f.name)
            values[f.name] = getattr(base, f.name) if v is None else v
        if not isinstance(values["do_sample"], bool):
            raise ValueError(f"{path}: do_sample={values['do_sample']!r} must be true or false; fix the file")
        try:  # the same checks a request gets, so a bad file fails here and not in every request
            checked = SamplingParams(
                temperature=values["temperature"],
                top_k=values["top_k"],
                top_p=values["top_p"],
                min_p=values["min_p"],
                repetition_penalty=values["repetition_penalty"],
            )
        except ValueError as e:
            raise ValueError(f"{path}: {e}; fix the model's generation config") from e
        return cls(
            do_sample=values["do_sample"],
            temperature=checked.temperature,
            top_k=checked.top_k,
            top_p=checked.top_p,
            min_p=checked.min_p,
            repetition_penalty=checked.repetition_penalty,
        )


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters; ``None`` means "the model's default" (see ``resolve``).

    Validated on construction: a bad value raises ``ValueError`` naming the parameter, the value and
    what is accepted. Ints are normalised to floats in the float fields.
    """

    temperature: float | None = None  # None: the model's default; 0.0: greedy (argmax)
    top_k: int | None = None  # 0: off
    top_p: float | None = None  # (0, 1]; 1.0: off
    min_p: float | None = None  # [0, 1]; 0.0: off
    repetition_penalty: float | None = None  # > 0; 1.0: off; over prompt + generated ids
    presence_penalty: float = 0.0  # OpenAI/vLLM semantics over the generated ids; [-2, 2]
    frequency_penalty: float = 0.0  # same
    seed: int | None = None  # None: fresh entropy per request
    logprobs: int | None = None  # None: off; k in [0, 20]: each token's logprob + top-k alternatives
    # {token id: bias in [-100, 100]} added to the logits before any other processor; None or {}: off.
    # Ids are checked against the vocabulary by Sampler (the params do not know its size).
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    speculative: bool = True  # False: this request never drafts (on an engine loaded with speculative=...)
    prediction: tuple[int, ...] | None = None  # token ids the output is expected to repeat: drafted first
    # vLLM's extensions: an eos id does not end the request (it runs to max_new_tokens or a stop string);
    # the eos ids are forbidden (and stop strings not matched) until min_tokens tokens are generated.
    ignore_eos: bool = False
    min_tokens: int = 0
    # Structured output (at most one; kvforge.runtime.constraints, the `structured` extra): a JSON Schema
    # (dict or JSON text), a regex the whole output matches, a Lark grammar (llguidance's syntax), any JSON object.
    json_schema: Mapping | str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        self._check_constraint(put)

        if self.temperature is not None:
            put(
                "temperature",
                _real(
                    "temperature",
                    self.temperature,
                    "a finite number >= 0 (0 means greedy) or None; a positive one within float32's "
                    f"[{F32_TINY:.2g}, {F32_MAX:.2g}]",
                    lambda v: v == 0 or F32_TINY <= v <= F32_MAX,
                ),
            )
        if self.top_k is not None:
            put("top_k", _int("top_k", self.top_k, "an int >= 0 (0 turns top-k off) or None", lambda v: v >= 0))
        if self.top_p is not None:
            put(
                "top_p",
                _real("top_p", self.top_p, "a number in (0, 1] (1 turns top-p off) or None", lambda v: 0 < v <= 1),
            )
        if self.min_p is not None:
            put(
                "min_p",
                _real("min_p", self.min_p, "a number in [0, 1] (0 turns min-p off) or None", lambda v: 0 <= v <= 1),
            )
        if self.repetition_penalty is not None:
            put(
                "repetition_penalty",
                _real(
                    "repetition_penalty",
                    self.repetition_penalty,
                    f"a finite number > 0 (1 turns it off) or None, within float32's [{F32_TINY:.2g}, {F32_MAX:.2g}]",
                    lambda v: F32_TINY <= v <= F32_MAX,
                ),
            )
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _real(name, getattr(self, name), "a number in [-2, 2] (0 turns it off)", lambda v: -2 <= v <= 2))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, "an int >= 0 or None (fresh entropy)", lambda v: v >= 0))
        if self.logprobs is not None:
            put(
                "logprobs",
                _int(
                    "logprobs",
                    self.logprobs,
                    f"an int in [0, {MAX_LOGPROBS}] (the number of alternatives per token) or None (off)",
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                ),
            )
        put("logit_bias", _logit_bias(self.logit_bias))

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={_short(self.ignore_eos)} is not accepted: ignore_eos must be True or False")
        put("min_tokens", _int("min_tokens", self.min_tokens, "an int >= 0 (0 turns it off)", lambda v: v >= 0))

        if not isinstance(self.speculative, bool):
            raise ValueError(
                f"speculative={_short(self.speculative)} is not accepted: speculative must be True or False"
            )
        if self.prediction is not None:
            ids = self.prediction
            listed = isinstance(ids, Sequence) and not isinstance(ids, (str, bytes))
            if not listed or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(
                    f"prediction={_short(ids)} is not accepted: prediction must be a list of token ids "
                    "(ints >= 0; encode a predicted text with the tokenizer first) or None"
                )
            put("prediction", tuple(int(t) for t in ids))

    def _check_constraint(self, put) -> None:
        from kvforge.runtime import constraints

        given = [k for k in constraints.KINDS if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are all set; a request takes at most one output constraint")
        for name in constraints.KINDS:
            value = getattr(self, name)
            if value is not None:
                put(name, constraints.check_field(name, value))
        if given:  # compiled now, so a bad schema, regex or grammar fails before anything runs
            constraints.compile_checked(given[0], getattr(self, given[0]))

    @property
    def constraint(self) -> tuple[str, object] | None:
        """``(kind, value)`` of the output constraint (kind one of json_schema, regex, grammar,
        json_object), or None."""
        for name in ("json_schema", "regex", "grammar", "json_object"):
            value = getattr(self, name)
            if value is not None and value is not False:
                return name, value
        return None

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SamplingParams:
        """Build from a mapping (e.g. a JSON request body); unknown keys raise ValueError naming them."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be a mapping of name -> value, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {', '.join(unknown)}; accepted: {', '.join(known)}")
        return cls(**d)

    @property
    def resolved(self) -> bool:
        """Every model-default field is concrete (what ``Sampler`` needs)."""
        return None not in (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)

    def resolve(self, defaults: GenerationDefaults) -> SamplingParams:
        """Every ``None`` filled from the model's generation defaults.

        A request without a temperature samples with the model's temperature when its generation config
        says ``do_sample``, else decodes greedily (temperature 0), as transformers' ``generate`` does. An
        explicit temperature > 0 always samples (OpenAI semantics). ``seed`` and ``logprobs`` keep ``None``
        (fresh entropy; no logprobs).
        """
        temperature = self.temperature
        if temperature is None:
            temperature = defaults.temperature if defaults.do_sample else 0.0
        return replace(
            self,
            temperature=temperature,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            min_p=(defaults.min_p or 0.0) if self.min_p is None else self.min_p,
            repetition_penalty=defaults.repetition_penalty
            if self.repetition_penalty is None
            else self.repetition_penalty,
        )


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model's raw distribution, and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), most likely first


@lru_cache(maxsize=8)
def _arange(n: int) -> np.ndarray:
    """``arange(n)`` shared by every Sampler of a vocabulary size (read only)."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


class Sampler:
    """One request's sampling state: its RNG (seeded once), token counts for the penalties, logprobs.

    Owns float32/float64 scratch rows of size V allocated once; the logits passed to ``__call__`` are
    only read (they are a view of the engine's buffer) and never kept.
    """

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, eos_token_ids: Sequence[int] = ()
    ) -> None:
        if not params.resolved:
            raise ValueError(
                f"Sampler needs resolved SamplingParams (no None among temperature, top_k, top_p, min_p, "
                f"repetition_penalty); got {params}. Call params.resolve(GenerationDefaults.from_artifact(dir)) first"
            )
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.params = params
        self.vocab_size = V = int(vocab_size)
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self.logprobs: list[TokenLogprob] = []
        self._greedy = params.temperature == 0.0
        self._rep = params.repetition_penalty != 1.0
        self._pen = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        bias = params.logit_bias or {}
        outside = sorted(t for t in bias if t >= V)
        if outside:
            raise ValueError(
                f"logit_bias has token id {outside[0]} outside the vocabulary [0, {V}); "
                "use ids of this model's tokenizer"
            )
        self._plain = self._greedy and not self._rep and not self._pen and not bias and params.logprobs is None
        self._plain = self._plain and params.constraint is None  # a constrained row argmaxes its masked copy
        # min_tokens: the eos ids (those inside the logits' vocabulary) are at -inf for the first min_tokens draws.
        eos = sorted(int(t) for t in eos_token_ids if 0 <= int(t) < V) if params.min_tokens else []
        self._eos = np.array(eos, dtype=np.intp) if eos else None
        self._eos_saved = np.empty(len(eos), dtype=np.float32)
        self.generated = 0  # tokens recorded (for min_tokens)
        self._plain = self._plain and self._eos is None
        if self._plain:
            return  # nothing to count, nothing to scratch: the engine's argmax is the whole job
        # logit_bias as a dense row, built once: one in-place add per step, no allocation.
        self._bias: np.ndarray | None = None
        if bias:
            self._bias = np.zeros(V, dtype=np.float32)
            for t, b in bias.items():
                self._bias[t] = b
        # Penalty state: ids seen in prompt + generated (repetition), counts of generated ids (presence/frequency).
        self._seen = np.zeros(V, dtype=bool)
        self._seen_list: list[int] = []
        self._seen_ids: np.ndarray | None = None  # cache of np.array(_seen_list), rebuilt when it grows
        self._counts = np.zeros(V, dtype=np.int32)
        self._gen_list: list[int] = []
        self._gen_ids: np.ndarray | None = None
        if self._rep:
            for t in prompt_ids:
                t = int(t)
                if 0 <= t < V and not self._seen[t]:  # ids beyond the logits' vocabulary cannot be penalised
                    self._seen[t] = True
                    self._seen_list.append(t)
        self._x = np.empty(V, dtype=np.float32)  # processed logits
        self._tmp = np.empty(V, dtype=np.float32)  # partition / exp scratch
        self._mask = np.empty(V, dtype=bool)
        self._p = np.empty(V, dtype=np.float64)  # probabilities of the candidates
        self._all = _arange(V)

    @property
    def plain_greedy(self) -> bool:
        """Temperature 0, no penalties, no logit bias, no logprobs: the engine may argmax a whole batch
        at once (then ``record``)."""
        return self._plain

    def record(self, token_id: int) -> None:
        """Count a generated token (for the penalties); ``__call__`` does this itself."""
        t = int(token_id)
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")
        if self._plain:
            return
        self.generated += 1
        if not self._seen[t]:
            self._seen[t] = True
            self._seen_list.append(t)
            self._seen_ids = None
        if self._counts[t] == 0:
            self._gen_list.append(t)
            self._gen_ids = None
        self._counts[t] += 1

    def replay(self, token_id: int, logprob: TokenLogprob | None, rng_state: Mapping) -> None:
        """Continue another sampler of the same request after its draw of ``token_id`` (a
        disaggregated hand-off): record the token and its logprob entry as ``__call__`` did there,
        and take that sampler's RNG state, so the next draws are the ones it would have made."""
        self.record(token_id)
        if self.params.logprobs is not None:
            if logprob is None:
                raise ValueError("the request asks for logprobs, but the replayed token comes without its entry")
            self.logprobs.append(logprob)
        self.rng.bit_generator.state = dict(rng_state)

    @property
    def rng_state(self) -> dict:
        """The RNG's state now (JSON-able), what :meth:`replay` restores."""
        return self.rng.bit_generator.state

    def __call__(self, logits: np.ndarray) -> int:
        """Pick the next token from ``logits`` ``[V]`` (float32/float16, read only), record it and return its id."""
        return self._pick(logits, None)

    def verify(self, logits: np.ndarray, draft: int) -> int:
        """The token at a drafted position: ``draft`` when accepted, else a replacement; recorded
        (with its logprob) as :meth:`__call__` records its token.

        The speculative-sampling rule with a point-mass draft (every kvforge drafter proposes one
        token, deterministically): accept ``draft`` with probability ``p(draft)`` under this
        request's processed distribution ``p`` (penalties, temperature, top-k/p, min-p applied);
        on rejection draw from ``p`` without ``draft``, renormalised (``norm(max(0, p - q))``). The
        token is then distributed exactly as ``p``. Greedy: accepted iff it is the argmax."""
        return self._pick(logits, int(draft))

    def _pick(self, logits: np.ndarray, draft: int | None) -> int:
        """:meth:`__call__` (``draft`` None: one draw from ``p``) and :meth:`verify` (one draw to
        accept ``draft``, a second from ``p`` without it on rejection), recorded alike."""
        self._check(logits)
        if self._plain:
            token = int(np.argmax(logits))
            self.record(token)
            return token
        k = self.params.logprobs
        if k is not None:  # before the processors touch the scratch rows
            lse = self._log_normalizer(logits)
            top = self._top_logprobs(logits, k, lse)
        idx, vals = self._process(logits)
        if idx is None:
            token = int(np.argmax(vals))
        else:
            p = self._softmax(vals)
            token = None
            if draft is not None:
                j = int(np.searchsorted(idx, draft))
                p_draft = float(p[j]) if j < len(idx) and idx[j] == draft else 0.0
                if self.rng.random() < p_draft:
                    token = draft
                elif p_draft > 0.0:
                    p[j] = 0.0
            if token is None:
                cdf = np.cumsum(p, out=p)
                j = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
                token = int(idx[min(j, len(idx) - 1)])
        if k is not None:
            self.logprobs.append(TokenLogprob(token, float(np.float32(logits[token])) - lse, top))
        self.record(token)
        return token

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The probabilities ``[V]`` float64 that ``__call__`` would draw from now (one-hot when greedy).

        Excluded tokens are exactly 0. Records nothing and draws nothing (for tests and inspection).
        """
        self._check(logits)
        out = np.zeros(self.vocab_size, dtype=np.float64)
        if self._plain:
            out[int(np.argmax(logits))] = 1.0
            return out
        idx, vals = self._process(logits)
        if idx is None:
            out[int(np.argmax(vals))] = 1.0
        else:
            out[idx] = self._softmax(vals)
        return out

    # -- internals ---------------------------------------------------------------------------------

    def _check(self, logits: np.ndarray) -> None:
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits must be one row of shape ({self.vocab_size},), got {logits.shape}")

    def _process(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Processors 0-7 of the module docstring. Returns ``(None, x[V])`` when greedy, else the kept
        candidate ids (increasing) and their processed float32 logits."""
        p = self.params
        x = self._x
        np.copyto(x, logits, casting="same_kind")
        if self._bias is not None:
            np.add(x, self._bias, out=x)
        if self._eos is not None and self.generated < p.min_tokens:
            # vLLM's min-tokens processor, beside the logit bias; never when eos is all that is left
            # (a grammar that allows only eos now: its output is complete).
            np.take(x, self._eos, out=self._eos_saved)
            x[self._eos] = -np.inf
            if not np.isfinite(x.max()):
                x[self._eos] = self._eos_saved
        if self._rep and self._seen_list:
            if self._seen_ids is None:
                self._seen_ids = np.array(self._seen_list, dtype=np.intp)
            s = x[self._seen_ids]
            x[self._seen_ids] = np.where(
                s < 0, s * np.float32(p.repetition_penalty), s / np.float32(p.repetition_penalty)
            )
        if self._pen and self._gen_list:
            if self._gen_ids is None:
                self._gen_ids = np.array(self._gen_list, dtype=np.intp)
            g = self._gen_ids
            s = x[g] - np.float32(p.frequency_penalty) * self._counts[g].astype(np.float32)
            x[g] = s - np.float32(p.presence_penalty)
        if self._greedy:
            return None, x
        if p.temperature != 1.0:
            np.divide(x, np.float32(p.temperature), out=x)
        V = self.vocab_size
        if 0 < p.top_k < V:
            np.greater_equal(x, self._kth_largest(x, p.top_k), out=self._mask)  # ties with the k-th are kept
            idx = np.flatnonzero(self._mask)
            vals = x[idx]
        else:
            idx, vals = self._all, x
        if p.top_p < 1.0:
            keep = self._top_p_keep(vals, p.top_p)
            idx, vals = idx[keep], vals[keep]
        if p.min_p > 0.0:
            e = np.exp(vals - vals.max())
            probs = e / e.sum(dtype=np.float32)
            keep = np.flatnonzero(probs >= np.float32(p.min_p) * probs.max())
            idx, vals = idx[keep], vals[keep]
        return idx, vals

    def _kth_largest(self, a: np.ndarray, k: int) -> np.float32:
        """The k-th largest value of ``a`` (1-D, 1 <= k <= len(a)) without partitioning all of it.

        The k-th largest of a strided subsample is a lower bound of the k-th largest of ``a``, so the
        values >= it (about ``k * stride``) hold the k largest: only those are partitioned. A stride of
        ``sqrt(n / k)`` balances the two partitions (n=49152, k=50: ~50 us instead of ~250 us).
        """
        n = len(a)
        stride = math.isqrt(n // k)
        if stride >= 4:
            sub = np.partition(a[::stride], -k)  # a copy of n / stride values
            mask = self._mask[:n]
            np.greater_equal(a, sub[-k], out=mask)
            a = a[np.flatnonzero(mask)]  # faster than a[mask] at these densities
        else:
            a = a.copy()
        a.partition(len(a) - k)
        return a[len(a) - k]

    def _top_p_keep(self, vals: np.ndarray, top_p: float) -> np.ndarray:
        """Positions in ``vals`` (increasing) that TopPLogitsWarper keeps.

        Its rule: sort ascending, float32 softmax, cumulative sum (torch accumulates a float32 cumsum
        in double on CPU), drop where ``cum <= 1 - top_p``, always keep the largest. Only the nucleus
        needs sorting: the tokens outside it all have ``cum <= 1 - top_p``, and their total mass is
        what the nucleus's cumulative sum starts from.
        """
        n = len(vals)
        probs = self._tmp[:n]
        np.subtract(vals, vals.max(), out=probs)
        np.exp(probs, out=probs)
        probs /= probs.sum(dtype=np.float32)
        bound = np.float32(1 - top_p)
        cand, m = None, 256
        while m * 8 <= n:  # grow a candidate set until it holds the nucleus with a margin
            np.greater_equal(probs, self._kth_largest(probs, m), out=self._mask[:n])
            c = np.flatnonzero(self._mask[:n])
            tail = float(probs.sum(dtype=np.float64)) - float(probs[c].sum(dtype=np.float64))
            if tail < float(bound) * (1 - 1e-4):
                cand = c
                break
            m *= 8
        if cand is None:
            cand, tail = np.arange(n), 0.0
        cp = probs[cand]
        order = np.argsort(cp, kind="stable")
        cum = (tail + np.cumsum(cp[order], dtype=np.float64)).astype(np.float32)
        drop = cum <= bound
        drop[-1] = False
        return cand[np.sort(order[~drop])]

    def _softmax(self, vals: np.ndarray) -> np.ndarray:
        """float64 softmax of ``vals`` into the scratch row (a view of it; valid until the next call)."""
        out = self._p[: len(vals)]
        np.subtract(vals, vals.max(), out=out, dtype=np.float64)
        np.exp(out, out=out)
        out /= out.sum()
        return out

    def _log_normalizer(self, logits: np.ndarray) -> float:
        """``logsumexp(logits)`` in float64 from the float32 values."""
        t = self._tmp
        np.copyto(t, logits, casting="same_kind")
        m = float(t.max())
        np.subtract(t, np.float32(m), out=t)
        np.exp(t, out=t)
        return m + math.log(float(t.sum(dtype=np.float64)))

    def _top_logprobs(self, logits: np.ndarray, k: int, lse: float) -> list[tuple[int, float]]:
        """The k most likely tokens of the raw distribution (ties: lower id first) with their logprobs.
        Tokens of probability 0 (logit ``-inf``: forbidden by the output's grammar) are not among
        them, so fewer than k come back when fewer are possible."""
        if k == 0:
            return []
        t = self._tmp
        np.copyto(t, logits, casting="same_kind")
        kk = min(k, self.vocab_size)
        np.greater_equal(t, self._kth_largest(t, kk), out=self._mask)
        np.greater(t, -np.inf, out=self._mask, where=self._mask)
        cand = np.flatnonzero(self._mask)
        cv = t[cand]
        order = np.lexsort((cand, -cv))[:kk]
        return [(int(cand[i]), float(cv[i]) - lse) for i in order]
