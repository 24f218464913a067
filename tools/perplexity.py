"""Windowed perplexity: which tokens each window scores, and the NLL of those tokens from logits.

A text longer than a model's cache is scored in windows of ``window`` tokens whose starts lie
``stride`` apart. Every token after the first is scored exactly once, by the first window that
holds it with at least one token before it:

* ``stride == window`` (the default): non-overlapping windows; the first token of each window is
  context only (it is scored by no window), as ``kvforge compare`` has always done;
* ``stride < window``: overlapping windows; each window scores only the tokens the previous one
  did not reach, so every scored token but those of the first window sees at least
  ``window - stride`` tokens of context (the "strided" evaluation: more context per token, about
  ``window / stride`` times the compute).

Every side of a comparison (kvforge's score graph, transformers, llama.cpp) runs the same windows
over the same token ids and hands its logits to :func:`window_nll`. This module imports numpy
only, so a process without kvforge's dependencies (llama.cpp's own venv in
``benchmarks/peer_llamacpp.py``) can load it by path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Window:
    """Tokens ``ids[start:end]`` go in; the targets ``ids[first:end]`` are scored
    (``start < first < end``)."""

    start: int
    end: int
    first: int

    @property
    def scored(self) -> int:
        return self.end - self.first


def windows(n_tokens: int, window: int, stride: int | None = None) -> list[Window]:
    """The windows that score a text of ``n_tokens`` tokens (see the module docstring)."""
    stride = window if stride is None else stride
    if window < 2:
        raise ValueError(f"a perplexity window needs at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"the stride must lie in 1..window={window}, got {stride}")
    out, start, reached = [], 0, 0
    while start < n_tokens:
        end = min(start + window, n_tokens)
        first = max(start + 1, reached)
        if end > first:
            out.append(Window(start, end, first))
        if end == n_tokens:
            break
        reached, start = end, start + stride
    return out


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis, in float64 (the same arithmetic for every side)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def window_nll(logits: np.ndarray, ids: list[int] | np.ndarray, w: Window) -> np.ndarray:
    """NLL (nats) of the targets ``w`` scores. ``logits`` are a side's logits ``[w.end - w.start, V]``
    for the window's tokens ``ids[w.start:w.end]`` (row i predicts token ``w.start + i + 1``);
    ``ids`` is the whole text. Returns ``[w.scored]`` float64."""
    rows = np.asarray(logits)[w.first - 1 - w.start : w.end - 1 - w.start]
    targets = np.asarray(ids[w.first : w.end], dtype=np.int64)
    log_p = log_softmax_rows(rows)
    return -log_p[np.arange(len(targets)), targets]


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    return float(np.exp(np.mean(nll)))
