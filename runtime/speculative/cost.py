"""What drafting costs, in units of one plain step (one token, one row): the choice of how many
tokens to draft, and whether a row's drafts pay for a call of their own.

* :func:`call_cost`: an engine call of ``rows × width`` tokens. Measured on SmolLM2-135M fp32, ORT
  CPU, 2 threads, 300 cached positions (benchmarks/README.md, "Verify width"): each more token of a
  row ~+7.5%, each more row of a decode step ~+12%. Only ratios of these costs steer anything.
* :func:`width_cost`: what one more token of a row's own verify call costs for an artifact: the
  float price above, or :data:`QUANTIZED_WIDTH_COST` where the weights are quantized.
* :func:`expected_tokens`: a verify call's tokens when each draft is right with probability ``a``
  (the accepted run and the one token after it).
* :func:`best_k`: the draft length with the most tokens per cost when each drafted token also
  costs ``token_cost`` steps (a draft model's forward pass; 0 for prompt lookup, whose drafts cost
  only the wider call); 0 when plain decoding is cheaper;
* :func:`rerun_cost`: what a rejection adds on an artifact whose layers keep a state: the row
  re-runs the tokens it kept (:mod:`.states`), a second call.
"""

from __future__ import annotations

WIDTH_COST = 0.075
# Quantized weights (MatMulNBits): ORT's int8-activation kernels at M > 1 cost more of a step per
# token than fp32's MatMul (SmolLM2 int4, 2 threads: widths 2-8 at 0.13-0.19 a token with
# `exact`, 0.21-0.37 with `gqa`, benchmarks/FINDINGS.md: verify width, bit identity). A prompt-lookup row priced
# at 0.15 matched or beat the old length rule on the int4 gqa artifact, at 0.075 it drafted too
# long (benchmarks/README.md, "ngram's length from the cost of a call").
QUANTIZED_WIDTH_COST = 0.15
ROW_COST = 0.12
MAX_RATE = 0.98  # an acceptance rate is never taken as certain


def call_cost(rows: int, width: int, width_cost: float = WIDTH_COST) -> float:
    """Estimated cost of a call of ``rows`` rows and ``width`` tokens each, in one-token steps."""
    return 1.0 + ROW_COST * (rows - 1) + width_cost * (width - 1) * rows


def width_cost(quantized: bool) -> float:
    """One more token of a row's own verify call, in steps, for float or quantized weights."""
    return QUANTIZED_WIDTH_COST if quantized else WIDTH_COST


def expected_tokens(a: float, drafts: int) -> float:
    """Tokens of a verify call with ``drafts`` drafts, each right with probability ``a``: the run of
    accepted drafts and the token after it, ``1 + a + … + a^drafts``."""
    a = min(a, MAX_RATE)
    return (1 - a ** (drafts + 1)) / (1 - a)


def rerun_cost(a: float, drafts: int, width_cost: float = WIDTH_COST) -> float:
    """The expected cost a hybrid artifact's row adds to a verify call of ``drafts`` drafts, each
    right with probability ``a``: unless every draft is accepted, a call of the tokens it kept
    (about the call's expected tokens)."""
    a = min(a, MAX_RATE)
    return (1 - a**drafts) * call_cost(1, expected_tokens(a, drafts), width_cost)


def best_k(a: float, limit: int, token_cost: float, width_cost: float = WIDTH_COST, rerun: bool = False) -> int:
    """The draft length in ``0..limit`` with the most tokens per cost (0: plain decoding, one token
    per step), when drafting costs ``token_cost`` steps per token and each token of the verify
    call ``width_cost``; ``rerun``: the artifact's layers keep a state, and a rejection costs
    :func:`rerun_cost`."""
    best, best_rate = 0, 1.0
    for k in range(1, limit + 1):
        cost = k * token_cost + call_cost(1, k + 1, width_cost) + (rerun_cost(a, k, width_cost) if rerun else 0.0)
        rate = expected_tokens(a, k) / cost
        if rate > best_rate:
            best, best_rate = k, rate
    return best
