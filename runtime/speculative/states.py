"""Verify on a hybrid artifact: each row keeps the state of the tokens it accepted, not of its drafts.

A layer's state is valid at one position only (:mod:`kvforge.graphs.contract`): the verify call of
``width`` tokens per row computes each row's state after all ``width``, but a row that rejects a
draft keeps fewer. KV needs nothing (positions past a row's length are stale and overwritten
later); a state cannot be cut back. So:

* :meth:`~kvforge.runtime.engine.StepEngine.verify_rows` writes the states after the ``width``
  tokens to ``engine.verify_states`` (a second ``[B_max, *shape]`` allocation per state tensor,
  made once with speculative decoding), and leaves each row's own state where it was, at the
  row's old length ``base``;
* :func:`keep_accepted`, called once the rows' lengths are set to what they accepted
  (``base + kept``): a row that kept all ``width`` tokens copies its state from the scratch (one
  row of each state tensor); rows that kept fewer re-run their kept tokens from ``base`` in one
  prefill call (the verify graph with ``input_lengths`` = each row's kept count: its state is
  written after its last kept token), which rewrites their KV at those positions with the same
  values.

The re-run is the price of a rejection: a second call of up to ``width`` tokens on the rows that
rejected (rows of the same call that accepted everything run inside it too, when they lie between
two that did not: one call, not one per row). A step where every row accepted all its drafts costs
only the row copies. The alternative, a verify graph that outputs the state after every position
(transformers' ``get_recurrent_states_to_keep``), would need ``width`` states per row from every
verify call, rejected or not, and a graph change per state kind.
"""

from __future__ import annotations

import numpy as np


def keep_accepted(engine, first: int, base: list[int], ids: np.ndarray) -> None:
    """Give rows ``first, first + 1, ...`` (one per entry of ``base``, their lengths before the
    verify call of ``ids [n, width]``) the state of what they kept: ``engine.lengths[row] - base``
    tokens of their ``ids`` row. Nothing to do for an artifact without state. A row that kept
    nothing (its verify call failed) keeps its old state. Raises what the re-run's engine call
    raises (the rows' states are then undefined: their requests must fail)."""
    if not engine.verify_states:
        return
    n, width = ids.shape
    kept = [int(engine.lengths[first + i]) - base[i] for i in range(n)]
    short = [i for i in range(n) if 0 < kept[i] < width]
    # gqa: each short row alone (ONNX Runtime's GroupQueryAttention continues one row per call)
    groups = _groups(short, kept) if engine.verify_together else [[i] for i in short]
    rerun = {i for group in groups for i in group}
    for i in range(n):
        if kept[i] == width and i not in rerun:  # every token accepted: the scratch holds its state
            for past, state in engine.cache.states.items():
                state[first + i] = engine.verify_states[past][first + i]
    for group in groups:
        rows = [ids[i, : kept[i]].tolist() for i in group]
        engine.prefill_rows(rows, [base[i] for i in group], first + group[0])


def _groups(short: list[int], kept: list[int]) -> list[list[int]]:
    """The re-run calls: the rows from the first short row to the last in one call (a row between
    them that accepted everything re-runs its tokens too: one call, not one per row), split where
    a row kept nothing. gqa re-runs each short row alone (ONNX Runtime's GroupQueryAttention
    continues several tokens one row per call)."""
    if not short:
        return []
    groups: list[list[int]] = [[]]
    for i in range(short[0], short[-1] + 1):
        if kept[i] > 0:
            groups[-1].append(i)
        elif groups[-1]:
            groups.append([])
    return [g for g in groups if g]
