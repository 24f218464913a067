"""compile/op_translations.py: the exporter's missing ops, translated to standard ONNX, give torch's
values. ``erfinv`` (and ``Normal(0, 1).icdf``, which Gemma 3n's activation sparsity computes in its
forward) over the open interval (-1, 1), tails included, within 1e-6 relative error (2e-7 measured) in float32,
run on ONNX Runtime's CPU provider. The Gated DeltaNet op ``kvforge::gated_delta_rule``
(graphs/gated_delta_onnx.py) gives the op's outputs and state at every length, from one token to
chunks with a padded tail."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
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


def _delta_rule_inputs(seq: int, seed: int = 0, batch: int = 2, per_channel: bool = False) -> tuple[torch.Tensor, ...]:
    """The op's inputs: per head decays, or (``per_channel``: KDA) per key channel."""
    g = torch.Generator().manual_seed(seed)
    b, h, dk, dv = batch, 3, 8, 5
    query = torch.nn.functional.normalize(torch.randn(b, h, seq, dk, generator=g), dim=-1) * dk**-0.5
    key = torch.nn.functional.normalize(torch.randn(b, h, seq, dk, generator=g), dim=-1)
    value = torch.randn(b, h, seq, dv, generator=g)
    decay = -torch.rand(b, h, seq, *((dk,) if per_channel else ()), generator=g)
    beta = torch.rand(b, h, seq, generator=g)
    return query, key, value, decay, beta, torch.randn(b, h, dk, dv, generator=g)


def _exported_rule(tmp_path, op, example, one_token: bool = True, fast: bool = False):
    """``op`` exported once with a dynamic batch and length, its node expanded
    (gated_delta_onnx.expand), as a checked ONNX file: ``(onnx.ModelProto, session)``. A seventh
    example tensor is the optional ``continues [B]``."""
    import onnx
    import onnx_ir as ir

    from kvforge.graphs import gated_delta_onnx

    class Rule(torch.nn.Module):
        def forward(self, query, key, value, g, beta, state, continues=None):
            return op(query, key, value, g, beta, state, continues)

    seq, batch = torch.export.Dim("seq", min=1, max=512), torch.export.Dim("batch", min=1, max=4)
    program = torch.onnx.export(
        Rule(),
        example,
        dynamo=True,
        opset_version=24,
        dynamic_shapes=({0: batch, 2: seq},) * 5 + ({0: batch},) * (len(example) - 5),
        input_names=_NAMES[: len(example)],
        output_names=["output", "final_state"],
        custom_translation_table=op_translations.translation_table(),
        verbose=False,
    )
    model = program.model
    recorded = [n.op_type for n in model.graph if n.domain == gated_delta_onnx.DOMAIN]
    assert recorded == [op.__name__.title().replace("_", "")]
    assert gated_delta_onnx.expand(model, one_token=one_token, fast=fast) == 1
    path = tmp_path / f"{op.__name__}_{one_token}_{fast}_{len(example)}.onnx"
    ir.save(model, path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return proto, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


_NAMES = ["query", "key", "value", "g", "beta", "state", "continues"]


def _assert_same_in_place(session, feeds, results) -> None:
    """The final state written into the state's own buffer, as the runtime binds them, gives
    ``results`` (from separate buffers) bit for bit."""
    binding = session.io_binding()
    state = ort.OrtValue.ortvalue_from_numpy(feeds["state"].copy())
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, state) if name == "state" else binding.bind_cpu_input(name, value)
    binding.bind_output("output")
    binding.bind_ortvalue_output("final_state", state)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], results[0])
    np.testing.assert_array_equal(state.numpy(), results[1])


def test_gated_delta_rule_translation_matches_the_op_at_every_length(tmp_path):
    """``kvforge::gated_delta_rule`` exported once with a dynamic length gives the op's outputs and
    final state for one token (decode), fewer tokens than a chunk, one chunk, and chunks with a
    padded tail; the graph passes ONNX's full check (the Scan's types included). Its one node is an
    ``If`` on the length: one token without a loop, more through the chunked form, whose only loop
    is one Scan over chunks."""
    from kvforge.graphs import gated_delta  # noqa: F401  (registers the op)

    model, session = _exported_rule(tmp_path, torch.ops.kvforge.gated_delta_rule, _delta_rule_inputs(9))
    [branch] = [n for n in model.graph.node if n.op_type not in ("Constant", "Shape", "Equal")]
    assert branch.op_type == "If"
    branches = {a.name: onnx.helper.get_attribute_value(a) for a in branch.attribute}
    then, orelse = branches["then_branch"], branches["else_branch"]
    assert {n.op_type for n in then.node}.isdisjoint({"Scan", "Loop", "Pad", "Reshape"})
    assert sum(n.op_type != "Constant" for n in then.node) <= 19
    assert [n.op_type for n in orelse.node].count("Scan") == 1 and "Loop" not in [n.op_type for n in orelse.node]
    for length in (1, 3, 64, 65, 130):
        inputs = _delta_rule_inputs(length, seed=length)
        got = session.run(None, {n: x.numpy() for n, x in zip(_NAMES, inputs)})
        for ours, want, what in zip(got, torch.ops.kvforge.gated_delta_rule(*inputs), ("output", "state")):
            worst = np.max(np.abs(ours - want.numpy()))
            assert worst < 1e-5, f"{length} tokens: {what} differs by {worst:.3g}"


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda_rule"])
@pytest.mark.parametrize("continues", [False, True])
def test_one_token_branch_equals_the_chunked_form_in_place(tmp_path, rule, continues):
    """The ``If``'s one-token branch is the chunked form at ``S = 1`` without its machinery: the
    same output and state as the graph expanded without the branch, within float32 rounding, per
    head (Gated DeltaNet) and per key channel (KDA); with ``continues``, rows of 0 start from a
    zero state in both (the step scales its factors, the chunked form zeroes the state) and rows
    of 1 from theirs. And the same when the final state is written into the state's own buffer,
    as the runtime binds them (every read of the past precedes the write)."""
    from kvforge.graphs import gated_delta  # noqa: F401  (registers the ops)

    op = getattr(torch.ops.kvforge, rule)
    kda = rule == "kda_rule"
    flags = (lambda batch: (torch.arange(batch) % 2 == 0).float()) if continues else None
    example = _delta_rule_inputs(9, per_channel=kda)
    example = (*example, flags(2)) if continues else example
    _, branched = _exported_rule(tmp_path, op, example)
    _, chunked = _exported_rule(tmp_path, op, example, one_token=False)
    for batch, seed in ((1, 1), (4, 2)):
        inputs = _delta_rule_inputs(1, seed, batch, kda)
        inputs = (*inputs, flags(batch)) if continues else inputs
        feeds = {n: x.numpy() for n, x in zip(_NAMES, inputs)}
        ours, theirs, want = branched.run(None, feeds), chunked.run(None, feeds), op(*inputs)
        for a, b, c in zip(ours, theirs, want):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(a, c.numpy(), rtol=1e-6, atol=1e-6)
        _assert_same_in_place(branched, feeds, ours)


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda_rule"])
@pytest.mark.parametrize("continues", [False, True])
def test_gqa_lowering_runs_the_rule_as_ort_linear_attention(tmp_path, rule, continues):
    """The gqa lowering (``fast``) of either rule (a decay per head; KDA's per key channel) is one
    ``com.microsoft.LinearAttention`` for every length (no ``If``, no loop): the op's output and
    final state within float32 rounding for one token, fewer than a chunk, one chunk and more
    (both rules' chunk sizes), batches of 1 and 4; with
    ``continues``, rows of 0 start from a zero state (their first token's decay is ``-inf``) though
    their state holds other numbers; and the final state written into the state's own buffer gives
    the same results bit for bit, as the runtime binds them."""
    from kvforge.graphs import gated_delta  # noqa: F401  (registers the op)

    op = getattr(torch.ops.kvforge, rule)
    kda = rule == "kda_rule"
    flags = (lambda batch: (torch.arange(batch) % 2 == 0).float()) if continues else None
    example = _delta_rule_inputs(9, per_channel=kda)
    model, session = _exported_rule(tmp_path, op, (*example, flags(2)) if continues else example, fast=True)
    ops = [(n.op_type, n.domain) for n in model.graph.node]
    assert ops.count(("LinearAttention", "com.microsoft")) == 1
    assert {"If", "Scan", "Loop"}.isdisjoint(t for t, _ in ops)
    for length, batch in ((1, 1), (1, 4), (3, 2), (17, 2), (64, 1), (65, 4), (130, 2)):
        inputs = _delta_rule_inputs(length, seed=length, batch=batch, per_channel=kda)
        inputs = (*inputs, flags(batch)) if continues else inputs
        feeds = {n: x.numpy() for n, x in zip(_NAMES, inputs)}
        got = session.run(None, feeds)
        for ours, want, what in zip(got, op(*inputs), ("output", "state")):
            worst = np.max(np.abs(ours - want.numpy()))
            assert worst < 1e-5, f"{length} tokens, batch {batch}: {what} differs by {worst:.3g}"
        _assert_same_in_place(session, feeds, got)


@pytest.mark.parametrize("bias", [False, True])
def test_depthwise_conv_branches_on_one_window(tmp_path, bias):
    """``kvforge::depthwise_conv`` (graphs/state.py) exported once with a dynamic length: one
    ``If`` whose window-of-the-kernel branch (a decode step) is products and a sum, not a ``Conv``,
    and both branches give torch's conv1d at its valid positions, with and without a bias."""
    import onnx_ir as ir

    from kvforge.graphs import gated_delta_onnx, state  # noqa: F401  (registers the op)

    channels, width = 6, 4
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(channels, 1, width, generator=g)
    shift = torch.randn(channels, generator=g) if bias else None

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight)
            self.bias = torch.nn.Parameter(shift) if bias else None

        def forward(self, x):
            return torch.ops.kvforge.depthwise_conv(x, self.weight, self.bias)

    length, batch = torch.export.Dim("length", min=width, max=64), torch.export.Dim("batch", min=1, max=4)
    program = torch.onnx.export(
        Conv(),
        (torch.randn(2, channels, 9, generator=g),),
        dynamo=True,
        opset_version=24,
        dynamic_shapes=({0: batch, 2: length},),
        input_names=["x"],
        output_names=["y"],
        custom_translation_table=op_translations.translation_table(),
        verbose=False,
    )
    model = program.model
    assert gated_delta_onnx.expand(model) == 1
    ir.save(model, tmp_path / "conv.onnx")
    proto = onnx.load(str(tmp_path / "conv.onnx"))
    onnx.checker.check_model(proto, full_check=True)
    [branch] = [n for n in proto.graph.node if n.op_type == "If"]
    branches = {a.name: [n.op_type for n in onnx.helper.get_attribute_value(a).node] for a in branch.attribute}
    assert "Conv" not in branches["then_branch"] and "ReduceSum" in branches["then_branch"]
    assert branches["else_branch"].count("Conv") == 1
    session = ort.InferenceSession(str(tmp_path / "conv.onnx"), providers=["CPUExecutionProvider"])
    for rows, length in ((1, width), (3, width), (2, width + 1), (3, 40)):
        x = torch.randn(rows, channels, length, generator=g)
        (ours,) = session.run(None, {"x": x.numpy()})
        want = torch.nn.functional.conv1d(x, weight, shift, groups=channels)
        assert ours.shape == tuple(want.shape)
        np.testing.assert_allclose(ours, want.numpy(), atol=1e-6, rtol=1e-6)


_MAMBA2_NAMES = ["x", "dt", "b", "c", "state", "continues"]


def _mamba2_inputs(seq: int, seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """``kvforge::mamba2_scan``'s run-time inputs (``a`` and ``d`` are the module's constants): 6
    heads of 5 in 2 groups, state size 4; steps of ``dt`` up to 1 and ``A`` down to -3, as
    transformers' initialization spans, with a padded tail (``dt = 0``) in row 1."""
    g = torch.Generator().manual_seed(seed)
    h, p, groups, n = 6, 5, 2, 4
    dt = torch.rand(batch, seq, h, generator=g)
    if batch > 1 and seq > 2:
        dt[1, seq - 2 :] = 0.0
    return (
        torch.randn(batch, seq, h, p, generator=g),
        dt,
        torch.randn(batch, seq, groups, n, generator=g),
        torch.randn(batch, seq, groups, n, generator=g),
        torch.randn(batch, h, n, p, generator=g),  # kvforge's [B, H, N, P]
    )


@pytest.mark.parametrize("continues", [False, True])
def test_gqa_lowering_runs_the_mamba2_scan_as_ort_linear_attention(tmp_path, continues):
    """The gqa lowering of Mamba2's scan (graphs/mamba2.py ``kvforge::mamba2_scan``) is one
    ``com.microsoft.LinearAttention`` (``update_rule="gated"``) for every length, no ``If`` or
    loop: its output (the ``D`` skip included) and final state (in the contract's ``[B, H, P,
    N]``) within float32 rounding of the op for one token, a few, and more than the op's chunks,
    batches of 1 to 4, groups of B and C shared by three heads each, a padded tail; with
    ``continues``, rows of 0 start from a zero state though their state holds other numbers; and the
    final state written into the state's own buffer gives the same results bit for bit. The state
    is the op's own ``[B, H, Dk = N, Dv = P]``, kvforge's layout: no ``Transpose`` reads or writes it."""
    import onnx_ir as ir

    from kvforge.graphs import gated_delta_onnx, mamba2  # noqa: F401  (registers the op)

    gen = torch.Generator().manual_seed(7)
    a, d = -3 * torch.rand(6, generator=gen), torch.randn(6, generator=gen)
    flags = (lambda batch: (torch.arange(batch) % 2 == 0).float()) if continues else None

    class Scan(torch.nn.Module):
        def forward(self, x, dt, b, c, state, continues=None):
            return torch.ops.kvforge.mamba2_scan(x, dt, a, b, c, d, state, continues)

    example = _mamba2_inputs(9)
    example = (*example, flags(2)) if continues else example
    seq, batch = torch.export.Dim("seq", min=1, max=512), torch.export.Dim("batch", min=1, max=4)
    program = torch.onnx.export(
        Scan(),
        example,
        dynamo=True,
        opset_version=24,
        dynamic_shapes=({0: batch, 1: seq},) * 4 + ({0: batch},) * (len(example) - 4),
        input_names=_MAMBA2_NAMES[: len(example)],
        output_names=["y", "final_state"],
        custom_translation_table=op_translations.translation_table(),
        verbose=False,
    )
    model = program.model
    assert [n.op_type for n in model.graph if n.domain == gated_delta_onnx.DOMAIN] == ["Mamba2Scan"]
    with pytest.raises(ValueError, match="only the gqa lowering"):
        gated_delta_onnx.expand(model)
    assert gated_delta_onnx.expand(model, fast=True) == 1
    path = tmp_path / f"mamba2_{continues}.onnx"
    ir.save(model, path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = [(n.op_type, n.domain) for n in proto.graph.node]
    assert ops.count(("LinearAttention", "com.microsoft")) == 1
    assert {"If", "Scan", "Loop"}.isdisjoint(t for t, _ in ops)
    [state_reader] = [n for n in proto.graph.node if "state" in n.input]
    assert state_reader.op_type == "LinearAttention"
    [writer] = [n for n in proto.graph.node if "final_state" in n.output]
    assert writer.op_type == "LinearAttention"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for length, rows in ((1, 1), (1, 4), (3, 2), (17, 2), (64, 1), (65, 4), (130, 2)):
        inputs = _mamba2_inputs(length, seed=length, batch=rows)
        inputs = (*inputs, flags(rows)) if continues else inputs
        feeds = {n: x.numpy() for n, x in zip(_MAMBA2_NAMES, inputs)}
        got = session.run(None, feeds)
        want = torch.ops.kvforge.mamba2_scan(*inputs[:2], a, *inputs[2:4], d, *inputs[4:])
        for ours, expected, what in zip(got, want, ("y", "state")):
            worst = np.max(np.abs(ours - expected.numpy()) / (1 + np.abs(expected.numpy())))
            assert worst < 1e-5, f"{length} tokens, batch {rows}: {what} differs by {worst:.3g}"
        binding = session.io_binding()
        state = ort.OrtValue.ortvalue_from_numpy(feeds["state"].copy())
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, state) if name == "state" else binding.bind_cpu_input(name, value)
        binding.bind_output("y")
        binding.bind_ortvalue_output("final_state", state)
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], got[0])
        np.testing.assert_array_equal(state.numpy(), got[1])
