"""Llama 3.1/3.2/3.3 JSON tool calls.

Llama 3's chat template asks for "a JSON for a function call with its proper arguments ... in the
format {"name": function name, "parameters": dictionary of argument name and its value}"; the
model answers with the object alone, bare or after ``<|python_tag|>`` (a special token), several
calls separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with ``<|python_tag|>`` or ``{`` is content, and so is a JSON answer
that is not a call (``arguments`` is read for ``parameters`` too). Text after the calls is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvforge.tools.serve.parsers.base import Segment, json_call, json_end, named_calls_rule, openai_call_id

TAG = "<|python_tag|>"


class Llama3JsonParser:
    name: ClassVar[str] = "llama3_json"
    needs_special_tokens: ClassVar[bool] = False  # <|python_tag|> decodes to nothing; the JSON is read bare
    separator: ClassVar[str] = "; "  # between two calls written by :meth:`write`
    structural: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Mapping] | None = None) -> None:
        self.tools = tools

    def split(self, text: str, final: bool) -> list[Segment]:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG) :].lstrip()
        elif not final and TAG.startswith(body):  # blanks, or the tag being written
            return []
        if not body.startswith("{"):
            return [text] if final or body else []
        out: list[Segment] = []
        pos = 0
        while True:
            rest = body[pos:]
            call, end = json_call(rest, final, require_args=True)
            if call is None:
                undecided = not final and (not rest.strip() or (rest.lstrip().startswith("{") and not _whole(rest)))
                if undecided:  # blanks, or an object that may still be a call: hold it back
                    return out
                return [*out, rest] if out else [text]  # text after the calls, or a JSON answer that is no call
            out.append(call)
            if not end:  # the call is still being written
                return out
            pos += end
            sep = re.match(r"\s*;", body[pos:])
            if sep is None:
                return [*out, body[pos:]]
            pos += sep.end()

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str:
        """``{"name": NAME, "parameters": ARGS}`` objects, ``; ``-separated."""
        start = 'start: call ("; " call)*' if many else "start: call"
        return f"{start}\ncall: {named_calls_rule(schemas, names, 'parameters')}\n"

    def write(self, name: str, arguments: str) -> str:
        """One call as this family writes it (``arguments``: JSON text)."""
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'

    def call_id(self) -> str:
        return openai_call_id()


def _whole(body: str) -> bool:
    """Whether ``body`` starts with a whole JSON value (so what it is can be decided)."""
    start = len(body) - len(body.lstrip())
    return json_end(body, start) is not None
