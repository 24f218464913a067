"""Structured output: a per-request grammar that masks each step's logits (llguidance).

Input: one request's constraint, the one of ``SamplingParams.json_schema`` (a JSON Schema, dict or
JSON text), ``regex`` (the whole output matches it), ``grammar`` (a Lark grammar as llguidance reads
it: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md) or ``json_object=True`` (any
JSON object). Output: per step, a bitmask of the allowed next tokens (``int32[ceil(V/32)]``, bit
``t & 31`` of word ``t >> 5`` set when token ``t`` is allowed) and the logits row with the others at
``-inf``; after each token, whether the grammar is terminated (it accepts and allows nothing more).

Why llguidance (benchmarks/FINDINGS.md, "Why llguidance"; SmolLM2's 49,152-token vocabulary): it
requires no other package (xgrammar requires torch, transformers and triton: the runtime imports
neither torch nor transformers), builds its tokenizer state from ``tokenizer.json`` text alone,
compiles a schema in ~2 ms (xgrammar ~40 ms, paid per request), and its mask (p50 ~0.02 ms, p99 ~0.4
ms) is a small fraction of a decode step.

Order in a step (vLLM v1's): the mask is applied to the raw logits first, then the sampler's
penalties, temperature, top-k, top-p, min-p and draw (:mod:`kvforge.runtime.sampling`); logprobs
are those of the masked row, as vLLM's are. A constrained row is never "plain greedy": the batch's
shared argmax does not pick for it.

Ownership: :class:`GrammarFactory` (one per engine) holds the llguidance tokenizer, built once on
first use from the artifact's ``tokenizer.json``; each :class:`GrammarConstraint` owns its matcher,
its bitmask and two scratch rows allocated at construction, so a step allocates nothing.
Unconstrained requests never touch this module. llguidance is the ``structured`` extra: without it,
a constrained request is refused with an ImportError naming the extra.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

EXTRA_HINT = "pip install 'kvforge[structured]' (or: pip install llguidance)"
KINDS = ("json_schema", "regex", "grammar", "json_object")
# Row b of _PENALTY: the 8 additive penalties (0 allowed, -inf forbidden) of a mask byte b, bit j being token 8k + j.
_PENALTY = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)
# Whitespace between JSON tokens: none, one space, or a newline and up to 20 spaces/tabs (llama.cpp's
# JSON grammars bound it alike). Compact and pretty-printed JSON pass; unbounded runs would let a weak
# model spend its whole budget on blanks. A schema's "x-guidance" options override it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(
            f"structured output (json_schema, regex, grammar, json_object) needs llguidance: {EXTRA_HINT}"
        ) from e
    return llguidance


def check_field(name: str, value: Any) -> Any:
    """The type check of one constraint field of SamplingParams (no llguidance needed); returns the
    value to keep (a JSON-text schema parsed into a dict)."""
    if name == "json_object":
        if not isinstance(value, bool):
            raise ValueError(f"json_object={value!r} is not accepted: json_object must be true or false")
        return value
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON ({e}); pass a JSON Schema object") from e
        if not isinstance(value, (Mapping, bool)):
            raise ValueError(
                f"json_schema must be a JSON Schema (a dict, or its JSON text), got {type(value).__name__}"
            )
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def grammar_text(kind: str, value: Any) -> str:
    """The llguidance grammar (its JSON form) of one constraint."""
    llg = _llguidance()
    options = {"whitespace_pattern": JSON_WHITESPACE}
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=options)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    return llg.LLMatcher.grammar_from_lark(value)


def compile_checked(kind: str, value: Any) -> str:
    """``grammar_text`` checked by llguidance: a ValueError naming the field and llguidance's
    message (with the position of the error) when the schema, regex or grammar is invalid.
    Cached: SamplingParams checks it, ``resolve`` copies it and the engine compiles it."""
    # The key keeps the schema's key order: llguidance writes properties in the order the schema lists them.
    return _compile_checked(kind, json.dumps(value) if kind == "json_schema" else value)


@lru_cache(maxsize=64)
def _compile_checked(kind: str, value: Any) -> str:
    llg = _llguidance()
    try:
        text = grammar_text(kind, json.loads(value) if kind == "json_schema" else value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{kind} is not accepted: {e}") from e
    error = llg.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"{kind} is not accepted: {error.strip()}")
    return text


class GrammarFactory:
    """One engine's grammar state: the llguidance tokenizer of ``tokenizer.json`` for logits rows of
    ``vocab_size`` (built once, on first use, ~0.3 s at 49k tokens) and the eos ids that end a
    finished grammar. Thread-safe: requests are made on any thread."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                if self.tokenizer_json is None:
                    raise ValueError(
                        "structured output needs the artifact's tokenizer (tokenizer.json); this artifact has none"
                    )
                llg = _llguidance()
                text = Path(self.tokenizer_json).read_text(encoding="utf-8")
                self._tok = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._tok

    def warm(self) -> threading.Thread | None:
        """Build the tokenizer on a daemon thread now (a server calls this at start-up, so that its
        first constrained request does not spend ~0.3 s of its event loop on it); None when there
        is nothing to build (no tokenizer.json, or llguidance is not installed)."""
        if self.tokenizer_json is None:
            return None
        try:
            _llguidance()
        except ImportError:
            return None

        def build() -> None:
            with contextlib.suppress(Exception):  # a broken tokenizer.json is reported by the request that needs it
                self.tokenizer()

        thread = threading.Thread(target=build, name="kvforge-grammar-warm", daemon=True)
        thread.start()
        return thread

    def new(self, kind: str, value: Any) -> GrammarConstraint:
        """A fresh constraint for one request (raises ValueError for an invalid one)."""
        text = compile_checked(kind, value)
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{kind} is not accepted: {matcher.get_error()}")
        return GrammarConstraint(matcher, self.vocab_size)


class GrammarConstraint:
    """One request's grammar state (the shape of vLLM's ``StructuredOutputGrammar``).

    ``accept(tokens)`` advances it, ``fill_mask()`` computes the allowed next tokens into
    ``bitmask``, ``mask(logits)`` returns the logits row with the others at ``-inf`` (a scratch row
    this object owns, valid until the next call), ``rollback(n)`` undoes the last ``n`` accepted
    tokens (speculative decoding), ``validate(tokens)`` counts how many of ``tokens`` it would
    accept in a row without advancing, ``is_terminated`` says the grammar is complete and allows
    nothing more. Not thread-safe: one batch loop drives it.
    """

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = V = int(vocab_size)
        words = (V + 31) // 32
        self.bitmask = np.zeros(words, dtype=np.int32)  # (ceil(V/32),) filled by fill_mask
        self._bytes = self.bitmask.view(np.uint8)  # little-endian words: byte k holds tokens 8k..8k+7
        self._penalty = np.empty((words * 4, 8), dtype=np.float32)  # 0 or -inf per token
        self._row = np.empty(V, dtype=np.float32)
        self.accepted = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar accepts what it has and allows no further token (only eos)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's message when the constraint is broken, else ``""``."""
        return self._m.get_error()

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens``; False (and the constraint is broken) when one is not allowed."""
        ok = self._m.consume_tokens([int(t) for t in tokens])
        if ok:
            self.accepted += len(tokens)
        return ok

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar accepts now (nothing is advanced)."""
        return self._m.validate_tokens([int(t) for t in tokens])

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n < 0 or n > self.accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.accepted} accepted")
        if n and not self._m.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._m.get_error()}")
        self.accepted -= n

    def fill_mask(self) -> np.ndarray:
        """The allowed next tokens into :attr:`bitmask` (returned)."""
        self._m.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        if self._m.is_error():
            raise RuntimeError(f"the output's grammar failed: {self._m.get_error()}")
        return self.bitmask

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` ``[V]`` (read only) with every token the grammar forbids now at ``-inf``, in
        this constraint's scratch row (valid until the next call)."""
        self.fill_mask()
        if not self.bitmask.any():
            raise RuntimeError(
                "the output's grammar allows no token of the model's vocabulary here (is the eos token missing?)"
            )
        # A table lookup and an add, no branch per token: ~10x faster than a masked copy of a half-allowed row.
        np.take(_PENALTY, self._bytes, axis=0, out=self._penalty)
        np.add(logits, self._penalty.reshape(-1)[: self.vocab_size], out=self._row, casting="same_kind")
        return self._row
