"""Shared plumbing of the measuring tools (``compare``, ``bench``, ``inspect``): bundled data, JSON
output, plots, the stderr progress line and the artifact summary every report starts with.

Nothing here measures anything; the tools stay thin layers over the public APIs.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

DATA_DIR = Path(__file__).resolve().parent / "data"


class PlotError(ValueError):
    """``--plot`` was asked but matplotlib is not installed."""


def data_file(name: str) -> Path:
    """A file bundled under ``kvforge/tools/data`` (package data)."""
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"bundled data file {name} is missing from {DATA_DIR}; reinstall kvforge")
    return path


def read_user_file(path: str | Path, what: str) -> str:
    """The text of a file the user named, or a one-line error that says which option it came from."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what} {str(file)!r} does not exist or is not a file")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {str(file)!r} is not UTF-8 text ({e})") from e


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by ``None``, recursively, so the
    JSON is strict (``json.dumps(allow_nan=False)``); the schemas document such values as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")
    return out


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on demand."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError("--plot needs matplotlib: pip install 'kvforge[plot]' (or drop --plot)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, one line per update otherwise
    (CI logs). ``Progress(total=0)`` prints stage messages only."""

    def __init__(self, label: str, total: int = 0, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def say(self, message: str) -> None:
        if self.enabled:
            self._end_line()
            print(f"[{self.label}] {message}", file=self.stream, flush=True)

    def advance(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (width - filled)
        line = f"[{self.label}] [{bar}] {self.done}/{self.total} {what}"
        if self.tty:
            print(f"\r{line:<100}", end="", file=self.stream, flush=True)
            if self.done >= self.total:
                print(file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self.tty and 0 < self.done < self.total:
            print(file=self.stream, flush=True)


def save_figure(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG (parents created) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def artifact_summary(path: str | Path, manifest) -> dict[str, Any]:
    """The ``artifact`` object of every report (see docs/tools.md)."""
    m = manifest.model
    return {
        "path": str(path),
        "architecture": m.architecture,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        "dtype": manifest.dtype,
        "lowering": manifest.lowering,
        "max_batch": manifest.limits.max_batch,
        "max_seq": manifest.limits.max_seq,
    }


def describe_artifact(artifact: dict[str, Any]) -> str:
    return (
        f"{artifact['path']} ({artifact['architecture']}, {artifact['num_layers']} layers, "
        f"{artifact['dtype']}, lowering {artifact['lowering']})"
    )


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the duration of a tool's run (None: leave as is); the
    previous count is restored, since it is global to the process."""
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
