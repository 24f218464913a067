"""One trace, four graphs: the prefill, decode and score graphs that compile derives from its one
traced general graph (kvforge.compile.derive) behave exactly like graphs traced directly from the
PrefillGraph/DecodeGraph/ScoreGraph wrappers: the same input and output names, dtypes and shapes,
logits within 1e-5 and the same cache contents, on a ragged prefill, a continued prefill
(write_indices > 0) and a decode step, for both lowerings and for the ORT-optimized variants.
The verify graph (the general graph itself) gives the score graph's logits at every position and
the prefill graph's at the last real token. A graph that is not a general graph is refused by name."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvforge.compile import derive
from kvforge.compile import export as export_stage
from kvforge.compile import load as load_stage
from kvforge.compile.weights import SharedWeights
from kvforge.graphs import contract
from tests.helpers import assert_close

LAYERS, KV_HEADS, HEAD_DIM, VOCAB, CAPACITY = 2, 2, 16, 384, 16


@pytest.fixture(scope="module")
def traced_dir(llama_dir, tmp_path_factory):
    """The tiny Llama's three graphs traced directly from their own wrappers (gqa lowering), the
    way compile made them before it traced once."""
    loaded = load_stage.load_model(llama_dir)
    graphs = {
        "prefill": export_stage.export_prefill(loaded, "gqa", 4, 96),
        "decode": export_stage.export_decode(loaded, "gqa", 4, 96),
        "score": export_stage.export_prefill(loaded, "gqa", 4, 96, all_logits=True),
    }
    out = tmp_path_factory.mktemp("traced")
    SharedWeights(out).add(graphs)
    return out


def _io(path):
    model = onnx.load(str(path), load_external_data=False)

    def spec(v):
        t = v.type.tensor_type
        return v.name, t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def _session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _calls():
    """(graph, feeds) of a ragged prefill, a continued prefill (one row: GroupQueryAttention takes
    a multi-token prefill after a past only at batch 1) and a decode step, on caches that already
    hold earlier tokens."""
    rng = np.random.default_rng(0)
    past = {
        name: rng.standard_normal((2, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32)
        for name in contract.past_names(LAYERS)
    }
    ids = rng.integers(0, VOCAB, (2, 5))
    fresh = {
        contract.INPUT_IDS: ids,
        contract.POSITION_IDS: np.tile(np.arange(5), (2, 1)),
        contract.WRITE_INDICES: np.zeros(2, np.int64),
        **past,
    }
    continued = {
        contract.INPUT_IDS: ids[:1, :3],
        contract.POSITION_IDS: np.array([[4, 5, 6]]),
        contract.WRITE_INDICES: np.array([4]),
        **{name: cache[:1] for name, cache in past.items()},
    }
    step = {
        contract.INPUT_IDS: ids[:, :1],
        contract.POSITION_IDS: np.array([[7], [3]]),
        contract.WRITE_INDICES: np.array([7, 3]),
        **past,
    }
    return [
        ("prefill", {**fresh, contract.INPUT_LENGTHS: np.array([5, 3])}),  # row 1 right-padded
        ("prefill", {**continued, contract.INPUT_LENGTHS: np.array([2])}),  # its last token padding
        ("score", fresh),
        ("score", continued),
        ("decode", step),
    ]


@pytest.mark.parametrize("graph", ["prefill", "decode", "score"])
@pytest.mark.parametrize("variant", ["", ".ort"])
def test_derived_graphs_have_the_traced_io(llama_artifact, llama_onnx_artifact, traced_dir, graph, variant):
    traced = _io(traced_dir / f"{graph}.onnx")
    assert _io(llama_artifact / f"{graph}{variant}.onnx") == traced
    assert _io(llama_onnx_artifact / f"{graph}{variant}.onnx") == traced
    inputs, outputs = traced
    assert [name for name, _, _ in inputs] == contract.input_names(graph, LAYERS)
    assert outputs[0][2] == (["batch", "seq", VOCAB] if graph == "score" else ["batch", VOCAB])


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
@pytest.mark.parametrize("variant", ["", ".ort"])
def test_derived_graphs_compute_what_the_traced_ones_do(
    llama_artifact, llama_onnx_artifact, traced_dir, lowering, variant
):
    artifact = llama_artifact if lowering == "gqa" else llama_onnx_artifact
    sessions = {}
    for call, (graph, feeds) in enumerate(_calls()):
        for path in (artifact / f"{graph}{variant}.onnx", traced_dir / f"{graph}.onnx"):
            sessions.setdefault(path, _session(path))
        derived = sessions[artifact / f"{graph}{variant}.onnx"].run(None, feeds)
        traced = sessions[traced_dir / f"{graph}.onnx"].run(None, feeds)
        what = f"{graph} call {call} ({lowering}{variant})"
        assert_close(derived[0], traced[0], atol=1e-5, rtol=0, what=f"{what} logits")
        batch, seq = feeds[contract.INPUT_IDS].shape
        lengths = feeds.get(contract.INPUT_LENGTHS, np.full(batch, seq))
        for row, length in enumerate(lengths):  # written real tokens; right padding is never read
            start = feeds[contract.WRITE_INDICES][row]
            for ours, theirs in zip(derived[1:], traced[1:]):
                assert_close(
                    ours[row, :, start : start + length], theirs[row, :, start : start + length], 1e-5, 0, what
                )


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
def test_verify_graph_is_the_general_graph(llama_artifact, llama_onnx_artifact, traced_dir, lowering):
    """verify (schema 2): the contract's inputs, logits [batch, positions, V] at logit_indices: every
    position equals the score graph's, the last real token the prefill graph's."""
    artifact = llama_artifact if lowering == "gqa" else llama_onnx_artifact
    inputs, outputs = _io(artifact / "verify.ort.onnx")
    assert [name for name, _, _ in inputs] == contract.input_names("verify", LAYERS)
    assert outputs[0][2] == ["batch", "positions", VOCAB]
    verify, score = _session(artifact / "verify.ort.onnx"), _session(traced_dir / "score.onnx")
    prefill = _session(traced_dir / "prefill.onnx")
    [(_, first), *_] = _calls()
    fresh = {name: value for name, value in first.items() if name != contract.INPUT_LENGTHS}
    every = verify.run(None, {**fresh, contract.LOGIT_INDICES: np.tile(np.arange(5), (2, 1))})[0]
    assert_close(every, score.run(None, fresh)[0], atol=1e-5, rtol=0, what=f"verify vs score ({lowering})")
    last = verify.run(None, {**fresh, contract.LOGIT_INDICES: np.array([[4], [2]])})[0]
    want = prefill.run(None, {**fresh, contract.INPUT_LENGTHS: np.array([5, 3])})[0]
    assert_close(last[:, 0], want, atol=1e-5, rtol=0, what=f"verify vs prefill ({lowering})")


def test_only_a_general_graph_is_derived_from(llama_artifact):
    import onnx_ir as ir

    prefill = ir.load(llama_artifact / "prefill.onnx")
    with pytest.raises(ValueError, match="not a general graph: it has no 'logit_indices' input"):
        derive.derive(prefill, "decode")
    with pytest.raises(ValueError, match="unknown graph 'bogus'; choose one of prefill, decode, score, verify"):
        derive.derive(prefill, "bogus")
