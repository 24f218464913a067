"""One request's generation as a state machine: prompt in, tokens, text chunks and a result out.

A :class:`Generation` is engine-independent: the batch loop (:mod:`kvforge.runtime.batching`)
prefills its prompt into a cache row, hands it each step's logits row to :meth:`Generation.pick`
a token, and :meth:`Generation.accept` turns the token into a :class:`StreamChunk` (incremental
detokenization, stop strings, eos, length) until the request finishes. States::

    waiting --admitted--> prefilling --prompt in the cache--> decoding --finish--> done
       \\--------------------------cancel / error------------------------------/

Text. ``chunk.text`` is what the token completed, after the detokenizer (UTF-8 characters and
merging pieces held back until complete) and the stop strings (text that could start one held
back until decided; a matched stop string and what follows are dropped). Joining every chunk's
``text`` and ``token_ids`` gives the result's ``text`` and ``token_ids``.

Timing. Monotonic ``time.perf_counter()`` stamps: ``submitted`` (the request was made),
``admitted`` (it got a cache row), ``first_token``, ``finished``; :class:`Timing` derives
``queue_s``, ``ttft_s``, ``decode_s`` from them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvforge.runtime import validate
from kvforge.runtime.detokenize import IncrementalDetokenizer
from kvforge.runtime.kv.block import KVBlock
from kvforge.runtime.kv.handoff import Handoff, params_dict
from kvforge.runtime.sampling import Sampler, SamplingParams, TokenLogprob
from kvforge.runtime.stops import StopStrings
from kvforge.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvforge.runtime.constraints import GrammarConstraint

FINISH_REASONS = ("stop", "length", "cancelled", "handoff")


log = logging.getLogger("kvforge.runtime")


@dataclass(frozen=True)
class Timing:
    """``time.perf_counter()`` seconds of one request's milestones (``first_token`` is None when
    it finished without a token, e.g. cancelled while queued)."""

    submitted: float
    admitted: float | None
    first_token: float | None
    finished: float

    @property
    def queue_s(self) -> float:
        """Waiting for a cache row: submitted -> admitted."""
        return (self.admitted if self.admitted is not None else self.finished) - self.submitted

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: submitted -> first token (queue and prefill included)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def decode_s(self) -> float | None:
        """First token -> finished: the decode steps of the other tokens."""
        return None if self.first_token is None else self.finished - self.first_token

    @property
    def total_s(self) -> float:
        return self.finished - self.submitted


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated ids only (the prompt excluded); an eos that stopped it is the last
    text: str | None  # decoded token_ids (special tokens skipped, stop string cut); None without a tokenizer
    # "stop" (eos id, stop string or the output's grammar complete) | "length" | "cancelled" | "handoff"
    finish_reason: str
    prompt_tokens: int
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"); None for eos
    logprobs: list[TokenLogprob] | None = None  # one per token when SamplingParams.logprobs is set
    timing: Timing | None = None
    cached_tokens: int = 0  # prompt tokens imported from the prefix cache instead of prefilled
    # Speculative decoding (0 without it): tokens drafted and verified, of them accepted, verify calls
    # with drafts; of which from the request's explicit prediction (SamplingParams.prediction).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    handoff: Handoff | None = None  # finish_reason "handoff": what a decode worker continues from

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens after the first, per second of decode time."""
        if self.timing is None or not self.timing.decode_s or len(self.token_ids) < 2:
            return None
        return (len(self.token_ids) - 1) / self.timing.decode_s


@dataclass(frozen=True)
class StreamChunk:
    """What one generated token added: ``text`` (possibly ``""``) and ``token_ids`` (one id; the
    lists of all chunks join to the result's). The last chunk has ``finish_reason`` (and
    ``stop_string`` when a stop string ended the request)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_string: str | None = None
    logprobs: list[TokenLogprob] | None = None


def check_max_new_tokens(max_new_tokens: object) -> None:
    """``max_new_tokens`` must be a Python or numpy int >= 1 (bools and floats such as 2.0 refused)."""
    if not validate.is_int(max_new_tokens):
        raise validate.WrongType(
            f"max_new_tokens must be an integer >= 1, got {validate.short_repr(max_new_tokens)} "
            f"({type(max_new_tokens).__name__}); pass an int"
        )
    if max_new_tokens < 1:
        raise validate.InvalidValue(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


class Generation:
    """One request: its prompt, sampler, detokenizer, stop strings, tokens and chunks.

    ``prompt_ids``: the whole sequence its cache row must hold before the first new token (for a
    session turn, the conversation so far), of which the first ``start`` are already in the cache.
    ``params`` must be resolved. Chunks go to ``sink`` (a callable) when given, else they collect
    in a list that :meth:`take_chunks` drains. Not thread-safe except :meth:`cancel` and
    :meth:`wait`: one batch loop drives it.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        stops: StopStrings,
        *,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_seq: int,
        start: int = 0,
        sink: Callable[[StreamChunk], None] | None = None,
        constraint: GrammarConstraint | None = None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = int(max_new_tokens)
        self.params = params
        self.sampler = Sampler(params, self.prompt_ids, vocab_size, eos_token_ids)
        self.stops = stops
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_seq = max_seq
        self.prefilled = start  # prompt tokens already in the cache row
        self.cached_tokens = 0  # of those, imported from the prefix cache (set by the batch loop)
        self.sink = sink
        self.drafting = None  # a speculative.RowDrafting when this request drafts
        self.constraint = constraint  # the output's grammar (kvforge.runtime.constraints), None when free
        self.hand_off = False  # end with a Handoff after the first token (disaggregated prefill)
        # prompt positions where a hybrid's prefill stops to leave a state snapshot in the prefix pool
        # (the end of a chat's system prompt, shared by the conversations that follow it)
        self.cache_points: tuple[int, ...] = ()
        self.handoff: Handoff | None = None
        self.resume_from: Handoff | None = None  # a resumed request's hand-off, its KV imported at admission
        self._handoff_chunk: StreamChunk | None = None
        self.state = "waiting"
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.error: BaseException | None = None
        self.cancel_requested = False
        self._pending: list[StreamChunk] = []
        self._logprobs_sent = 0
        self._done = threading.Event()
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.finished: float | None = None

    # ------------------------------------------------------------------ driven by the batch loop

    @property
    def remaining_prompt(self) -> int:
        """Prompt tokens not yet in the cache."""
        return len(self.prompt_ids) - self.prefilled

    def admit(self) -> None:
        self.state = "prefilling"
        self.admitted = time.perf_counter()

    def pick(self, logits: np.ndarray, greedy: int | None) -> int:
        """The next token from this request's logits row ``[V]`` (a view of the engine's buffer,
        read only). ``greedy``: the row's argmax when the loop computed it for the batch; used
        when the sampler is plain greedy (same token as the sampler's own argmax). A constraint
        masks the row first (then penalties, temperature, top-k/p: vLLM's order); its sampler is
        never plain greedy."""
        if self.constraint is not None:
            return int(self.sampler(self.constraint.mask(logits)))
        if greedy is not None and self.sampler.plain_greedy:
            self.sampler.record(greedy)
            return greedy
        return int(self.sampler(logits))

    def accept(self, token: int, room: bool) -> None:
        """Record ``token`` and emit its chunk; finish on eos (not with ``ignore_eos``), a stop
        string (not before ``min_tokens`` tokens), ``max_new_tokens`` or ``room=False`` (the cache
        row cannot hold the token for another step), or when the output's grammar is complete
        (``stop``)."""
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.state = "decoding"
        self.token_ids.append(token)
        if self.constraint is not None and not self.constraint.accept([token]):
            raise RuntimeError(f"token {token} broke the output's grammar: {self.constraint.error}")
        text = self.detok.add(token) if self.detok is not None else ""
        # min_tokens (vLLM's): no stop string is matched before that many tokens; their text passes as it is.
        early = len(self.token_ids) <= self.params.min_tokens
        text, matched = self.stops.feed(text) if text and not early else (text, None)
        eos = token in self.eos_token_ids and not self.params.ignore_eos
        if matched is not None:
            self._finish("stop", text, [token], stop_string=matched)
        elif eos or (self.constraint is not None and self.constraint.is_terminated):
            self._finish("stop", text, [token])
        elif len(self.token_ids) >= self.max_new_tokens or not room:
            self._finish("length", text, [token])
        elif self.hand_off and len(self.token_ids) == 1:
            # The batch loop exports the prompt's KV, then finish_handoff emits this chunk.
            self.state = "handing_off"
            self._handoff_chunk = StreamChunk(text, [token], "handoff", logprobs=self._new_logprobs())
        else:
            self._emit(StreamChunk(text, [token], logprobs=self._new_logprobs()))

    # ------------------------------------------------------------------ disaggregated prefill/decode

    @property
    def handing_off(self) -> bool:
        """The first token is accepted and the prompt's KV waits to be exported (:meth:`finish_handoff`)."""
        return self.state == "handing_off"

    def finish_handoff(
        self, block: KVBlock, checksum: str | None = None, export_s: float = 0.0, on_release=None
    ) -> None:
        """End with finish_reason "handoff": ``block`` holds the prompt's KV (``checksum``: its
        data's, from the export, which took ``export_s`` seconds; ``on_release``: the hand-off's
        hook that frees the memory the data is a view of, e.g. a lent cache row); the first token's
        chunk (finish_reason "handoff") is emitted and the result carries the :class:`Handoff`."""
        self.handoff = Handoff(
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            sampling=params_dict(self.params),
            stop=list(self.stops.stops) or None,
            first_token=self.token_ids[0],
            first_logprobs=self.sampler.logprobs[0] if self.params.logprobs is not None else None,
            rng_state=self.sampler.rng_state,
            block=block,
            cached_tokens=self.cached_tokens,
            checksum=checksum,
            export_s=export_s,
            on_release=on_release,
        )
        self.finish_reason = "handoff"
        self.state = "done"
        self.finished = time.perf_counter()
        self._emit(self._handoff_chunk)
        self._done.set()

    def replay_first(self, handoff: Handoff) -> None:
        """Take the first token of ``handoff`` as if this request had sampled it (the sampler's
        record, logprob and RNG state, the grammar, the detokenizer and stop strings), without
        emitting it; the batch loop then imports ``handoff.block`` and decodes from there."""
        token = handoff.first_token
        self.sampler.replay(token, handoff.first_logprobs, handoff.rng_state)
        self._logprobs_sent = len(self.sampler.logprobs)
        self.token_ids.append(token)
        if self.constraint is not None and not self.constraint.accept([token]):
            raise ValueError(
                f"the hand-off's first token {token} breaks the request's grammar: {self.constraint.error}"
            )
        text = self.detok.add(token) if self.detok is not None else ""
        text, matched = self.stops.feed(text) if text else ("", None)
        if matched is not None or len(self.token_ids) >= self.max_new_tokens:
            raise ValueError("the hand-off's first token already ends the request; it should not have been handed off")
        if text:
            self.text_parts.append(text)
        self.prefilled = len(self.prompt_ids)
        self.cached_tokens = handoff.cached_tokens
        self.resume_from = handoff

    def drop_handoff(self) -> None:
        """The resumed request's block is imported (or never will be): release its memory."""
        handoff, self.resume_from = self.resume_from, None
        if handoff is None:
            return
        try:
            handoff.release()
        except Exception as error:  # the block is imported (or the request failed already)
            # A release hook that fails (say, shared memory already unlinked) leaks at most that
            # block's memory; raising here would drop the request between the loop's queues.
            log.warning("releasing a resumed request's hand-off block failed (its KV is in): %r", error)

    def cancel(self) -> None:
        """Ask to stop (thread-safe); the loop retires the request at its next step."""
        self.cancel_requested = True

    def finish_cancelled(self) -> None:
        self._finish("cancelled", "", [])

    def fail(self, error: BaseException) -> None:
        """End with ``error`` (raised by :meth:`result`); no further chunk."""
        if self.state == "done":
            return
        self.error = error
        self.state = "done"
        self.finished = time.perf_counter()
        self._done.set()
        if self.sink is not None:
            self.sink(None)  # end of stream; the consumer reads the error from the generation

    @property
    def done(self) -> bool:
        return self.state == "done"

    def _finish(self, reason: str, text: str, token_ids: list[int], stop_string: str | None = None) -> None:
        if stop_string is None and self.detok is not None:
            # The end for another reason: what the detokenizer and the stop strings still hold.
            tail, matched = self.stops.feed(self.detok.flush())
            text += tail
            if matched is not None:
                reason, stop_string = "stop", matched
            else:
                text += self.stops.flush()
        self.finish_reason, self.stop_string = reason, stop_string
        self.state = "done"
        self.finished = time.perf_counter()
        chunk = StreamChunk(text, token_ids, reason, stop_string, self._new_logprobs())
        self._emit(chunk)
        self._done.set()

    def _emit(self, chunk: StreamChunk) -> None:
        if chunk.text:
            self.text_parts.append(chunk.text)
        if self.sink is not None:
            self.sink(chunk)
        else:
            self._pending.append(chunk)

    def _new_logprobs(self) -> list[TokenLogprob] | None:
        if self.params.logprobs is None:
            return None
        new = self.sampler.logprobs[self._logprobs_sent :]
        self._logprobs_sent += len(new)
        return list(new)

    # ------------------------------------------------------------------ read by the caller

    def take_chunks(self) -> list[StreamChunk]:
        """The chunks emitted since the last call (when no ``sink`` was given)."""
        chunks, self._pending = self._pending, []
        return chunks

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self) -> GenerationResult:
        """The finished request's result; raises its error if it failed."""
        if self.error is not None:
            raise self.error
        if self.state != "done":
            raise RuntimeError("the request has not finished")
        timing = Timing(self.submitted, self.admitted, self.first_token, self.finished)
        d = self.drafting
        spec = {}
        if d is not None:
            spec = dict(drafted_tokens=d.drafted, accepted_tokens=d.accepted, verify_steps=d.steps)
            if d.prediction:
                spec.update(prediction_accepted=d.accepted, prediction_rejected=d.drafted - d.accepted)
        return GenerationResult(
            token_ids=list(self.token_ids),
            text="".join(self.text_parts) if self.detok is not None else None,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            stop_string=self.stop_string,
            logprobs=list(self.sampler.logprobs) if self.params.logprobs is not None else None,
            timing=timing,
            cached_tokens=self.cached_tokens,
            handoff=self.handoff,
            **spec,
        )
