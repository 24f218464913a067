"""Qwen3-Coder (and Qwen3.5) XML tool calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each parameter's value is the text between its tags, less one newline after the opening tag and one
before the closing tag. The arguments object is built in the order written; a value is typed by
the tool's parameters schema as Qwen's own parser does: ``string`` (and parameters the schema does
not name) stay text, ``integer``/``number``/``boolean`` are converted, ``null`` is null, ``object``/``array``
are read as JSON; a value that does not convert stays text. String values stream as they are
written; others arrive when their parameter closes. Text outside the blocks is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvforge.tools.serve.parsers.base import Call, Segment, openai_call_id, partial_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
_HEADER = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")


class Qwen3CoderParser:
    name: ClassVar[str] = "qwen3_coder"
    needs_special_tokens: ClassVar[bool] = False
    separator: ClassVar[str] = "\n"  # between two calls written by :meth:`write`
    structural: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Mapping] | None = None) -> None:
        self.types: dict[str, dict[str, Any]] = {}  # function -> parameter -> its schema
        for tool in tools or ():
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters") or {}
                props = params.get("properties") if isinstance(params, Mapping) else None
                self.types[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}

    def split(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            i = text.find(OPEN, pos)
            if i < 0:
                tail = text[pos:]
                out.append(tail if final else tail[: len(tail) - partial_marker(tail, [OPEN])])
                return out
            out.append(text[pos:i])
            j = text.find(CLOSE, i + len(OPEN))
            block = text[i + len(OPEN) : j if j >= 0 else len(text)]
            call = self._call(block, closed=j >= 0 or final)
            if call is None:
                if j >= 0 or final:
                    out.append(text[i : j + len(CLOSE)] if j >= 0 else text[i:])
                return out
            out.append(call)
            if j < 0:
                return out
            pos = j + len(CLOSE)

    def _call(self, block: str, closed: bool) -> Call | None:
        """The call in one block's text (all of it when ``closed``), or None when it is no call."""
        header = _HEADER.match(block)
        if header is None:
            return None
        name = header.group(1).strip()
        schema = self.types.get(name, {})
        parts: list[str] = []
        pos = header.end()
        while True:
            m = _PARAM.match(block, pos)
            if m is None:
                break
            key = m.group(1).strip()
            start = m.end()
            end = block.find(END_PARAMETER, start)
            head = json.dumps(key, ensure_ascii=False) + ": "
            if end < 0:  # the value is being written
                raw = block[start:]
                if not closed and _is_text(schema.get(key)):
                    raw = raw[: len(raw) - partial_marker(raw, [END_PARAMETER])]
                    raw = raw[1:] if raw.startswith("\n") else raw
                    raw = raw[:-1] if raw.endswith("\n") else raw
                    held = "null".startswith(raw.lower())  # may still be null, which is no text
                    parts.append(head + ("" if held else json.dumps(raw, ensure_ascii=False)[:-1]))
                elif not closed:
                    parts.append(head)
                else:
                    parts.append(head + json.dumps(_typed(_value(raw), schema.get(key)), ensure_ascii=False))
                return Call(name, "{" + ", ".join(parts), complete=False)
            parts.append(head + json.dumps(_typed(_value(block[start:end]), schema.get(key)), ensure_ascii=False))
            pos = end + len(END_PARAMETER)
        rest = block[pos:]
        done = rest.lstrip().startswith(END_FUNCTION)
        if done or closed:
            return Call(name, "{" + ", ".join(parts) + "}", complete=done)
        return Call(name, "{" + ", ".join(parts), complete=False)

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str:
        """One (or more) blocks of ``names``: the required parameters in the schema's order, each
        value a JSON value of its schema (strings as one line of plain text without ``<``, at most
        ``maxLength`` characters; an ``enum`` as its values), then ``</function>``."""
        rules = []
        for k, n in enumerate(names):
            props = (schemas[n] or {}).get("properties", {}) if isinstance(schemas[n], Mapping) else {}
            required = set((schemas[n] or {}).get("required", [])) if isinstance(schemas[n], Mapping) else set()
            items = []
            for j, (key, sub) in enumerate(props.items()):
                value = f"v{k}_{j}"
                if _is_text(sub) and "enum" not in (sub or {}):
                    most = (sub or {}).get("maxLength")
                    rules.append(f"{value}: /[^<\\n]{{0,{int(most)}}}/" if most else f"{value}: /[^<\\n]*/")
                elif _is_text(sub):
                    rules.append(f"{value}: " + " | ".join(json.dumps(str(v)) for v in sub["enum"]))
                else:
                    rules.append(f"{value}: %json {json.dumps(sub)}")
                item = f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"'
                items.append(item if key in required else f"({item})?")
            rules.append(f'f{k}: "<function={n}>\\n" {" ".join(items)} "</function>"')
        start = 'start: call ("\\n" call)*' if many else "start: call"
        calls = " | ".join(f"f{k}" for k in range(len(names)))
        return "\n".join([start, f'call: "{OPEN}\\n" ({calls}) "\\n{CLOSE}"', *rules]) + "\n"

    def write(self, name: str, arguments: str) -> str:
        """One call as this family writes it (``arguments``: JSON text of an object)."""
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            args = {}
        params = "".join(
            f"{PARAMETER}{key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}\n"
            f"{END_PARAMETER}\n"
            for key, value in (args.items() if isinstance(args, dict) else ())
        )
        return f"{OPEN}\n{FUNCTION}{name}>\n{params}{END_FUNCTION}\n{CLOSE}"

    def call_id(self) -> str:
        return openai_call_id()


def _value(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _is_text(schema: Any) -> bool:
    """Whether a parameter's value stays text: a string schema, or one the tool does not describe."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if kind is None:
        return not any(k in schema for k in ("properties", "items", "anyOf", "oneOf"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _typed(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema asks for (``null`` is null whatever the
    type, as in Qwen's parser); text when it does not convert."""
    if raw.strip().lower() == "null":
        return None
    if _is_text(schema):
        return raw
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    text = raw.strip()
    try:
        if "integer" in kinds and re.fullmatch(r"-?\d+", text):
            return int(text)
        if "number" in kinds:
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if "boolean" in kinds and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if "null" in kinds and text.lower() in ("null", "none"):
            return None
        return json.loads(text)
    except ValueError:
        return raw
