"""The benchmark suite's entry point (``python -m benchmarks``): its help lists every subcommand;
the merged table reads both peer scripts' reports and states each row as a ratio to kvforge's;
and a real ``--quick`` run (kvforge against transformers on the 4-layer shape, each side in its own
process) writes the JSON, Markdown and plot the README's table comes from, with the thread count,
rounds and KV capacity recorded. No figure is asserted: speed belongs to the run, not the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:  # the scripts import each other as top-level modules
    sys.path.append(str(ROOT / "benchmarks"))  # last, as tests/helpers.load_benchmark does

import common  # noqa: E402


def _suite(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_subcommand():
    from benchmarks.__main__ import FEATURES

    run = _suite("--help")
    assert run.returncode == 0, run.stderr
    for name, (script, _) in FEATURES.items():
        assert f"  {name} " in run.stdout, f"{name} missing from --help"
        assert (ROOT / "benchmarks" / f"{script}.py").is_file(), f"{name}: benchmarks/{script}.py does not exist"
    assert "peers" in run.stdout


def test_a_subcommand_runs_its_script_with_the_arguments_after_it():
    run = _suite("gemm", "--help")
    assert run.returncode == 0, run.stderr
    assert "--decode" in run.stdout  # gemm_ceiling.py's own options


def test_rows_of_both_peer_reports_with_ratios_to_kvforge():
    genai = {
        "config": {"shape": "smollm", "batch": 1},
        "rows": {
            "transformers eager (fp32)": {"ttft_ms": 300.0, "decode_ms_step": 60.0, "rss_peak_bytes": 2**30},
            "kvforge gqa (fp32)": {"ttft_ms": 150.0, "decode_ms_step": 20.0, "rss_peak_bytes": 2**29},
            "genai (fp32)": {"error": "not built"},
        },
    }
    llama = [
        {
            "model_name": "smollm2",
            "tables": {
                "batch 4": {
                    "llama.cpp (Q4_1)": {"ttft_ms": 1911.0, "decode_ms_step": 26.83, "rss_peak_bytes": None},
                    "kvforge int4": {"ttft_ms": 764.0, "decode_ms_step": 16.85, "rss_peak_bytes": 2**28},
                }
            },
        }
    ]
    rows = common.with_ratios(common.peer_rows(genai, "peer_genai") + common.peer_rows(llama, "peer_llamacpp"))
    by_side = {r["side"]: r for r in rows}
    assert set(by_side) == {"transformers eager (fp32)", "kvforge gqa (fp32)", "llama.cpp (Q4_1)", "kvforge int4"}
    assert by_side["transformers eager (fp32)"]["decode_ms_step_vs_kvforge"] == pytest.approx(3.0)
    assert by_side["kvforge gqa (fp32)"]["ttft_ms_vs_kvforge"] == pytest.approx(1.0)
    assert by_side["llama.cpp (Q4_1)"]["batch"] == 4 and by_side["llama.cpp (Q4_1)"]["rss_peak_mib"] is None
    assert by_side["llama.cpp (Q4_1)"]["ttft_ms_vs_kvforge"] == pytest.approx(1911 / 764)
    table = common.markdown(rows, "python -m benchmarks", "2 threads.")
    assert table.startswith("Command: `python -m benchmarks`. 2 threads.")
    assert "| smollm2 | 4 | llama.cpp (Q4_1) | 1911.0 | 26.83 | 2.50 | 1.59 | - |" in table


@pytest.mark.slow
def test_quick_run_writes_the_table_the_readme_quotes(tmp_path):
    out = tmp_path / "results"
    run = _suite("--quick", "--out", str(out), "--work-dir", str(tmp_path / "work"), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "peers.json").read_text())
    assert report["schema"] == "kvforge.bench_suite" and report["settings"]["threads"] == 2
    assert report["settings"]["rounds"] == 1 and report["settings"]["max_seq"] == 512
    assert report["skipped"]["llama.cpp"] == "--quick"
    sides = {r["side"] for r in report["rows"]}
    assert any(s.startswith("kvforge") for s in sides) and any(s.startswith("transformers") for s in sides)
    for row in report["rows"]:
        assert row["model"] == "tiny4" and row["batch"] == 1
        assert row["ttft_ms"] > 0 and row["decode_ms_step"] > 0 and row["decode_ms_step_vs_kvforge"] > 0
    table = (out / "peers.md").read_text()
    assert table.startswith("Command: `python -m benchmarks peers --quick --threads 2`")
    assert "| tiny4 | 1 | kvforge" in table and "step × kvforge's" in table
    assert (out / "peers.png").read_bytes()[:4] == b"\x89PNG"
