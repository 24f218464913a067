"""What a user sees from ``kvforge compile -q``: kvforge's own result line and nothing else.

The real CLI runs in a fresh process (as a user runs it: the libraries' once-per-process warnings
and exit-time messages happen there), int4 so that ORT's quantizer runs too. Its stdout is exactly
one ``compiled ...`` line and its stderr is empty: no transformers loading bar, no ONNX exporter
warning about torchvision, no warnings, no nanobind "leaked" report at exit."""

from __future__ import annotations

import re
import subprocess
import sys


def test_quiet_compile_prints_only_its_result_line(llama_dir, tmp_path):
    out = tmp_path / "art"
    cmd = [sys.executable, "-m", "kvforge.tools.cli", "compile", str(llama_dir), "-o", str(out), "-q"]
    done = subprocess.run(
        [*cmd, "--quantize", "int4", "--max-batch", "1", "--max-seq", "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for noise in ("leaked", "torchvision", "Loading weights", "Warning", "warn", "W1"):
        assert noise not in done.stdout + done.stderr, (noise, done.stdout, done.stderr)
    assert done.stderr == ""
    line = re.escape(f"compiled LlamaForCausalLM -> {out}: parity vs transformers prefill max|diff| ")
    assert re.fullmatch(line + r"\S+, decode \S+, greedy match (True|False)\n", done.stdout), done.stdout
