"""What a user sees from ``kvforge compile -q``: kvforge's own result line and nothing else.

The ``kvforge`` command's entry point runs in a fresh process (as a user runs it: the libraries'
once-per-process warnings and exit-time messages happen there), int4 so that ORT's quantizer runs
too. Its stdout is exactly one ``compiled ...`` line and its stderr is empty: no transformers
loading bar, no ONNX exporter warning about torchvision, no warnings. A successful compile ends the
process without the interpreter's teardown (an ``atexit`` hook registered before it never runs),
which is where extension libraries print leak reports at exit (triton's nanobind bindings, where a
CUDA build of torch brings triton: "nanobind: leaked ... instances")."""

from __future__ import annotations

import re
import subprocess
import sys

ENTRY_WITH_A_TEARDOWN_HOOK = (
    "import atexit, sys; atexit.register(lambda: print('interpreter teardown ran', file=sys.stderr)); "
    "from kvforge.tools.cli import entry; entry()"
)


def test_quiet_compile_prints_only_its_result_line(llama_dir, tmp_path):
    out = tmp_path / "art"
    args = ["compile", str(llama_dir), "-o", str(out), "-q", "--quantize", "int4", "--max-batch", "1"]
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_WITH_A_TEARDOWN_HOOK, *args, "--max-seq", "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for noise in ("leaked", "torchvision", "Loading weights", "Warning", "warn", "W1", "teardown"):
        assert noise not in done.stdout + done.stderr, (noise, done.stdout, done.stderr)
    assert done.stderr == ""
    line = re.escape(f"compiled LlamaForCausalLM -> {out}: parity vs transformers prefill max|diff| ")
    assert re.fullmatch(line + r"\S+, decode \S+, greedy match (True|False)\n", done.stdout), done.stdout
    assert (out / "manifest.json").is_file()


def test_other_failures_and_commands_exit_normally(tmp_path):
    """A failed compile is an error line and status 2, through the interpreter's normal exit."""
    args = ["compile", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_WITH_A_TEARDOWN_HOOK, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("kvforge: error: model directory") and "does not exist" in done.stderr
    assert done.stderr.endswith("interpreter teardown ran\n")


NOISE = ("Loading weights", "it/s]", "\r", "torchvision", "Warning", "leaked")


def _kvforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvforge.tools.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_compare_and_bench_print_their_own_lines_only(llama_artifact, llama_dir):
    """``compare`` and ``bench`` load transformers' reference too: what they print is their report
    (stdout) and their own ``[compare]``/``[bench]`` progress lines (stderr), never a library's
    loading bar or warning."""
    compare = _kvforge("compare", str(llama_artifact), "--reference", str(llama_dir), "--steps", "4")
    bench = _kvforge(
        "bench", str(llama_artifact), "--reference", str(llama_dir), "--prompt-lens", "8", "--batch-sizes", "1",
        "--new-tokens", "4", "--repeat", "1", "--warmup", "0",
    )  # fmt: skip
    for done, tool in ((compare, "compare"), (bench, "bench")):
        assert done.returncode == 0, done.stderr
        for noise in NOISE:
            assert noise not in done.stdout + done.stderr, (tool, noise, done.stdout, done.stderr)
        progress = [line for line in done.stderr.splitlines() if line]
        assert progress and all(line.startswith(f"[{tool}] ") for line in progress), (tool, done.stderr)
    assert "greedy" in compare.stdout and "ms" in bench.stdout


def test_serve_start_up_lines(llama_artifact):
    """``kvforge serve``'s output, start-up to drain: one layout, uvicorn's (``INFO:     ...``), for
    uvicorn's lines and kvforge's own (``WARNING:  [kvforge] draining: ...``); no loading bar, no
    library warning."""
    from tests.tools.test_serve import free_port, start_cli_server

    port = free_port()
    proc = start_cli_server([str(llama_artifact)], port)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line]
    for noise in NOISE:
        assert noise not in out, (noise, out)
    assert any(f"127.0.0.1:{port}" in line for line in lines), out
    assert not [line for line in lines if not re.match(r"(INFO|WARNING): +\S", line)], out
    assert "WARNING:  [kvforge] draining: 0 sequences in flight; new requests get 503" in lines, out
