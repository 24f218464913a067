"""Tokenizer and generation defaults: model directory -> artifact directory.

The runtime reads ``tokenizer.json`` with the ``tokenizers`` library alone (no transformers at run
time). A model that ships only a slow tokenizer gets a ``tokenizer.json`` converted by transformers
where it can; a model without any tokenizer compiles too, and its artifact accepts token ids only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def copy_tokenizer(model_dir: Path, out_dir: Path, config: dict) -> dict[str, Any]:
    """Copy the tokenizer and generation config; return the manifest's ``tokenizer`` record."""
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
            copied.append(name)
    if "tokenizer.json" not in copied and _convert_slow_tokenizer(model_dir, out_dir):
        copied.append("tokenizer.json")

    generation = {}
    if (model_dir / "generation_config.json").is_file():
        generation = json.loads((model_dir / "generation_config.json").read_text())
    eos = _ids(generation.get("eos_token_id", config.get("eos_token_id")))
    bos = generation.get("bos_token_id", config.get("bos_token_id"))
    pad = generation.get("pad_token_id", config.get("pad_token_id"))
    return {
        "files": sorted(copied),
        "has_tokenizer": "tokenizer.json" in copied,
        "bos_token_id": bos,
        "eos_token_ids": eos,
        "pad_token_id": pad,
    }


def _convert_slow_tokenizer(model_dir: Path, out_dir: Path) -> bool:
    """Write ``tokenizer.json`` from a slow tokenizer through transformers; False if there is none."""
    if not any((model_dir / f).exists() for f in ("tokenizer.model", "vocab.json", "tokenizer_config.json")):
        return False
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return False
    if not getattr(tok, "is_fast", False):
        return False
    tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    return True
