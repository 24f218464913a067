"""The OpenAI API's request and response bodies as pydantic models, field by field.

The shapes follow OpenAI's API reference (and vLLM's ``entrypoints/openai/protocol.py``) for the
routes kvforge serves: ``/v1/completions``, ``/v1/chat/completions`` (whole and streamed),
``/v1/models`` and the error object. The request models declare every field of the ``openai``
package's ``completion_create_params`` (tests/tools/test_serve_fields.py derives the list from its
TypedDicts, so a new client version's fields are noticed); the response models are field for field
the package's ``Completion``, ``ChatCompletion`` and chunk types, plus vLLM's ``stop_reason`` and
``max_model_len``.

What the server does with each request field (implemented, ignored, refused unless a no-op value)
is :mod:`kvforge.tools.serve.fields`'s job; fields outside the schema land in ``model_extra``,
which that module reports (a warning and a response header) or refuses (``--strict-fields``).

Nothing here knows about the engine: :mod:`kvforge.tools.serve.serving` maps these to the
scheduler.
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

# ---------------------------------------------------------------------------------------- common


class RequestModel(BaseModel):
    """Request bodies. Types are strict (``strict=True``): an integer field refuses ``2.5``,
    ``2.0``, ``"2"`` and ``true``; token ids must be JSON integers (``[1.0, 2.0]`` and ``[true]``
    are refused, not read as ids 1, 2 and 1). A float field still takes a JSON integer
    (``"temperature": 1``). A JSON ``null`` for a field whose type here has no ``None`` means its
    default (``"n": null`` is ``n = 1``: OpenAI's schema makes every such field nullable). Fields
    outside the schema are kept in ``model_extra`` (``extra="allow"``) for :mod:`.fields` to report
    or refuse."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        declared = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (v is None and k in declared and not declared[k].is_required() and not _nullable(declared[k]))
        }


def _nullable(field: FieldInfo) -> bool:
    return type(None) in typing.get_args(field.annotation)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(RequestModel):
    include_usage: bool = False  # a last chunk with `usage` and no choices, before [DONE]
    include_obfuscation: bool | None = None  # ignored: no obfuscation padding on a local server
    continuous_usage_stats: bool = False  # vLLM extension: every chunk carries the usage so far


class CompletionTokensDetails(ResponseModel):
    # Predicted outputs (chat's ``prediction``): draft tokens the verify step kept / dropped.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0
    audio_tokens: int = 0


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvforge"
    max_model_len: int | None = None  # kvforge/vLLM extension: the artifact's max_seq


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------------- completions


class CompletionRequest(RequestModel):
    # https://platform.openai.com/docs/api-reference/completions/create
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # as chat's (vLLM accepts it here too); tools/serve/structured.py
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # ignored
    # vLLM extensions: an eos does not end the output; no eos nor stop string before min_tokens tokens
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM extension: each prompt token's logprob, rank and top alternatives


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's prompt_logprobs entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1: the likeliest token at that position
    decoded_token: str | None = None


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM extension: the stop string matched, if any
    # vLLM extension (request field prompt_logprobs): per prompt position, {"token id": PromptLogprob}
    # for the prompt's token and the top alternatives; the first position has none (null).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------ chat


class ChatMessage(BaseModel):
    # Extra keys (an assistant message's ``tool_calls``, ``refusal``, ... as clients send history
    # back) are accepted and not passed to the template, which sees ``role`` and ``content``.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]  # function: deprecated tools
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class PredictionContent(RequestModel):
    """Predicted outputs: text the answer is expected to repeat (e.g. the code being edited),
    a draft the runtime may verify instead of generating token by token."""

    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(RequestModel):
    # https://platform.openai.com/docs/api-reference/chat/create
    # Fields the server ignores are typed loosely (str, not OpenAI's current enum), so a value
    # added by a newer API version is still accepted.
    messages: list[ChatMessage]
    model: str
    audio: dict[str, Any] | None = None  # refused: text output only
    frequency_penalty: float = 0.0
    function_call: str | dict[str, Any] | None = None  # deprecated tools: "none" only
    functions: list[dict[str, Any]] | None = None  # deprecated tools: [] only
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None  # ["text"] only
    moderation: dict[str, Any] | None = None
    n: int = 1
    parallel_tool_calls: bool | None = None
    prediction: PredictionContent | None = None
    presence_penalty: float = 0.0
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None  # passed to the chat template (gpt-oss reads it)
    response_format: dict[str, Any] | None = None  # {"type": "text"} only
    safety_identifier: str | None = None
    seed: int | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None  # [] only
    tool_choice: str | dict[str, Any] | None = None  # "none" only
    user: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM extensions (as in CompletionRequest)
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's extension: variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int  # the call's position among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's/DeepSeek's field: the model's reasoning, never in content
    refusal: str | None = None
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------ tokenizer routes
# vLLM's /tokenize, /detokenize and /tokenizer_info (entrypoints/serve/tokenize): what
# lm-evaluation-harness' remote tokenizer calls.


class TokenizeRequest(RequestModel):
    """``{"prompt": text}`` or ``{"messages": [...]}`` (rendered through the chat template), not both.
    ``add_special_tokens`` defaults as vLLM's: true for a prompt, false for messages (the template
    writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only: leave the last message open
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str
