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

Tool calls are written Hermes-style, the format most open chat models are trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (parallel calls: blocks separated by a newline). The tools reach the model through
its chat template (``tools=`` as transformers passes them) when the template reads ``tools``; a
template that ignores them (SmolLM2's) gets them in a system message that lists the tools and this
format. ``required`` and a named function constrain the output to such blocks whose JSON is
``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}`` (a named function:
exactly one call of it; ``required``: one call, or one or more when ``parallel_tool_calls`` is
true); ``auto`` leaves the output free (with a ``json_schema`` response format: the schema's JSON
or tool calls) and parses what comes; ``none`` renders no tools and parses nothing. A response with
calls has ``finish_reason: "tool_calls"`` and the text outside the blocks as ``content`` (None when
blank).

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
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvforge.runtime import constraints
from kvforge.runtime.sampling import SamplingParams
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import ServingError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
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


def _calls_grammar(schemas: Mapping[str, dict], names: Sequence[str], many: bool, close: bool = False) -> str:
    """A Lark grammar (llguidance's) of one, or one or more, ``<tool_call>`` blocks of ``names``;
    ``close``: argument objects closed (:func:`closed_objects`), as for forced calls."""
    body = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": closed_objects(schemas[n]) if close else schemas[n]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in names
        ],
        "x-guidance": _JSON_OPTIONS,
    }
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(body)}\n'


def plan(
    response_format: Mapping | None,
    tools: Sequence[Mapping] | None = None,
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool | None = None,
) -> Plan:
    """The :class:`Plan` of one chat request (400 naming the field for anything malformed)."""
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
            calls = _calls_grammar(schemas, list(schemas), parallel_tool_calls is True)
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
    grammar = _calls_grammar(schemas, names, many, close=True)
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


def tools_system_prompt(tools: Sequence[Mapping]) -> str:
    """The tools and the call format, for a template that does not render tools itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Their signatures are listed between <tools> and </tools>. To call one, "
        f"answer with a JSON object holding the function's name and its arguments between {OPEN} and {CLOSE}, "
        f'one block per call:\n{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}\n'
        f"<tools>\n{listed}\n</tools>"
    )


def chat_messages(messages: list[dict], raw: Sequence[Any], plan: Plan, template: Any) -> tuple[list[dict], Any]:
    """The messages and the ``tools`` argument to render with: history tool calls and tool results
    kept for a template that reads tools; else calls written as ``<tool_call>`` blocks and the tools
    in the system message."""
    reads = template_reads_tools(template)
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
            blocks = "\n".join(f"{OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{CLOSE}" for c in calls)
            out.append({**m, "content": (m["content"] + "\n" if m["content"] else "") + blocks})
        else:
            out.append(m)
    if plan.tools is None or reads:
        return out, plan.tools
    prompt = tools_system_prompt(plan.tools)
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> dict | None:
    """An OpenAI tool call ``{"id", "type", "function": {"name", "arguments"}}`` from one block's
    JSON, or None when it is not ``{"name": str, "arguments": ...}``."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": text}}


def parse_output(text: str, forced: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output; blocks that are not calls stay in the content.
    ``forced``: the output is calls only (a forced tool choice): an unclosed last block (the output
    hit ``max_tokens``) is dropped, not content."""
    stream = CallStream(forced)
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, dict)]
    return (content if content.strip() else None), calls


class CallStream:
    """Incremental ``<tool_call>`` parsing of streamed text: :meth:`feed` returns content strings
    and tool calls (dicts) as soon as they are certain. Text that may begin a block is held back;
    blank text next to a call is dropped; a block that does not parse is passed on as content.
    ``forced``: what is held at the end (an unclosed block) is dropped instead."""

    def __init__(self, forced: bool = False) -> None:
        self.forced = forced
        self.buf = ""
        self.blank = ""  # whitespace held until we know whether a call follows
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[str | dict]:
        self.buf += text
        out: list[str | dict] = []
        while True:
            if self.in_call:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                body, self.buf = self.buf[:j], self.buf[j + len(CLOSE) :]
                self.in_call = False
                call = parse_call(body.strip())
                if call is None:
                    self._content(OPEN + body + CLOSE, out)
                else:
                    self.blank = ""
                    self.calls += 1
                    out.append(call)
                continue
            i = self.buf.find(OPEN)
            if i >= 0:
                self._content(self.buf[:i], out, before_call=True)
                self.buf, self.in_call = self.buf[i + len(OPEN) :], True
                continue
            n = len(self.buf)
            keep = next((k for k in range(min(len(OPEN) - 1, n), 0, -1) if OPEN.startswith(self.buf[-k:])), 0)
            self._content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return out

    def finish(self) -> list[str | dict]:
        """What is held at the end (an unfinished block is content; dropped when forced)."""
        out: list[str | dict] = []
        rest = "" if self.forced else (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        self._content(rest, out)
        if self.blank and not self.calls:  # a reply of blanks alone stays what it was
            out.append(self.blank)
        self.blank = ""
        return out

    def _content(self, text: str, out: list, before_call: bool = False) -> None:
        """Emit ``text``, holding its trailing whitespace until more text comes (dropped at a call)."""
        body = text.rstrip()
        if body:
            out.append(self.blank + body)
            self.blank = ""
        self.blank += text[len(body) :]
        if before_call:
            self.blank = ""


class DeltaParser:
    """One streamed chat choice with tools: text pieces -> ``DeltaMessage``s (content, and each
    call whole, as one ``tool_calls`` entry, once its block closes)."""

    def __init__(self, forced: bool = False) -> None:
        self.stream = CallStream(forced)
        self.calls = 0

    def feed(self, text: str, keep_one: bool = False) -> list[p.DeltaMessage]:
        """Deltas for ``text``; ``keep_one``: at least one (an empty one to carry logprobs)."""
        out = self._deltas(self.stream.feed(text))
        return out or ([p.DeltaMessage(content="")] if keep_one else [])

    def finish(self) -> list[p.DeltaMessage]:
        return self._deltas(self.stream.finish())

    def _deltas(self, events: list[str | dict]) -> list[p.DeltaMessage]:
        out = []
        for e in events:
            if isinstance(e, str):
                out.append(p.DeltaMessage(content=e))
            else:
                call = p.DeltaToolCall(index=self.calls, id=e["id"], type="function", function=e["function"])
                self.calls += 1
                out.append(p.DeltaMessage(tool_calls=[call]))
        return out
