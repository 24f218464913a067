"""The generation facade of :class:`~kvforge.runtime.engine.Engine`: text in, text out.

``Engine`` is two things: the step machine (``engine.py``: buffers, bindings, rows, the step API
``prefill``/``decode``/``verify``/``score``, KV export and import) and this facade, the calls
users make (``generate``, ``stream``, ``chat``, ``session()``, ``scheduler()``) and the
``request`` that turns a prompt and its parameters into a validated
:class:`~kvforge.runtime.generation.Generation` for the batch loop. ``Engine`` inherits this class;
it is not used alone. What it reads of the engine: the tokenizer and chat template, the
generation defaults, the grammar factory and drafting set-up, the lock and the rows
(``own_rows``, ``reserve_row``, ``_check_rows``). Threads and rows: see ``engine.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.runtime import batching
from kvforge.runtime import validate as check
from kvforge.runtime.generation import Generation, GenerationResult, StreamChunk, check_max_new_tokens
from kvforge.runtime.sampling import SamplingParams
from kvforge.runtime.speculative import setup
from kvforge.runtime.stops import StopStrings

if TYPE_CHECKING:
    from kvforge.runtime.engine import Prompt, Sampling


def _drop_chunk(chunk: StreamChunk | None) -> None:
    """The sink of :meth:`Engine.generate`'s requests: their chunks have no reader."""


class GenerationFacade:
    """``Engine``'s generation calls (see the module docstring)."""

    def encode(self, prompt: Prompt, add_special_tokens: bool = True, name: str = "prompt") -> list[int]:
        """A prompt's token ids: strings through the artifact's tokenizer, id sequences (Python or
        numpy ints) as ``list[int]``. Refuses anything else (bytes, None, floats, bools, nested
        lists) with a ValueError/TypeError naming ``name``."""
        prompt = check.prompt(name, prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this artifact has no tokenizer; pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return prompt

    def request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
        index: int = 0,
        start: int = 0,
    ) -> Generation:
        """A validated :class:`Generation` for ``prompt_ids`` (the whole sequence of its row; the
        first ``start`` of them already in the cache, for sessions). Raises ValueError naming the
        bad parameter (``max_new_tokens``, ``sampling``, ``stop``, the prompt) before anything runs."""
        check_max_new_tokens(max_new_tokens)
        params = _sampling_params(sampling).resolve(self.generation_defaults)
        stops = StopStrings(stop)
        if not stops.empty and self.tokenizer is None:
            raise ValueError("stop strings need the artifact's tokenizer; this artifact has none (pass stop=None)")
        self._check_rows([prompt_ids], [0], first_index=index)
        constraint = params.constraint and self.grammars.new(*params.constraint)
        gen = Generation(
            prompt_ids,
            max_new_tokens,
            params,
            stops,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            max_seq=self.max_seq,
            start=start,
            constraint=constraint,
        )
        # A constrained row does not draft: its grammar would have to check every drafted position.
        gen.drafting = (
            None
            if constraint
            else setup.drafting(gen, params, self.speculative, self.draft_model, self.vocab_size, self.width_cost)
        )
        return gen

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
        """The token ids of ``messages`` rendered by the model's chat template. Raises
        :class:`~kvforge.runtime.chat.ChatTemplateError` (a ValueError) when the model has none."""
        from kvforge.runtime.chat import ChatTemplate

        if self.tokenizer is None:
            raise ValueError("chat needs the artifact's tokenizer; this artifact has none")
        if self._chat_template is None:
            self._chat_template = ChatTemplate.require(self.artifact_dir)
        text = self._chat_template.render(list(messages), add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def session(self, restore: str | Path | None = None):
        """A :class:`~kvforge.runtime.session.Session`: one conversation kept in one reserved
        cache row (the highest free one), until ``close()``. ``restore``: a file written by
        ``Session.save``; the conversation continues from it exactly as if it had never stopped
        (its KV is imported, nothing is prefilled again)."""
        from kvforge.runtime.session import Session

        session = Session(self, self.reserve_row())
        if restore is not None:
            try:
                session.restore(restore)
            except BaseException:
                session.close()
                raise
        return session

    def scheduler(self, prefill_chunk: int | None = None, block_alloc=None, lend_rows: bool = False):
        """A :class:`~kvforge.runtime.scheduler.Scheduler` (in-flight batching on a background
        thread) over rows ``[0, k)``; it holds them until ``close()``. ``prefill_chunk``: tokens per
        prefill call of a joining request (default :attr:`chunk_tokens`); ``block_alloc``: where a
        hand-off's KV is exported; ``lend_rows``: hand-offs lend their rows of a shared cache
        instead (``load(..., kv_shared=True)``; see the scheduler's module docstring)."""
        from kvforge.runtime.scheduler import Scheduler

        return Scheduler(self, prefill_chunk, block_alloc, lend_rows)


def _sampling_params(sampling: Sampling) -> SamplingParams:
    """``None``, a :class:`SamplingParams` or a dict of its fields -> SamplingParams."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        return SamplingParams.from_dict(sampling)  # unknown keys: ValueError naming them
    raise ValueError(f"sampling must be a SamplingParams, a dict of its fields or None, got {type(sampling).__name__}")
