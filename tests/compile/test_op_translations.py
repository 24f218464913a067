"""compile/op_translations.py: the exporter's missing ops, translated to standard ONNX, give torch's
values. ``erfinv`` (and ``Normal(0, 1).icdf``, which Gemma 3n's activation sparsity computes in its
forward) over the open interval (-1, 1), tails included, within 1e-6 relative error (2e-7 measured) in float32,
run on ONNX Runtime's CPU provider. The Gated DeltaNet op ``kvforge::gated_delta_rule``
(graphs/gated_delta_onnx.py) gives the op's outputs and state at every length, from one token to
chunks with a padded tail."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from kvforge.compile import op_translations


class _Erfinv(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        icdf = torch.distributions.normal.Normal(0, 1).icdf((x + 1) / 2)  # sqrt(2) * erfinv(x)
        return torch.erfinv(x), icdf


def test_erfinv_matches_torch_across_its_domain(tmp_path):
    x = torch.cat([torch.linspace(-0.999999, 0.999999, 2001), torch.tensor([0.0, 0.9, -0.95, 0.99999, -0.9999999])])
    program = torch.onnx.export(
        _Erfinv(),
        (x,),
        dynamo=True,
        custom_translation_table=op_translations.translation_table(),
        verbose=False,
    )
    program.save(str(tmp_path / "erfinv.onnx"))
    session = ort.InferenceSession(str(tmp_path / "erfinv.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = [t.numpy() for t in _Erfinv()(x)]
    for got, want in zip(ours, expected):
        worst = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-6))
        assert worst < 1e-6, f"worst relative error {worst:.3g}"


class _GatedDeltaRule(torch.nn.Module):
    def forward(self, query, key, value, g, beta, state):
        return torch.ops.kvforge.gated_delta_rule(query, key, value, g, beta, state)


def _delta_rule_inputs(seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 5
    query = torch.nn.functional.normalize(torch.randn(b, h, seq, dk, generator=g), dim=-1) * dk**-0.5
    key = torch.nn.functional.normalize(torch.randn(b, h, seq, dk, generator=g), dim=-1)
    value = torch.randn(b, h, seq, dv, generator=g)
    decay, beta = -torch.rand(b, h, seq, generator=g), torch.rand(b, h, seq, generator=g)
    return query, key, value, decay, beta, torch.randn(b, h, dk, dv, generator=g)


def test_gated_delta_rule_translation_matches_the_op_at_every_length(tmp_path):
    """``kvforge::gated_delta_rule`` exported once with a dynamic length gives the op's outputs and
    final state for one token (decode), fewer tokens than a chunk, one chunk, and chunks with a
    padded tail; the graph passes ONNX's full check (the Scan's types included), and its only loop
    is one Scan over chunks."""
    import onnx

    from kvforge.graphs import gated_delta  # noqa: F401  (registers the op)

    names = ["query", "key", "value", "g", "beta", "state"]
    seq, batch = torch.export.Dim("seq", min=1, max=512), torch.export.Dim("batch", min=1, max=4)
    program = torch.onnx.export(
        _GatedDeltaRule(),
        _delta_rule_inputs(9),
        dynamo=True,
        opset_version=24,
        dynamic_shapes=({0: batch, 2: seq},) * 5 + ({0: batch},),
        input_names=names,
        output_names=["output", "final_state"],
        custom_translation_table=op_translations.translation_table(),
        verbose=False,
    )
    program.save(str(tmp_path / "gated_delta.onnx"))
    model = onnx.load(str(tmp_path / "gated_delta.onnx"))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Scan") == 1 and "Loop" not in ops
    session = ort.InferenceSession(str(tmp_path / "gated_delta.onnx"), providers=["CPUExecutionProvider"])
    for length in (1, 3, 64, 65, 130):
        inputs = _delta_rule_inputs(length, seed=length)
        got = session.run(None, {n: x.numpy() for n, x in zip(names, inputs)})
        for ours, want, what in zip(got, torch.ops.kvforge.gated_delta_rule(*inputs), ("output", "state")):
            worst = np.max(np.abs(ours - want.numpy()))
            assert worst < 1e-5, f"{length} tokens: {what} differs by {worst:.3g}"
