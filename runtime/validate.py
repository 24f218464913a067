"""Strict checks of what a user passes to the public API: token ids, prompts, counts.

Every check either returns the value in its canonical form (``int``, ``list[int]``, ``str``) or
raises before anything runs, with a message that names the parameter, the value received (a
truncated ``repr``) and what is accepted:

    max_new_tokens=2.5 is not accepted: max_new_tokens must be a positive integer (int or numpy integer)

Errors. A wrong *type* raises :class:`WrongType`, a wrong *value* :class:`InvalidValue`. Both are
``ValueError`` subclasses (kvforge's convention: every user-facing error is a ValueError, which the
CLI prints as one line and the server answers with 400); :class:`WrongType` is also a ``TypeError``,
as Python's own type errors are, so ``except TypeError`` catches it as well.

Accepted. Token ids: ``int`` or numpy integer scalars; ``bool`` (an ``int`` subclass), floats
(even ``2.0``), strings and ``None`` are refused. An id sequence: a ``list``/``tuple``/``range`` or
any ``Sequence`` of ids, or a 1-D numpy array of an integer dtype; ``str``, ``bytes`` and
``bytearray`` are refused (they are sequences, but of characters and bytes, not ids). A prompt: a
``str`` or an id sequence. A batch of prompts: a sequence of prompts, never a single string.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence

import numpy as np

REPR_LIMIT = 60  # characters of a received value shown in a message


class WrongType(TypeError, ValueError):
    """A parameter of the wrong type (also a ValueError: kvforge's user-facing error class)."""


class InvalidValue(ValueError):
    """A parameter of the right type with a value outside what is accepted."""


def short_repr(value: object, limit: int = REPR_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` (a 10 000-token prompt stays readable)."""
    try:
        text = repr(value)
    except Exception:  # a user object whose __repr__ fails must not hide the real error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse(cls: type[ValueError], name: str, value: object, accepted: str) -> ValueError:
    return cls(f"{name}={short_repr(value)} is not accepted: {name} must be {accepted}")


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(name: str, value: object, *, minimum: int = 1) -> int:
    """An integer count ``>= minimum`` (Python or numpy int), as an ``int``. Refuses bools, floats
    (``2.5`` and ``2.0``), strings and None."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if not is_int(value):
        raise _refuse(WrongType, name, value, f"{what} (int or numpy integer)")
    if int(value) < minimum:
        raise _refuse(InvalidValue, name, value, what)
    return int(value)


def cache_points(value: object, prompt_length: int) -> tuple[int, ...]:
    """Prompt positions (a sequence of ints, each ``1 <= p < prompt_length``) as a sorted tuple
    without repeats."""
    accepted = f"a list of prompt positions, each an integer from 1 to {prompt_length - 1} (the prompt's length - 1)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _refuse(WrongType, "cache_points", value, accepted)
    if not all(is_int(p) and 1 <= int(p) < prompt_length for p in value):
        raise _refuse(InvalidValue, "cache_points", value, accepted)
    return tuple(sorted({int(p) for p in value}))


def integer(name: str, value: object) -> int:
    """A Python or numpy int (any value; the caller checks the range), as an ``int``."""
    if not is_int(value):
        raise _refuse(WrongType, name, value, "an integer (int or numpy integer; bools and floats are refused)")
    return int(value)


def flag(name: str, value: object) -> bool:
    """``True`` or ``False`` (not 0/1, not a numpy bool)."""
    if not isinstance(value, bool):
        raise _refuse(WrongType, name, value, "True or False")
    return value


def path(name: str, value: object, what: str = "a path") -> str | os.PathLike:
    """A ``str`` or ``os.PathLike`` (``what``: what the path is, for the message)."""
    if not isinstance(value, (str, os.PathLike)):
        raise _refuse(WrongType, name, value, f"a str or a path: {what}")
    return value


def optional_count(name: str, value: object, *, minimum: int = 1) -> int | None:
    """:func:`count`, or None."""
    return None if value is None else count(name, value, minimum=minimum)


def real(name: str, value: object, accepted: str) -> float:
    """A finite real number (int or float, numpy included; not a bool), as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise _refuse(WrongType, name, value, accepted)
    try:
        out = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        raise _refuse(InvalidValue, name, value, accepted) from None
    if out != out or out in (float("inf"), float("-inf")):
        raise _refuse(InvalidValue, name, value, accepted)
    return out


def _is_id_sequence(value: object) -> bool:
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return False
    if isinstance(value, np.ndarray):
        return True
    return isinstance(value, Sequence)


def token_ids(name: str, value: object, *, vocab_size: int | None = None, rule: str | None = None) -> list[int]:
    """A sequence of token ids as ``list[int]`` (possibly empty: callers that need a token say so).

    ``vocab_size``: when given, every id must lie in ``[0, vocab_size)``. ``rule``: the sentence
    the message gives for what is accepted (default: "NAME must be a list of token ids ...")."""
    rule = rule or f"{name} must be a list of token ids (Python or numpy ints)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise WrongType(
            f"{name}={short_repr(value)} is not accepted: {rule}; bytes are not token ids "
            "(decode them to a str for text, or pass list(...) of ids)"
        )
    if not _is_id_sequence(value):
        raise WrongType(f"{name}={short_repr(value)} ({type(value).__name__}) is not accepted: {rule}")
    if type(value) is list and all(type(t) is int for t in value):  # the common case, checked fast
        ids = list(value)
    elif isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise WrongType(
                f"{name}=<array of dtype {value.dtype}, ndim {value.ndim}> is not accepted: {rule} "
                "(a 1-D integer array is accepted)"
            )
        ids = [int(t) for t in value]
    else:
        ids = []
        for i, t in enumerate(value):
            if not is_int(t):
                raise WrongType(
                    f"{name}[{i}]={short_repr(t)} ({type(t).__name__}) is not accepted: {rule}; "
                    "bools, floats, strings, nested lists and None are refused as ids"
                )
            ids.append(int(t))
    if vocab_size is not None and ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidValue(f"{name}[{i}]={short_repr(t)} is outside the vocabulary [0, {vocab_size})")
    return ids


PROMPT_RULE = "a prompt is a string or a list of token ids (Python or numpy ints)"


def prompt(name: str, value: object) -> str | list[int]:
    """A prompt: a ``str`` as it is, or an id sequence as ``list[int]``."""
    if isinstance(value, str):
        return value
    return token_ids(name, value, rule=PROMPT_RULE)


def prompt_batch(name: str, value: object) -> list[str | list[int]]:
    """A non-empty sequence of prompts (each a ``str`` or an id sequence). A single string is refused
    (it would otherwise be read as a batch of one-character prompts)."""
    accepted = "a list of prompts (each a str or a list of token ids)"
    if isinstance(value, str):
        raise WrongType(
            f"{name}={short_repr(value)} is not accepted: {name} must be {accepted}, not one string; "
            f"wrap it: [{short_repr(value, 30)}]"
        )
    if not _is_id_sequence(value):
        raise _refuse(WrongType, name, value, accepted)
    if len(value) == 0:
        raise _refuse(InvalidValue, name, value, f"{accepted}, with at least one")
    if isinstance(value, np.ndarray) and value.ndim == 1:
        raise _refuse(WrongType, name, value, f"{accepted}; a 1-D array is one prompt: wrap it in a list")
    return [prompt(f"{name}[{i}]", p) for i, p in enumerate(value)]


def id_rows(name: str, value: object) -> list[list[int]]:
    """A non-empty batch of id rows (the step API's ``rows``): ``list[list[int]]``."""
    accepted = "a list of token-id lists, one per row"
    if isinstance(value, str) or not _is_id_sequence(value):
        raise _refuse(WrongType, name, value, accepted)
    if isinstance(value, np.ndarray) and value.ndim != 2:
        raise _refuse(WrongType, name, value, f"{accepted} (a 2-D integer array is accepted too)")
    rows = list(value)
    if rows and all(is_int(r) for r in rows):
        raise _refuse(WrongType, name, value, f"{accepted}; this is one row: wrap it in a list")
    return [token_ids(f"{name}[{i}]", r) for i, r in enumerate(rows)]
