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


def _openvino_report() -> list[dict]:
    """peer_openvino.py's report shape: one per prompt length, rows labelled with their precision."""

    def row(ttft, step, mib, precision, defaults=False, ppl=None):
        r = {"ttft_ms": ttft, "decode_ms_step": step, "rss_peak_bytes": mib * 2**20, "precision": precision}
        return {**r, "defaults": defaults, "perplexity": ppl}

    return [
        {
            "model_name": "smollm2",
            "tables": {
                "batch 1": {
                    "kvforge (int4)": row(160.0, 8.0, 260, "int4", ppl=10.99),
                    "OpenVINO GenAI (int4), f32 execution and KV": row(80.0, 12.0, 380, "int4", ppl=10.26),
                    "OpenVINO GenAI (int4), its defaults (bf16 execution, u8 KV)": row(
                        40.0, 10.0, 400, "int4", defaults=True, ppl=10.30
                    ),
                    "kvforge (fp32)": row(150.0, 20.0, 660, "fp32"),
                    "OpenVINO GenAI (fp32), f32 execution and KV": row(300.0, 30.0, 1200, "fp32"),
                }
            },
        },
        {
            "model_name": "smollm2, prompt 1024",
            "tables": {
                "batch 1": {
                    "kvforge (int4)": row(1000.0, 9.0, 300, "int4"),
                    "OpenVINO GenAI (int4), f32 execution and KV": row(500.0, 13.0, 420, "int4"),
                }
            },
        },
    ]


def test_openvino_rows_are_compared_with_kvforge_of_their_own_precision():
    rows = common.with_ratios(common.peer_rows(_openvino_report(), "peer_openvino"))
    by = {(r["model"], r["side"]): r for r in rows}
    ov_int4 = by["smollm2", "OpenVINO GenAI (int4), f32 execution and KV"]
    assert ov_int4["ttft_ms_vs_kvforge"] == pytest.approx(0.5)  # against kvforge (int4), not the first row
    assert ov_int4["decode_ms_step_vs_kvforge"] == pytest.approx(1.5)
    ov_fp32 = by["smollm2", "OpenVINO GenAI (fp32), f32 execution and KV"]
    assert ov_fp32["ttft_ms_vs_kvforge"] == pytest.approx(2.0) and ov_fp32["decode_ms_step_vs_kvforge"] == 1.5
    assert by["smollm2", "kvforge (fp32)"]["ttft_ms_vs_kvforge"] == pytest.approx(1.0)
    long = by["smollm2, prompt 1024", "OpenVINO GenAI (int4), f32 execution and KV"]
    assert long["ttft_ms_vs_kvforge"] == pytest.approx(0.5) and long["batch"] == 1
    assert ov_int4["precision"] == "int4" and not ov_int4.get("defaults") and ov_int4["perplexity"] == 10.26
    assert "perplexity" not in by["smollm2", "kvforge (fp32)"]  # None is not carried


def test_openvino_defaults_rows_are_marked_and_perplexity_gets_its_own_table():
    rows = common.with_ratios(common.peer_rows(_openvino_report(), "peer_openvino"))
    table = common.markdown(rows, "python -m benchmarks", "2 threads.")
    defaults = "OpenVINO GenAI (int4), its defaults (bf16 execution, u8 KV)"
    assert f"| smollm2 | 1 | {defaults} ¹ | 40.0 | 10.00 | 0.25 | 1.25 | 400 |" in table
    assert "| smollm2 | 1 | OpenVINO GenAI (int4), f32 execution and KV | 80.0 | 12.00 | 0.50 | 1.50 | 380 |" in table
    assert "¹ the peer's own defaults (its precision choices, not kvforge's arithmetic): never the headline." in table
    assert "| smollm2 | kvforge (int4) | 10.990 |" in table
    assert "| smollm2 | OpenVINO GenAI (int4), f32 execution and KV | 10.260 |" in table
    # a table without defaults rows or perplexities keeps its old form
    plain = common.markdown([r for r in rows if r["side"] == "kvforge (fp32)"], "c", "s")
    assert "¹" not in plain and "perplexity" not in plain


def test_openvino_peer_plan_pins_its_venv_and_matches_kvforge_capacity():
    import peer_openvino as ov

    pinned, optimum = ov.install_commands(Path("/v"))
    assert pinned[:5] == ["/v/bin/python", "-m", "pip", "install", "-q"]
    assert all("==" in spec for spec in pinned[5:]) and "torch==2.13.0" in pinned
    assert not any(spec.startswith(("optimum-intel", "torchvision")) for spec in pinned)
    assert optimum[-2:] == ["--no-deps", "optimum-intel==2.2.0"]  # its unpinned torch would pull a CUDA torch
    assert set(ov.wanted_versions()) == set(ov.OV_DISTS)
    assert ov.max_seq_for(128, 64, 512) == 512 and ov.max_seq_for(1024, 64, 512) == 2048
    assert ov.max_seq_for(448, 64, 512) == 512 and ov.max_seq_for(449, 64, 512) == 1024
    probe = {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8"}
    assert ov.defaults_label("int4", probe) == "OpenVINO GenAI (int4), its defaults (bf16 execution, u8 KV)"
    assert ov.matched_label("fp32") == "OpenVINO GenAI (fp32), f32 execution and KV"
    assert ov.MATCHED == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    assert ov._ov_properties({"threads": 2, "hints": ov.MATCHED}) == {"INFERENCE_NUM_THREADS": 2, **ov.MATCHED}
    assert ov.EXPORT_FLAGS["int4"] == ["--weight-format", "int4", "--sym", "--group-size", "32", "--ratio", "1.0"]
    # kvforge's OpenVINO-prefill rows: the ORT row always runs first, the reference of their ratios
    assert ov.kvforge_prefills(["openvino:bf16", "ort", "openvino:bf16"]) == ["ort", "openvino:bf16"]
    assert ov.kvforge_label("int4", "ort") == "kvforge (int4)"
    assert ov.kvforge_label("fp32", "openvino:bf16") == "kvforge (fp32), prefill=openvino:bf16"


def test_the_suite_runs_openvino_on_smollm2_only_when_quick(tmp_path):
    import argparse

    from benchmarks.__main__ import openvino_args

    quick = argparse.Namespace(threads=2, max_seq=512, batch=[1, 4], quick=True, work_dir=None)
    cmd = openvino_args(quick, 1, tmp_path / "openvino.json")
    assert cmd[cmd.index("--model") + 1 :][:2] == ["smollm2", "--new-tokens"]
    assert cmd[cmd.index("--prompt-lens") + 1 : cmd.index("--prompt-lens") + 3] == ["128", "1024"]
    assert cmd[cmd.index("--rounds") + 1] == "1" and cmd[cmd.index("--threads") + 1] == "2"
    full = openvino_args(argparse.Namespace(**{**vars(quick), "quick": False}), 3, tmp_path / "o.json")
    assert full[full.index("--model") + 1 :] == ["smollm2", "large"]
    run = _suite("peers", "--help")
    assert "--openvino" in run.stdout and "--no-openvino" in run.stdout


@pytest.mark.real_model
def test_openvino_peer_runs_smollm2_beside_kvforge(tmp_path):
    """The real thing, opt-in (`-m real_model`): SmolLM2 exported by optimum-intel and run by
    LLMPipeline beside kvforge. Needs `make smollm2` and the OpenVINO venv (the script makes it)."""
    import peer_llamacpp
    import peer_openvino as ov

    if not (peer_llamacpp.SMOLLM2_HF / "config.json").exists():
        pytest.skip("SmolLM2 is not there: run `make smollm2`")
    venv = common.PEERS_CACHE / "openvino-venv"
    if ov.installed_versions(venv / "bin" / "python") != ov.wanted_versions():
        pytest.skip(f"no OpenVINO venv at {venv}: `python benchmarks/peer_openvino.py` makes it (minutes)")
    report = tmp_path / "openvino.json"
    args = ["--model", "smollm2", "--rounds", "1", "--new-tokens", "4", "--prompt-lens", "32", "--batches", "1"]
    args += ["--ppl-tokens", "1024", "--json", str(report)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peer_openvino.py"), *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [rep] = json.loads(report.read_text())
    assert rep["kv_tokens"] == 4 * 512 and rep["env"]["openvino"] == ov.wanted_versions()
    rows = rep["tables"]["batch 1"]
    matched = rows["OpenVINO GenAI (int4), f32 execution and KV"]
    assert matched["properties"] == {"INFERENCE_NUM_THREADS": 2, **ov.MATCHED}
    assert matched["kv_blocks"] == 4 * 512 // ov.OV_KV_BLOCK and len(matched["tokens"][0]) == 4
    assert any(r["defaults"] for r in rows.values()) and not rows["kvforge (int4)"]["defaults"]
    for label in ("kvforge (int4)", "OpenVINO GenAI (int4), f32 execution and KV"):
        assert 1 < rows[label]["perplexity"] < 100, label  # SmolLM2 on Genesis: about 10-20


def test_prefill_profile_splits_a_prefill_by_op_and_runs_the_lm_head_on_the_last_row(tiny_artifact, tmp_path):
    out = tmp_path / "profile.json"
    run = _suite("prefill-profile", str(tiny_artifact), "--tokens", "16", "48", "--runs", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    reports = json.loads(out.read_text())["reports"]
    assert [r["tokens"] for r in reports] == [16, 48]
    for report in reports:
        ops = {o["op"]: o for o in report["ops"]}
        assert ops["GroupQueryAttention"]["nodes"] == 4  # one a layer of the bundled model (4 layers)
        assert "MatMul" in ops and len(report["wall_ms"]) == 2
        assert sum(o["share"] for o in report["ops"]) == pytest.approx(1.0)
        assert report["lm_head_rows"] == 1  # the logits of the last token only, whatever M is
    assert "| GroupQueryAttention | 4 |" in run.stdout


def test_artifact_ab_times_both_sides_on_the_same_calls_and_refuses_too_many_rows(tiny_artifact, tmp_path):
    out = tmp_path / "ab.json"
    args = ("artifact-ab", str(tiny_artifact), str(tiny_artifact), "--prompt-lens", "16", "--rounds", "2")
    run = _suite(*args, "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "kvforge.artifact_ab" and report["threads"] == 2
    assert [c["case"] for c in report["cases"]] == ["decode b1", "prefill 16"]
    for case in report["cases"]:
        assert case["a_ms"] > 0 and case["b_ms"] > 0 and case["ratio"] == pytest.approx(case["b_ms"] / case["a_ms"])
        assert f"{case['case']}: A {case['a_ms']:.1f} ms, B {case['b_ms']:.1f} ms" in run.stdout
    refused = _suite("artifact-ab", str(tiny_artifact), str(tiny_artifact), "--rows", "99", "--prompt-lens")
    assert refused.returncode != 0 and "< 99 rows; compile with --max-batch" in refused.stderr
