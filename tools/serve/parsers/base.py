"""What every output parser shares: calls, the parser protocols, and the streaming diff.

A parser is a pure function of the text generated so far. ``split(text, final)`` returns what is
*certain* of that text: with ``final=False`` a tail that may still become markup (a partial
``<tool_call`` or ``</think``) is left out, and a call whose arguments are still being written
carries the arguments written so far. Each parser keeps one promise, checked by the golden tests
(every prefix of a documented output): what ``split`` returns for a prefix of ``text`` is a prefix
of what it returns for ``text`` (content, reasoning, each call's name and arguments). So a stream
is the difference between two successive splits (:class:`Stream`), and the concatenated deltas
equal the whole parse.

Input: decoded output text (with the special tokens kept where a parser's ``needs_special_tokens``
says so). Output: :class:`Parsed` (reasoning, content, calls), or :class:`Delta` pieces of it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvforge.runtime.constraints import JSON_WHITESPACE


@dataclass
class Call:
    """One tool call as written so far: ``arguments`` is JSON text (the whole object once
    ``complete``; a prefix of it while the model is still writing or when the output was cut off)."""

    name: str
    arguments: str
    complete: bool = True


Segment = str | Call  # a parser's output: content text and calls, in the order written


TokenId = Callable[[str], int | None]  # the served tokenizer's id of a token's text (None: not one token)


class ToolParser(Protocol):
    """One model family's tool-call format. Built per request with the request's tools; a family
    whose markup is special tokens (``needs_special_tokens``) also with the served tokenizer's
    :data:`TokenId` lookup, as its grammar forces those tokens by id."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool]  # its markup is special tokens ([TOOL_CALLS], <|channel|>)
    structural: ClassVar[bool]  # the whole output is markup: parse it even when no tools are sent
    separator: ClassVar[str]  # between two calls written one after the other

    def split(self, text: str, final: bool) -> list[Segment]:
        """Content pieces and calls of ``text`` (see the module docstring for the prefix promise)."""
        ...

    def grammar(self, schemas: Mapping[str, dict], names: Sequence[str], many: bool) -> str | None:
        """A Lark grammar (llguidance's) of one, or one or more, calls of ``names`` written in this
        format (``tool_choice`` required/named); None where kvforge builds none for the family."""
        ...

    def call_id(self) -> str:
        """A new id for a call, in the family's form."""
        ...

    def write(self, name: str, arguments: str) -> str:
        """One call (``arguments``: JSON text) as the family writes it; calls are joined with
        ``separator``. What :meth:`split` reads back as that call."""
        ...


class ReasoningParser(Protocol):
    """One family's reasoning markup: the reasoning text, and the rest of the output."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool]

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, the text after it) of ``text``, both certain (the prefix promise)."""
        ...


# --------------------------------------------------------------------------------- helpers


def marker_ids(token_id: TokenId | None, markers: Sequence[str]) -> list[int] | None:
    """The ids of ``markers`` in the served tokenizer (``token_id``: its lookup), for a grammar to
    force each as one token (llguidance's ``<[id]>``; Mistral's ``[ARGS]`` cannot be named in its
    ``<name>`` syntax); None without a tokenizer or where one of them is not a single token."""
    if token_id is None:
        return None
    ids = [token_id(m) for m in markers]
    return None if any(i is None for i in ids) else [int(i) for i in ids]


def json_rule(schema: Any) -> str:
    """The body of a Lark rule (llguidance's ``%json``) of one tool's arguments: JSON of ``schema``
    with kvforge's whitespace rule (:data:`~kvforge.runtime.constraints.JSON_WHITESPACE`)."""
    body = dict(schema) if isinstance(schema, Mapping) else {"anyOf": [schema]}
    return f"%json {json.dumps({**body, 'x-guidance': {'whitespace_pattern': JSON_WHITESPACE}})}"


def named_calls_rule(schemas: Mapping[str, dict], names: Sequence[str], arguments_key: str) -> str:
    """:func:`json_rule` of one call object ``{"name": NAME, ARGUMENTS_KEY: ARGS}`` of any of
    ``names``, its arguments following that tool's schema (Hermes: "arguments", Llama 3: "parameters")."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, arguments_key: schemas[n]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for n in names
    ]
    return json_rule({"anyOf": calls})


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def alnum_id(length: int = 9) -> str:
    """Mistral's call ids: exactly nine letters and digits (its chat template refuses others)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(length))


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``:
    the characters to hold back because the next ones may complete the marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


_DECODER = json.JSONDecoder()
_NAME_THEN_ARGS = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*', re.DOTALL
)


def json_end(text: str, start: int) -> int | None:
    """The end of the JSON value at ``text[start:]`` (after leading whitespace), or None while it is
    incomplete or not JSON."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return None


def json_call(
    body: str, final: bool, keys: tuple[str, ...] = ("arguments", "parameters"), require_args: bool = False
) -> tuple[Call | None, int]:
    """A call from a JSON object ``{"name": ..., "arguments": {...}}`` at the start of ``body``
    (``parameters`` for ``arguments`` too), and where the object ends (0 when it has not).

    While the object is being written, a call appears once its name and the start of its arguments
    are (``"name"`` first, as the families write it): the arguments so far are the raw text after
    ``"arguments":``. A whole object with its keys in another order is read when it closes. The
    arguments are the model's own text (its spacing kept), so the streamed pieces join to it.
    ``require_args``: an object without arguments is no call (else its arguments are ``{}``)."""
    m = _NAME_THEN_ARGS.match(body)
    value = body[m.end() :] if m is not None else ""
    if m is not None and value and not value.startswith('"'):  # a string of arguments: read when whole
        name = json.loads(f'"{m.group(1)}"')
        end = json_end(body, m.end())
        if end is None:  # still being written (or cut off): all of it is arguments
            return Call(name, value, complete=False), 0
        tail = re.match(r"\s*\}", body[end:])
        if tail is not None:
            return Call(name, body[m.end() : end]), end + tail.end()
        whole = _whole_object(body)
        if whole is not None:  # more keys after the arguments
            return Call(name, body[m.end() : end]), whole[1]
        return Call(name, body[m.end() : end], complete=False), 0
    if m is not None and not value and not final:
        return None, 0
    whole = _whole_object(body)
    if whole is None:
        return None, 0
    data, end = whole
    if not isinstance(data.get("name"), str) or (require_args and not any(k in data for k in keys)):
        return None, 0
    args = next((data[k] for k in keys if k in data), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(data["name"], text), end


def _whole_object(body: str) -> tuple[dict, int] | None:
    """The JSON object at the start of ``body`` (after blanks) and its end, when it is complete."""
    start = len(body) - len(body.lstrip())
    if body[start : start + 1] != "{":
        return None
    end = json_end(body, start)
    if end is None:
        return None
    data = json.loads(body[start:end])
    return (data, end) if isinstance(data, dict) else None


# ------------------------------------------------------------------------------- assembling


@dataclass
class Parsed:
    """A whole output, parsed: ``content`` None when blank, ``calls`` in the order written."""

    reasoning: str | None
    content: str | None
    calls: list[Call] = field(default_factory=list)


def content_of(segments: Sequence[Segment], final: bool) -> tuple[str, list[Call]]:
    """Join a split's content pieces: blank text before a call is dropped (the newline between two
    calls), trailing blanks are held while more may come and dropped at the end after calls."""
    pieces: list[str] = []
    calls: list[Call] = []
    pending = ""
    for seg in segments:
        if isinstance(seg, Call):
            pieces.append(pending.rstrip())
            pending = ""
            calls.append(seg)
        else:
            pending += seg
    if final and not calls:
        pieces.append(pending)
    else:
        pieces.append(pending.rstrip())
    return "".join(pieces), calls


@dataclass
class Delta:
    """One streamed piece: reasoning text, content text, or a piece of call ``index`` (its ``id``
    and ``name`` with the first piece, then argument text)."""

    reasoning: str | None = None
    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class OutputParser:
    """A reasoning parser and a tool parser over one output (either may be None)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        keep_calls: bool = True,
        forced: bool = False,
    ) -> None:
        self.reasoning, self.tools, self.keep_calls = reasoning, tools, keep_calls
        self.forced = forced and tools is not None  # calls only: no content; unfinished calls dropped at the end

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def split(self, text: str, final: bool) -> tuple[str, str, list[Call]]:
        """(reasoning, content, calls) certain of ``text``."""
        reasoning, rest = self.reasoning.split(text, final) if self.reasoning is not None else ("", text)
        if self.tools is None:
            return reasoning, rest, []
        content, calls = content_of(self.tools.split(rest, final), final)
        if self.forced:  # the grammar wrote calls only: what is not a call is an unfinished one's markup
            content = ""
            calls = [c for c in calls if c.complete] if final else calls
        return reasoning, content, calls if self.keep_calls else []

    def parse(self, text: str) -> Parsed:
        """The whole output: reasoning (None when there is none), content (None when blank and
        something else was parsed), calls."""
        reasoning, content, calls = self.split(text, final=True)
        blank = not content.strip() and (self.tools is not None or reasoning)
        return Parsed(reasoning or None, None if blank else content, calls)

    def stream(self) -> Stream:
        return Stream(self)

    def call_id(self) -> str:
        return self.tools.call_id() if self.tools is not None else openai_call_id()


class Stream:
    """Incremental parsing: :meth:`feed` the text as it is generated, get the :class:`Delta`s that
    became certain; :meth:`finish` at the end. Each feed re-splits the text so far (C-speed string
    searches over one output) and sends what grew."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_args: list[int] = []  # per call: argument characters sent
        self.ids: list[str] = []
        self.calls: list[Call] = []

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        return self._diff(*self.parser.split(self.text, final=False))

    def finish(self) -> list[Delta]:
        return self._diff(*self.parser.split(self.text, final=True))

    def _diff(self, reasoning: str, content: str, calls: list[Call]) -> list[Delta]:
        out: list[Delta] = []
        if len(reasoning) > self.sent_reasoning:
            out.append(Delta(reasoning=reasoning[self.sent_reasoning :]))
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            out.append(Delta(content=content[self.sent_content :]))
            self.sent_content = len(content)
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(self.parser.call_id())
                self.sent_args.append(len(call.arguments))
                out.append(Delta(index=i, id=self.ids[i], name=call.name, arguments=call.arguments))
            elif len(call.arguments) > self.sent_args[i]:
                out.append(Delta(index=i, arguments=call.arguments[self.sent_args[i] :]))
                self.sent_args[i] = len(call.arguments)
        self.calls = calls
        return out


def call_dicts(parser: OutputParser, calls: Sequence[Call]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries for whole calls."""
    return [
        {"id": parser.call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
