"""The batch loop's verify step: each decoding row's drafts checked in ONE engine call.

Input: the decoding requests of a batch loop (request ``i`` in cache row ``first + i``), each with
its :class:`~kvforge.runtime.speculative.drafters.RowDrafting` or none. Output: every row's
accepted tokens fed to its :class:`~kvforge.runtime.generation.Generation`, the cache rows'
lengths set to what they now hold. One step:

1. each drafting row proposes up to ``k`` tokens (fewer near ``max_seq`` or ``max_new_tokens``;
   a row alone in the step by the cost of its own call, rows of several by the length rule for
   batches: :class:`~kvforge.runtime.speculative.drafters.RowDrafting`); no proposal anywhere ->
   ``False``, and the loop takes its plain decode step;
2. one engine call of ``width = 1 + longest draft`` tokens per row (the row's last token, its
   drafts, padding for shorter rows) with logits at every position, ``[n, width, V]``. A row
   without drafts takes its plain step in the same call (its logits at position 0). With several
   rows every row pays the width, so the width is the one with the most expected tokens per cost
   (each row's acceptance rate so far, :mod:`.cost`), drafts cut to it; a plain step when none wins;
3. per row, position by position: the token is the draft when accepted (greedy: it is the argmax;
   sampling: ``Sampler.verify``'s rule, which keeps the target distribution), else the
   replacement, which ends the row's run; after the last draft, one more token from the last
   position's logits (the "bonus"). Each token goes through ``Generation.accept`` as in plain
   decoding, so eos, stop strings, ``max_new_tokens``, logprobs and streaming behave alike: a stop
   inside an accepted run ends the request there and the tokens after it are dropped;
4. the row's cache length is set to its old length + 1 + accepted drafts: the rejected positions
   hold stale keys and values that no query attends (they lie past the row's length) and the next
   call overwrites them. A hybrid artifact's rows also keep the state of those tokens only
   (:mod:`.states`: a row that rejected a draft re-runs what it kept).

The gqa lowering cannot verify several rows in one call (ONNX Runtime's GroupQueryAttention:
"batch_size must be 1 when sequence_length > 1 and past context is given"). With more than one
decoding row there, a step is split (:meth:`Verifier._split_step`): ONE plain decode call over all
rows gives every row its next token, which also checks each row's first draft; a row whose first
draft was right then verifies the rest of its drafts in a call of its own (batch 1, written after
that token), when its expected tokens pay for the call: ``1 + a + a² + …`` (``a``: the row's
acceptance rate so far) per :func:`call_cost` of its width must beat the batched step's tokens per
its cost (:mod:`.cost`). A row whose first draft was wrong cost nothing more than plain decoding.
"""

from __future__ import annotations

import time

import numpy as np

from kvforge.runtime.speculative.cost import call_cost, expected_tokens, rerun_cost
from kvforge.runtime.speculative.states import keep_accepted

NO_DRAFT: list[int] = []


class Verifier:
    """One batch loop's verify step; owns the scratch row of argmaxes ``[max_batch, max_width]``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.width = engine.verify_width
        self._greedy = np.zeros(engine.max_batch * self.width, dtype=np.int64)
        self._drafts: list[list[int]] = []

    def step(self, gens: list, first: int) -> bool:
        """Draft, verify and accept for ``gens`` (in rows ``first, first + 1, ...``). Returns False,
        having run nothing, when no row proposed a token."""
        engine, n = self.engine, len(gens)
        lengths, max_seq = engine.lengths, engine.max_seq
        drafts = self._drafts
        drafts.clear()
        longest = 0
        least_room = max_seq
        for i, g in enumerate(gens):
            room = max_seq - int(lengths[first + i])  # positions this row can still write
            least_room = min(least_room, room)
            d = g.drafting
            if d is None:
                drafts.append(NO_DRAFT)
                continue
            fit = min(self.width, room, g.max_new_tokens - len(g.token_ids)) - 1
            p = d.propose(g.token_ids, fit, alone=n == 1) if fit > 0 else NO_DRAFT
            drafts.append(p)
            longest = max(longest, len(p))
        width = min(1 + longest, least_room)  # every row writes `width` positions
        if width < 2:
            return False
        if n > 1 and not engine.verify_together:
            self._split_step(gens, first)
            return True
        if n > 1:  # one call for all rows: the width whose expected tokens per cost are highest
            width = _best_width(gens, drafts, width)
            if width < 2:
                return False
        ids = engine.verify_ids(n, width)  # [n, width]
        for i, (g, p) in enumerate(zip(gens, drafts)):
            if len(p) >= width:
                drafts[i] = p = p[: width - 1]
            ids[i, 0] = g.token_ids[-1]
            ids[i, 1 : 1 + len(p)] = p
            ids[i, 1 + len(p) :] = 0  # padding: written past the row's length, never attended
        base = [int(lengths[first + i]) for i in range(n)]
        try:
            started = time.perf_counter()
            logits = engine.verify_rows(n, width, first)  # [n, width, V]
            self._timed(time.perf_counter() - started, n, width)
        except Exception as error:  # the engine call failed: its requests fail, the loop goes on
            for g in gens:
                g.fail(error)
            return True
        greedy = None
        if any(g.sampler.plain_greedy for g in gens):
            greedy = self._greedy[: n * width].reshape(n, width)
            np.argmax(logits, axis=-1, out=greedy)
        for i, (g, p) in enumerate(zip(gens, drafts)):
            accepted = 0
            try:
                accepted = _accept_row(g, p, logits[i], None if greedy is None else greedy[i], base[i], max_seq)
            except Exception as error:  # this request alone fails
                g.fail(error)
            lengths[first + i] = base[i] + 1 + accepted
            if p and g.drafting is not None:
                g.drafting.learn(len(p), accepted)
        _keep_states(engine, gens, first, base, ids)
        return True

    def _timed(self, seconds: float, rows: int, width: int) -> None:
        """A draft model's choice of k weighs its own time against the target's step time."""
        model = self.engine.draft_model
        if model is not None:
            model.target_step(seconds / call_cost(rows, width))

    def _split_step(self, gens: list, first: int) -> None:
        """The gqa lowering with several rows: one decode call for all, then a batch-1 verify call
        per row whose first draft the decode confirmed and whose expected tokens pay for it."""
        engine, n, drafts = self.engine, len(gens), self._drafts
        lengths, max_seq = engine.lengths, engine.max_seq
        ids = engine.decode_ids(n)
        for i, g in enumerate(gens):
            ids[i] = g.token_ids[-1]
        try:
            started = time.perf_counter()
            logits = engine.decode_rows(n, first)  # [n, V]; every row's length + 1
            self._timed(time.perf_counter() - started, n, 1)
        except Exception as error:
            for g in gens:
                g.fail(error)
            return
        greedy = None
        if any(g.sampler.plain_greedy for g in gens):
            greedy = self._greedy[:n]
            np.argmax(logits, axis=-1, out=greedy)
        batch_rate = n / call_cost(n, 1)  # tokens per unit of cost of this plain step
        follow = []  # (row, its remaining drafts) to verify alone
        for i, (g, p) in enumerate(zip(gens, drafts)):
            row = first + i
            try:
                if not p:
                    token = g.pick(logits[i], None if greedy is None else int(greedy[i]))
                    g.accept(token, room=bool(lengths[row] < max_seq))
                    continue
                if g.sampler.plain_greedy:
                    token = int(greedy[i])
                    g.sampler.record(token)
                else:
                    token = g.sampler.verify(logits[i], p[0])
                hit = token == p[0]
                g.accept(token, room=bool(lengths[row] < max_seq))
            except Exception as error:
                g.fail(error)
                continue
            rest = p[1 : max_seq - int(lengths[row])]  # the row writes token + rest
            if hit and not g.done and rest and _pays(g.drafting, 1 + len(rest), batch_rate, bool(engine.verify_states)):
                follow.append((i, rest))
            elif g.drafting is not None:
                g.drafting.learn(1, int(hit))  # only the first draft was checked
        for i, rest in follow:
            g, row = gens[i], first + i
            base = int(lengths[row])  # the first draft's position
            width = 1 + len(rest)
            vids = engine.verify_ids(1, width)
            vids[0, 0] = g.token_ids[-1]
            vids[0, 1:] = rest
            try:
                started = time.perf_counter()
                vlogits = engine.verify_rows(1, width, row)[0]  # [width, V]
                self._timed(time.perf_counter() - started, 1, width)
            except Exception as error:
                g.fail(error)
                lengths[row] = base
                continue
            vgreedy = None
            if g.sampler.plain_greedy:
                vgreedy = self._greedy[:width]
                np.argmax(vlogits, axis=-1, out=vgreedy)
            accepted = 0
            try:
                accepted = _accept_row(g, rest, vlogits, vgreedy, base, max_seq)
            except Exception as error:
                g.fail(error)
            lengths[row] = base + 1 + accepted
            if g.drafting is not None:
                g.drafting.learn(width, 1 + accepted)
            _keep_states(engine, [g], row, [base], vids)


def _keep_states(engine, gens: list, first: int, base: list[int], ids: np.ndarray) -> None:
    """A hybrid artifact's rows keep the state of what they accepted (:mod:`.states`); when that
    fails, their requests fail (their states are undefined)."""
    try:
        keep_accepted(engine, first, base, ids)
    except Exception as error:
        for g in gens:
            g.fail(error)


def _rate(drafting) -> float:
    """A row's acceptance rate so far (0.7 before its first verified draft: a row is given the
    chance to show what its drafts are worth)."""
    return drafting.accepted / drafting.drafted if drafting is not None and drafting.drafted else 0.7


def _best_width(gens: list, drafts: list[list[int]], widest: int) -> int:
    """The width of a call of all rows (every row pays it: padding for shorter drafts) with the
    most expected tokens per cost; 1 (a plain step) when no width beats it. A hybrid artifact's
    re-run after a rejection (:mod:`.states`) is not priced here: with it, rows at the prior rate
    (0.7) would never draft in a batch, and so never show a better rate."""
    n = len(gens)
    best_width, best = 1, n / call_cost(n, 1)
    for width in range(2, widest + 1):
        tokens = sum(
            expected_tokens(_rate(g.drafting), min(len(p), width - 1)) if p else 1.0 for g, p in zip(gens, drafts)
        )
        if tokens / call_cost(n, width) > best:
            best_width, best = width, tokens / call_cost(n, width)
    return best_width


def _pays(drafting, width: int, batch_rate: float, rerun: bool = False) -> bool:
    """Whether a batch-1 verify call of ``width`` tokens (the confirmed first draft and the rest)
    is expected to give more tokens per cost than the batched decode step (``batch_rate``);
    ``rerun``: a hybrid artifact's rejection adds :func:`.cost.rerun_cost`."""
    cost = call_cost(1, width) + (rerun_cost(_rate(drafting), width - 1) if rerun else 0.0)
    return expected_tokens(_rate(drafting), width - 1) / cost > batch_rate


def _accept_row(g, draft: list[int], logits: np.ndarray, greedy: np.ndarray | None, base: int, max_seq: int) -> int:
    """Feed row ``g`` its tokens from ``logits [width, V]``; returns how many drafts were accepted."""
    plain = g.sampler.plain_greedy
    accepted = 0
    for j in range(len(draft) + 1):
        if j < len(draft):
            if plain:
                token = int(greedy[j])
                g.sampler.record(token)
            else:
                token = g.sampler.verify(logits[j], draft[j])
        else:
            token = g.pick(logits[j], None if greedy is None else int(greedy[j]))
        hit = j < len(draft) and token == draft[j]
        accepted += hit
        g.accept(token, room=base + 1 + j < max_seq)
        if g.done or not hit:
            break
    return accepted
