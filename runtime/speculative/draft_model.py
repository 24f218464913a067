"""A draft model: a second kvforge artifact, with the target's tokenizer, proposing greedily.

:class:`DraftModel` holds the draft engine (its own weights, session and KV cache) and hands each
request a :class:`DraftModelDrafter`, which takes a cache row of the draft engine the first time it
proposes (rows of finished requests are taken back then; a request finding none free does not
draft). Of the free rows it takes the one whose tokens share the longest prefix with its own, so a
chat's next turn, or a request repeating a system prompt, finds the earlier tokens already in the
draft cache. A proposal brings the draft row up to date with the request's tokens (the draft cache
keeps the longest prefix it shares with them: a rejection shortens it, as in the target) by one
prefill of the missing tokens, then runs ``k - 1`` greedy decode steps: ``k`` tokens for ``k`` calls of a
model much cheaper than the target. The draft engine's step API is used below its ownership layer:
the target's batch loop, under the target's lock, is its only caller. Its time per drafted token
(timed when the draft row was at most a step behind: the prompt's prefill is a one-time cost) and
the target's time per step are measured as they run: a request's draft length is the one with
the most expected tokens per cost (:func:`.cost.best_k`), none when drafting does not pay.

A hybrid draft (its layers keep a state, valid at one position only) cannot shorten a row as KV
is shortened: :class:`StateSnapshots` keeps each draft row's state at every position its next
proposal may resume from (the proposal's start and after each of its drafted tokens but the
last, which the row holds), and a resume elsewhere re-prefills the row from its start.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvforge.graphs.manifest import ArtifactError
from kvforge.runtime.kv.prefix_pool import common_prefix


def _tokenizer_digest(engine) -> str | None:
    path = engine.artifact_dir / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


class DraftModel:
    """The draft engine of a target engine; refuses a draft whose tokenizer is not the target's."""

    def __init__(self, draft_engine, target_engine) -> None:
        ours, theirs = _tokenizer_digest(target_engine), _tokenizer_digest(draft_engine)
        if ours != theirs or (ours is None and draft_engine.vocab_size != target_engine.vocab_size):
            draft_engine.close()
            raise ArtifactError(
                f"the draft model {draft_engine.artifact_dir} does not share the target's tokenizer "
                f"(tokenizer.json sha256 {str(theirs)[:12]} vs {str(ours)[:12]}): its token ids would mean other "
                "text. Use a draft compiled from a model with the same tokenizer (e.g. a smaller model of the "
                "same family)"
            )
        self.engine = draft_engine
        self.target_vocab = target_engine.vocab_size
        self.snapshots = StateSnapshots(draft_engine) if draft_engine.manifest.layout.has_state else None
        self.rows: list[DraftModelDrafter | None] = [None] * draft_engine.max_batch
        self.row_tokens: list[list[int]] = [[] for _ in self.rows]  # what each draft row's cache holds
        # Moving averages of the seconds a drafted token and a target step (one token, one row) take.
        self.token_s: float | None = None
        self.step_s: float | None = None

    def target_step(self, seconds: float) -> None:
        """The verify step reports a target call's time per step (see :func:`.cost.call_cost`)."""
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def drafted(self, seconds: float, tokens: int) -> None:
        per = seconds / tokens
        self.token_s = per if self.token_s is None else 0.8 * self.token_s + 0.2 * per

    def token_cost(self) -> float | None:
        """A drafted token's cost in target steps; None until both have been timed."""
        if self.token_s is None or not self.step_s:
            return None
        return self.token_s / self.step_s

    def drafter(self, prompt: Sequence[int], done: Callable[[], bool]) -> DraftModelDrafter:
        """A request's drafter; ``done()`` says when the request has finished (its row is free then)."""
        return DraftModelDrafter(self, prompt, done)

    def take_row(self, drafter: DraftModelDrafter) -> int | None:
        """A free row for ``drafter`` (None when every row's request is still running): the one whose
        cached tokens share the longest prefix with ``drafter.prompt``; on a tie the one holding the
        fewest tokens, which keeps the others' for the requests that share them."""
        best, best_key = None, None
        for r, holder in enumerate(self.rows):
            if holder is None or holder.finished():
                key = (common_prefix(self.row_tokens[r], drafter.prompt), -len(self.row_tokens[r]))
                if best_key is None or key > best_key:
                    best, best_key = r, key
        if best is None:
            return None
        holder = self.rows[best]
        if holder is not None:
            holder.row = None
        self.rows[best] = drafter
        return best

    def forget(self) -> None:
        """Drop what the free draft rows hold: the next request prefills its whole prompt there, as
        the first one did (a benchmark of first requests calls this between them)."""
        for r, holder in enumerate(self.rows):
            if holder is None or holder.finished():
                self.row_tokens[r] = []

    def close(self) -> None:
        self.engine.close()


class DraftModelDrafter:
    """One request's proposals from the draft model (greedy, on the draft engine's row ``row``)."""

    def __init__(self, model: DraftModel, prompt: Sequence[int], done: Callable[[], bool]) -> None:
        self.model = model
        self.finished = done  # the request proposes no more: its row may be taken
        self.prompt = [int(t) for t in prompt]
        self.row: int | None = None
        self.cached: list[int] = []  # the tokens in the draft row, in order

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        model = self.model
        engine = model.engine
        if self.row is None:
            self.row = model.take_row(self)
            if self.row is None:
                return []
            self.cached = model.row_tokens[self.row]
        started = time.perf_counter()
        tokens = self.prompt + [int(t) for t in generated]
        if len(tokens) + k > engine.max_seq:
            k = engine.max_seq - len(tokens)
            if k < 1:
                return []
        # The longest prefix the draft row shares with the tokens; the rest is prefilled.
        same = min(common_prefix(self.cached, tokens), len(tokens) - 1)  # the last token goes in, for its logits
        row = self.row
        snapshots = model.snapshots
        if snapshots is not None:  # a hybrid draft resumes where it has the row's state
            same = snapshots.resume(row, len(self.cached), same)
        step = engine.chunk_tokens
        for at in range(same, len(tokens), step):
            logits = engine.prefill_rows([tokens[at : at + step]], [at], row)
        out = [int(np.argmax(logits[0]))]
        ids = engine.decode_ids(1)
        for j in range(k - 1):
            if snapshots is not None:
                snapshots.save(row, len(tokens), j, k - 1)
            ids[0] = out[-1]
            logits = engine.decode_rows(1, row)
            out.append(int(np.argmax(logits[0])))
        self.cached = model.row_tokens[row] = tokens + out[:-1]
        if len(tokens) - same <= k + 1:  # a step's catch-up, not the prompt's or a long gap's prefill
            model.drafted(time.perf_counter() - started, len(out))
        # The target cannot take ids beyond its vocabulary: a draft stops before the first such id.
        for j, t in enumerate(out):
            if t >= model.target_vocab:
                return out[:j]
        return out


class StateSnapshots:
    """A hybrid draft engine's row states at the positions a row's next proposal may resume from.

    ``saved[name]``: ``[B_max, slots, *shape]`` per state tensor (by past-input name), slot ``j`` of
    row ``r`` the state after ``start[r] + j`` tokens of the row's cached tokens (``count[r]`` slots
    valid); grown, never shrunk, to the longest proposal seen.
    """

    def __init__(self, engine) -> None:
        self.states = engine.cache.states
        self.saved: dict[str, np.ndarray] = {}
        self.start = [0] * engine.max_batch
        self.count = [0] * engine.max_batch

    def save(self, row: int, start: int, slot: int, slots: int) -> None:
        """Keep row ``row``'s state (after ``start + slot`` tokens) in slot ``slot`` of ``slots``."""
        if not self.saved or next(iter(self.saved.values())).shape[1] < slots:
            self.saved = {
                name: np.zeros((state.shape[0], slots, *state.shape[1:]), state.dtype)
                for name, state in self.states.items()
            }
            self.count = [0] * len(self.count)  # the old slots are gone with their arrays
        for name, state in self.states.items():
            self.saved[name][row, slot] = state[row]
        self.start[row], self.count[row] = start, slot + 1

    def resume(self, row: int, held: int, at: int) -> int:
        """Where row ``row`` (its state after ``held`` tokens) can continue at ``at`` tokens: ``at``
        when its state is there or a slot holds it (restored), else 0 (re-prefill from the start).
        The slots are spent: what the row runs next makes the later ones another sequence's."""
        slot, valid = at - self.start[row], self.count[row]
        self.count[row] = 0
        if at == held:
            return at
        if not 0 <= slot < valid:
            return 0
        for name, state in self.states.items():
            state[row] = self.saved[name][row, slot]
        return at
