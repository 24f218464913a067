"""The benchmarks' named shapes and the sharded checkpoint writer: common.MODEL_SHAPES build the
published models' sizes (checked on the meta device: no memory), compile_time.write_sharded
writes a checkpoint transformers loads whole, shard by shard, and hybrid_bench's summary
states the issue's ratios from bench reports."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def common():
    return load_benchmark("common")


def _meta_model(common, name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = common.MODEL_SHAPES[name]
    config = AutoConfig.for_model(shape.model_type, **shape.config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_lfm2_350m_shape_is_the_published_model(common):
    model = _meta_model(common, "lfm2-350m")
    assert sum(p.numel() for p in model.parameters()) == 354_483_968  # LFM2-350M's 354M
    assert model.config.layer_types.count("conv") == 10 and model.config.layer_types.count("full_attention") == 6
    assert model.model.layers[0].feed_forward.w1.weight.shape == (4608, 1024)  # 6656 auto-adjusted
    twin = _meta_model(common, common.MODEL_SHAPES["lfm2-350m"].baseline)
    assert type(twin).__name__ == "LlamaForCausalLM" and twin.config.num_hidden_layers == 16
    assert twin.model.layers[0].mlp.gate_proj.weight.shape == (4608, 1024)


def test_qwen35_shape_is_qwen35_08b_and_compiles_today(common):
    from kvforge.graphs.architectures import lookup

    shape = common.MODEL_SHAPES["qwen3.5-0.8b"]
    assert shape.needs is None and shape.baseline in common.MODEL_SHAPES
    assert lookup("Qwen3_5ForCausalLM").state == "gated_delta"
    model = _meta_model(common, "qwen3.5-0.8b")
    assert model.config.layer_types.count("linear_attention") == 18
    assert 0.7e9 < sum(p.numel() for p in model.parameters()) < 0.8e9


def test_granite_shape_is_a_mamba2_hybrid_of_granite_4_h_350m_size(common):
    model = _meta_model(common, "granite-4.0-h-350m")
    assert type(model).__name__ == "GraniteMoeHybridForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 340_332_224  # Granite-4.0-H-350M's 340M
    assert [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"] == [10, 13, 17, 27]
    assert model.model.layers[0].mamba.num_heads == 48 and model.model.layers[0].mamba.ssm_state_size == 128


@pytest.mark.parametrize("hybrid", ["qwen3.5-0.8b", "lfm2-350m", "granite-4.0-h-350m"])
def test_matched_twins_hold_the_hybrids_parameter_count(common, hybrid):
    """The "same size" twin of hybrid_bench's second reading: the same-dimension twin's MLP widened
    until its parameters are the hybrid's within 0.5%."""
    shape = common.MODEL_SHAPES[hybrid]
    count = {name: sum(p.numel() for p in _meta_model(common, name).parameters()) for name in (hybrid, shape.matched)}
    same_dims = sum(p.numel() for p in _meta_model(common, shape.baseline).parameters())
    assert abs(count[shape.matched] / count[hybrid] - 1) < 0.005
    assert count[hybrid] - same_dims > abs(count[hybrid] - count[shape.matched])
    twin = _meta_model(common, shape.matched)
    assert type(twin).__name__ == "LlamaForCausalLM"
    assert twin.config.num_hidden_layers == common.MODEL_SHAPES[hybrid].config["num_hidden_layers"]


def test_sharded_checkpoint_loads_whole_in_transformers(tmp_path):
    ct = load_benchmark("compile_time")
    shape = ct.peer.Shape(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=128, tied=False)
    model_dir = tmp_path / "model"
    ct.write_sharded(shape, model_dir, shard_bytes=40_000)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and sorted(p.name for p in model_dir.glob("*.safetensors")) == files
    assert not (tmp_path / "model.partial").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < state["model.layers.2.mlp.down_proj.weight"].float().std() < 0.025


def _cell(p: int, ttft: float, step: float, ref: tuple[float, float] | None = None) -> dict:
    theirs = {"ttft_ms": ref[0], "decode_ms_per_token_p50": ref[1]} if ref else None
    mine = {"ttft_ms": ttft, "decode_ms_per_token_p50": step}
    return {"prompt_len": p, "kvforge": mine, "transformers": theirs, "greedy_tokens_identical": bool(ref)}


def test_hybrid_summary_states_the_issue_ratios():
    hb = load_benchmark("hybrid_bench")
    hybrid = {"report": {"cells": [_cell(512, 200.0, 10.0, (1000.0, 60.0))]}}
    baseline = {"report": {"cells": [_cell(512, 160.0, 12.0)]}}
    matched = {"report": {"cells": [_cell(512, 180.0, 13.0)]}}
    [row] = hb.summarize(hybrid, baseline, matched)
    assert row["decode_speedup"] == pytest.approx(6.0)
    assert row["kvforge_prefill_tok_s"] == pytest.approx(2560.0)
    assert row["baseline_prefill_tok_s"] == pytest.approx(3200.0)
    assert row["prefill_slowdown_vs_baseline"] == pytest.approx(1.25)
    assert row["prefill_slowdown_vs_matched"] == pytest.approx(200.0 / 180.0)
    assert "prefill_slowdown_vs_matched" not in hb.summarize(hybrid, baseline)[0]
    assert row["greedy_tokens_identical"] is True


def test_compile_time_labels_rss_samples_with_the_running_stage(tmp_path):
    """The runner reads the child's progress lines while sampling: the peak is named by the stage
    running then, also for a child that never prints a stage's "took" line (stopped in it)."""
    import sys

    ct = load_benchmark("compile_time")
    child = (
        "import sys, time\n"
        "print('[kvforge] [1/2   0.0s] loading', flush=True); time.sleep(1.2)\n"
        "print('[kvforge] [1/2   1.2s] load took 1.2s', flush=True)\n"
        "print('[kvforge] [2/2   1.2s] checking parity', flush=True)\n"
        'block = b"x" * (300 << 20); time.sleep(1.5)\n'
    )
    row = ct.measure_child([sys.executable, "-c", child], tmp_path / "log", {})
    assert row["rc"] == 0 and len(row["rss_samples"]) >= 3
    stages = {sample[3] for sample in row["rss_samples"]}
    assert "loading" in stages and "checking parity" in stages
    assert ct.peak_stage(row) == "checking parity"
    assert row["peak_rss_bytes"] >= 300 << 20
