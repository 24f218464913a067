"""``kvforge bench`` on the tiny Llama: both sides timed in one run with their ratio, the documented
JSON keys with consistent values (cache sizes exact, ratios = kvforge / transformers), a progress
line while it runs, and one-line errors for cells the artifact cannot hold; without ``--threads``
both sides (ORT and torch) get the machine's cores."""

from __future__ import annotations

import json
import os

import pytest

from kvforge.tools import bench
from kvforge.tools.cli import main
from kvforge.tools.report import Progress

SIDE_KEYS = {
    "ttft_ms", "decode_ms_per_token_p50", "decode_ms_per_token_p90", "decode_tokens_per_s", "e2e_ms",
    "e2e_tokens_per_s", "rss_peak_bytes", "rss_peak_reset", "device_peak_bytes", "kv_cache_bytes",
    "ttft_ms_runs", "e2e_ms_runs", "rss_before_load_bytes", "rss_added_bytes",
}  # fmt: skip
PROMPT, NEW, REPEAT = 8, 4, 2


def test_bench_reports_both_sides_and_their_ratio(llama_artifact, llama_dir, tmp_path, capsys):
    argv = ["bench", str(llama_artifact), "--reference", str(llama_dir), "--prompt-lens", str(PROMPT)]
    argv += ["--batch-sizes", "1,2", "--new-tokens", str(NEW), "--repeat", str(REPEAT), "--warmup", "1"]
    argv += ["--threads", "1", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    printed = capsys.readouterr()
    result = json.loads((tmp_path / "b.json").read_text())
    manifest = json.loads((llama_artifact / "manifest.json").read_text())

    assert result["kind"] == "kvforge.bench" and result["schema_version"] == 1
    assert set(result) == {
        "kind",
        "schema_version",
        "artifact",
        "reference",
        "settings",
        "environment",
        "gpu",
        "cells",
        "prefix_cache",
    }
    assert result["gpu"] is None and result["settings"]["device"] == "cpu"  # GPU figures only with --device cuda
    assert result["reference"]["matches_source"] is True
    assert result["settings"]["prompt_lens"] == [PROMPT] and result["settings"]["batch_sizes"] == [1, 2]
    assert result["settings"]["threads"] == 1 and result["environment"]["torch_threads"] == 1
    assert result["environment"]["ort_threads"] == 1
    # whether the engine's FTZ flag was left on the thread transformers then ran on (ORT sets it on
    # the first session's thread only: this test process made sessions before)
    assert result["environment"]["denormals_flushed_for_transformers"] in (True, False)
    assert [(c["prompt_len"], c["batch_size"]) for c in result["cells"]] == [(PROMPT, 1), (PROMPT, 2)]
    for cell in result["cells"]:
        batch = cell["batch_size"]
        for side in ("kvforge", "transformers"):
            m = cell[side]
            assert set(m) == SIDE_KEYS, side
            assert len(m["ttft_ms_runs"]) == REPEAT and len(m["e2e_ms_runs"]) == REPEAT
            assert 0 < m["ttft_ms"] <= m["e2e_ms"]
            assert 0 < m["decode_ms_per_token_p50"] <= m["decode_ms_per_token_p90"]
            assert m["decode_tokens_per_s"] == pytest.approx(batch * 1e3 / m["decode_ms_per_token_p50"])
            assert m["e2e_tokens_per_s"] == pytest.approx(batch * NEW * 1e3 / m["e2e_ms"])
            assert m["rss_peak_bytes"] > 10 * 2**20 and m["device_peak_bytes"] is None  # CPU run
            assert m["rss_added_bytes"] == max(m["rss_peak_bytes"] - m["rss_before_load_bytes"], 0)
        # kvforge: its one allocation; transformers: K and V of every layer for P + N - 1 positions.
        assert cell["kvforge"]["kv_cache_bytes"] == manifest["kv_cache"]["bytes"]
        m = manifest["model"]
        grown = m["num_layers"] * 2 * batch * m["num_kv_heads"] * (PROMPT + NEW - 1) * m["head_dim"] * 4
        assert cell["transformers"]["kv_cache_bytes"] == grown
        assert set(cell["ratio"]) == set(bench.RATIO_KEYS)
        for key, ratio in cell["ratio"].items():
            assert ratio == pytest.approx(cell["kvforge"][key] / cell["transformers"][key]), key
        assert cell["greedy_tokens_identical"] is True

    assert "kvforge/hf" in printed.out and "greedy tokens identical on both sides in every cell: yes" in printed.out
    total = 2 * 2 * (1 + REPEAT)  # cells x sides x (warm-up + repeats)
    assert "[bench] [" in printed.err and f"{total}/{total} transformers prompt {PROMPT} batch 2" in printed.err
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_without_reference(llama_artifact):
    options = bench.BenchOptions(prompt_lens=(4,), batch_sizes=(1,), new_tokens=2, repeat=1, warmup=0)
    result = bench.run_bench(llama_artifact, None, options, Progress("bench", enabled=False))
    [cell] = result["cells"]
    assert result["reference"] is None and cell["transformers"] is None and cell["ratio"] is None
    assert cell["kvforge"]["decode_ms_per_token_p50"] > 0
    # No --threads: both sides get the machine's cores, not each library's own default.
    assert result["settings"]["threads"] is None
    assert result["environment"]["ort_threads"] == result["environment"]["torch_threads"] == (os.cpu_count() or 1)
    assert "transformers" not in bench.format_report(result).split("\n", 3)[-1]


def test_default_cells_are_capped_to_the_artifact():
    """A bare ``kvforge bench OUT`` fits any artifact; explicit cells that do not fit are errors."""
    resolved = bench.BenchOptions(new_tokens=16).resolve(max_batch=4, max_seq=96)
    assert resolved.prompt_lens == (32, 80) and resolved.batch_sizes == (1, 4)
    resolved = bench.BenchOptions().resolve(max_batch=2, max_seq=512)
    assert resolved.prompt_lens == (32, 128, 480) and resolved.batch_sizes == (1, 2)
    with pytest.raises(ValueError, match="max_batch=2"):
        bench.BenchOptions(batch_sizes=(4,)).resolve(max_batch=2, max_seq=512)


def test_bench_refuses_cells_the_artifact_cannot_hold(llama_artifact, capsys):
    base = ["bench", str(llama_artifact), "--repeat", "1"]
    assert main([*base, "--batch-sizes", "8", "--prompt-lens", "4"]) == 2
    assert "batch size 8 exceeds this artifact's max_batch=4" in capsys.readouterr().err
    assert main([*base, "--batch-sizes", "1", "--prompt-lens", "90", "--new-tokens", "10"]) == 2
    assert "max_seq=96" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--prompt-lens", "32,abc"])
    assert exit_info.value.code == 2
    assert "comma-separated positive integers" in capsys.readouterr().err
