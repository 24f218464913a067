"""Which tool-call and reasoning format a model writes: tokenizer files in, two parser names out.

Input: the artifact directory's tokenizer files as compile copied them (``chat_template.jinja``,
``tokenizer_config.json``'s ``chat_template``, ``tokenizer.json``'s added tokens). Output: the
manifest's ``tool_parser`` and ``reasoning_parser`` (names of :mod:`kvforge.tools.serve.parsers`,
listed in :data:`kvforge.graphs.manifest.TOOL_PARSERS` / ``REASONING_PARSERS``). Each family's chat
template writes the history's tool calls, and any thinking, in the format the model was trained on,
so the template's own markup says which parser reads the answers:

- ``<|channel|>`` and ``<|message|>`` (gpt-oss): ``harmony`` for both;
- ``<function=`` with ``<parameter=`` (Qwen3-Coder, Qwen3.5): ``qwen3_coder``;
- ``[TOOL_CALLS]`` in the template or among the special tokens (Mistral): ``mistral``;
- ``<|python_tag|>``, or Llama 3's header tokens with a ``"parameters"`` call format: ``llama3_json``;
- otherwise ``hermes`` (``<tool_call>`` JSON blocks: Qwen2.5/3, Hermes, SmolLM3; also the format
  kvforge's server teaches a template that renders no tools);
- ``<think>`` in the template (Qwen3, QwQ, DeepSeek-R1 distills, SmolLM3): reasoning ``think``.

``kvforge serve --tool-parser/--reasoning-parser`` override the choice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def detect(template: str | None, tokens: Iterable[str] = ()) -> tuple[str, str | None]:
    """(tool_parser, reasoning_parser) for a chat template's text and the tokenizer's added tokens."""
    text = template or ""
    tokens = set(tokens)
    if ("<|channel|>" in text and "<|message|>" in text) or {"<|channel|>", "<|message|>"} <= tokens:
        return "harmony", "harmony"
    if "<function=" in text and "<parameter=" in text:
        tool = "qwen3_coder"
    elif "[TOOL_CALLS]" in text or "[TOOL_CALLS]" in tokens:
        tool = "mistral"
    elif "<|python_tag|>" in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        tool = "llama3_json"
    else:
        tool = "hermes"
    return tool, "think" if "<think>" in text else None


def detect_artifact(directory: Path) -> tuple[str, str | None]:
    """:func:`detect` over the tokenizer files in ``directory`` (every named template of a list)."""
    directory = Path(directory)
    texts = []
    if (directory / "chat_template.jinja").is_file():
        texts.append((directory / "chat_template.jinja").read_text(encoding="utf-8"))
    config = _json(directory / "tokenizer_config.json")
    source = config.get("chat_template")
    if isinstance(source, str):
        texts.append(source)
    elif isinstance(source, list):
        texts.extend(t.get("template", "") for t in source if isinstance(t, dict))
    tokens = [t.get("content", "") for t in _json(directory / "tokenizer.json").get("added_tokens", [])]
    tokens += [t for t in config.get("additional_special_tokens", []) if isinstance(t, str)]
    return detect("\n".join(t for t in texts if isinstance(t, str)), tokens)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
