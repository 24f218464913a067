"""``Engine``: a compiled artifact -> text. The calls users make, over the step machine.

``Engine`` is :class:`~kvforge.runtime.engine.StepEngine` (buffers, bindings, rows, the step API
``prefill``/``decode``/``verify``/``score``, KV export and import; ``Engine.load``) plus the calls
users make: ``generate``, ``stream``, ``chat``, ``session()``, ``scheduler()``, and ``encode``/
``request``/``chat_prompt`` (:mod:`kvforge.runtime.requests`). It sits at the top of the runtime:
it imports the batch loop, the scheduler and sessions, and none of them imports it (they take a
step engine). Threads and rows: see ``engine.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvforge.runtime import batching, requests
from kvforge.runtime import validate as check
from kvforge.runtime.engine import StepEngine
from kvforge.runtime.generation import Generation, GenerationResult, StreamChunk
from kvforge.runtime.requests import Prompt, Sampling
from kvforge.runtime.scheduler import Scheduler
from kvforge.runtime.session import Session

__all__ = ["Engine", "GenerationResult", "Prompt", "Sampling", "StreamChunk"]


def _drop_chunk(chunk: StreamChunk | None) -> None:
    """The sink of :meth:`Engine.generate`'s requests: their chunks have no reader."""


class Engine(StepEngine):
    """A loaded artifact: ``Engine.load(out)``, then ``generate``/``stream``/``chat``/``session``/
    ``scheduler`` (see the module docstring)."""

    def encode(self, prompt: Prompt, add_special_tokens: bool = True, name: str = "prompt") -> list[int]:
        """:func:`kvforge.runtime.requests.encode` on this engine."""
        return requests.encode(self, prompt, add_special_tokens, name)

    def request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
        index: int = 0,
        start: int = 0,
    ) -> Generation:
        """:func:`kvforge.runtime.requests.request` on this engine: a validated Generation."""
        return requests.request(self, prompt_ids, max_new_tokens, sampling, stop, index, start)

    def close(self) -> None:
        """Close a scheduler that holds the rows (cancelling its requests), then the step machine."""
        if isinstance(self._rows_owner, Scheduler):
            self._rows_owner.close(cancel=True)
        super().close()

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 32,
        sampling: Sampling | Sequence[Sampling] = None,
        stop: str | Sequence[str] | None = None,
    ) -> list[GenerationResult]:
        """One :class:`GenerationResult` per prompt, in order.

        ``prompts``: strings (encoded with the artifact's tokenizer) or lists of token ids.
        ``sampling``: one :class:`SamplingParams` (or a dict of its fields) for every prompt, or a
        list with one per prompt; ``None`` fields come from the model's ``generation_config.json``
        (greedy unless it says ``do_sample``). ``stop``: stop strings for every prompt.
        Every prompt and parameter is checked before any runs. Prompts run with in-flight
        batching on rows ``[0, k)`` (see the module docstring): at most ``k`` at once, and a
        queued prompt takes the row of one that finished.
        """
        if isinstance(prompts, Sequence) and not isinstance(prompts, str) and len(prompts) == 0:
            raise check.InvalidValue("no prompts given: prompts must be a list of at least one prompt")
        prompts = check.prompt_batch("prompts", prompts)
        if isinstance(sampling, Sequence) and not isinstance(sampling, str):
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts; give one each")
            per_prompt = list(sampling)
        else:
            per_prompt = [sampling] * len(prompts)
        gens = [
            self.request(self.encode(p, name=f"prompts[{i}]"), max_new_tokens, sp, stop, index=i)
            for i, (p, sp) in enumerate(zip(prompts, per_prompt))
        ]
        with self._lock, self.own_rows(self) as rows:
            loop = batching.BatchLoop(self, rows)
            for g in gens:
                g.sink = _drop_chunk  # nobody reads generate's chunks: do not collect them (the result has the text)
                loop.add(g)
            while not loop.idle:
                loop.step()
        return [g.result() for g in gens]

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 32,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding a :class:`StreamChunk` per generated token as it is
        produced (``chunk.text`` may be ``""`` while a character or a possible stop string is
        incomplete); the last chunk has ``finish_reason``. The concatenated ``text`` and
        ``token_ids`` of the chunks equal :meth:`generate`'s result. Parameters are checked at
        the call; the rows are held from the first ``next()`` until the iterator ends or is closed."""
        gen = self.request(self.encode(prompt), max_new_tokens, sampling, stop)
        return self._stream(gen)

    def _stream(self, gen: Generation) -> Iterator[StreamChunk]:
        with self.own_rows(gen) as rows:
            loop = batching.BatchLoop(self, rows)
            loop.add(gen)
            while True:
                with self._lock:
                    if not loop.idle:
                        loop.step()
                yield from gen.take_chunks()
                if loop.idle:
                    break
        gen.result()  # raises the request's error, if it failed

    def chat(
        self,
        messages: Sequence[Mapping],
        max_new_tokens: int = 32,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationResult:
        """Render ``messages`` with the model's chat template (as transformers'
        ``apply_chat_template(messages, add_generation_prompt=True)``), encode without adding
        special tokens (the template writes them) and generate one reply."""
        return self.generate([self.chat_prompt(messages)], max_new_tokens, sampling, stop)[0]

    def chat_prompt(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` rendered by the model's chat template
        (:func:`kvforge.runtime.requests.chat_prompt`)."""
        return requests.chat_prompt(self, messages, add_generation_prompt)

    def session(self, restore: str | Path | None = None) -> Session:
        """A :class:`~kvforge.runtime.session.Session`: one conversation kept in one reserved
        cache row (the highest free one), until ``close()``. ``restore``: a file written by
        ``Session.save``; the conversation continues from it exactly as if it had never stopped
        (its KV is imported, nothing is prefilled again)."""
        session = Session(self, self.reserve_row())
        if restore is not None:
            try:
                session.restore(restore)
            except BaseException:
                session.close()
                raise
        return session

    def scheduler(self, prefill_chunk: int | None = None, block_alloc=None, lend_rows: bool = False) -> Scheduler:
        """A :class:`~kvforge.runtime.scheduler.Scheduler` (in-flight batching on a background
        thread) over rows ``[0, k)``; it holds them until ``close()``. ``prefill_chunk``: tokens per
        prefill call of a joining request (default :attr:`chunk_tokens`); ``block_alloc``: where a
        hand-off's KV is exported; ``lend_rows``: hand-offs lend their rows of a shared cache
        instead (``load(..., kv_shared=True)``; see the scheduler's module docstring)."""
        return Scheduler(self, prefill_chunk, block_alloc, lend_rows)
