"""gpt-oss's harmony format: messages on channels, for reasoning and for tool calls.

The chat template ends the prompt with ``<|start|>assistant``; the model then writes messages::

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>

or, to answer, ``<|channel|>final<|message|>It is sunny.<|return|>``. ``analysis`` is reasoning;
``final`` is content, and so is ``commentary`` without a recipient (a preamble the user may see);
a message to ``functions.NAME`` (the recipient written after the channel or after the role) is a
call of NAME with the message as its arguments. A message to another recipient (a built-in tool
such as ``browser.search``, which the client did not declare) is dropped, as vLLM does.
``<|return|>`` and ``<|call|>`` are end-of-sequence tokens, so an output usually ends without
them. The markers are special tokens: the server decodes this family's output with special tokens
kept. An output without harmony markup is content.

The grammar of forced calls writes what the model writes after the template's generation prompt
(``<|start|>assistant``, which the prompt already ends with): ``<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``, the markers forced as their token ids.
It is one call even when parallel calls are allowed: ``<|call|>`` ends the turn (an end-of-sequence
token), and gpt-oss calls one function per turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvforge.tools.serve.parsers.base import (
    Call,
    Segment,
    TokenId,
    json_rule,
    marker_ids,
    openai_call_id,
    partial_marker,
)

START, CHANNEL, MESSAGE, CONSTRAIN, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"
ENDS = ("<|end|>", CALL, "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Message:
    channel: str
    recipient: str | None
    body: str  # as far as it is certain
    closed: bool
    span: tuple[int, int]  # where the whole message lies in the text (its end: as far as it goes)


def messages(text: str, final: bool) -> list[Message] | None:
    """The messages of ``text`` whose header is whole; None when the text is not harmony at all."""
    lead = text.lstrip()
    if not (lead.startswith((CHANNEL, START)) or (not final and (CHANNEL.startswith(lead) or START.startswith(lead)))):
        return None
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        at = text.find(MESSAGE, pos)
        if at < 0:  # a header being written (or cut off): nothing of it is certain
            return out
        header = text[pos:at]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        start = at + len(MESSAGE)
        ends = [(k, m) for m in (*ENDS, START) if (k := text.find(m, start)) >= 0]
        if ends:
            k, marker = min(ends)
            out.append(
                Message(
                    channel.group(1) if channel else "", recipient and recipient.group(1), text[start:k], True, (pos, k)
                )
            )
            pos = k + (0 if marker == START else len(marker))
            continue
        body = text[start:]
        if not final:
            body = body[: len(body) - partial_marker(body, [*ENDS, START])]
        out.append(
            Message(
                channel.group(1) if channel else "", recipient and recipient.group(1), body, final, (pos, len(text))
            )
        )
        return out
    return out


class HarmonyReasoning:
    """The ``analysis`` messages as reasoning; the rest of the output, still harmony, after it."""

    name: ClassVar[str] = "harmony"
    needs_special_tokens: ClassVar[bool] = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        found = messages(text, final)
        if found is None:
            return "", text
        reasoning = [m.body.strip() for m in found if m.channel == "analysis"]
        rest = [text[m.span[0] : _after(text, m.span[1])] for m in found if m.channel != "analysis"]
        return "\n\n".join(r for r in reasoning if r), "".join(rest)


def _after(text: str, end: int) -> int:
    for marker in ENDS:
        if text.startswith(marker, end):
            return end + len(marker)
    return end


class HarmonyParser:
    """Content (``final`` and preamble messages) and calls (messages to a recipient)."""

    name: ClassVar[str] = "harmony"
    needs_special_tokens: ClassVar[bool] = True
    separator: ClassVar[str] = ""  # between two calls written by :meth:`write`
    structural: ClassVar[bool] = True

    def __init__(self, tools: Sequence[Mapping] | None = None, token_id: TokenId | None = None) -> None:
        self.tools = tools
        self.token_id = token_id

    def split(self, text: str, final: bool) -> list[Segment]:
        found = messages(text, final)
        if found is None:
            return [text]
        out: list[Segment] = []
        for m in found:
            if m.channel == "analysis":
                continue  # reasoning never goes to the content
            if m.recipient and m.recipient.startswith("functions."):
                out.append(Call(m.recipient.removeprefix("functions."), m.body.strip(), complete=m.closed))
            elif m.recipient:
                continue  # a built-in tool's call (browser.search, python): not the client's to run
            else:
                out.append(m.body)
        return out

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str | None:
        """One call message of ``names`` after the prompt's ``<|start|>assistant`` (``many`` changes
        nothing: see the module docstring); None where the tokenizer lacks one of the markers as
        one token."""
        ids = marker_ids(self.token_id, (CHANNEL, CONSTRAIN, MESSAGE, CALL))
        if ids is None:
            return None
        channel, constrain, message, call = (f"<[{i}]>" for i in ids)
        rules = []
        for k, n in enumerate(names):
            header = json.dumps(f"commentary to=functions.{n} ")
            rules.append(f'f{k}: {channel} {header} {constrain} "json" {message} a{k} {call}')
            rules.append(f"a{k}: {json_rule(schemas[n])}")
        return "\n".join(["start: call", "call: " + " | ".join(f"f{k}" for k in range(len(names))), *rules]) + "\n"

    def write(self, name: str, arguments: str) -> str:
        """One call as this family writes it (``arguments``: JSON text)."""
        return f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"

    def call_id(self) -> str:
        return openai_call_id()
