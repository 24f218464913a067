"""Mistral tool calls, after the special token ``[TOOL_CALLS]``, in either of its two forms.

Tokenizers before v11 (Mistral-7B-Instruct-v0.3, Mixtral) write a JSON list of calls::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

v11 and later (Mistral Small 3.1/3.2, Magistral, Devstral, Ministral 3) write each call as its
name, optionally ``[CALL_ID]`` and an id, then ``[ARGS]`` and the arguments object::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": 1}

Text before the first ``[TOOL_CALLS]`` is content. Call ids are nine letters and digits, the only
form Mistral's chat templates accept back. The markers are special tokens: the server decodes this
family's output with special tokens kept, and the grammar of forced calls writes the v11 form with
each marker forced as its token id (``<[id]>``: llguidance's ``<name>`` syntax cannot name
``[ARGS]``), so a tokenizer without them as single tokens gets no grammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvforge.tools.serve.parsers.base import (
    Call,
    Segment,
    TokenId,
    alnum_id,
    json_call,
    json_end,
    json_rule,
    marker_ids,
    partial_marker,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)")


class MistralParser:
    name: ClassVar[str] = "mistral"
    needs_special_tokens: ClassVar[bool] = True
    separator: ClassVar[str] = ""  # between two calls written by :meth:`write`
    structural: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Mapping] | None = None, token_id: TokenId | None = None) -> None:
        self.tools = tools
        self.token_id = token_id

    def split(self, text: str, final: bool) -> list[Segment]:
        i = text.find(TOOL_CALLS)
        if i < 0:
            return [text if final else text[: len(text) - partial_marker(text, [TOOL_CALLS])]]
        out: list[Segment] = [text[:i]]
        rest = text[i + len(TOOL_CALLS) :]
        if rest.lstrip().startswith(("[", "{")):
            return out + self._json_calls(rest, final)
        if not rest.strip() and not final:
            return out
        return out + self._named_calls(text[i:], final)

    def _json_calls(self, rest: str, final: bool) -> list[Segment]:
        """``[{...}, {...}]`` (or one bare object) after the marker."""
        body = rest.lstrip()
        listed = body.startswith("[")
        pos = 1 if listed else 0
        out: list[Segment] = []
        while True:
            call, end = json_call(body[pos:], final)
            if call is None:
                return out if out or not final else [body]
            out.append(call)
            if not end:
                return out
            pos += end
            sep = re.match(r"\s*([,\]])", body[pos:])
            if sep is None or not listed:
                tail = body[pos:]
                return out + ([tail] if tail.strip() and (final or not listed) else [])
            pos += sep.end()
            if sep.group(1) == "]":
                return [*out, body[pos:]]

    def _named_calls(self, text: str, final: bool) -> list[Segment]:
        """``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` repeated, from the first marker on."""
        out: list[Segment] = []
        pos = 0
        while text.startswith(TOOL_CALLS, pos):
            pos += len(TOOL_CALLS)
            m = _NAME.match(text, pos)
            args_at = text.find(ARGS, pos)
            if m is None or args_at < 0:  # the name is still being written (or the call was cut off)
                return out
            name = m.group(1)
            header = text[m.end() : args_at].strip()
            if header and not header.startswith(CALL_ID):
                return out + ([text[pos - len(TOOL_CALLS) :]] if final else [])
            start = args_at + len(ARGS)
            value = text[start:]
            if not value:
                return out if not final else [*out, Call(name, "", complete=False)]
            end = json_end(text, start)
            if end is None:
                return [*out, Call(name, value, complete=False)]
            out.append(Call(name, text[start:end]))
            pos = end
            nxt = text[pos:]
            if not nxt.startswith(TOOL_CALLS):
                held = 0 if final else partial_marker(nxt, [TOOL_CALLS])
                return [*out, nxt[: len(nxt) - held]]
        return out

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str | None:
        """``[TOOL_CALLS]NAME[ARGS]ARGS`` (v11 form), one call or (``many``) one or more written one
        after the other; None where the tokenizer lacks ``[TOOL_CALLS]`` or ``[ARGS]`` as one token."""
        ids = marker_ids(self.token_id, (TOOL_CALLS, ARGS))
        if ids is None:
            return None
        calls, args = ids
        rules = []
        for k, n in enumerate(names):
            rules.append(f"f{k}: <[{calls}]> {json.dumps(n)} <[{args}]> a{k}")
            rules.append(f"a{k}: {json_rule(schemas[n])}")
        start = "start: call call*" if many else "start: call"
        return "\n".join([start, "call: " + " | ".join(f"f{k}" for k in range(len(names))), *rules]) + "\n"

    def write(self, name: str, arguments: str) -> str:
        """One call as this family writes it, v11 form (``arguments``: JSON text)."""
        return f"{TOOL_CALLS}{name}{ARGS}{arguments}"

    def call_id(self) -> str:
        return alnum_id()
