"""What the server does with each OpenAI request field it does not implement, and with fields
outside OpenAI's schema.

Every field of OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` request schemas is
declared in :mod:`.protocol`; each is in exactly one of three groups (tests/tools/test_serve_fields.py
checks this against the ``openai`` package's TypedDicts):

- **implemented**: changes generation (sampling, stop rules, lengths, logprobs, ``logit_bias``,
  ``prediction``, ``response_format``, ``tools``/``tool_choice``/``parallel_tool_calls``, ...);
  handled by :mod:`.chat`, :mod:`.completions` and :mod:`.structured`;
- **ignored** (:data:`IGNORED`): meaningless for a local server; accepted, counted in
  ``kvforge_ignored_fields_total{field}`` and listed in the README with what the server does;
- **refused unless a no-op** (:func:`check_refused`): a value kvforge cannot honour (audio output,
  the deprecated ``functions``/``function_call``, ``suffix``) is a 400 naming the field; the no-op
  values (``functions: []``, ``function_call: "none"``, ``modalities: ["text"]``, ...) pass. A tool
  type other than ``function`` is refused by :mod:`.structured`.

vLLM's extensions ``ignore_eos``, ``min_tokens`` (both routes) and
``stream_options.continuous_usage_stats`` are declared in :mod:`.protocol` and implemented (the
runtime's ``SamplingParams``; the streams of :mod:`.chat` and :mod:`.completions`), so they are
neither unknown nor ignored (docs/serving.md's table of them).

Fields outside the schema (:func:`unknown_fields`) are ignored with a warning in the log and named
in the response header ``x-kvforge-ignored-fields`` (as vLLM ignores and logs them), or refused
with a 400 when the server runs with ``--strict-fields``.
"""

from __future__ import annotations

from typing import Any

from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import ServingError

IGNORED_HEADER = "x-kvforge-ignored-fields"

# field -> what the server does with it (the README's table says the same).
IGNORED: dict[str, str] = {
    "user": "nothing: no per-user accounting or abuse monitoring",
    "safety_identifier": "nothing: no per-user accounting or abuse monitoring",
    "store": "nothing is stored (no distillation or evals store)",
    "metadata": "nothing is stored; not echoed in the response",
    "service_tier": "one tier: every request is scheduled alike; the response has no service_tier",
    "prompt_cache_key": "nothing: kvforge's caching needs no routing key",
    "prompt_cache_options": "nothing: no cache breakpoints or lifetimes to set",
    "prompt_cache_retention": "nothing: no cache lifetimes to set",
    "verbosity": "nothing: the answer's length is the model's (use max_tokens to bound it)",
    "web_search_options": "nothing: no web search is run",
    "moderation": "nothing: no moderation model is run",
    "modalities": 'nothing for ["text"] (text is the only output); any other modality is a 400',
    "stream_options.include_obfuscation": "nothing: stream chunks carry no obfuscation padding",
}


def ignored_fields(req: p.RequestModel) -> list[str]:
    """The :data:`IGNORED` fields this request sets (to anything but null)."""
    out = [name for name in IGNORED if "." not in name and getattr(req, name, None) is not None]
    options = getattr(req, "stream_options", None)
    if options is not None and options.include_obfuscation is not None:
        out.append("stream_options.include_obfuscation")
    return out


def unknown_fields(req: p.RequestModel, prefix: str = "") -> list[str]:
    """Fields outside the schema, dotted (``stream_options.foo``), in request order; messages'
    extra keys (an assistant turn's ``tool_calls`` sent back as history) are not counted."""
    out = [prefix + name for name in req.model_extra or {}]
    for name in type(req).model_fields:
        value = getattr(req, name)
        if isinstance(value, p.RequestModel):
            out.extend(unknown_fields(value, f"{prefix}{name}."))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, p.RequestModel):
                    out.extend(unknown_fields(item, f"{prefix}{name}[{i}]."))
    return out


def strict_refusal(unknown: list[str]) -> ServingError:
    names = ", ".join(f"'{name}'" for name in unknown)
    return ServingError(
        f"unknown field {names}: remove it (see the OpenAI API reference for this route; this server runs with "
        "--strict-fields, without it such fields are ignored)",
        param=unknown[0].split(".")[0],
        code="unknown_field",
    )


def _unsupported(name: str, message: str) -> ServingError:
    return ServingError(message, param=name, code="unsupported")


def _deprecated(name: str, value: Any, no_op: str) -> ServingError:
    return _unsupported(
        name,
        f"'{name}' (OpenAI's deprecated form of tools) is not supported by this server; send 'tools' and "
        f"'tool_choice' instead, or {no_op} (got {str(value)[:80]})",
    )


def check_refused(req: p.RequestModel) -> None:
    """400 naming the first field whose value kvforge cannot honour (see the module docstring)."""
    if isinstance(req, p.CompletionRequest):
        if req.suffix:
            raise _unsupported(
                "suffix",
                "'suffix' (text after the completion, fill-in-the-middle) is not supported by this server: the "
                "artifact has no insertion format; remove it and put the text before the completion in 'prompt'",
            )
        return
    assert isinstance(req, p.ChatCompletionRequest)
    if req.audio is not None:
        raise _unsupported("audio", "'audio' output is not supported: this server generates text only; remove it")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        other = [m for m in req.modalities if m != "text"]
        raise _unsupported(
            "modalities",
            f"modalities {other} cannot be produced: this server generates text only; send ['text'] or leave it out",
        )
    if req.functions:
        raise _deprecated("functions", f"{len(req.functions)} function(s)", "functions: [] (no functions)")
    if req.function_call not in (None, "none"):
        raise _deprecated("function_call", req.function_call, 'function_call: "none"')
