"""benchmarks/peer_llamacpp.py's report (no peer runs): every row's TTFT and ms/step as a ratio to
llama.cpp's, a failed side as one line with its error, `uptime` before and after, and the
perplexity of each row (the GGUF-blocks row included) looked up in benchmarks/quality.py's JSON."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import load_benchmark


def _peers():
    return load_benchmark("peer_llamacpp")


def _row(ttft: float, step: float, **extra) -> dict:
    return {
        "ttft_ms": ttft,
        "decode_ms_step": step,
        "decode_tokens_per_s": 1e3 / step,
        "rss_peak_bytes": 2**28,
        **extra,
    }


def test_report_gives_ratios_to_llamacpp_uptime_and_failures():
    peers = _peers()
    report = {
        "model": "m",
        "config": {"prompt_len": 128, "new_tokens": 64, "threads": 2, "max_seq": 512, "rounds": 2, "repeat": 1},
        "env": {"llama_cpp_python": "0.3.36", "onnxruntime": "1.32.0", "onnxruntime-genai": "0.18.0", "commit": "c"},
        "uptime_before": "up 1:00, load average: 0.50, 0.40, 0.30",
        "uptime_after": "up 1:10, load average: 1.50, 1.40, 1.30",
        "tables": {
            "batch 1": {
                "llama.cpp (Q4_1 GGUF)": _row(400.0, 8.0, perplexity=13.26),
                "kvforge (GGUF blocks)": _row(200.0, 2.0, perplexity=13.4, agreement="5/8", agreement_vs="x"),
                "onnxruntime-genai (fp32)": {"error": "onnxruntime-genai builder failed (exit 1)\nlog tail"},
            }
        },
    }
    lines = peers.format_report(report).splitlines()
    assert "uptime before: up 1:00, load average: 0.50, 0.40, 0.30" in lines
    assert "uptime after:  up 1:10, load average: 1.50, 1.40, 1.30" in lines
    [gguf] = [line for line in lines if line.startswith("kvforge (GGUF blocks)")]
    assert "x0.50 x0.25" in gguf and "13.40" in gguf and "5/8 vs x" in gguf
    [llama] = [line for line in lines if line.startswith("llama.cpp")]
    assert " x" not in llama.split("13.26")[1]  # no ratio to itself
    [failed] = [line for line in lines if line.startswith("onnxruntime-genai (fp32)")]
    assert failed.endswith("failed: onnxruntime-genai builder failed (exit 1)")


def test_perplexity_rows_map_to_quality_json():
    peers = _peers()
    quality = {
        "rows": {"kvforge GGUF blocks (compile file.gguf)": {"perplexity": 13.4}, "kvforge fp32": {"perplexity": 13.2}}
    }
    assert peers._perplexity_of(quality, "kvforge (GGUF blocks)") == 13.4
    assert peers._perplexity_of(quality, "kvforge (fp32)") == 13.2
    assert peers._perplexity_of(quality, "onnxruntime-genai (int4)") is None
    assert peers._perplexity_of(None, "kvforge (fp32)") is None


def test_a_hybrid_shape_gets_llamacpp_and_kvforge_rows_of_each_precision(tmp_path, monkeypatch):
    import argparse

    peers = _peers()
    built, converted = [], []
    monkeypatch.setattr(
        peers,
        "ensure_built",
        lambda model, work, python, threads: (
            built.append(model) or (work / f"model-{model}", work / f"{model}-Q4_0.gguf", {"build_s": 1.0})
        ),
    )
    monkeypatch.setattr(
        peers, "convert_to_gguf", lambda model, src, out, outtype, work: converted.append((out.name, outtype)) or 2.0
    )
    monkeypatch.setattr(peers, "ensure_kvforge_artifact", lambda source, out, quantize, flags=(): out)
    probes = []

    def crash(python, name, job, work):  # llama.cpp's decode with its extra buffer types on segfaults
        probes.append((name, Path(job["gguf"]).name))
        raise peers.pg.StepFailed("llamacpp-probe failed (exit -11)")

    monkeypatch.setattr(peers, "run_llama_worker", crash)
    args = argparse.Namespace(sides=list(peers.SIDES), precisions=None, llama_venv=None, threads=2)
    builds: dict = {}
    model_dir, sides = peers.plan_sides(args, "qwen3.5-0.8b", tmp_path, "/llama/python", builds)
    assert built == ["qwen3.5-0.8b"] and model_dir == tmp_path / "model-qwen3.5-0.8b"
    assert converted == [("qwen3.5-0.8b-f32.gguf", "f32")] and builds == {"build_s": 1.0, "convert_f32_s": 2.0}
    assert probes == [("llamacpp-probe", "qwen3.5-0.8b-Q4_0.gguf")]  # the quantized GGUF only
    # no GGUF-blocks or genai rows: neither takes the family
    assert [(label, side, precision) for label, side, precision, _ in sides] == [
        ("llama.cpp (Q4_0 GGUF, no repack)", "llamacpp", "Q4_0"),
        ("llama.cpp (F32 GGUF)", "llamacpp", "F32"),
        ("kvforge (int4)", "kvforge", "int4"),
        ("kvforge (fp32)", "kvforge", "fp32"),
    ]
    rows = {label: {"tokens": [[1]], "precision": precision} for label, _, precision, _ in sides}
    assert peers._reference_row("qwen3.5-0.8b", rows) == "llama.cpp (F32 GGUF)"  # greedy agreement's reference
    del rows["llama.cpp (F32 GGUF)"]
    assert peers._reference_row("qwen3.5-0.8b", rows) == "llama.cpp (Q4_0 GGUF, no repack)"
    rows["llama.cpp (F32 GGUF)"] = {"tokens": [[1]], "precision": "F32"}
    # each kvforge row is compared with llama.cpp's row of its precision
    assert peers._llama_row_for(rows["kvforge (fp32)"], rows) is rows["llama.cpp (F32 GGUF)"]
    assert peers._llama_row_for(rows["kvforge (int4)"], rows) is rows["llama.cpp (Q4_0 GGUF, no repack)"]


def test_llamacpp_runs_at_its_defaults_where_its_probe_decodes(tmp_path, monkeypatch):
    peers = _peers()
    monkeypatch.setattr(peers, "run_llama_worker", lambda python, name, job, work: {"ok": True})
    row = peers.llama_row("Q4_1", tmp_path / "m.gguf", "/llama/python", tmp_path, 2)
    assert row == ("llama.cpp (Q4_1 GGUF)", "llamacpp", "Q4_1", tmp_path / "m.gguf")
