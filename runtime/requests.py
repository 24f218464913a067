"""Prompts and their parameters -> validated :class:`~kvforge.runtime.generation.Generation`\\ s for
a step engine (:class:`~kvforge.runtime.engine.StepEngine`): what ``Engine.generate``, streams,
schedulers and sessions do before anything runs. Reads of the engine: its tokenizer and chat
template, generation defaults, grammar factory, drafting set-up and row checks; writes nothing to
it but the chat template it loads on first use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvforge.runtime import validate as check
from kvforge.runtime.generation import Generation, check_max_new_tokens
from kvforge.runtime.sampling import SamplingParams
from kvforge.runtime.speculative import setup
from kvforge.runtime.stops import StopStrings

if TYPE_CHECKING:
    from kvforge.runtime.engine import StepEngine

Prompt = str | Sequence[int]
Sampling = SamplingParams | Mapping | None


class Engine(Protocol):
    """What the scheduler and sessions call on the engine they are given (``kvforge.runtime.Engine``
    has it: a step engine plus this module's functions as methods), typed here so that neither
    imports the facade above them."""

    def encode(self, prompt: Prompt, add_special_tokens: bool = True, name: str = "prompt") -> list[int]: ...

    def request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
        index: int = 0,
        start: int = 0,
    ) -> Generation: ...

    def chat_prompt(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]: ...


def encode(engine: StepEngine, prompt: Prompt, add_special_tokens: bool = True, name: str = "prompt") -> list[int]:
    """A prompt's token ids: strings through the artifact's tokenizer, id sequences (Python or
    numpy ints) as ``list[int]``. Refuses anything else (bytes, None, floats, bools, nested
    lists) with a ValueError/TypeError naming ``name``."""
    prompt = check.prompt(name, prompt)
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("this artifact has no tokenizer; pass prompts as lists of token ids")
        return engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return prompt


def request(
    engine: StepEngine,
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
    params = sampling_params(sampling).resolve(engine.generation_defaults)
    stops = StopStrings(stop)
    if not stops.empty and engine.tokenizer is None:
        raise ValueError("stop strings need the artifact's tokenizer; this artifact has none (pass stop=None)")
    engine._check_rows([prompt_ids], [0], first_index=index)
    constraint = params.constraint and engine.grammars.new(*params.constraint)
    gen = Generation(
        prompt_ids,
        max_new_tokens,
        params,
        stops,
        tokenizer=engine.tokenizer,
        eos_token_ids=engine.eos_token_ids,
        vocab_size=engine.vocab_size,
        max_seq=engine.max_seq,
        start=start,
        constraint=constraint,
    )
    # A constrained row does not draft: its grammar would have to check every drafted position.
    gen.drafting = (
        None
        if constraint
        else setup.drafting(
            gen,
            params,
            engine.speculative,
            engine.draft_model,
            engine.vocab_size,
            engine.width_cost,
            rerun=bool(engine.verify_states),
        )
    )
    return gen


def chat_prompt(engine: StepEngine, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template. Raises
    :class:`~kvforge.runtime.chat.ChatTemplateError` (a ValueError) when the model has none."""
    from kvforge.runtime.chat import ChatTemplate

    if engine.tokenizer is None:
        raise ValueError("chat needs the artifact's tokenizer; this artifact has none")
    if engine._chat_template is None:
        engine._chat_template = ChatTemplate.require(engine.artifact_dir)
    text = engine._chat_template.render(list(messages), add_generation_prompt=add_generation_prompt)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def sampling_params(sampling: Sampling) -> SamplingParams:
    """``None``, a :class:`SamplingParams` or a dict of its fields -> SamplingParams."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        return SamplingParams.from_dict(sampling)  # unknown keys: ValueError naming them
    raise ValueError(f"sampling must be a SamplingParams, a dict of its fields or None, got {type(sampling).__name__}")
