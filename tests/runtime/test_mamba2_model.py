"""Mamba2 (SSD) families end to end on the runtime: Mamba2 itself (every layer a Mamba2 mixer, no KV
at all; the ``gqa`` lowering, whose scan is ONNX Runtime's ``LinearAttention``), Granite 4
(``granitemoehybrid``: Mamba2 layers beside an attention layer, MoE MLPs; the portable ``onnx``
lowering, the scan in standard ops) and Zamba2 (Mamba2 layers, and hybrid layers that run one
shared attention block, each with its own KV, before their mixer; ``gqa``). Each artifact records
a conv and a float32 recurrent state per Mamba2 layer and KV only for the layers that attend; its
graphs hold no loop (an ``If`` per mixer's convolution, on the call's length); prefill and
teacher-forced decode logits are within fp32 tolerance of transformers; greedy output equals
transformers' generate for a ragged batch and at both ends of ``max_seq`` (a 1-token prompt run
to a full row, a full-length prompt); chunked prefill (chunks shorter and longer than
transformers' ``chunk_size`` of 8) equals one-shot prefill; in-flight batching with more requests
than rows gives every request its solo result; prompt-lookup drafting and the prefix cache (a
chat's next turn resuming from a state snapshot) give the tokens of a plain engine; ``compare``
reads every state and KV layer within tolerance of transformers' cache.
Bamba, Nemotron-H and Falcon-H1 run the same checks in tests/runtime/test_families.py."""

from __future__ import annotations

import onnx
import pytest
import torch
import transformers

from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine
from tests import families
from tests.helpers import (
    assert_close,
    check_chunked_prefill,
    check_greedy_at_both_ends_of_max_seq,
    check_in_flight_batching,
    check_state_features,
    hf_greedy,
)

ATOL, RTOL = 2e-4, 2e-4  # fp32, as tests/runtime/test_families.py
PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64, 5, 88, 23, 41, 9, 200, 7], [7, 5, 9, 250, 31]]
MAX_SEQ = 40
CASES = ("mamba2", "granitemoehybrid", "zamba2")
LOWERINGS = {"mamba2": "gqa", "granitemoehybrid": "onnx", "zamba2": "gqa"}


def _compile(case: str, root) -> tuple:
    from kvforge.compile import compile_model

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == case]
    model_dir = families.build(root / "model", architecture, config_class, overrides)
    # without ORT's graph optimization, to keep the compile short: Mamba2 on the CPU default's
    # lowering (the scan as ORT's LinearAttention), Granite 4 on the portable one (the scan in
    # standard ops); both lowerings of every Mamba2 family run in tests/runtime/test_families.py
    compile_model(
        model_dir, root / "out", max_batch=2, max_seq=MAX_SEQ, lowering=LOWERINGS[case], optimize=False,
        score_graph=False, progress=None,
    )  # fmt: skip
    reference = getattr(transformers, architecture).from_pretrained(model_dir).eval()
    return root / "out", reference


@pytest.fixture(scope="session")
def mamba2_models(tmp_path_factory) -> dict:
    """Each case of :data:`CASES` compiled once per session: ``{case: (artifact, transformers model)}``."""
    return {case: _compile(case, tmp_path_factory.mktemp(case)) for case in CASES}


@pytest.fixture(params=CASES)
def family(request, mamba2_models):
    artifact, reference = mamba2_models[request.param]
    with Engine.load(artifact) as engine:
        yield request.param, engine, reference


def test_manifest_records_mamba2_states_and_kv_only_where_layers_attend(mamba2_models):
    # zamba2: its hybrid layers keep KV (the shared attention block's, one cache per layer that runs
    # it) and a Mamba2 state each
    expected = {"mamba2": ([], [0, 1]), "granitemoehybrid": ([1], [0, 2, 3]), "zamba2": ([1, 3, 4], [0, 1, 2, 3, 4])}
    for case, (attention, stateful) in expected.items():
        artifact, _ = mamba2_models[case]
        manifest = mf.read(artifact)
        assert manifest.kv_cache.get("layers", []) == attention and manifest.kv_cache["shape"][0] == len(attention)
        assert [(e["layer"], e["kind"]) for e in manifest.state] == [(i, "mamba2") for i in stateful]
        tensors = [(t["part"], t["shape"], t["dtype"]) for t in manifest.state[0]["tensors"]]
        assert tensors == [("conv", [192, 3], "float32"), ("recurrent", [8, 16, 16], "float32")]
        inputs = [t.name for t in manifest.graphs["prefill"].inputs]
        assert inputs[-2:] == [f"past_state.{stateful[-1]}.conv", f"past_state.{stateful[-1]}.recurrent"]
        for name in ("prefill", "decode"):
            ops = [n.op_type for n in onnx.load(str(artifact / f"{name}.onnx"), load_external_data=False).graph.node]
            assert not {"Loop", "Scan"} & set(ops), case
            # each mixer's causal convolution: an If on the call's length (one token: K products and a
            # sum per channel; more: a Conv over the valid positions)
            assert ops.count("If") == len(stateful), (case, name)
            # gqa: each Mamba2 layer's scan is one ORT LinearAttention; onnx: standard ops only
            assert ops.count("LinearAttention") == (len(stateful) if LOWERINGS[case] == "gqa" else 0), (case, name)


def _hf_steps(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' logits as its generate sees them: prefill, then one step per token with its cache."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for i, token in enumerate(tokens):  # explicit positions, as generate passes them
            position = torch.tensor([[len(prompt) + i]])
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True, position_ids=position)
            logits.append(out.logits[0, -1])
    return logits


def test_logits_and_greedy_tokens_equal_transformers_for_a_ragged_batch(family):
    case, engine, reference = family
    expected = [hf_greedy(reference, p, 16) for p in PROMPTS]
    steps = expected[0][:8]
    ours = [engine.prefill([PROMPTS[0]])[0].copy()] + [engine.decode([t])[0].copy() for t in steps]
    for i, (a, b) in enumerate(zip(ours, _hf_steps(reference, PROMPTS[0], steps))):
        assert_close(a, b.numpy(), ATOL, RTOL, f"{case}: {'prefill' if i == 0 else f'decode step {i}'} logits")
    batch = engine.generate(PROMPTS, max_new_tokens=16)  # row 1 right-padded by 14 in the prefill
    assert [r.token_ids for r in batch] == expected, case


def test_chunked_prefill_equals_one_shot_prefill(family):
    case, engine, _ = family
    # chunks shorter and longer than chunk_size 8
    check_chunked_prefill(engine, PROMPTS[0], ((1, 19), (3, 11, 19), (9, 10, 19)), f"{case}: ")


def test_greedy_equals_transformers_at_both_ends_of_max_seq(family):
    case, engine, reference = family
    check_greedy_at_both_ends_of_max_seq(engine, reference, case)


def test_in_flight_batching_moves_states_with_their_rows(family):
    case, engine, reference = family
    prompts = [PROMPTS[0], PROMPTS[1], [11, 2], [40, 41, 42, 43, 44, 45, 46]]
    check_in_flight_batching(engine, reference, prompts, [12, 5, 14, 8], prefill_chunk=6, label=f"{case}: ")


@pytest.mark.parametrize("case", CASES)
def test_drafting_and_the_prefix_cache_give_plain_tokens(mamba2_models, case):
    check_state_features(mamba2_models[case][0], [5, 6, 7, 8] * 2, [40, 41, 42], new=6)


def test_compare_reads_each_mamba2_state_as_transformers_holds_it(family):
    """``compare``'s per-layer diffs after a prompt and its greedy continuation: every conv and
    recurrent state (kvforge's ``[H, N, P]`` read against transformers' ``[H, P, N]``) and the
    attention layer's KV within fp32 tolerance of transformers' cache. The state here is square
    (P = N = 16), so only reading it the right way round passes."""
    from kvforge.tools import compare

    case, engine, reference = family
    continuation = hf_greedy(reference, PROMPTS[0], 4)
    compare._teacher_forced(engine, [PROMPTS[0]], [continuation])
    diffs = compare._layer_diffs(engine, reference, PROMPTS[0] + continuation)
    stateful = [e.layer for e in engine.manifest.layout.states]
    assert {(layer, "recurrent") for layer in stateful} | {(layer, "conv") for layer in stateful} <= set(diffs), case
    assert all(d is not None and d < ATOL for d in diffs.values()), (case, diffs)
