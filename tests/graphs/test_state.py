"""The model-state contract (schema 3): the pure-torch reference of each state kind's update equals
transformers' own kernels (the conv state against ``causal_conv1d_fn``/``causal_conv1d_update``,
the gated delta step against ``torch_recurrent_gated_delta_rule``, Mamba2's and Mamba's steps
against the recurrences written out), ragged rows keep the state of their last real input, the
layout names every graph input/output, the export cache zeroes the state of a row that starts a
sequence, and a manifest with state entries is checked field by field while schema-1/2 artifacts
keep their meaning (every layer attends). kvforge's Mamba2 scan (:mod:`kvforge.graphs.mamba2`)
equals transformers' chunked scan and the recurrent step (initial state included), keeps each
ragged row's state at its last real token, continues a chunk from the state it left, and exports
with a symbolic length; each Mamba2 family's layout (no attention, hybrid, both in one layer,
neither in an MLP block) is read from its config and accepted by the manifest; the swapped-in scan
runs only inside an export trace."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge.graphs import architectures, contract, reference
from kvforge.graphs import manifest as mf
from kvforge.graphs.state import ExportStateCache


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


def test_mamba2_and_mamba_steps_follow_the_recurrence():
    g = torch.Generator().manual_seed(2)
    b, h, p, n = 2, 3, 4, 5
    state = torch.randn(b, h, p, n, generator=g)
    x, dt = torch.randn(b, h, p, generator=g), torch.rand(b, h, generator=g)
    a, bm, cm, d = (
        -torch.rand(h, generator=g),
        torch.randn(b, h, n, generator=g),
        torch.randn(b, h, n, generator=g),
        torch.randn(h, generator=g),
    )
    y, new = reference.mamba2_step(state, x, dt, a, bm, cm, d)
    for i in range(b):  # h_t = exp(dt·A)·h + dt·x ⊗ B; y = h_t·C + D·x, head by head
        for j in range(h):
            expected = torch.exp(dt[i, j] * a[j]) * state[i, j] + dt[i, j] * torch.outer(x[i, j], bm[i, j])
            torch.testing.assert_close(new[i, j], expected)
            torch.testing.assert_close(y[i, j], expected @ cm[i, j] + d[j] * x[i, j])
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
        initial_state=torch.randn(batch, heads, head_dim, size, generator=g),
    )


def test_mamba2_scan_equals_transformers_chunk_scan_and_the_recurrent_step():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    from kvforge.graphs.mamba2 import ssd_scan

    t = _ssd_inputs()
    y, final = ssd_scan(**t, lengths=None)
    # transformers' chunked scan in chunks of 4 (11 positions: three chunks, the last one padded)
    expected, expected_final = mamba2_chunk_scan(
        t["x"], t["dt"], t["a"], t["b"], t["c"], chunk_size=4, D=t["d"], initial_states=t["initial_state"],
        return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)
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
    conv, recurrent = (128 + 2 * 2 * 16, 3), (8, 16, 16)  # [H*P + 2*G*N, K-1], [H, P, N]
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
