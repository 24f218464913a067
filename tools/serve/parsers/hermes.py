"""Hermes tool calls: Qwen2.5/Qwen3, Hermes 2/3, SmolLM3 and most open chat models.

One JSON block per call, parallel calls one after another::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is content; a block that is not such a call stays in the content as it
was written. A block cut off by the end of the output is a call (``complete=False``) once its name
and the start of its arguments are written, else content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvforge.tools.serve.parsers.base import Segment, json_call, named_calls_rule, openai_call_id, partial_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    name: ClassVar[str] = "hermes"
    needs_special_tokens: ClassVar[bool] = False
    separator: ClassVar[str] = "\n"  # between two calls written by :meth:`write`
    structural: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Mapping] | None = None) -> None:
        self.tools = tools

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
            body_start = i + len(OPEN)
            j = text.find(CLOSE, body_start)
            if j < 0:  # the block is open: a call as far as it goes, or held back
                call, _ = json_call(text[body_start:], final)
                if call is not None:
                    out.append(call)
                elif final:
                    out.append(text[i:])
                return out
            call, end = json_call(text[body_start:j], final=True)
            if call is not None and call.complete and not text[body_start + end : j].strip():
                out.append(call)
            else:
                out.append(text[i : j + len(CLOSE)])
            pos = j + len(CLOSE)

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str:
        """``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` blocks, newline-separated."""
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: {named_calls_rule(schemas, names, "arguments")}\n'

    def write(self, name: str, arguments: str) -> str:
        """One call as this family writes it (``arguments``: JSON text)."""
        return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CLOSE}'

    def call_id(self) -> str:
        return openai_call_id()
