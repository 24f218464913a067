"""Every verified family end to end (tests/families.py), under both lowerings: compile, then
prefill and decode logits within tolerance of transformers, 36 greedy tokens identical to
transformers' generate for batch 1 and for a ragged batch of 2, and a prompt prefilled in two
chunks gives the logits of one call. Prompts + outputs cross the 8-token sliding windows and
Phi-3's 32-token longrope switch. Under the onnx lowering, the graph
TensorRT builds from, ``inspect``'s TensorRT lint finds no unsupported op, no restriction
violation and an opset in the parser's range in every graph of every family (Gemma-2's soft-cap
included: it is lowered to Tanh ops, not to ``Attention``'s ``softcap``)."""

from __future__ import annotations

import pytest
import torch

from kvforge.compile import compile_model
from kvforge.runtime import Engine
from tests import families
from tests.helpers import assert_close, hf_greedy

ATOL, RTOL = 2e-4, 2e-4  # fp32; MoE routing and soft-caps add a little summation-order noise
NEW_TOKENS = 36
PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31]]


def _hf_steps(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' logits as its generate sees them: prefill, then one step per token with its cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits = [out.logits[0, -1].float()]
        for i, token in enumerate(tokens):  # explicit positions: Bamba's forward mis-derives them from its cache
            position = torch.tensor([[len(prompt) + i]])
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True, position_ids=position)
            logits.append(out.logits[0, -1].float())
    return logits


def _assert_tensorrt_lint_clean(out, case: str) -> None:
    """The TensorRT lint of kvforge inspect, as is: nothing unsupported, no violation, opset in range."""
    from kvforge.tools.inspect_artifact import inspect

    report = inspect(out)["tensorrt"]
    findings = {
        name: {k: check[k] for k in ("unsupported", "violations") if check[k]}
        | ({} if check["opset_ok"] else {"opset": check["opset"]})
        for name, check in report["graphs"].items()
    }
    findings = {name: f for name, f in findings.items() if f}
    assert not findings and report["compatible"], f"{case}: TensorRT lint findings {findings}"


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["onnx", "gqa"])
@pytest.mark.parametrize(
    ("case", "architecture", "config_class", "overrides"), families.CASES, ids=[c[0] for c in families.CASES]
)
def test_family(case, architecture, config_class, overrides, lowering, tmp_path):
    import transformers

    model_dir = families.build(tmp_path / "model", architecture, config_class, overrides)
    out = tmp_path / "out"
    # onnx: the portable graph as TensorRT gets it; gqa: ORT's fast path, with the ORT-optimized graphs.
    manifest = compile_model(
        model_dir,
        out,
        max_batch=2,
        max_seq=64,
        lowering=lowering,
        score_graph=False,
        optimize=lowering == "gqa",
        progress=None,
    )
    assert manifest.model.architecture == architecture
    assert manifest.parity["greedy_match"] and manifest.parity["verified_family"]
    if lowering == "onnx":
        _assert_tensorrt_lint_clean(out, case)
    reference = getattr(transformers, architecture).from_pretrained(model_dir, attn_implementation="eager").eval()

    with Engine.load(out) as engine:
        # Logits: prefill, then teacher-forced decode steps on transformers' greedy tokens.
        expected_tokens = hf_greedy(reference, PROMPTS[0], NEW_TOKENS)
        steps = expected_tokens[:20]
        ours = [engine.prefill([PROMPTS[0]])[0].copy()]
        for token in steps:
            ours.append(engine.decode([token])[0].copy())
        theirs = _hf_steps(reference, PROMPTS[0], steps)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_close(a, b, ATOL, RTOL, f"{case}: {'prefill' if i == 0 else f'decode step {i}'} logits")

        # Greedy generation: batch 1, and a ragged batch of 2 where each row equals its batch-1 run.
        [alone] = engine.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)
        assert alone.token_ids == expected_tokens
        batch = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert batch[0].token_ids == expected_tokens
        assert batch[1].token_ids == hf_greedy(reference, PROMPTS[1], NEW_TOKENS)
        assert len(batch[1].token_ids) == NEW_TOKENS

        # Chunked prefill: the 12-token prompt in chunks of 5 and 7 (crossing the 8-token windows)
        one_shot = engine.prefill([PROMPTS[0]])[0].copy()
        engine.prefill([PROMPTS[0][:5]])
        chunked = engine.prefill([PROMPTS[0][5:]], start=[5])[0].copy()
        assert_close(chunked, one_shot, 1e-5, 1e-5, f"{case}: chunked prefill logits")
