"""Drafters: what a request proposes for the target model to verify, and how many tokens.

A drafter has one verb, ``propose(generated, k) -> list[int]``: up to ``k`` tokens that may follow
the prompt (given at construction) and ``generated`` (the request's output so far). It keeps what it
needs between calls and reads only the tokens it has not seen. :class:`RowDrafting` wraps one
request's drafter with the adaptive draft length and the counts a result reports.

* :class:`NgramDrafter`: prompt lookup. The last ``n`` tokens (``ngram_max`` down to ``ngram_min``)
  are looked up among the earlier tokens of prompt + output; the tokens that followed their first
  occurrence are proposed (as transformers' prompt lookup does; the first occurrence also has the
  longest continuation in a repeating run). An index of every n-gram's first continuation is kept
  up to date as tokens arrive (O(1) per token and per proposal, no scan of the text).
* :class:`PredictionDrafter`: an explicit prediction (OpenAI's "predicted outputs"): while the
  output follows the prediction, the prediction's next tokens; after a divergence, the prediction
  is re-entered like a diff: where the output's last tokens occur nearest after the point it left.
* :class:`kvforge.runtime.speculative.draft_model.DraftModelDrafter`: a smaller model's greedy tokens.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from kvforge.runtime.speculative.cost import WIDTH_COST, best_k

PROBE = 16  # a draft model's row that does not draft tries one token after PROBE steps, then 2x later


class NgramDrafter:
    """Prompt lookup over ``prompt`` + the generated tokens."""

    def __init__(self, prompt: Sequence[int], ngram_max: int = 3, ngram_min: int = 2) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: list[int] = []
        self.prompt_len = len(prompt)
        # (n-gram) -> the position right after its first occurrence (which has a known continuation).
        self.index: dict[tuple[int, ...], int] = {}
        self._extend(prompt)

    def _extend(self, new: Sequence[int]) -> None:
        tokens, index = self.tokens, self.index
        for t in new:
            i = len(tokens)  # t's position: the n-grams ending at i - 1 now have a continuation
            for n in range(self.ngram_min, self.ngram_max + 1):
                if i >= n:
                    index.setdefault(tuple(tokens[i - n : i]), i)
            tokens.append(int(t))

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        seen = len(self.tokens) - self.prompt_len
        if len(generated) > seen:
            self._extend(generated[seen:])
        tokens = self.tokens
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(tokens) <= n:
                continue
            at = self.index.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + k]
        return []


class PredictionDrafter:
    """Proposes an explicit ``prediction`` (token ids the output is expected to repeat), re-syncing
    like a diff after the output leaves it.

    While the output follows the prediction, the prediction's next tokens are proposed. After a
    divergence (an edit: tokens replaced, inserted or left out), the output's last ``n`` tokens
    (``ngram_max`` down to ``ngram_min``) are looked up in the prediction, and the match chosen is
    the one starting nearest at or after ``anchor`` (the end of the part the output last followed:
    in a diff the output re-joins the prediction after where it left it), else the nearest before
    it. A one-token match counts only within ``near`` tokens after the anchor (a common token
    further on says little). An edit thus costs the tokens the model writes itself plus about one
    step, wherever the same tokens recur elsewhere in the prediction."""

    def __init__(self, prediction: Sequence[int], ngram_max: int = 4, ngram_min: int = 1, near: int = 16) -> None:
        self.prediction = pred = [int(t) for t in prediction]
        self.ngram_max, self.ngram_min, self.near = ngram_max, ngram_min, near
        self.at: int | None = 0  # the prediction's next token while the output follows it; None: lost
        self.anchor = 0  # where the output last followed the prediction to
        self.seen = 0
        self.last: list[int] = []  # the latest ngram_max generated tokens
        # n-gram -> the positions where it starts in the prediction (ascending), if a token follows it.
        self.starts: dict[tuple[int, ...], list[int]] = {}
        for n in range(ngram_min, ngram_max + 1):
            for i in range(len(pred) - n):
                self.starts.setdefault(tuple(pred[i : i + n]), []).append(i)

    def propose(self, generated: Sequence[int], k: int) -> list[int]:
        pred, at = self.prediction, self.at
        for t in generated[self.seen :]:
            t = int(t)
            if at is not None and at < len(pred) and pred[at] == t:
                at += 1
                self.anchor = at
            else:
                at = None
            self.last.append(t)
        del self.last[: -self.ngram_max]
        self.seen = len(generated)
        if at is None:
            at = self._rejoin()
        self.at = at
        return [] if at is None else pred[at : at + k]

    def _rejoin(self) -> int | None:
        """The prediction's position after the output's last tokens, the nearest to the anchor."""
        last, anchor = self.last, self.anchor
        for n in range(min(self.ngram_max, len(last)), self.ngram_min - 1, -1):
            starts = self.starts.get(tuple(last[-n:]))
            if not starts:
                continue
            j = bisect_left(starts, anchor)
            if j < len(starts) and (n > 1 or starts[j] - anchor <= self.near):
                return starts[j] + n
            if j > 0 and n > 1:
                return starts[j - 1] + n
        return None


class RowDrafting:
    """One request's drafting: its drafter, the draft length and what it proposed and got accepted.

    Adaptive length (``adaptive=True``), by the kind of drafter:

    * **Prompt lookup** (no ``token_cost``, not a prediction), in a step of its own (``alone``):
      drafting is free, a verify call costs :func:`~kvforge.runtime.speculative.cost.call_cost` of
      its width at ``width_cost`` a token (the artifact's: float or quantized weights), so the
      length is the one with the most expected tokens per call cost at the row's acceptance rate
      (:func:`best_k` with no token cost). The rate is per drafted token reached: a
      call whose run of ``a`` accepted drafts ended on a miss says ``a / (a + 1)``, one that
      accepted all says 1, averaged with the rate so far half and half. A copying run thus drafts
      long at once, and after a miss the next match is still tried (a one-token draft costs ~8% of
      a step in fp32). Only when the rate says plain decoding is cheaper does it pause: a miss then
      holds drafting for 1, 2, 4 ... 16 steps before the next one-token draft (reset by the next
      acceptance). (The rule below, used alone before, drafted 5-7% fewer tokens per cost on fp32
      grounded text: benchmarks/README.md, "ngram's length from the cost of a call".)
    * **Prompt lookup in a step of several rows**, where every row pays the widest draft or a
      call of its own (:mod:`.verify`): a step whose drafts are all accepted doubles the length (up
      to ``k``), a partial acceptance sets it to the accepted count + 1, and nothing accepted sets
      it to 1 and pauses drafting for 1, 2, 4 ... 16 steps (reset by the next acceptance), so a row
      whose text offers nothing to copy decodes plainly.
    * **A draft model** (``token_cost``: its cost per drafted token in target steps, a callable;
      None until measured): the length with the most expected tokens per cost, 0 when plain
      decoding is cheaper; then a probe of one token after 16, 32, 64 ... steps keeps the
      acceptance rate current. Its rate is the share of drafted tokens accepted (moving average).
    * **An explicit prediction** (``prediction=True``): lengths as prompt lookup's in a step of
      several rows, but nothing accepted halves the length and never pauses: its drafter proposes
      nothing while the output is off the prediction, and re-joins it at once when it comes back."""

    def __init__(
        self,
        drafter,
        k: int,
        adaptive: bool = True,
        prediction: bool = False,
        token_cost=None,
        width_cost: float = WIDTH_COST,
        rerun: bool = False,
    ) -> None:
        self.drafter, self.k_max, self.adaptive = drafter, k, adaptive
        self.width_cost = width_cost  # one more token of the row's own verify call, in steps
        self.rerun = rerun  # the artifact keeps states: a rejection re-runs the kept tokens (cost.rerun_cost)
        self.prediction = prediction  # the drafter is the request's explicit prediction
        self.token_cost = token_cost
        self.rate = 0.6  # recent acceptance rate per drafted token (moving average)
        self.idle = 0
        self.probe_every = PROBE
        self.k = k  # the length in a step of several rows (and a prediction's)
        self.pause = 0  # in a step of several rows: plain steps left before drafting again
        self.misses = 0  # calls in a row that accepted nothing
        self.alone_pause = 0  # prompt lookup alone: plain steps left before a one-token draft
        self.alone_misses = 0  # ... calls in a row that accepted nothing while the rate said plain
        self.drafted = 0  # tokens proposed and verified
        self.accepted = 0  # of them, tokens accepted
        self.steps = 0  # verify calls with at least one drafted token

    def propose(self, generated: Sequence[int], room: int, alone: bool = True) -> list[int]:
        """Up to ``min(k, room)`` tokens to verify after ``generated`` (empty: a plain step);
        ``alone``: the row is the only one of its step."""
        limit = min(self.k_max, room)
        if limit <= 0:
            return []
        cost = self.token_cost() if self.adaptive and self.token_cost is not None else None
        lookup = self.token_cost is None and not self.prediction  # prompt lookup
        if not self.adaptive:
            k = limit
        elif cost is not None:
            k = best_k(self.rate, limit, cost, rerun=self.rerun)
            self.idle = 0 if k else self.idle + 1
            if k:
                self.probe_every = PROBE
            elif self.idle >= self.probe_every:  # a probe; the next one twice as far (each one
                k, self.idle = 1, 0  # brings the draft row up to date: a prefill of the tokens since)
                self.probe_every = min(2 * self.probe_every, 256)
        elif lookup and alone:
            k = best_k(self.rate, limit, 0.0, self.width_cost, self.rerun)
            if k == 0:  # plain decoding is cheaper at this rate: one token, after a pause
                if self.alone_pause > 0:
                    self.alone_pause -= 1
                    return []
                k = 1
        else:
            if self.pause > 0:
                self.pause -= 1
                return []
            k = min(self.k, limit)
        return self.drafter.propose(generated, k)[:k] if k > 0 else []

    def learn(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafted tokens were the target's."""
        if proposed == 0:
            return
        self.steps += 1
        self.drafted += proposed
        self.accepted += accepted
        if self.token_cost is None and not self.prediction:  # prompt lookup: per drafted token
            # reached (a run of `accepted`, then a miss unless all were accepted)
            self.rate = 0.5 * self.rate + 0.5 * accepted / (accepted + (accepted < proposed))
            if accepted:
                self.alone_misses = 0
            elif best_k(self.rate, self.k_max, 0.0, self.width_cost, self.rerun) == 0:
                self.alone_pause = min(1 << self.alone_misses, 16)
                self.alone_misses += 1
        else:
            self.rate = 0.7 * self.rate + 0.3 * accepted / proposed
        if not self.adaptive:
            return
        if accepted == proposed:
            self.k = min(self.k_max, 2 * self.k)
            self.misses = 0
        elif accepted > 0:
            self.k = accepted + 1
            self.misses = 0
        elif self.prediction:
            self.k = max(1, self.k // 2)
        else:
            self.k = 1
            self.pause = min(1 << self.misses, 16)
            self.misses += 1
