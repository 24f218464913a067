"""The model-state contract (schema 3): the pure-torch reference of each state kind's update equals
transformers' own kernels (the conv state against ``causal_conv1d_fn``/``causal_conv1d_update``,
the gated delta step against ``torch_recurrent_gated_delta_rule``, Mamba2's and Mamba's steps
against the recurrences written out); Mamba's chunked selective scan equals transformers' steps
from a state, with ragged rows, and its ONNX lowering (one Scan over chunks) equals it in ONNX
Runtime; ragged rows keep the state of their last real input, the layout names every graph
input/output, the export cache zeroes the state of a row that starts a sequence, and a manifest
with state entries is checked field by field while schema-1/2 artifacts keep their meaning (every
layer attends). kvforge's chunked gated delta rule (the kernel swapped in for transformers' at
export) equals transformers' chunked and recurrent kernels, inverts its triangular system
exactly, keeps each ragged row's state at its last real token and gives a chunked prompt the
state of one call; the Gated DeltaNet layout keeps a conv and a float32 recurrent state per
linear layer. kvforge's Mamba2 scan (:mod:`kvforge.graphs.mamba2`) equals transformers' chunked
scan and the recurrent step (initial state included), keeps each ragged row's state at its last
real token, continues a chunk from the state it left, and exports with a symbolic length; each
Mamba2 family's layout (no attention, hybrid, both in one layer, neither in an MLP block) is read
from its config and accepted by the manifest; the swapped-in scan runs only inside an export
trace."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge.graphs import architectures, contract, reference
from kvforge.graphs import manifest as mf
from kvforge.graphs.state import ExportCausalConv1dForward, ExportStateCache


def _conv_inputs(batch=2, channels=6, kernel=4, seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, channels, kernel - 1, generator=g)
    x = torch.randn(batch, channels, seq, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    bias = torch.randn(channels, generator=g)
    return state, x, weight, bias


def test_conv_update_equals_transformers_kernels():
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn, causal_conv1d_update

    state, x, weight, bias = _conv_inputs()
    lengths = torch.full((2,), x.shape[-1])
    out, new_state = reference.conv_update(state, x, weight, bias, lengths)
    full = torch.cat([state, x], -1)
    expected = causal_conv1d_fn(full, weight, bias)[:, :, -x.shape[-1] :]  # over the state and the chunk
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_state, full[:, :, -3:])
    # one token at a time through transformers' in-place step gives the same outputs and state
    running = state.clone()
    steps = [causal_conv1d_update(x[:, :, i : i + 1], running, weight, bias) for i in range(x.shape[-1])]
    torch.testing.assert_close(torch.cat(steps, -1), out)
    torch.testing.assert_close(running, new_state)


def test_conv_update_of_ragged_rows_keeps_each_rows_last_real_inputs():
    state, x, weight, bias = _conv_inputs()
    lengths = torch.tensor([5, 2])  # row 1: 2 real inputs, 3 padding
    _, new_state = reference.conv_update(state, x, weight, bias, lengths)
    _, alone = reference.conv_update(state[1:], x[1:, :, :2], weight, bias, torch.tensor([2]))
    torch.testing.assert_close(new_state[1:], alone)
    # chunked = one-shot: 2 inputs, then 3 more from the state left
    _, first = reference.conv_update(state, x[:, :, :2], weight, bias, torch.tensor([2, 2]))
    out2, second = reference.conv_update(first, x[:, :, 2:], weight, bias, torch.tensor([3, 3]))
    out, whole = reference.conv_update(state, x, weight, bias, torch.tensor([5, 5]))
    torch.testing.assert_close(second, whole)
    torch.testing.assert_close(out2, out[:, :, 2:])


def test_gated_delta_step_equals_transformers_recurrence():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(1)
    b, s, h, dk, dv = 2, 4, 3, 8, 5
    q, k = torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g)
    v = torch.randn(b, s, h, dv, generator=g)
    decay, beta = -torch.rand(b, s, h, generator=g), torch.rand(b, s, h, generator=g)
    initial = torch.randn(b, h, dk, dv, generator=g)
    expected, final = torch_recurrent_gated_delta_rule(
        q, k, v, decay, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    state, outs = initial, []
    qn = torch.nn.functional.normalize(q, dim=-1) * dk**-0.5  # what the kernel does before its loop
    kn = torch.nn.functional.normalize(k, dim=-1)
    for t in range(s):
        out, state = reference.gated_delta_step(state, qn[:, t], kn[:, t], v[:, t], decay[:, t], beta[:, t])
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 1), expected)
    torch.testing.assert_close(state, final)


def _delta_rule_inputs(b=2, s=7, hk=2, hv=4, dk=8, dv=6, seed=0, hard=False):
    """``hard``: gates of Qwen3.5's range (-A * softplus: A = exp(A_log) up to 16), half the heads
    forgetting up to ~20 nats a token, so a chunk's cumulative decay passes exp's denormal range."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, hk, dk, generator=g), torch.randn(b, s, hk, dk, generator=g)
    v = torch.randn(b, s, hv, dv, generator=g)
    decay, beta = -torch.rand(b, s, hv, generator=g), torch.rand(b, s, hv, generator=g)
    if hard:
        decay[..., ::2] = -20.0 * torch.rand(decay[..., ::2].shape, generator=g) - 1.0
    return q, k, v, decay, beta, torch.randn(b, hv, dk, dv, generator=g)


@pytest.mark.parametrize(("seq", "hard"), [(1, False), (7, False), (64, False), (130, False), (130, True)])
def test_chunked_gated_delta_rule_equals_transformers_kernels(seq, hard):
    """kvforge's kernel (chunks of min(S, 64), (I + A)^-1 by block forward substitution) against
    transformers' chunked and token-by-token kernels: grouped value heads, an initial state, one
    token (decode), a whole chunk, chunks with a padded tail, and gates that forget hard (the
    decays floored above the denormals, gated_delta.LOG_DECAY_FLOOR)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    from kvforge.graphs import gated_delta

    q, k, v, decay, beta, initial = _delta_rule_inputs(s=seq, hard=hard)
    kwargs = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, state = gated_delta.export_gated_delta_rule(q, k, v, decay, beta, **kwargs)
    for kernel in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        expected, final = kernel(q, k, v, decay, beta, **kwargs)
        torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state, final, atol=2e-5, rtol=2e-5)


def test_decays_are_floored_above_the_denormals_and_the_rule_stays_exact(tmp_path):
    """``gated_delta.decay`` never returns a denormal (the CPU computes with them ~100x slower):
    exp(x) for x >= LOG_DECAY_FLOOR, exp(floor) below it, 0 for -inf. With gates that forget hard,
    the unfloored cumulative decays are denormal in places; the rule's ONNX translation in ONNX
    Runtime still equals transformers' chunked kernel (its torch form: the test above)."""
    import numpy as np
    import onnxruntime as ort
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from kvforge.graphs import gated_delta, gated_delta_onnx

    tiny = float(np.finfo(np.float32).tiny)
    x = torch.tensor([-1000.0, -100.0, -87.5, -60.0, -1.0, 0.0, float("-inf")])
    got = gated_delta.decay(x)
    assert not ((got > 0) & (got < tiny)).any()
    torch.testing.assert_close(got[3:6], x[3:6].exp())
    assert torch.all(got[:3] == torch.tensor(gated_delta.LOG_DECAY_FLOOR).exp()) and got[6] == 0

    q, k, v, decay, beta, initial = _delta_rule_inputs(s=130, hard=True)
    cum = torch.nn.functional.pad(decay.transpose(1, 2), (0, 62)).unflatten(-1, (-1, 64)).cumsum(-1)
    unfloored = cum.exp()
    assert ((unfloored > 0) & (unfloored < tiny)).any()  # the inputs reach the denormals
    kwargs = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)

    # The ONNX translation, on the op's own inputs ([B, H, S, D], heads repeated, L2-normalized).
    def norm(t):
        return torch.nn.functional.normalize(t, dim=-1).transpose(1, 2)

    qh, kh = (norm(t).repeat_interleave(2, 1) for t in (q, k))
    qh = qh * q.shape[-1] ** -0.5
    args = (qh, kh, v.transpose(1, 2), decay.transpose(1, 2), beta.transpose(1, 2), initial)

    class Rule(torch.nn.Module):
        def forward(self, query, key, value, g, beta, state):
            return torch.ops.kvforge.gated_delta_rule(query, key, value, g, beta, state)

    seq = torch.export.Dim("seq", min=1, max=256)
    shapes = ({2: seq}, {2: seq}, {2: seq}, {2: seq}, {2: seq}, None)
    program = torch.export.export(Rule(), args, dynamic_shapes=shapes)
    onnx_program = torch.onnx.export(
        program, dynamo=True, opset_version=24, custom_translation_table=gated_delta_onnx.translation_table()
    )
    assert gated_delta_onnx.expand(onnx_program.model) == 1
    path = tmp_path / "rule.onnx"
    onnx_program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out, final = session.run(None, dict(zip([i.name for i in session.get_inputs()], [t.numpy() for t in args])))
    expected, expected_final = torch_chunk_gated_delta_rule(q, k, v, decay, beta, **kwargs)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), expected.numpy(), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(final, expected_final.numpy(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_block_forward_substitution_inverts_a_unit_lower_triangular_matrix(chunk):
    from kvforge.graphs.gated_delta import unit_lower_inverse

    g = torch.Generator().manual_seed(chunk)
    a = torch.randn(3, chunk, chunk, generator=g, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(chunk, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(a) @ (eye + a), eye.expand(3, -1, -1))


def test_gated_delta_rule_of_ragged_rows_and_chunks_keeps_each_rows_state():
    """Inside a wrapper's trace (state.current()), positions past a row's length leave its state as
    it was after its last real token; a prompt run in two chunks, the state carried, gives the
    outputs and the state of one call."""
    from kvforge.graphs import gated_delta, state

    q, k, v, decay, beta, initial = _delta_rule_inputs(s=70)

    def run(sl, start_state, lengths):
        cache = ExportStateCache({}, torch.ones(2, dtype=torch.int64), lengths)
        with state.active(cache):
            return gated_delta.export_gated_delta_rule(
                q[:, sl],
                k[:, sl],
                v[:, sl],
                decay[:, sl],
                beta[:, sl],
                initial_state=start_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )

    out, ragged = run(slice(0, 70), initial, torch.tensor([70, 23]))
    _, alone = run(slice(0, 23), initial, torch.tensor([23, 23]))
    torch.testing.assert_close(ragged[1], alone[1], atol=1e-5, rtol=1e-5)  # row 1: 23 real tokens, 47 padding
    first_out, first = run(slice(0, 66), initial, torch.tensor([66, 66]))
    second_out, second = run(slice(66, 70), first, torch.tensor([4, 4]))
    torch.testing.assert_close(second[0], ragged[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first_out, second_out], 1)[0], out[0], atol=1e-5, rtol=1e-5)


def test_kernel_swap_reaches_only_the_export_models_gated_delta_layers(monkeypatch):
    """kernels.kernelize, through transformers' hub registration, puts kvforge's kernel in the
    Gated DeltaNet layers of the model it is given (its logits stay transformers'), not in another
    instance of the family (the parity reference keeps transformers' kernels)."""
    import transformers

    from kvforge.graphs import gated_delta
    from tests import families

    [(_, _, _, overrides)] = [c for c in families.CASES if c[0] == "qwen3.5"]
    config = transformers.Qwen3_5TextConfig(**{**families.COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    reference = transformers.Qwen3_5ForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    gated_delta.use_export_kernels(model)
    calls = []
    original = gated_delta.export_gated_delta_rule
    monkeypatch.setattr(gated_delta, "export_gated_delta_rule", lambda *a, **k: calls.append(1) or original(*a, **k))
    tokens = torch.tensor([[3, 17, 201, 33, 90, 4, 150, 77]])
    with torch.no_grad():
        ours, theirs = model(tokens).logits, reference(tokens).logits
    assert len(calls) == 3  # the three linear-attention layers, once each; none from the reference
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


def _kda_inputs(b=2, s=7, h=3, d=8, seed=0, hard=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    decay = -torch.rand(b, s, h, d, generator=g)  # a log decay per key channel
    if hard:  # gates that forget everything in some channels: a chunked form with exp(-cum) factors overflows
        decay[..., ::2] = -60.0
    beta = torch.rand(b, s, h, generator=g)
    return q, k, v, decay, beta, torch.randn(b, h, d, d, generator=g)


@pytest.mark.parametrize(("seq", "hard"), [(1, False), (7, False), (16, False), (40, False), (40, True)])
def test_chunked_kda_rule_equals_transformers_kernels(seq, hard):
    """KDA (a decay per key channel): kvforge's chunked rule (chunks of min(S, 16), every exponent
    <= 0) against transformers' chunked and token-by-token Kimi-Linear kernels, from a state: one
    token (decode), part of a chunk, a whole chunk, chunks with a padded tail, and gates that
    forget hard (still finite and equal)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    from kvforge.graphs import gated_delta

    q, k, v, decay, beta, initial = _kda_inputs(s=seq, hard=hard)
    kwargs = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, state = gated_delta.export_gated_delta_rule(q, k, v, decay, beta, **kwargs)
    assert torch.isfinite(ours).all() and torch.isfinite(state).all()
    for kernel in (chunk_kimi_delta_attention, recurrent_kimi_delta_attention):
        expected, final = kernel(q, k, v, decay, beta, **kwargs)
        torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state, final, atol=2e-5, rtol=2e-5)


def test_kda_rule_of_ragged_rows_and_chunks_keeps_each_rows_state():
    """As for the per-head rule: padding past a row's length leaves its state as after its last real
    token, and a prompt run in two calls (the second across a 16-token chunk) equals one call."""
    from kvforge.graphs import gated_delta, state

    q, k, v, decay, beta, initial = _kda_inputs(s=40)

    def run(sl, start_state, lengths):
        cache = ExportStateCache({}, torch.ones(2, dtype=torch.int64), lengths)
        with state.active(cache):
            return gated_delta.export_gated_delta_rule(
                q[:, sl], k[:, sl], v[:, sl], decay[:, sl], beta[:, sl],
                initial_state=start_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip

    out, ragged = run(slice(0, 40), initial, torch.tensor([40, 19]))
    _, alone = run(slice(0, 19), initial, torch.tensor([19, 19]))
    torch.testing.assert_close(ragged[1], alone[1], atol=1e-5, rtol=1e-5)
    first_out, first = run(slice(0, 10), initial, torch.tensor([10, 10]))
    second_out, second = run(slice(10, 40), first, torch.tensor([30, 30]))
    torch.testing.assert_close(second[0], ragged[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first_out, second_out], 1)[0], out[0], atol=1e-5, rtol=1e-5)


def test_kda_layout_keeps_a_conv_over_q_k_and_v_and_a_square_float32_state():
    from transformers import KimiLinearConfig

    from tests import families

    [(_, architecture, _, overrides)] = [c for c in families.CASES if c[0] == "kimi-linear"]
    config = KimiLinearConfig(**{**families.COMMON, **overrides})
    layout = architectures.state_layout(architectures.ARCHITECTURES[architecture], config, "float16")
    assert layout.attention == (1,)
    conv = contract.StateTensor("conv", (3 * 2 * 16, 3), "float16")  # q, k and v: 2 heads of 16 each; K-1 inputs
    recurrent = contract.StateTensor("recurrent", (2, 16, 16), "float32")
    assert layout.states == tuple(contract.StateEntry(i, "gated_delta", (conv, recurrent)) for i in (0, 2, 3))
    dims = architectures.Dims.from_config(config)  # latent attention: keys of 16 + 8, values of 16, every head
    assert (dims.num_kv_heads, dims.head_dim) == (4, 24)


def _qwen35_layout() -> contract.Layout:
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=16,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        vocab_size=32,
    )
    return architectures.state_layout(architectures.ARCHITECTURES["Qwen3_5ForCausalLM"], config, "bfloat16")


def test_gated_delta_layout_keeps_a_conv_and_a_float32_recurrent_state_per_linear_layer():
    layout = _qwen35_layout()
    assert layout.attention == (1,)
    conv = contract.StateTensor("conv", (2 * 2 * 8 + 4 * 6, 3), "bfloat16")  # q, k and v channels; K-1 inputs
    recurrent = contract.StateTensor("recurrent", (4, 8, 6), "float32")  # [Hv, Dk, Dv], float32 in any model
    assert layout.states == tuple(contract.StateEntry(i, "gated_delta", (conv, recurrent)) for i in (0, 2, 3))
    assert contract.past_names(layout)[2:4] == ["past_state.0.conv", "past_state.0.recurrent"]
    assert layout.state_row_bytes() == 3 * (56 * 3 * 2 + 4 * 8 * 6 * 4)


def test_mamba2_and_mamba_steps_follow_the_recurrence():
    g = torch.Generator().manual_seed(2)
    b, h, p, n = 2, 3, 4, 5
    state = torch.randn(b, h, n, p, generator=g)  # kvforge's [B, H, N, P]
    x, dt = torch.randn(b, h, p, generator=g), torch.rand(b, h, generator=g)
    a, bm, cm, d = (
        -torch.rand(h, generator=g),
        torch.randn(b, h, n, generator=g),
        torch.randn(b, h, n, generator=g),
        torch.randn(h, generator=g),
    )
    y, new = reference.mamba2_step(state, x, dt, a, bm, cm, d)
    for i in range(b):  # h_t = exp(dt·A)·h + B ⊗ dt·x; y = Cᵀ·h_t + D·x, head by head
        for j in range(h):
            expected = torch.exp(dt[i, j] * a[j]) * state[i, j] + dt[i, j] * torch.outer(bm[i, j], x[i, j])
            torch.testing.assert_close(new[i, j], expected)
            torch.testing.assert_close(y[i, j], cm[i, j] @ expected + d[j] * x[i, j])
    dm = 6
    state1 = torch.randn(b, dm, n, generator=g)
    x1, dt1 = torch.randn(b, dm, generator=g), torch.rand(b, dm, generator=g)
    a1, d1 = -torch.rand(dm, n, generator=g), torch.randn(dm, generator=g)
    bm1, cm1 = torch.randn(b, n, generator=g), torch.randn(b, n, generator=g)
    y1, new1 = reference.mamba_step(state1, x1, dt1, a1, bm1, cm1, d1)
    expected1 = torch.exp(dt1[..., None] * a1) * state1 + (dt1 * x1)[..., None] * bm1[:, None]
    torch.testing.assert_close(new1, expected1)
    torch.testing.assert_close(y1, torch.einsum("bdn,bn->bd", expected1, cm1) + d1 * x1)


def _lfm2_layout() -> contract.Layout:
    from transformers import Lfm2Config

    config = Lfm2Config(
        hidden_size=16,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    return architectures.state_layout(architectures.ARCHITECTURES["Lfm2ForCausalLM"], config, "float32")


def test_layout_names_kv_of_attention_layers_then_states():
    layout = _lfm2_layout()
    assert layout.attention == (1, 3)
    assert [(e.layer, e.kind, e.tensors[0].shape) for e in layout.states] == [
        (0, "conv", (16, 2)),
        (2, "conv", (16, 2)),
    ]
    assert contract.past_names(layout) == [
        "past_key_values.1.key",
        "past_key_values.1.value",
        "past_key_values.3.key",
        "past_key_values.3.value",
        "past_state.0.conv",
        "past_state.2.conv",
    ]
    assert contract.output_names(layout)[-2:] == ["present_state.0.conv", "present_state.2.conv"]
    assert contract.past_names(2) == contract.past_names(contract.Layout.all_attention(2))  # as before schema 3
    assert layout.state_row_bytes() == 2 * 16 * 2 * 4


def test_export_cache_zeroes_a_new_rows_state_and_takes_the_last_real_inputs():
    past = torch.randn(2, 4, 2)  # (B, C, K-1)
    cache = ExportStateCache({(0, "conv"): past}, torch.tensor([0, 5]), torch.tensor([3, 1]))
    chunk = torch.randn(2, 4, 3)
    full = cache.update_conv_state(chunk, 0)
    torch.testing.assert_close(full[0, :, :2], torch.zeros(4, 2))  # row 0 starts a sequence
    torch.testing.assert_close(full[1, :, :2], past[1])  # row 1 continues its own
    torch.testing.assert_close(cache.present[(0, "conv")][0], chunk[0, :, 1:3])
    torch.testing.assert_close(cache.present[(0, "conv")][1], torch.cat([past[1, :, 1:], chunk[1, :, :1]], -1))
    with pytest.raises(RuntimeError, match="layer 3 asks for a conv state"):
        cache.get_conv_state(3)


def _manifest_dict(layout: contract.Layout) -> dict:
    shape = [len(layout.attention), 2, 1, 1, 8, 8]
    return {
        "schema_version": 3,
        "kvforge_version": "x",
        "created_utc": "x",
        "source": {},
        "model": {
            "architecture": "Lfm2ForCausalLM",
            "model_type": "lfm2",
            "num_layers": 4,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 8,
            "hidden_size": 16,
            "vocab_size": 32,
        },
        "dtype": "float32",
        "limits": {"max_batch": 1, "max_seq": 8, "max_prompt": 8},
        "lowering": "onnx",
        "kv_cache": {"shape": shape, "dtype": "float32", "layers": list(layout.attention)},
        "graphs": {"prefill": {"file": "prefill.onnx", "sha256": "0", "inputs": [], "outputs": []}},
        "weights": {"file": "weights.data", "sha256": "0", "bytes": 0},
        "tokenizer": {},
        "generation": {},
        "versions": {},
        "parity": {},
        "state": [e.to_dict() for e in layout.states],
    }


def test_manifest_state_round_trips_and_is_checked():
    layout = _lfm2_layout()
    manifest = mf.Manifest.from_dict(_manifest_dict(layout))
    assert manifest.layout == layout
    bad = _manifest_dict(layout)
    bad["state"][0]["kind"] = "lstm"
    with pytest.raises(mf.ArtifactError, match=r"state\[0\]\.kind is 'lstm', expected one of conv"):
        mf.Manifest.from_dict(bad)
    bad = _manifest_dict(layout)
    bad["kv_cache"]["layers"] = [1, 4]  # layer 4 is not a layer of the model's 4
    with pytest.raises(mf.ArtifactError, match="are not layers of the model's 4, each listed at most once"):
        mf.Manifest.from_dict(bad)
    bad = _manifest_dict(layout)
    bad["state"][1]["tensors"][0]["dtype"] = "int8"
    with pytest.raises(mf.ArtifactError, match=r"state\[1\]\.tensors\[0\]\.dtype"):
        mf.Manifest.from_dict(bad)


def test_older_schemas_mean_every_layer_attends():
    data = _manifest_dict(contract.Layout.all_attention(4))
    old = copy.deepcopy(data)
    for version in (1, 2):
        old["schema_version"] = version
        del old["state"]
        del old["kv_cache"]["layers"]
        manifest = mf.Manifest.from_dict(copy.deepcopy(old))
        assert manifest.layout == contract.Layout.all_attention(4) and not manifest.layout.has_state
        old = copy.deepcopy(data)


# ---------------------------------------------------------------- Mamba's chunked selective scan


def _scan_inputs(batch=2, channels=6, size=4, seq=11, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, seq, generator=g)
    time_step = torch.randn(batch, channels, seq, generator=g)
    bias = torch.randn(channels, generator=g)
    a = -torch.exp(torch.randn(channels, size, generator=g))  # -exp(A_log), as the mixer computes it
    b, c = torch.randn(batch, seq, size, generator=g), torch.randn(batch, seq, size, generator=g)
    d, gate = torch.randn(channels, generator=g), torch.randn(batch, channels, seq, generator=g)
    h0 = torch.randn(batch, channels, size, generator=g)
    return x, time_step, bias, a, b, c, d, gate, h0


def _transformers_steps(x, time_step, bias, a, b, c, d, gate, h0, count):
    """transformers' Mamba decode step (``mamba_selective_state_update``), token by token from ``h0``:
    the outputs of the first ``count`` tokens and the state after them."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_state_update

    state, outs = h0.clone(), []
    for t in range(count):
        outs.append(
            mamba_selective_state_update(
                state,
                x[..., t],
                time_step[..., t],
                a,
                b[:, t],
                c[:, t],
                d,
                z=gate[..., t],
                dt_bias=bias,
                dt_softplus=True,
            )
        )
    return torch.stack(outs, -1), state


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_scan_equals_transformers_from_a_state_with_ragged_rows(chunk):
    from kvforge.graphs import mamba

    x, time_step, bias, a, b, c, d, gate, h0 = _scan_inputs()
    lengths = torch.tensor([11, 6])  # row 1: 6 real tokens, 5 padding
    dt = torch.nn.functional.softplus(time_step + bias[:, None])
    dt = dt * (torch.arange(11)[None, :] < lengths[:, None])[:, None, :]  # what ChunkedMambaScan does
    y, h = torch.ops.kvforge.selective_scan(x, dt, a, b, c, h0, chunk)
    y = (y + x * d[None, :, None]) * torch.nn.functional.silu(gate)
    for row, n in enumerate(lengths.tolist()):
        one = slice(row, row + 1)
        args = (x[one], time_step[one], bias, a, b[one], c[one], d, gate[one], h0[one])
        expected, state = _transformers_steps(*args, n)
        torch.testing.assert_close(y[one, :, :n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[one], state, atol=1e-5, rtol=1e-5)
    # the chunk sizes kvforge picks keep the decay matrix within the budget
    assert (
        mamba.chunk_length(128, 16) == 32 and mamba.chunk_length(1536, 16) == 8 and mamba.chunk_length(10**7, 64) == 1
    )


def test_chunked_scan_from_zero_equals_transformers_prefill_scan():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x, time_step, bias, a, b, c, d, gate, _ = _scan_inputs(seq=37)
    expected, final = mamba_selective_scan(
        x,
        time_step,
        a,
        b.transpose(1, 2),
        c.transpose(1, 2),
        d,
        gate,
        bias,
        delta_softplus=True,
        return_last_state=True,
    )
    dt = torch.nn.functional.softplus(time_step + bias[:, None])
    y, h = torch.ops.kvforge.selective_scan(x, dt, a, b, c, torch.zeros_like(final), 8)
    torch.testing.assert_close(
        (y + x * d[None, :, None]) * torch.nn.functional.silu(gate), expected, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(h, final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [False, True])
def test_chunked_scan_lowers_to_one_node_and_matches_in_onnx_runtime(tmp_path, fast):
    """The selective scan's two lowerings: one ``Scan`` over chunks (standard ops, no ``Loop``),
    or (``fast``, the ``gqa`` lowering) one ``com.microsoft.LinearAttention`` and no loop at all;
    both give the op's outputs and state for one token, one chunk, a ragged last chunk and several,
    at batches 1 and 2; the fast form's state written into its own buffer (as the runtime binds
    it) gives the same results bit for bit."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from kvforge.graphs import mamba

    x, time_step, bias, a, b, c, _, _, h0 = _scan_inputs(seq=9)
    dt = torch.nn.functional.softplus(time_step + bias[:, None])

    class Scan(torch.nn.Module):
        def forward(self, x, dt, b, c, h0):
            return torch.ops.kvforge.selective_scan(x, dt, a, b, c, h0, 4)

    batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=1, max=64)
    shapes = ({0: batch, 2: seq}, {0: batch, 2: seq}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch})
    program = torch.export.export(Scan(), (x, dt, b, c, h0), dynamic_shapes=shapes)
    onnx_program = torch.onnx.export(
        program, dynamo=True, opset_version=24, custom_translation_table=mamba.translation_table(fast=fast)
    )
    path = tmp_path / "scan.onnx"
    onnx_program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert "Loop" not in ops
    if fast:
        assert ops.count("LinearAttention") == 1 and "Scan" not in ops
    else:
        assert ops.count("Scan") == 1 and "LinearAttention" not in ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for length, rows in ((1, 1), (1, 2), (4, 2), (9, 1), (23, 2), (70, 2)):  # decode, a chunk, ragged, several
        xs, dts, _, _, bs, cs, _, _, _ = _scan_inputs(seq=length, seed=length)  # a: the exported one
        xs, dts, bs, cs = (t[:rows] for t in (xs, dts, bs, cs))
        dts = torch.nn.functional.softplus(dts)
        start = torch.randn(h0[:rows].shape, generator=torch.Generator().manual_seed(length))
        feeds = dict(zip(names, [t.numpy() for t in (xs, dts, bs, cs, start)]))
        y, state = session.run(None, feeds)
        expected_y, expected_state = torch.ops.kvforge.selective_scan(xs, dts, a, bs, cs, start, 4)
        np.testing.assert_allclose(y, expected_y.numpy(), atol=1e-5, rtol=1e-5, err_msg=f"S={length}")
        np.testing.assert_allclose(state, expected_state.numpy(), atol=1e-5, rtol=1e-5, err_msg=f"S={length}")
        if fast:
            binding = session.io_binding()
            shared = ort.OrtValue.ortvalue_from_numpy(feeds[names[-1]].copy())
            for name, value in feeds.items():
                binding.bind_ortvalue_input(name, shared) if name == names[-1] else binding.bind_cpu_input(name, value)
            outputs = [o.name for o in session.get_outputs()]
            binding.bind_output(outputs[0])
            binding.bind_ortvalue_output(outputs[1], shared)
            session.run_with_iobinding(binding)
            np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], y)
            np.testing.assert_array_equal(shared.numpy(), state)


def test_mamba_layout_reads_each_familys_sizes():
    from transformers import JambaConfig, MambaConfig

    config = MambaConfig(hidden_size=16, num_hidden_layers=2, state_size=4, conv_kernel=4, expand=2, vocab_size=32)
    layout = architectures.state_layout(architectures.ARCHITECTURES["MambaForCausalLM"], config, "float16")
    assert layout.attention == () and [e.layer for e in layout.states] == [0, 1]
    assert [(t.part, t.shape, t.dtype) for t in layout.states[0].tensors] == [
        ("conv", (32, 3), "float16"),
        ("recurrent", (32, 4), "float32"),
    ]
    assert contract.past_names(layout) == [
        "past_state.0.conv",
        "past_state.0.recurrent",
        "past_state.1.conv",
        "past_state.1.recurrent",
    ]
    jamba = JambaConfig(
        hidden_size=16, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_expand=2
    )
    layout = architectures.state_layout(architectures.ARCHITECTURES["JambaForCausalLM"], jamba, "float32")
    assert layout.attention == (1, 3) and [e.layer for e in layout.states] == [0, 2]
    assert layout.states[0].tensors[1].shape == (32, 4)


def test_the_chunked_scan_is_swapped_in_through_transformers_kernel_hook_alone():
    from transformers import MambaConfig, MambaForCausalLM

    from kvforge.graphs import mamba

    config = MambaConfig(
        hidden_size=16, num_hidden_layers=2, state_size=4, expand=2, vocab_size=32, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    ours, theirs = MambaForCausalLM(config).eval(), MambaForCausalLM(config).eval()
    theirs.load_state_dict(ours.state_dict())
    mamba.use_chunked_scan(ours)
    mixer = ours.backbone.layers[0].mixer
    assert mixer._kernel_funcs[mamba.KERNEL_NAME].forward.__func__ is mamba.ChunkedMambaScan.forward
    # the causal convolution takes kvforge's too (graphs/state.py CONV_KERNELS); the other hooks keep theirs
    assert mixer._kernel_funcs["causal_conv1d_forward"].forward.__func__ is ExportCausalConv1dForward.forward
    assert "forward" not in vars(mixer._kernel_funcs["selective_scan_fn"])
    with pytest.raises(RuntimeError, match="a second kernelize would put transformers' forward back"):
        mamba.use_chunked_scan(ours)  # kernels.kernelize resets every hook its mapping leaves out
    assert "forward" not in vars(theirs.backbone.layers[0].mixer._kernel_funcs[mamba.KERNEL_NAME])  # per model
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Mamba2 (SSD) scan, kvforge.graphs.mamba2


def _ssd_inputs(batch=2, seq=11, heads=4, head_dim=3, groups=2, size=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, seq, heads, head_dim, generator=g),
        dt=torch.rand(batch, seq, heads, generator=g),  # after softplus: positive
        a=-torch.rand(heads, generator=g) - 0.1,
        b=torch.randn(batch, seq, groups, size, generator=g),
        c=torch.randn(batch, seq, groups, size, generator=g),
        d=torch.randn(heads, generator=g),
        initial_state=torch.randn(batch, heads, size, head_dim, generator=g),  # kvforge's [B, H, N, P]
    )


def test_mamba2_scan_equals_transformers_chunk_scan_and_the_recurrent_step():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    from kvforge.graphs.mamba2 import ssd_scan

    t = _ssd_inputs()
    y, final = ssd_scan(**t, lengths=None)
    # transformers' chunked scan in chunks of 4 (11 positions: three chunks, the last one padded)
    # transformers' state is [B, H, P, N], kvforge's the same transposed
    expected, expected_final = mamba2_chunk_scan(
        t["x"], t["dt"], t["a"], t["b"], t["c"], chunk_size=4, D=t["d"],
        initial_states=t["initial_state"].transpose(-1, -2), return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    # token by token through the reference step: the same outputs and state
    state, outs = t["initial_state"], []
    heads = t["x"].shape[2]
    for s in range(t["x"].shape[1]):
        b, c = (t[k][:, s].repeat_interleave(heads // t["b"].shape[2], dim=1) for k in ("b", "c"))
        out, state = reference.mamba2_step(state, t["x"][:, s], t["dt"][:, s], t["a"], b, c, t["d"])
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 1), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


def test_mamba2_scan_of_ragged_rows_keeps_each_rows_state_after_its_last_real_token():
    from kvforge.graphs.mamba2 import ssd_scan

    t = _ssd_inputs()
    y, final = ssd_scan(**t, lengths=torch.tensor([11, 5]))  # row 1: 5 real positions, 6 padding
    alone = {k: v[1:, :5] if k in ("x", "dt", "b", "c") else v for k, v in t.items()}
    alone["initial_state"] = t["initial_state"][1:]
    y1, final1 = ssd_scan(**alone, lengths=None)
    torch.testing.assert_close(final[1:], final1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y[1:, :5], y1, atol=1e-6, rtol=1e-6)
    full, full_final = ssd_scan(**t, lengths=None)
    torch.testing.assert_close(final[0], full_final[0])  # a full row is untouched by the masking
    # chunked = one-shot: 4 positions, then the other 7 from the state left
    first = {k: v[:, :4] if k in ("x", "dt", "b", "c") else v for k, v in t.items()}
    rest = {k: v[:, 4:] if k in ("x", "dt", "b", "c") else v for k, v in t.items()}
    y_a, state = ssd_scan(**first, lengths=None)
    y_b, state = ssd_scan(**{**rest, "initial_state": state}, lengths=None)
    torch.testing.assert_close(torch.cat([y_a, y_b], 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, full_final, atol=1e-5, rtol=1e-5)


def test_mamba2_scan_exports_with_a_symbolic_sequence_length():
    from kvforge.graphs.mamba2 import ssd_scan

    t = _ssd_inputs(seq=7)

    class Scan(torch.nn.Module):
        def forward(self, x, dt, b, c, initial_state, lengths):
            return ssd_scan(x, dt, t["a"], b, c, t["d"], initial_state, lengths)

    batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=1, max=64)
    rows = {0: batch, 1: seq}
    args = (t["x"], t["dt"], t["b"], t["c"], t["initial_state"], torch.tensor([7, 3]))
    program = torch.export.export(Scan(), args, dynamic_shapes=(rows, rows, rows, rows, {0: batch}, {0: batch}))
    for length in (1, 20):  # decode (one position) and a prompt longer than the traced one
        u = _ssd_inputs(seq=length, seed=length)
        lengths = torch.tensor([length, 1])
        got = program.module()(u["x"], u["dt"], u["b"], u["c"], u["initial_state"], lengths)
        want = ssd_scan(u["x"], u["dt"], t["a"], u["b"], u["c"], t["d"], u["initial_state"], lengths)
        torch.testing.assert_close(got, want)


def _mamba2_family_layout(case: str) -> contract.Layout:
    import transformers

    from tests import families

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == case]
    config = getattr(transformers, config_class)(**{**families.COMMON, **overrides})
    return architectures.state_layout(architectures.ARCHITECTURES[architecture], config, "float32")


def test_mamba2_layouts_of_each_family():
    conv, recurrent = (128 + 2 * 2 * 16, 3), (8, 16, 16)  # [H*P + 2*G*N, K-1], [H, N, P]
    shapes = [(conv, "float32"), (recurrent, "float32")]
    expected = {
        "mamba2": ((), (0, 1)),  # no layer attends
        "granitemoehybrid": ((1,), (0, 2, 3)),
        "bamba": ((1,), (0, 2)),
        "nemotron-h": ((1,), (0, 4)),  # blocks 2 (MLP) and 3 (MoE) keep neither
        "falcon-h1": ((0, 1), (0, 1)),  # every layer both
    }
    for case, (attention, stateful) in expected.items():
        layout = _mamba2_family_layout(case)
        assert layout.attention == attention, case
        assert [e.layer for e in layout.states] == list(stateful), case
        assert all(e.kind == "mamba2" for e in layout.states)
        assert [[(t.shape, t.dtype) for t in e.tensors] for e in layout.states] == [shapes] * len(stateful), case
        # the recurrent state is recorded as kvforge's [H, N, P]; an entry without axes is [H, P, N]
        assert all([t.axes for t in e.tensors] == ["", "hnp"] for e in layout.states), case
    entry = _mamba2_family_layout("mamba2").states[0]
    recorded = {"part": "recurrent", "shape": [8, 16, 16], "dtype": "float32", "axes": "hnp"}
    assert entry.to_dict()["tensors"][1] == recorded
    older = entry.to_dict()
    del older["tensors"][1]["axes"]  # as artifacts compiled before the layout change recorded it
    assert contract.StateEntry.from_dict(older).tensors[1] == contract.StateTensor("recurrent", (8, 16, 16), "float32")
    names = contract.past_names(_mamba2_family_layout("falcon-h1"))
    assert names[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert names[-4:] == ["past_state.0.conv", "past_state.0.recurrent", "past_state.1.conv", "past_state.1.recurrent"]


def test_manifest_takes_layers_with_kv_and_a_state_or_neither():
    for case in ("falcon-h1", "nemotron-h"):
        layout = _mamba2_family_layout(case)
        data = _manifest_dict(layout)
        data["model"]["num_layers"] = 5 if case == "nemotron-h" else 2
        assert mf.Manifest.from_dict(data).layout == layout
    bad = _manifest_dict(_mamba2_family_layout("falcon-h1"))
    bad["model"]["num_layers"] = 2
    bad["state"][1]["layer"] = 0  # layer 0's state listed twice
    with pytest.raises(mf.ArtifactError, match="each listed at most once among each"):
        mf.Manifest.from_dict(bad)


def test_kernelize_swaps_the_scan_only_inside_an_export_trace():
    import transformers

    from kvforge.graphs import mamba2, state
    from tests import families

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "mamba2"]
    config = getattr(transformers, config_class)(**{**families.COMMON, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    ids = torch.tensor([[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101]])
    with torch.no_grad():
        before = model(ids).logits
        assert mamba2.kernelize(model) == config.num_hidden_layers
        after = model(ids).logits  # no trace in progress: transformers' own scan, bit for bit
    torch.testing.assert_close(after, before, atol=0, rtol=0)

    layout = architectures.state_layout(architectures.ARCHITECTURES[architecture], config, "float32")
    past = {(e.layer, t.part): torch.zeros(1, *t.shape) for e in layout.states for t in e.tensors}
    cache = ExportStateCache(past, torch.tensor([0]), torch.tensor([ids.shape[1]]))
    with torch.no_grad(), state.active(cache):
        traced = model.backbone(input_ids=ids, cache=cache, use_cache=False).last_hidden_state
    torch.testing.assert_close(model.lm_head(traced), before, atol=1e-5, rtol=1e-5)
    assert set(cache.present) == {(i, part) for i in (0, 1) for part in ("conv", "recurrent")}
