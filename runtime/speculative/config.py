"""How an engine drafts: :class:`SpeculativeConfig`, parsed from ``"ngram"``, ``"ngram:k"``,
``"draft"``, ``"draft:k"`` or ``"prediction"`` (only per-request predictions), or given as an object.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.runtime import validate

METHODS = ("ngram", "draft", "prediction")
# The most tokens drafted per step when "ngram"/"draft" names no K. ngram: 8, because a verify call
# of up to ~12 tokens costs little more than a step (fp32 SmolLM2, 2 threads: width 9, 1.3-1.75 steps)
# and the adaptive length reaches 8 only while the row's drafts are mostly accepted; replaying greedy
# outputs with recorded costs put 8 ahead of 4 on every precision and level with 12
# (benchmarks/ngram_replay.py). A draft model's length is chosen by cost up to K: its 4 was not
# measured against others.
DEFAULT_K = {"ngram": 8, "draft": 4}
MAX_K = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (prompt lookup: the last ``ngram_max`` .. ``ngram_min`` tokens matched
    against the prompt and the output so far, the tokens that followed proposed), ``"draft"`` (a
    draft model, ``Engine.load(..., draft=DRAFT_OUT)``) or ``"prediction"`` (no drafter of the
    engine's own: only requests with ``SamplingParams(prediction=...)`` draft). ``k``: the most
    tokens drafted per step (1..32; None: 8 for ngram, 4 otherwise); with ``adaptive`` the count
    follows the acceptance rate and the cost of a verify call, and a row whose drafts keep missing
    drafts one token only after pauses (so text with nothing to copy runs as plain decoding;
    :class:`~kvforge.runtime.speculative.drafters.RowDrafting`). ``prediction_k``: the most tokens of an
    explicit prediction drafted per step."""

    method: str = "ngram"
    k: int | None = None
    ngram_max: int = 3
    ngram_min: int = 2
    adaptive: bool = True
    prediction_k: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise validate.InvalidValue(
                f"speculative method {self.method!r} is not accepted: choose one of {', '.join(METHODS)}"
            )
        if self.k is None:
            object.__setattr__(self, "k", DEFAULT_K.get(self.method, DEFAULT_K["draft"]))
        for name in ("k", "prediction_k"):
            value = getattr(self, name)
            if not validate.is_int(value) or not 1 <= value <= MAX_K:
                raise validate.InvalidValue(f"speculative {name}={value!r} is not accepted: give an int in 1..{MAX_K}")
        if not (validate.is_int(self.ngram_min) and validate.is_int(self.ngram_max)) or not (
            1 <= self.ngram_min <= self.ngram_max <= 8
        ):
            raise validate.InvalidValue(
                f"speculative ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r} are not accepted: "
                "give ints with 1 <= ngram_min <= ngram_max <= 8"
            )

    @property
    def max_width(self) -> int:
        """Tokens per row of the widest verify call: the fed token and the drafts."""
        return 1 + max(self.k, self.prediction_k)


def parse_speculative(value: object, draft: object = None) -> SpeculativeConfig | None:
    """``None``/``False``/``"off"`` -> None (no drafting; with ``draft`` given: ``"draft"``);
    ``"ngram"``, ``"ngram:k"``, ``"draft"``, ``"draft:k"``, ``"prediction"`` or a
    :class:`SpeculativeConfig` -> the config. Anything else: ValueError saying what is accepted."""
    if isinstance(value, SpeculativeConfig):
        config = value
    elif value is None or value is False or value == "off":
        config = SpeculativeConfig(method="draft") if draft is not None else None
    elif isinstance(value, str):
        method, _, k = value.partition(":")
        if method not in METHODS or (k and not k.isdigit()) or (k and method == "prediction"):
            raise validate.InvalidValue(
                f"speculative={value!r} is not accepted: give 'ngram', 'ngram:K', 'draft', 'draft:K' or "
                f"'prediction' (K = the most tokens drafted per step, 1..{MAX_K}), or a SpeculativeConfig"
            )
        config = SpeculativeConfig(method=method, k=int(k) if k else None)
    else:
        raise validate.WrongType(
            f"speculative={validate.short_repr(value)} is not accepted: give a string such as 'ngram:4', "
            "a SpeculativeConfig or None"
        )
    if config is not None and (config.method == "draft") != (draft is not None):
        raise validate.InvalidValue(
            "speculative='draft' needs draft=DRAFT_OUT (a kvforge artifact with the same tokenizer)"
            if draft is None
            else f"draft= is given, but speculative={value!r} does not use it: pass speculative='draft' (or None)"
        )
    return config
