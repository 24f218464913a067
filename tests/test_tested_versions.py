"""The key dependencies installed are the versions the suite was last run with (``constraints.txt``,
written by ``make lock``; torch from its header), so a run on an untested transformers, onnxruntime,
torch, onnx or onnxscript fails here first, naming the package and both versions, instead of deep
inside a compile test. ``make test-latest`` installs the newest versions pyproject's ranges allow and
so fails here exactly when one of them moved; ``make lock`` after a green run adopts them. Also: the
lock covers every package kvforge's requirements reach (``scripts/lock.py --check``)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
KEY = ("transformers", "onnxruntime", "torch", "onnx", "onnxscript")


def lock_versions(text: str) -> dict[str, str]:
    """``{name: version}`` from the lock's pins and its ``tested torch==X`` header line."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE))
    torch = re.search(r"tested torch==(\S+)", text)
    if torch:
        pins["torch"] = torch.group(1)
    return pins


def untested(installed: dict[str, str], tested: dict[str, str]) -> list[str]:
    """One line per key package whose installed version is not the tested one (local build labels
    such as ``+cpu`` or ``+cu130`` ignored: they are the same release)."""
    lines = []
    for name in KEY:
        want, have = tested.get(name), installed.get(name)
        if want is None:
            lines.append(f"{name}: not in {LOCK.name}; run `make lock` after a green `make test`")
        elif have is None:
            lines.append(f"{name}: not installed (tested {want}); run `make setup`")
        elif Version(have).public != Version(want).public:
            lines.append(f"untested version {name} {have} (the suite passed on {want})")
    return lines


def test_installed_key_packages_are_the_tested_ones():
    installed = {}
    for name in KEY:
        for dist in (name, f"{name}-gpu"):  # the [gpu] extra's onnxruntime-gpu is the same module
            try:
                installed[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    problems = untested(installed, lock_versions(LOCK.read_text()))
    assert not problems, (
        "\n".join(problems) + f"\n{LOCK.name} lists the versions `make setup` installs. If this run is "
        "`make test-latest`, the lines above are the drift: fix what fails, then `make lock`."
    )


def test_untested_versions_are_named_with_both_versions():
    tested = lock_versions("# tested torch==2.13.0+cpu (installed\nonnx==1.23.2\ntransformers==5.25.0\n")
    installed = {"torch": "2.13.0+cu130", "onnx": "1.23.2", "transformers": "5.26.0"}
    assert untested(installed, tested) == [
        "untested version transformers 5.26.0 (the suite passed on 5.25.0)",
        "onnxruntime: not in constraints.txt; run `make lock` after a green `make test`",
        "onnxscript: not in constraints.txt; run `make lock` after a green `make test`",
    ]


def _gpu_build() -> bool:
    try:
        return bool(metadata.version("onnxruntime-gpu"))
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(Path(sys.prefix) != ROOT / ".venv" or _gpu_build(), reason="not `make setup`'s CPU venv")
def test_the_lock_is_this_environment():
    run = subprocess.run([sys.executable, ROOT / "scripts" / "lock.py", "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr + "\nrun `make lock` (after a green `make test`)"
