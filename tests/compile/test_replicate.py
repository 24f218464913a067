"""Layer copies (kvforge.compile.replicate): the general graph traced from the first 3 layers of a
4-layer Llama, the 4th copied in the graph (after onnxscript's optimizer, as compile does, or
before it, compile's fallback), is the full trace's graph: the same inputs and outputs in contract
order, the same node count per op type and the same initializer shapes, and its derived prefill and
decode graphs give outputs within 1e-6 of the full trace's on a ragged prefill and a decode step.
(The tiny Llama's norm weights are all ones, so the optimizer merges them: the copies' merged
weights are exercised too.) Layers that are not one computation take the full trace and say why: a config whose
``layer_types`` mix sliding and full attention (in compile's progress line), a first-k-dense MoE,
GPT-2's per-layer attention scaling; and the graph check alone, without the module check, refuses
that GPT-2 and falls back to the full trace. A constant the optimizer folded from a layer's
weights and merged across layers (Gemma's ``1 + weight`` norms, equal in a random model) is never
shared by the copies: Gemma is copied before the optimizer."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from kvforge.compile import derive, replicate
from kvforge.compile import export as export_stage
from kvforge.compile import load as load_stage
from kvforge.graphs import contract
from tests import families
from tests.helpers import assert_close, make_llama

LAYERS, KV_HEADS, HEAD_DIM, VOCAB, CAPACITY = 4, 2, 16, 384, 16


COPIED = ("copied", "copied before the optimizer")


@pytest.fixture(scope="module")
def four_layer_graphs(tmp_path_factory):
    """{kind: (graph, ExportTimes)} of a tiny 4-layer Llama, for kind in COPIED and "full"."""
    model_dir = make_llama(tmp_path_factory.mktemp("llama4"), num_hidden_layers=LAYERS)
    loaded = load_stage.load_model(model_dir)
    graphs = {}
    for kind in (*COPIED, "full"):
        times = export_stage.ExportTimes()
        with pytest.MonkeyPatch.context() as patch:
            if kind == "copied before the optimizer":  # the copy after the optimizer refused
                patch.setattr(replicate, "replicate", _refusing_once(replicate.replicate))
            graph = export_stage.export_general(loaded, "gqa", 2, CAPACITY, times, full_trace=kind == "full")
        graphs[kind] = (graph, times)
    return graphs


def _refusing_once(replicate_layers):
    calls = []

    def refuse_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise replicate.NotReplicable("refused for the test")
        return replicate_layers(*args, **kwargs)

    return refuse_first


@pytest.mark.parametrize("kind", COPIED)
def test_the_copied_graph_is_the_full_trace(four_layer_graphs, kind):
    (copied, copied_times), (full, full_times) = four_layer_graphs[kind], four_layer_graphs["full"]
    assert (
        copied_times.trace
        == {
            "copied": "traced 3 of 4 layers, copied the other 1 in the graph after the optimizer",
            "copied before the optimizer": "traced 3 of 4 layers, copied the other 1 in the graph before the "
            "optimizer (after it: refused for the test)",
        }[kind]
    )
    assert full_times.trace == "traced all 4 layers: full trace asked for"
    names = [*contract.decode_input_names(LAYERS)[:3], export_stage.LOGIT_INDICES, *contract.past_names(LAYERS)]
    for graph in (copied.graph, full.graph):
        assert [v.name for v in graph.inputs] == names
        assert [v.name for v in graph.outputs] == contract.output_names(LAYERS)
    assert [(v.dtype, v.shape) for v in copied.graph.inputs] == [(v.dtype, v.shape) for v in full.graph.inputs]
    assert Counter(n.op_type for n in copied.graph) == Counter(n.op_type for n in full.graph)

    def shapes(graph: ir.Graph) -> Counter:
        return Counter((v.dtype, tuple(v.shape)) for v in graph.initializers.values())

    assert shapes(copied.graph) == shapes(full.graph)
    # The copy's nodes have HF names (its own weights are checked by the values of the next test).
    assert any(n.name.startswith("/model/layers.3/self_attn/") for n in copied.graph)


def _session(model: ir.Model, path):
    ir.save(model, path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_the_copied_graph_computes_what_the_full_trace_does(four_layer_graphs, tmp_path):
    rng = np.random.default_rng(0)
    empty = {n: np.zeros((2, KV_HEADS, CAPACITY, HEAD_DIM), np.float32) for n in contract.past_names(LAYERS)}
    ids = rng.integers(0, VOCAB, (2, 5))
    prefill = {
        contract.INPUT_IDS: ids,
        contract.POSITION_IDS: np.tile(np.arange(5), (2, 1)),
        contract.WRITE_INDICES: np.zeros(2, np.int64),
        contract.INPUT_LENGTHS: np.array([5, 3]),  # row 1 right-padded
        **empty,
    }
    results = {}
    for kind, (general, _) in four_layer_graphs.items():  # both copies and the full trace
        sessions = {
            g: _session(derive.derive(general, g), tmp_path / f"{kind}-{g}.onnx") for g in ("prefill", "decode")
        }
        first = sessions["prefill"].run(None, prefill)
        step = {
            contract.INPUT_IDS: first[0].argmax(-1).reshape(2, 1),
            contract.POSITION_IDS: np.array([[5], [3]]),
            contract.WRITE_INDICES: np.array([5, 3]),
            **dict(zip(contract.past_names(LAYERS), first[1:])),
        }
        results[kind] = (first, sessions["decode"].run(None, step))
    pairs = [(kind, call, pair) for kind in COPIED for call, pair in enumerate(zip(results[kind], results["full"]))]
    for kind, call, (ours, theirs) in pairs:
        what = f"{kind}: {'prefill' if call == 0 else 'decode'}"
        assert np.abs(theirs[0]).max() > 0.1, "the logits are not trivially zero"
        assert_close(ours[0], theirs[0], atol=1e-6, rtol=0, what=f"{what} logits")
        for name, a, b in zip(contract.present_names(LAYERS), ours[1:], theirs[1:]):
            assert_close(a, b, atol=1e-6, rtol=0, what=f"{what} {name}")
        # the copied layer (3) wrote rows of its own: its cache differs from the traced layer 2's
        assert np.abs(ours[-1] - ours[-3]).max() > 1e-3


def _model(architecture: str, config_class: str, overrides: dict) -> torch.nn.Module:
    """A tiny random model of tests/families.py's kind, built in memory (never saved)."""
    import transformers

    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    common = {k: v for k, v in families.COMMON.items() if config_class != "GPT2Config" or k not in sizes}
    kwargs = {**common, **overrides}
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, architecture)(config).eval()


def test_mixed_layer_types_take_the_full_trace_and_say_why(tmp_path):
    from kvforge.compile import compile_model

    overrides = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=families.WINDOW, max_window_layers=2)
    model_dir = families.build(tmp_path / "qwen2", "Qwen2ForCausalLM", "Qwen2Config", overrides)
    lines: list[str] = []
    manifest = compile_model(
        model_dir, tmp_path / "out", max_batch=2, max_seq=32, score_graph=False, optimize=False, progress=lines.append
    )
    [export_line] = [line for line in lines if "export took" in line]
    assert export_line.endswith(
        "; traced all 4 layers: config.layer_types differs across layers ('full_attention', 'sliding_attention'))"
    )
    assert manifest.parity["greedy_match"] is True


def test_a_first_k_dense_moe_takes_the_full_trace():
    overrides = dict(num_hidden_layers=4, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    model = _model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**overrides, "mlp_only_layers": [0]})
    plan = replicate.plan(model, 4)
    assert plan.stack is None and plan.traced == 4
    assert plan.reason == "layer 1's mlp is Qwen3MoeSparseMoeBlock, layer 0's mlp Qwen3MoeMLP"
    assert replicate.plan(_model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", overrides), 4).traced == replicate.TRACED


GPT2_INVERSE_SCALE = dict(
    n_embd=64, n_layer=4, n_head=4, n_positions=64, n_inner=128, scale_attn_by_inverse_layer_idx=True
)


def test_per_layer_attributes_take_the_full_trace():
    model = _model("GPT2LMHeadModel", "GPT2Config", GPT2_INVERSE_SCALE)
    plan = replicate.plan(model, 4)
    assert plan.stack is None
    assert plan.reason == "layer 1's attn has scaling=0.125, layer 0's scaling=0.25"  # 16 ** -0.5 / (1 + 1)


def test_the_graph_check_alone_refuses_layers_that_differ(tmp_path, monkeypatch):
    """With the module check off, GPT-2's per-layer scaling still shows in the traced graph (layer
    2's attention scale is not layer 1's): no copy, the full trace, and why."""
    model_dir = families.build(tmp_path / "gpt2", "GPT2LMHeadModel", "GPT2Config", GPT2_INVERSE_SCALE)
    monkeypatch.setattr(replicate, "_layer_difference", lambda layers: None)
    loaded = load_stage.load_model(model_dir)
    times = export_stage.ExportTimes()
    graph = export_stage.export_general(loaded, "gqa", 2, 32, times)
    assert times.trace.startswith("traced all 4 layers: layer 2's node ")
    assert "differs from layer 1's: attribute scale=" in times.trace
    assert [v.name for v in graph.graph.outputs] == contract.output_names(4)
    assert len(loaded.model.transformer.h) == 4 and loaded.model.config.n_layer == 4  # restored after the prefix


def test_a_constant_folded_from_weights_is_not_shared_by_the_copies(tmp_path):
    overrides = dict(num_hidden_layers=4, head_dim=16)
    model_dir = families.build(tmp_path / "gemma", "GemmaForCausalLM", "GemmaConfig", overrides)
    loaded = load_stage.load_model(model_dir)
    times = export_stage.ExportTimes()
    export_stage.export_general(loaded, "gqa", 2, 32, times)
    assert times.trace.startswith("traced 3 of 4 layers, copied the other 1 in the graph before the optimizer")
    assert "both read" in times.trace and "which depends on a layer's weights" in times.trace
