"""Tool-call and reasoning parsers, one per model family, chosen by name.

The names a server uses come from the artifact's manifest (``tool_parser``, ``reasoning_parser``:
chosen at compile time from the chat template and the tokenizer's special tokens, see
:mod:`kvforge.compile.chat_format`), or from ``kvforge serve --tool-parser NAME
--reasoning-parser NAME``. A new family is one module here with its golden test.

    fmt = ChatFormat("hermes", "think")
    out = fmt.output(tools=[...], prompt=rendered_prompt, parse_calls=True)
    parsed = out.parse(text)            # whole: reasoning, content, calls
    stream = out.stream()               # streamed: stream.feed(piece) -> [Delta], stream.finish()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvforge.tools.serve.parsers.base import (
    Call,
    Delta,
    OutputParser,
    Parsed,
    ReasoningParser,
    Stream,
    TokenId,
    ToolParser,
    call_dicts,
)
from kvforge.tools.serve.parsers.harmony import HarmonyParser, HarmonyReasoning
from kvforge.tools.serve.parsers.hermes import HermesParser
from kvforge.tools.serve.parsers.llama3_json import Llama3JsonParser
from kvforge.tools.serve.parsers.mistral import MistralParser
from kvforge.tools.serve.parsers.qwen3_coder import Qwen3CoderParser
from kvforge.tools.serve.parsers.think import ThinkParser

TOOL_PARSERS: dict[str, type] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, HarmonyParser)
}
REASONING_PARSERS: dict[str, type] = {p.name: p for p in (ThinkParser, HarmonyReasoning)}
DEFAULT_TOOL_PARSER = "hermes"  # what an artifact compiled before the manifest recorded a parser gets

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Call",
    "ChatFormat",
    "Delta",
    "OutputParser",
    "Parsed",
    "ReasoningParser",
    "Stream",
    "ToolParser",
    "call_dicts",
]


def check_names(tool_parser: str | None, reasoning_parser: str | None, where: str = "--tool-parser") -> None:
    """ValueError naming the choices for an unknown parser name (``none`` turns reasoning off)."""
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {tool_parser!r} ({where}); choose one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser not in (None, "none", *REASONING_PARSERS):
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)} or none"
        )


@dataclass(frozen=True)
class ChatFormat:
    """The tool-call and reasoning formats one served model writes."""

    tool_parser: str = DEFAULT_TOOL_PARSER
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_names(self.tool_parser, self.reasoning_parser, "tool_parser")

    @classmethod
    def choose(
        cls, manifest: object, tool_parser: str | None = None, reasoning_parser: str | None = None
    ) -> ChatFormat:
        """The manifest's choice (an artifact compiled before the fields existed: hermes, no
        reasoning), each overridden when given (``reasoning_parser="none"`` turns reasoning off)."""
        tool = tool_parser or getattr(manifest, "tool_parser", None) or DEFAULT_TOOL_PARSER
        reasoning = reasoning_parser if reasoning_parser is not None else getattr(manifest, "reasoning_parser", None)
        return cls(tool, None if reasoning == "none" else reasoning)

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the output must be decoded with special tokens kept (the markup is made of them)."""
        tool = TOOL_PARSERS[self.tool_parser]
        reasoning = REASONING_PARSERS.get(self.reasoning_parser or "")
        return tool.needs_special_tokens or bool(reasoning and reasoning.needs_special_tokens)

    def tool(self, tools: Sequence[Mapping] | None = None, token_id: TokenId | None = None) -> ToolParser:
        """The tool parser of one request; ``token_id`` (the served tokenizer's lookup) reaches a
        family whose markup is special tokens: its grammar of forced calls names them by id."""
        parser = TOOL_PARSERS[self.tool_parser]
        return parser(tools, token_id=token_id) if parser.needs_special_tokens else parser(tools)

    def reasoning(self, prompt: str = "", answer_only: bool = False) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        if self.reasoning_parser == ThinkParser.name:
            return ThinkParser(inside=False) if answer_only else ThinkParser.for_prompt(prompt)
        return REASONING_PARSERS[self.reasoning_parser]()

    def output(
        self,
        tools: Sequence[Mapping] | None = None,
        prompt: str = "",
        parse_calls: bool = False,
        answer_only: bool = False,
        forced: bool = False,
    ) -> OutputParser:
        """The parser of one answer: reasoning always (when the family has it); calls when
        ``parse_calls``; a structural format (harmony) is parsed even without tools, its calls
        dropped. ``answer_only``: a grammar constrains the output from its first token to the
        answer (forced calls, a JSON schema), so it does not start inside a reasoning the prompt
        opened. ``forced``: the output is calls only (a forced tool choice): no content, and a call
        the output did not finish (cut by ``max_tokens``) is dropped from the whole answer."""
        tool = self.tool(tools)
        use_tools = parse_calls or tool.structural
        reasoning = self.reasoning(prompt, answer_only)
        return OutputParser(reasoning, tool if use_tools else None, keep_calls=parse_calls, forced=forced)
