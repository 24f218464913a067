"""``POST /v1/chat/completions``: OpenAI's chat completions over :class:`ModelServer`.

The messages are rendered with the artifact's chat template exactly as transformers'
``apply_chat_template(..., add_generation_prompt=True)`` does (the runtime's ``ChatTemplate``), then
encoded without special tokens (as ``apply_chat_template(tokenize=True)`` does). ``max_tokens``
(or ``max_completion_tokens``) defaults to the rest of the model's context. ``logprobs: true`` with
``top_logprobs: k`` returns each token's logprob and k alternatives. ``logit_bias`` maps to the
runtime's ``SamplingParams.logit_bias``. ``prediction`` (predicted outputs) is tokenized like the
answer would be (no special tokens) and handed to the runtime by :func:`.serving.with_prediction`;
``usage.completion_tokens_details`` reports the accepted and rejected prediction tokens.

The answer is read by the model family's parsers (:mod:`.parsers`, chosen by the server's
``chat_format``): reasoning to ``reasoning_content``, tool calls to ``tool_calls`` (streamed: each
call's name, then its arguments as they are generated), the rest to ``content``.
``reasoning_effort`` and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``) reach the
chat template as variables.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvforge.runtime.chat import ChatTemplateError
from kvforge.tools.serve import fields, parsers, structured
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.parsers.text import OutputText
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
    with_prediction,
)


@dataclass
class Prepared:
    sequences: list[SeqRequest]
    prompt_tokens: int
    plan: structured.Plan
    output: parsers.OutputParser  # reads each choice's answer (reasoning, content, calls)


def _content(message: p.ChatMessage, index: int) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServingError(
                f"messages[{index}] has a content part of type {part.get('type')!r}; this server takes text only "
                "(parts {'type': 'text', 'text': ...})",
                param=f"messages[{index}].content",
            )
        texts.append(part["text"])
    return "".join(texts)


def _prediction_text(prediction: p.PredictionContent) -> str:
    if isinstance(prediction.content, str):
        return prediction.content
    return "".join(part.text for part in prediction.content)


def prepare(server: ModelServer, req: p.ChatCompletionRequest) -> Prepared:
    server.check_model(req.model)
    fields.check_refused(req)
    chat_format = _chat_format(server)
    tokenizer = getattr(server, "tokenizer", None)
    tool_parser = chat_format.tool(req.tools, tokenizer.token_to_id if tokenizer is not None else None)
    plan = structured.plan(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
    if not req.messages:
        raise ServingError("messages is empty; send at least one message", param="messages")
    if server.chat_template is None:
        raise ServingError(
            f"model {server.model_name!r} has no chat template (no chat_template in its tokenizer_config.json nor a "
            "chat_template.jinja); use /v1/completions with a plain prompt",
            param="messages",
            code="no_chat_template",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise ServingError("top_logprobs needs logprobs: true; set both or neither", param="top_logprobs")
    server.check_n(req.n)
    messages = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(req.messages)]
    messages, tools = structured.chat_messages(messages, req.messages, plan, server.chat_template, tool_parser)
    try:
        text = server.chat_template.render(messages, add_generation_prompt=True, tools=tools, **_template_kwargs(req))
    except ChatTemplateError as e:
        raise ServingError(f"the chat template rejected the messages: {e}", param="messages") from e
    ids = server.encode(text, special=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = server.check_lengths(ids, max_tokens, what="the rendered messages", param="messages")
    base = sampling_params(
        temperature=req.temperature,
        top_p=req.top_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logit_bias=req.logit_bias,
        vocab_size=server.engine.vocab_size,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    if req.prediction is not None:  # the draft, tokenized as the answer would be (no special tokens)
        base = with_prediction(base, server.encode(_prediction_text(req.prediction), special=False))
    base = structured.constrain(base, plan)
    # kvforge's grammars of calls and JSON cover the answer alone (a user's Lark grammar may hold the reasoning).
    answer_only = bool(plan.fields) and (req.response_format or {}).get("type") != "grammar"
    output = chat_format.output(
        plan.tools, prompt=text, parse_calls=plan.parse_calls, answer_only=answer_only, forced=plan.forced
    )
    points = _system_cache_point(server, messages, tools, req, ids)
    return Prepared(choices(req, ids, max_tokens, base, cache_points=points), len(ids), plan, output)


def _system_cache_point(server: ModelServer, messages: list[dict], tools, req, ids: list[int]) -> tuple[int, ...]:
    """On an artifact whose layers keep a state, with the prefix cache on: the end of the leading
    system (or developer) messages in ``ids``, where a snapshot lets the next conversation with the
    same system prompt resume (a state cannot resume anywhere else). Their rendering alone must be
    a token prefix of ``ids``; otherwise (a template that renders them differently alone, or
    refuses a conversation without a user turn) no point, and the request runs as any other."""
    pool = getattr(server.engine, "prefix_pool", None)
    lead = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), len(messages))
    if not getattr(pool, "needs_state", False) or not 0 < lead < len(messages):  # a router's pools: none
        return ()
    try:
        kwargs = _template_kwargs(req)
        text = server.chat_template.render(messages[:lead], add_generation_prompt=False, tools=tools, **kwargs)
    except Exception:  # a boundary: any template failure here only means no cache point
        return ()
    prefix = server.encode(text, special=False)
    return (len(prefix),) if 0 < len(prefix) < len(ids) and ids[: len(prefix)] == prefix else ()


def _chat_format(server: ModelServer) -> parsers.ChatFormat:
    return getattr(server, "chat_format", None) or parsers.ChatFormat()


# Template variables a request may not set through chat_template_kwargs (the server sets them).
_RESERVED_TEMPLATE_VARS = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(req: p.ChatCompletionRequest) -> dict:
    """The chat template's extra variables: ``chat_template_kwargs`` and ``reasoning_effort``."""
    extra = dict(req.chat_template_kwargs or {})
    taken = [k for k in extra if k in _RESERVED_TEMPLATE_VARS]
    if taken:
        raise ServingError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server passes those from the request's own "
            "fields (messages, tools); remove them from chat_template_kwargs",
            param="chat_template_kwargs",
        )
    if req.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", req.reasoning_effort)
    return extra


def _output_text(server: ModelServer, prep: Prepared) -> OutputText:
    eos = getattr(server.engine, "eos_token_ids", ())
    return OutputText(server.tokenizer, eos, _chat_format(server).needs_special_tokens and prep.output.active)


def chat_logprobs(server: ModelServer, logprobs) -> p.ChatCompletionLogProbs:
    content = []
    for lp in logprobs:
        token = server.token_text(lp.token_id)
        top = []
        for t, v in possible_top(lp.top):
            alt = server.token_text(t)
            top.append(p.TopLogprob(token=alt, logprob=v, bytes=list(alt.encode())))
        content.append(
            p.ChatCompletionLogProb(
                token=token, logprob=finite_logprob(lp.logprob), bytes=list(token.encode()), top_logprobs=top
            )
        )
    return p.ChatCompletionLogProbs(content=content)


async def full(
    server: ModelServer, req: p.ChatCompletionRequest, prep: Prepared, flight: Flight
) -> p.ChatCompletionResponse:
    results = await final_results(flight)
    response_choices = []
    for i in range(len(prep.sequences)):
        content, reasoning, calls = results[i].text, None, []
        if prep.output.active:
            parsed = prep.output.parse(_output_text(server, prep).whole(results[i].text, results[i].token_ids))
            content, reasoning = parsed.content, parsed.reasoning
            calls = parsers.call_dicts(prep.output, parsed.calls)
        response_choices.append(
            p.ChatCompletionResponseChoice(
                index=i,
                message=p.ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None),
                logprobs=chat_logprobs(server, results[i].logprobs) if req.logprobs else None,
                finish_reason=_finish_reason(results[i].finish_reason, calls),
                stop_reason=results[i].stop_string,
            )
        )
    return p.ChatCompletionResponse(
        model=server.model_name,
        choices=response_choices,
        usage=usage(prep.prompt_tokens, list(results.values()), cached_tokens(results, len(prep.sequences))),
    )


async def stream(
    server: ModelServer, req: p.ChatCompletionRequest, prep: Prepared, flight: Flight
) -> AsyncIterator[str]:
    """Server-sent events: per choice a first chunk with the assistant role, content deltas, a last
    chunk with the finish_reason; the usage chunk if asked; ``[DONE]``. With
    ``continuous_usage_stats`` every chunk carries the usage so far."""
    head = p.ChatCompletionStreamResponse(
        id=p.random_id("chatcmpl"), created=int(time.time()), model=server.model_name, choices=[]
    )
    continuous, generated = continuous_usage(req), 0

    def chunk(index: int, delta: p.DeltaMessage, **fields) -> str:
        choice = p.ChatCompletionStreamChoice(index=index, delta=delta, **fields)
        update = {"choices": [choice]}
        if continuous:
            update["usage"] = running_usage(prep.prompt_tokens, generated)
        return sse(head.model_copy(update=update))

    streams = [prep.output.stream() if prep.output.active else None for _ in prep.sequences]
    texts = [_output_text(server, prep) for _ in prep.sequences]
    results = {}
    try:
        for index in range(len(prep.sequences)):
            yield chunk(index, p.DeltaMessage(role="assistant", content=""))
        async with contextlib.aclosing(flight.events()) as events:
            async for event in events:
                raise_on_error(event)
                reader = streams[event.index]
                if event.kind == "chunk":
                    piece = event.payload
                    generated += len(piece.token_ids)
                    logprobs = chat_logprobs(server, piece.logprobs) if req.logprobs and piece.logprobs else None
                    if reader is not None:  # reasoning, content and call pieces as they are certain
                        deltas = _deltas(reader.feed(texts[event.index].piece(piece.text, piece.token_ids)))
                        if not deltas and logprobs is not None:
                            deltas = [p.DeltaMessage(content="")]  # an empty one to carry the logprobs
                        for j, delta in enumerate(deltas):
                            yield chunk(event.index, delta, logprobs=None if j else logprobs)
                    elif piece.text or logprobs is not None:
                        yield chunk(event.index, p.DeltaMessage(content=piece.text), logprobs=logprobs)
                else:
                    result = results[event.index] = event.payload
                    if reader is not None:
                        rest = reader.feed(texts[event.index].flush()) + reader.finish()
                        for delta in _deltas(rest):
                            yield chunk(event.index, delta)
                    yield chunk(
                        event.index,
                        p.DeltaMessage(),
                        finish_reason=_finish_reason(result.finish_reason, reader.ids if reader else 0),
                        stop_reason=result.stop_string,
                    )
        if req.stream_options and req.stream_options.include_usage:
            cached = cached_tokens(results, len(prep.sequences))
            yield sse(head.model_copy(update={"usage": usage(prep.prompt_tokens, list(results.values()), cached)}))
    except ServingError as e:
        yield sse(e.body())
    yield SSE_DONE


def _deltas(pieces: list[parsers.Delta]) -> list[p.DeltaMessage]:
    """The parser's pieces as OpenAI's deltas: a call's first piece carries its id, type and name."""
    out = []
    for d in pieces:
        if d.index is None:
            out.append(p.DeltaMessage(content=d.content, reasoning_content=d.reasoning))
            continue
        function = p.DeltaFunctionCall(name=d.name, arguments=d.arguments)
        call = p.DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None, function=function)
        out.append(p.DeltaMessage(tool_calls=[call]))
    return out


def _finish_reason(reason: str, calls: list | int) -> str:
    """OpenAI's ``tool_calls`` when the model ended (``stop``) after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason
