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

Prompt logprobs (evaluation: lm-evaluation-harness' loglikelihood requests). ``echo: true`` with
``logprobs: N`` returns the prompt's tokens in the choice's ``logprobs`` before the generated ones,
as OpenAI's legacy API did: the first token's ``token_logprobs`` and ``top_logprobs`` are ``null``
(nothing comes before it), each other position's ``top_logprobs`` holds the N likeliest tokens and
the prompt's own token; the prompt's ``text_offset`` counts from 0. ``max_tokens: 0`` generates
nothing (with ``echo``, the text is the prompt). vLLM's ``prompt_logprobs: N`` adds the choice's
``prompt_logprobs``: per position ``{"token id": {"logprob", "rank", "decoded_token"}}`` for the
prompt's token and the N likeliest. Both come from the scheduler's score turns
(:mod:`kvforge.runtime.scoring`: the score graph's logits of every position, prompts batched
between decode steps), computed once per prompt whatever ``n``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvforge.tools.serve import fields, structured
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import (
    MAX_LOGPROBS,
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
    prompt_ids: list[list[int]]  # each prompt's token ids
    score_top: int | None = None  # prompt logprobs: alternatives per position (None: not asked)
    generate: bool = True  # False for max_tokens 0: no sequences, each choice is the echo alone


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
    generate = req.max_tokens != 0
    if not generate:
        best_of = req.n  # nothing to rank
    score_top = _score_top(req)
    if score_top is not None:
        check_scoring = getattr(server, "check_scoring", None)
        if check_scoring is None:
            raise ServingError(
                "prompt logprobs (echo with logprobs, prompt_logprobs) are not computed by a disaggregated server; "
                "serve the artifact without --prefill-workers/--decode-workers for evaluation",
                param="logprobs",
                code="invalid_value",
            )
        check_scoring()  # before anything starts: a stream's refusal is a 400, not an event
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
        max_tokens = server.check_lengths(ids, req.max_tokens if generate else None, what=what)
        if generate:
            sequences.extend(choices(req, ids, max_tokens, base, count=best_of))
    return Prepared(
        sequences,
        [text for _, text in prompts],
        sum(len(ids) for ids, _ in prompts),
        req.n,
        best_of,
        [ids for ids, _ in prompts],
        score_top,
        generate,
    )


def _score_top(req: p.CompletionRequest) -> int | None:
    """Alternatives per prompt position the request needs scored (None: no prompt logprobs)."""
    if req.max_tokens is not None and req.max_tokens < 0:
        raise ServingError(f"max_tokens must be at least 0, got {req.max_tokens}", param="max_tokens")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise ServingError(
            f"prompt_logprobs must be in 0..{MAX_LOGPROBS} (alternatives per prompt token), got {req.prompt_logprobs}",
            param="prompt_logprobs",
            code="invalid_value",
        )
    tops = [req.prompt_logprobs, req.logprobs if req.echo else None]
    tops = [t for t in tops if t is not None]
    return max(tops) if tops else None


async def _scores(server: ModelServer, prep: Prepared) -> list[Any] | None:
    if prep.score_top is None:
        return None
    return await server.score(prep.prompt_ids, prep.score_top)


def echo_logprobs(server: ModelServer, scores, top: int) -> p.CompletionLogProbs:
    """The prompt's part of OpenAI's legacy logprobs: first position null; each other position's
    ``top`` likeliest tokens and the prompt's own; ``text_offset`` from 0."""
    out = p.CompletionLogProbs()
    offset = 0
    for i, token_id in enumerate(scores.token_ids):
        token = server.token_text(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if i == 0:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(scores.logprobs[i])
        alternatives = {server.token_text(t): v for t, v in scores.top[i][:top]}
        alternatives.setdefault(token, scores.logprobs[i])
        out.top_logprobs.append(alternatives)
    return out


def prompt_logprobs(server: ModelServer, scores, top: int) -> list[dict[str, p.PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per position the prompt's token and the ``top`` likeliest."""
    out: list[dict[str, p.PromptLogprob] | None] = [None]
    for i in range(1, len(scores.token_ids)):
        token_id = scores.token_ids[i]
        own = p.PromptLogprob(
            logprob=scores.logprobs[i], rank=scores.ranks[i], decoded_token=server.token_text(token_id)
        )
        entry = {str(token_id): own}
        for rank, (t, v) in enumerate(scores.top[i][:top], start=1):
            entry.setdefault(str(t), p.PromptLogprob(logprob=v, rank=rank, decoded_token=server.token_text(t)))
        out.append(entry)
    return out


def _joined(head: p.CompletionLogProbs | None, tail: p.CompletionLogProbs | None) -> p.CompletionLogProbs | None:
    if head is None or tail is None:
        return head or tail
    return p.CompletionLogProbs(
        text_offset=head.text_offset + tail.text_offset,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


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


def _prompt_parts(server: ModelServer, req: p.CompletionRequest, prep: Prepared, scores, prompt: int) -> dict:
    """What a choice of prompt ``prompt`` starts with: the echoed text, the prompt's logprobs
    (echo with logprobs) and vLLM's prompt_logprobs."""
    parts: dict[str, Any] = {"text": prep.prompt_texts[prompt] if req.echo else ""}
    if scores is not None and req.echo and req.logprobs is not None:
        parts["logprobs"] = echo_logprobs(server, scores[prompt], req.logprobs)
    if scores is not None and req.prompt_logprobs is not None:
        parts["prompt_logprobs"] = prompt_logprobs(server, scores[prompt], req.prompt_logprobs)
    return parts


async def full(server: ModelServer, req: p.CompletionRequest, prep: Prepared, flight: Flight) -> p.CompletionResponse:
    scores, results = await asyncio.gather(_scores(server, prep), final_results(flight))
    response_choices = []
    if not prep.generate:  # max_tokens 0: each choice is the prompt's part alone
        for index in range(len(prep.prompt_ids) * prep.n):
            parts = _prompt_parts(server, req, prep, scores, index // prep.n)
            response_choices.append(p.CompletionResponseChoice(index=index, finish_reason="length", **parts))
    for index, seq_index in enumerate(_answer_order(prep, results)):
        result = results[seq_index]
        prompt = seq_index // prep.candidates
        parts = _prompt_parts(server, req, prep, scores, prompt)
        logprobs = parts.pop("logprobs", None)
        if req.logprobs is not None:
            generated = completion_logprobs(server, result.logprobs, len(prep.prompt_texts[prompt]))
            logprobs = _joined(logprobs, generated)
        response_choices.append(
            p.CompletionResponseChoice(
                index=index,
                text=parts.pop("text") + result.text,
                logprobs=logprobs,
                finish_reason=result.finish_reason,
                stop_reason=result.stop_string,
                **parts,
            )
        )
    return p.CompletionResponse(
        model=server.model_name,
        choices=response_choices,
        usage=usage(prep.prompt_tokens, list(results.values()), cached_tokens(results, prep.candidates)),
    )


async def stream(server: ModelServer, req: p.CompletionRequest, prep: Prepared, flight: Flight) -> AsyncIterator[str]:
    """Server-sent events: one ``data:`` line per chunk of each choice (with echo or prompt
    logprobs, each choice's first chunk carries the prompt's part), a last chunk per choice with its
    finish_reason, the usage chunk if asked (``stream_options.include_usage``), ``[DONE]``.
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
        scores = await _scores(server, prep)
        per_prompt = prep.candidates if prep.generate else prep.n
        for index in range(len(prep.prompt_ids) * per_prompt):
            parts = _prompt_parts(server, req, prep, scores, index // per_prompt)
            if not prep.generate:
                yield chunk(index, finish_reason="length", **parts)
            elif parts["text"] or len(parts) > 1:
                yield chunk(index, **parts)
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
