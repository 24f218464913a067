"""``POST /v1/completions``: OpenAI's text completions over :class:`ModelServer`.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists; each prompt
gets ``n`` choices, numbered ``prompt_index * n + j`` (OpenAI's and vLLM's order). Choice ``j`` of a
seeded request samples with ``seed + j``, so the ``n`` choices differ and each is reproducible.
``usage.prompt_tokens`` counts each prompt once; ``completion_tokens`` counts every generated id
(an eos included, as the runtime reports it).

``best_of = k > n``: each prompt gets k candidates (candidate ``j`` seeded ``seed + j``) and the
answer holds the n with the highest log-probability per token (the mean of the chosen tokens'
raw logprobs, as OpenAI defines "best"; ties: the earlier candidate), best first; ``usage``
counts the tokens of all k. It cannot stream (the best are known only at the end).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvforge.tools.serve import fields, structured
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import (
    SSE_DONE,
    Flight,
    ModelServer,
    SeqRequest,
    ServingError,
    cached_tokens,
    choices,
    continuous_usage,
    final_results,
    finite_logprob,
    possible_top,
    raise_on_error,
    running_usage,
    sampling_params,
    sse,
    usage,
)


@dataclass
class Prepared:
    sequences: list[SeqRequest]  # ``candidates`` per prompt, prompt by prompt
    prompt_texts: list[str]  # for echo
    prompt_tokens: int  # usage: each prompt once
    n: int  # choices per prompt in the answer
    candidates: int  # sequences per prompt: best_of (>= n)


def _prompts(server: ModelServer, prompt) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt in OpenAI's four prompt forms."""
    if isinstance(prompt, str):
        return [(server.encode(prompt), prompt)]
    if not prompt:
        raise ServingError("prompt is an empty list; send a string or a non-empty list", param="prompt")
    if all(isinstance(x, str) for x in prompt):
        return [(server.encode(x), x) for x in prompt]
    lists = [prompt] if all(isinstance(x, int) for x in prompt) else prompt
    vocab = server.engine.vocab_size
    for i, ids in enumerate(lists):  # before decoding: the tokenizer cannot decode a negative id
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ServingError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})", param="prompt")
    return [([int(t) for t in ids], server.tokenizer.decode(list(ids))) for ids in lists]


def prepare(server: ModelServer, req: p.CompletionRequest) -> Prepared:
    server.check_model(req.model)
    fields.check_refused(req)
    best_of = req.n if req.best_of is None else req.best_of
    if best_of < req.n:
        raise ServingError(
            f"best_of={best_of} is less than n={req.n}: best_of is how many candidates the n choices are picked "
            "from; set best_of >= n or leave it out",
            param="best_of",
            code="invalid_value",
        )
    if best_of > req.n and req.stream:
        raise ServingError(
            f"best_of={best_of} > n={req.n} cannot be streamed (the best candidates are known only at the end); "
            "set stream to false, or best_of = n",
            param="best_of",
            code="invalid_value",
        )
    if req.echo and req.logprobs is not None:
        raise ServingError("echo with logprobs (prompt logprobs) is not supported; drop one", param="echo")
    prompts = _prompts(server, req.prompt)
    server.check_n(req.n, len(prompts))
    server.check_n(best_of, len(prompts))
    vocab = server.engine.vocab_size
    ranked = best_of > req.n and req.logprobs is None  # the ranking needs each token's logprob
    base = sampling_params(
        temperature=req.temperature,
        top_p=req.top_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        logprobs=0 if ranked else req.logprobs,
        logit_bias=req.logit_bias,
        vocab_size=vocab,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    base = structured.constrain(base, structured.Plan(structured.response_format_fields(req.response_format)))
    sequences = []
    for i, (ids, _) in enumerate(prompts):
        what = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        max_tokens = server.check_lengths(ids, req.max_tokens, what=what)
        sequences.extend(choices(req, ids, max_tokens, base, count=best_of))
    return Prepared(sequences, [text for _, text in prompts], sum(len(ids) for ids, _ in prompts), req.n, best_of)


def _answer_order(prep: Prepared, results: dict[int, Any]) -> list[int]:
    """The sequence indices the answer's choices come from, in order: all of them when
    ``best_of = n``, else per prompt the n candidates with the highest mean token logprob."""
    k, n = prep.candidates, prep.n
    if k == n:
        return list(range(len(prep.sequences)))

    def score(i: int) -> float:
        lps = results[i].logprobs or []
        return sum(lp.logprob for lp in lps) / max(1, len(lps))

    order = []
    for first in range(0, len(prep.sequences), k):
        order.extend(sorted(range(first, first + k), key=lambda i: (-score(i), i))[:n])
    return order


def completion_logprobs(server: ModelServer, logprobs, offset: int) -> p.CompletionLogProbs:
    """OpenAI's legacy logprobs object; ``text_offset`` counts from the start of the prompt text."""
    out = p.CompletionLogProbs()
    for lp in logprobs:
        token = server.token_text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(finite_logprob(lp.logprob))
        out.top_logprobs.append({server.token_text(t): v for t, v in possible_top(lp.top)})
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def full(server: ModelServer, req: p.CompletionRequest, prep: Prepared, flight: Flight) -> p.CompletionResponse:
    results = await final_results(flight)
    response_choices = []
    for index, seq_index in enumerate(_answer_order(prep, results)):
        result = results[seq_index]
        prompt_text = prep.prompt_texts[seq_index // prep.candidates]
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(server, result.logprobs, len(prompt_text))
        response_choices.append(
            p.CompletionResponseChoice(
                index=index,
                text=(prompt_text if req.echo else "") + result.text,
                logprobs=logprobs,
                finish_reason=result.finish_reason,
                stop_reason=result.stop_string,
            )
        )
    return p.CompletionResponse(
        model=server.model_name,
        choices=response_choices,
        usage=usage(prep.prompt_tokens, list(results.values()), cached_tokens(results, prep.candidates)),
    )


async def stream(server: ModelServer, req: p.CompletionRequest, prep: Prepared, flight: Flight) -> AsyncIterator[str]:
    """Server-sent events: one ``data:`` line per chunk of each choice, a last chunk per choice with
    its finish_reason, the usage chunk if asked (``stream_options.include_usage``), ``[DONE]``.
    With ``continuous_usage_stats`` every chunk carries the usage so far."""
    head = p.CompletionStreamResponse(
        id=p.random_id("cmpl"), created=int(time.time()), model=server.model_name, choices=[]
    )
    offsets = [len(prep.prompt_texts[i // prep.candidates]) for i in range(len(prep.sequences))]
    results = {}
    continuous, generated = continuous_usage(req), 0

    def chunk(index: int, text: str, **fields) -> str:
        update = {"choices": [p.CompletionResponseChoice(index=index, text=text, **fields)]}
        if continuous:
            update["usage"] = running_usage(prep.prompt_tokens, generated)
        return sse(head.model_copy(update=update))

    try:
        if req.echo:
            for index in range(len(prep.sequences)):
                yield chunk(index, prep.prompt_texts[index // prep.candidates])
        async with contextlib.aclosing(flight.events()) as events:
            async for event in events:
                raise_on_error(event)
                index = event.index
                if event.kind == "chunk":
                    piece = event.payload
                    generated += len(piece.token_ids)
                    logprobs = None
                    if prep.sequences[index].sampling.logprobs is not None and piece.logprobs:
                        logprobs = completion_logprobs(server, piece.logprobs, offsets[index])
                        offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    if piece.text or logprobs is not None:
                        yield chunk(index, piece.text, logprobs=logprobs)
                else:
                    result = results[index] = event.payload
                    yield chunk(index, "", finish_reason=result.finish_reason, stop_reason=result.stop_string)
        if req.stream_options and req.stream_options.include_usage:
            cached = cached_tokens(results, prep.candidates)
            yield sse(head.model_copy(update={"usage": usage(prep.prompt_tokens, list(results.values()), cached)}))
    except ServingError as e:
        yield sse(e.body())
    yield SSE_DONE
