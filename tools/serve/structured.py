"""OpenAI's ``response_format``, ``tools`` and ``tool_choice`` -> the runtime's output constraint, and
the model's output -> OpenAI ``tool_calls`` (whole and streamed).

Input: a request's ``response_format`` (``{"type": "text"}``, ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; kvforge extensions
``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": <Lark>}``), ``tools``
(``[{"type": "function", "function": {"name", "description", "parameters"}}]``), ``tool_choice``
(``"auto"`` (default with tools), ``"none"``, ``"required"``, or ``{"type": "function", "function":
{"name": ...}}``) and ``parallel_tool_calls``. Output: a :class:`Plan`: the SamplingParams fields of
the constraint (see :mod:`kvforge.runtime.constraints`), the tools to render, whether to parse calls
and whether they are forced.

Tool calls are written in the served model family's format (:mod:`.parsers`; Hermes-style by
default, the format most open chat models are trained on)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (parallel calls: blocks separated by a newline). The tools reach the model through
its chat template (``tools=`` as transformers passes them) when the template reads ``tools``; a
template that ignores them (SmolLM2's) gets them in a system message that lists the tools and the
Hermes format. ``required`` and a named function constrain the output to calls in the family's
format (the parser's ``grammar``; a 400 where the tokenizer lacks the family's special tokens) whose
arguments follow the tool's ``parameters`` schema (a named function: exactly one call of it;
``required``: one call, or one or more when ``parallel_tool_calls`` is true); ``auto`` leaves the
output free (with a ``json_schema`` response format: the schema's JSON or calls, where the family
has a grammar) and parses what comes; ``none`` renders no tools and parses nothing. A response with calls has
``finish_reason: "tool_calls"`` and the text outside the calls as ``content`` (None when blank).

Grammar rules of forced calls (docs/serving.md, "Tool calls"):

- ``parallel_tool_calls`` left out writes one call, as ``false`` does; only ``true`` lets the grammar
  continue with more calls. OpenAI's default is parallel calls, but a grammar that lets the model
  go on offers it a newline after each call, and small models take it and repeat the same call
  until ``max_tokens``; a client that wants several calls in one turn says so.
- Each object schema in a tool's ``parameters`` that says nothing about ``additionalProperties``
  (nor ``patternProperties``/``unevaluatedProperties``) is closed (``additionalProperties: false``)
  in the grammar: LangChain's ``bind_tools`` sends schemas without it, and a model let free adds
  keys until ``max_tokens``. The top-level parameters object is closed even without
  ``properties`` (a tool that lists no parameters takes none); a nested object without
  ``properties`` (a free-form dict) stays open. A schema that sets ``additionalProperties`` keeps it.
- A forced output that ends before its last block closes (``finish_reason: "length"``) answers the
  calls that closed; the unclosed block is dropped, never returned as ``content``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvforge.runtime import constraints
from kvforge.runtime.sampling import SamplingParams
from kvforge.tools.serve import parsers
from kvforge.tools.serve.parsers.hermes import HermesParser
from kvforge.tools.serve.serving import ServingError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_OPTIONS = {"whitespace_pattern": constraints.JSON_WHITESPACE}


@dataclass
class Plan:
    """What a request's structured-output fields ask of the runtime and of the response."""

    fields: dict[str, Any] = field(default_factory=dict)  # SamplingParams constraint fields
    tools: list[dict] | None = None  # the tools to render (None: none)
    parse_calls: bool = False  # read the output's <tool_call> blocks into tool_calls
    forced: bool = False  # the grammar writes calls only (tool_choice required or named): no content
    param: str = "response_format"  # the request field a refused constraint is blamed on


def response_format_fields(response_format: Mapping | None) -> dict[str, Any]:
    """SamplingParams fields of OpenAI's ``response_format`` (400 naming what is wrong)."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), (Mapping, bool)):
            raise ServingError(
                "response_format json_schema must be {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': "
                "{...}, 'strict': true}}",
                param="response_format",
            )
        return {"json_schema": spec.get("schema", {})}  # no schema: any JSON (OpenAI requires one)
    if kind in ("regex", "grammar") and isinstance(response_format.get(kind), str):
        return {kind: response_format[kind]}
    raise ServingError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object', 'json_schema' "
        "(or kvforge's 'regex' with a 'regex' string, 'grammar' with a Lark 'grammar' string)",
        param="response_format",
    )


def _tool_schemas(tools: Sequence[Mapping]) -> dict[str, dict]:
    """name -> parameters schema of each function tool (400 for a malformed tool or schema)."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise ServingError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                param=f"tools[{i}]",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in out:
            raise ServingError(f"tools[{i}].function.name must be a unique non-empty string", param=f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        try:
            constraints.compile_checked("json_schema", constraints.check_field("json_schema", params))
        except ValueError as e:
            raise ServingError(f"tools[{i}] ({name}) parameters: {e}", param=f"tools[{i}].function.parameters") from e
        except ImportError:
            pass  # checked where a constraint needs llguidance; `auto` runs without it
        out[name] = params
    return out


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA = ("items", "not", "if", "then", "else", "contains", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, top: bool = True) -> Any:
    """``schema`` (a tool's parameters) with ``additionalProperties: false`` on each object schema
    that lists ``properties`` (the top level: always) and says nothing about extra keys; a copy,
    the request's schema is not changed. Subschemas are found where JSON Schema puts them
    (``properties``, ``items``, ``anyOf``, ``$defs``, ...), never in ``const``/``enum``/``default``
    values; the branches of an ``allOf`` of several schemas stay open (closing one would forbid
    the keys another declares)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed_objects(v, False) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v, False) for v in out[key]]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key], False)
    if isinstance(out.get("allOf"), list) and len(out["allOf"]) == 1:
        out["allOf"] = [closed_objects(out["allOf"][0], False)]
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = closed_objects(out["additionalProperties"], False)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and (top or "properties" in out) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _calls_grammar(
    schemas: Mapping[str, dict], names: Sequence[str], many: bool, parser: Any = None, close: bool = False
) -> str:
    """A Lark grammar (llguidance's) of one, or one or more, calls of ``names`` in the format of
    ``parser`` (a :class:`~kvforge.tools.serve.parsers.ToolParser`; Hermes ``<tool_call>`` blocks
    when None); a family whose grammar cannot be built (its special tokens are not single tokens of the
    served tokenizer: Mistral's, harmony's) is a 400 naming it. ``close``:
    argument objects closed (:func:`closed_objects`), as for forced calls."""
    parser = parser if parser is not None else HermesParser()
    if close:
        schemas = {n: closed_objects(s) for n, s in schemas.items()}
    grammar = parser.grammar(schemas, names, many)
    if grammar is None:
        raise ServingError(
            f"tool_choice 'required' or a named function needs a grammar of this model's tool-call format "
            f"({parser.name}), which is written with special tokens that this model's tokenizer does not have as "
            "single tokens; send tool_choice 'auto' and let the model call, or serve with --tool-parser naming a "
            "format the model also writes",
            param="tool_choice",
            code="unsupported",
        )
    return grammar


def plan(
    response_format: Mapping | None,
    tools: Sequence[Mapping] | None = None,
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool | None = None,
    parser: Any = None,
) -> Plan:
    """The :class:`Plan` of one chat request (400 naming the field for anything malformed);
    ``parser``: the model family's tool parser, whose format forced calls are written in (Hermes
    when None)."""
    fields = response_format_fields(response_format)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ServingError(f"tool_choice {tool_choice!r} needs tools; send tools or drop it", param="tool_choice")
        return Plan(fields)
    schemas = _tool_schemas(tools)
    if tool_choice == "none":
        return Plan(fields)
    if tool_choice in (None, "auto"):
        if "json_schema" in fields or "json_object" in fields:
            schema = fields.get("json_schema", {"type": "object"})
            schema = {**schema, "x-guidance": _JSON_OPTIONS} if isinstance(schema, Mapping) else {}
            if parser is not None and parser.grammar(schemas, list(schemas), True) is None:
                return Plan(fields, list(tools), True)  # no grammar of this family's calls: the schema alone
            calls = _calls_grammar(schemas, list(schemas), parallel_tool_calls is True, parser)
            grammar = calls.replace("start: ", "start: answer | calls\ncalls: ", 1)
            grammar += f"answer: %json {json.dumps(schema)}\n"
            return Plan({"grammar": grammar}, list(tools), True, "response_format")
        return Plan(fields, list(tools), True)
    if tool_choice == "required":
        names, many = list(schemas), parallel_tool_calls is True
    elif isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        if name not in schemas:
            raise ServingError(
                f"tool_choice names function {name!r}, which is not among the tools ({', '.join(schemas)})",
                param="tool_choice",
            )
        names, many = [name], False
    else:
        raise ServingError(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    grammar = _calls_grammar(schemas, names, many, parser, close=True)
    return Plan({"grammar": grammar}, list(tools), parse_calls=True, param="tools", forced=True)


def constrain(base: SamplingParams, plan: Plan) -> SamplingParams:
    """``base`` with the plan's constraint; a refused schema or grammar is a 400 naming it."""
    if not plan.fields:
        return base
    try:
        return replace(base, **plan.fields)
    except ValueError as e:
        raise ServingError(str(e), param=plan.param, code="invalid_value") from e
    except ImportError as e:
        raise ServingError(str(e), param=plan.param, code="unsupported") from e


# ------------------------------------------------------------------------------- rendering


def template_reads_tools(template: Any) -> bool:
    """Whether the chat template that renders with tools mentions ``tools`` at all."""
    source = template.templates.get("tool_use", template.source)
    return re.search(r"\btools\b", source) is not None


def tools_system_prompt(tools: Sequence[Mapping], parser: Any = None) -> str:
    """The tools and the call format, for a template that does not render tools itself (``parser``:
    the family's tool parser, whose format is shown; Hermes when None)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser is not None and not isinstance(parser, HermesParser):
        example = parser.write("NAME", '{"ARGUMENT": "VALUE"}')
        return (
            "You can call functions. Their signatures are listed between <tools> and </tools>. To call one, "
            f"answer with the call written as below (NAME: the function, then its arguments), one per call:\n"
            f"{example}\n<tools>\n{listed}\n</tools>"
        )
    return (
        "You can call functions. Their signatures are listed between <tools> and </tools>. To call one, "
        f"answer with a JSON object holding the function's name and its arguments between {OPEN} and {CLOSE}, "
        f'one block per call:\n{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}\n'
        f"<tools>\n{listed}\n</tools>"
    )


def chat_messages(
    messages: list[dict], raw: Sequence[Any], plan: Plan, template: Any, parser: Any = None
) -> tuple[list[dict], Any]:
    """The messages and the ``tools`` argument to render with: history tool calls and tool results
    kept for a template that reads tools; else calls written in the family's format (``parser``'s;
    Hermes ``<tool_call>`` blocks when None) and the tools in the system message."""
    reads = template_reads_tools(template)
    parser = parser if parser is not None else HermesParser()
    out = []
    for m, r in zip(messages, raw):
        extra = dict(getattr(r, "model_extra", None) or {})  # ChatMessage keeps tool_calls, tool_call_id as extras
        calls = extra.get("tool_calls")
        if reads:  # as transformers' templates take them: arguments as a dict
            kept = {"tool_call_id": extra["tool_call_id"]} if "tool_call_id" in extra else {}
            if calls:
                kept["tool_calls"] = [{"type": "function", "function": _call_json(c)} for c in calls]
            out.append({**m, **kept})
        elif calls:
            written = [_call_json(c) for c in calls]
            blocks = parser.separator.join(
                parser.write(str(c["name"]), json.dumps(c["arguments"], ensure_ascii=False)) for c in written
            )
            out.append({**m, "content": (m["content"] + "\n" if m["content"] else "") + blocks})
        else:
            out.append(m)
    if plan.tools is None or reads:
        return out, plan.tools
    prompt = tools_system_prompt(plan.tools, parser)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _call_json(call: Any) -> dict:
    fn = call.get("function", {}) if isinstance(call, Mapping) else {}
    args = fn.get("arguments", "{}")
    with contextlib.suppress(json.JSONDecodeError):
        args = json.loads(args) if isinstance(args, str) else args
    return {"name": fn.get("name"), "arguments": args}


# --------------------------------------------------------------------------------- parsing


def parse_output(text: str, forced: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output in Hermes' format (see :mod:`.parsers` for the
    other families); blocks that are not calls stay in the content. ``forced``: the output is calls
    only (a forced tool choice): an unclosed last block (the output hit ``max_tokens``) is dropped,
    not content."""
    parser = parsers.ChatFormat().output(parse_calls=True, forced=forced)
    parsed = parser.parse(text)
    return parsed.content, parsers.call_dicts(parser, parsed.calls)
