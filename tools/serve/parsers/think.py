"""``<think>…</think>`` reasoning: Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3.

The model writes ``<think>`` at the start of its answer, its reasoning, ``</think>``, then the
answer; or the chat template has already opened ``<think>`` in the prompt (DeepSeek-R1's
generation prompt, Qwen3 thinking-only models), so the output starts inside the reasoning and
only closes it. :meth:`ThinkParser.for_prompt` tells which from the rendered prompt: the output
starts inside when the prompt's last ``<think>`` comes after its last ``</think>`` (a template
that turned thinking off, e.g. Qwen3 with ``enable_thinking=False``, renders an empty closed pair).

The reasoning is the text between the tags, stripped; the content is what follows ``</think>``,
without its leading blanks. An output cut off inside the reasoning is all reasoning.
"""

from __future__ import annotations

from typing import ClassVar

from kvforge.tools.serve.parsers.base import partial_marker

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    name: ClassVar[str] = "think"
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside  # the prompt opened <think>: the output starts in the reasoning

    @classmethod
    def for_prompt(cls, prompt: str) -> ThinkParser:
        return cls(inside=prompt.rfind(OPEN) > prompt.rfind(CLOSE))

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if body.startswith(OPEN):
            body = body[len(OPEN) :]
        elif not final and OPEN.startswith(body):  # blanks, or the tag being written
            return "", ""
        elif not self.inside:
            return "", text
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end].strip(), body[end + len(CLOSE) :].lstrip()
        if final:
            return body.strip(), ""
        return body[: len(body) - partial_marker(body, [CLOSE])].strip(), ""
