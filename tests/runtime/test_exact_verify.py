"""The ``exact`` lowering: a speculative verify call gives bit for bit what one-token steps give
(issue 23), so greedy output under drafting is plain decoding's, in float32 and in int4.

On tiny random Llamas compiled with ``lowering="exact"``:

* fp32, GQA (4 query heads, 2 KV heads): one k-token verify call (k = 2, 5, 8; one row, and two
  rows of different lengths in one call) gives exactly (``np.array_equal``) the logits of k
  one-token decode steps and writes exactly the same keys and values in every layer; the plain
  engine's steps (through the prefill graph) give those same logits; its logits are transformers'
  within 1e-4.
* int4 (``MatMulNBits``, ``accuracy_level`` 4: int8 activations, where on SmolLM2 a 1e-6
  difference grows to ~0.5 in the gqa lowering), no grouping (4 query heads, 4 KV heads: the
  lowering doubles the query rows): the same equalities, and greedy output with n-gram drafts is
  token-identical to plain decoding for one row and for a batch of three.
* Opt-in (``-m real_model``): SmolLM2-135M-Instruct ``--quantize int4 --lowering exact``, a
  code-edit chat turn with n-gram drafting gives plain decoding's tokens, with drafts accepted.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime import Engine
from kvforge.runtime.speculative import SpeculativeConfig
from kvforge.runtime.speculative.cost import QUANTIZED_WIDTH_COST
from tests.helpers import hf_logits, make_llama

PROMPT = [(i * 37) % 300 + 2 for i in range(60)]
SPEC = SpeculativeConfig(method="prediction", prediction_k=8)


@pytest.fixture(scope="module")
def exact_fp32(llama_dir, tmp_path_factory):
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("exact") / "fp32"
    compile_model(  # no ORT-optimized copies (seconds saved): ORT optimizes these graphs at load
        llama_dir, out, max_batch=2, max_seq=96, lowering="exact", score_graph=False, optimize=False, progress=None
    )
    return out


@pytest.fixture(scope="module")
def exact_int4_mha(tmp_path_factory):
    from kvforge.compile import compile_model

    root = tmp_path_factory.mktemp("exact-int4")
    model = make_llama(root / "model", seed=3, num_key_value_heads=4)
    out = root / "out"
    compile_model(  # no ORT-optimized copies (seconds saved): ORT optimizes these graphs at load
        model, out, max_batch=4, max_seq=96, lowering="exact", quantize="int4", score_graph=False, optimize=False,
        progress=None,
    )  # fmt: skip
    return out


def _verify_vs_steps(engine: Engine, rows: int, k: int, start: int) -> None:
    """Row r holds ``PROMPT[:start + 3r]`` (rows of different lengths in one call); one k-token
    call against k steps: logits and every written key/value must be equal, bit for bit."""
    starts = [start + 3 * r for r in range(rows)]
    engine.prefill_rows([PROMPT[:n] for n in starts], [0] * rows, 0)
    engine.lengths[:rows] = starts
    tokens = np.array([PROMPT[n : n + k] for n in starts])
    engine.verify_ids(rows, k)[:] = tokens
    one_call = engine.verify_rows(rows, k, 0).copy()

    def written():
        views = engine.cache.views(rows, 0)
        return {(name, r): np.array(c[r, :, n : n + k]) for name, c in views.items() for r, n in enumerate(starts)}

    by_call = written()
    engine.lengths[:rows] = starts
    steps = []
    for j in range(k):
        engine.decode_ids(rows)[:] = tokens[:, j]
        steps.append(engine.decode_rows(rows, 0).copy())
    assert np.array_equal(one_call, np.stack(steps, axis=1)), f"rows={rows} k={k}: logits differ"
    for key, by_steps in written().items():
        assert np.array_equal(by_call[key], by_steps), f"rows={rows} k={k}: {key} differs"


@pytest.mark.parametrize("which", ["exact_fp32", "exact_int4_mha"])
def test_verify_call_equals_one_token_steps(request, which):
    out = request.getfixturevalue(which)
    with Engine.load(out, speculative=SPEC, prefix_cache=0) as spec, Engine.load(out, prefix_cache=0) as plain:
        for rows, k, start in [(1, 2, 7), (1, 5, 20), (1, 8, 33), (2, 4, 11)]:
            _verify_vs_steps(spec, rows, k, start)
        # the speculative engine's one-token steps (verify graph) are the plain engine's (prefill graph)
        a = spec.prefill([PROMPT[:12]]).copy()
        b = plain.prefill([PROMPT[:12]]).copy()
        assert np.array_equal(a, b)
        for token in PROMPT[12:18]:
            assert np.array_equal(spec.decode([token]), plain.decode([token]))


def test_exact_lowering_matches_transformers(exact_fp32, llama_reference):
    with Engine.load(exact_fp32, prefix_cache=0) as e:
        logits = e.prefill([PROMPT[:20]])[0]
        want = hf_logits(llama_reference, PROMPT[:20])[-1].numpy()
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)
        assert e.manifest.lowering == "exact"


def test_cli_drafts_on_exact_artifact_need_no_note(exact_fp32, capsys):
    """``kvforge generate --speculative`` notes near-ties for gqa/onnx artifacts (test_speculative);
    on an exact one drafting gives plain decoding's tokens bit for bit, so it says nothing."""
    from kvforge.tools.cli import main

    assert main(["generate", str(exact_fp32), "hi", "--max-new-tokens", "2", "--speculative", "ngram"]) == 0
    assert "near-ties" not in capsys.readouterr().err


def test_int4_blocks_never_run_on_one_row(exact_int4_mha):
    """Every MatMulNBits of the exact lowering reads a Pad that adds a zero row when its call has
    one (compile/quantize.never_one_row): on an AVX2-only CPU MLAS's one-row int4 kernel rounds
    differently from its many-row kernel, and the verify call above would differ from the steps."""
    import onnx

    for graph_file in ("prefill.onnx", "verify.onnx"):
        graph = onnx.load(str(exact_int4_mha / graph_file), load_external_data=False).graph
        producers = {out: node for node in graph.node for out in node.output}
        blocks = [node for node in graph.node if node.op_type == "MatMulNBits"]
        assert blocks and all(producers[node.input[0]].op_type == "Pad" for node in blocks), graph_file


def test_int4_greedy_identical_with_ngram_drafts(exact_int4_mha):
    repeat = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
    prompts = [repeat, [1, 2, 3, 4, 1, 2, 3], list(range(30, 50)) * 2]
    with Engine.load(exact_int4_mha) as plain, Engine.load(exact_int4_mha, speculative="ngram:4") as spec:
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=40)]
        batch = spec.generate(prompts, max_new_tokens=40)
        single = [spec.generate([p], max_new_tokens=40)[0] for p in prompts]
    assert [r.token_ids for r in batch] == want
    assert [r.token_ids for r in single] == want
    assert sum(r.accepted_tokens for r in single) > 0 and sum(r.accepted_tokens for r in batch) > 0
    assert spec.width_cost == QUANTIZED_WIDTH_COST  # quantized weights: a verify call's tokens cost more


CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def format_receipt(items, tax_rate):
    lines = []
    for item in items:
        lines.append(f"{item['name']}: {item['price'] * item['quantity']:.2f}")
    lines.append(f"Total: {total_price(items, tax_rate):.2f}")
    return "\\n".join(lines)
"""


@pytest.mark.real_model
def test_smollm2_int4_code_edit_identical_with_ngram_drafts(smollm2_dir, tmp_path_factory):
    from kvforge.compile import compile_model
    from kvforge.runtime import SamplingParams

    out = tmp_path_factory.mktemp("smollm2-exact") / "int4"
    compile_model(smollm2_dir, out, max_seq=1024, lowering="exact", quantize="int4", score_graph=False, progress=None)
    messages = [{"role": "user", "content": "Rename total_price to order_total everywhere in this code:\n\n" + CODE}]
    greedy = SamplingParams(temperature=0)
    with Engine.load(out) as plain, Engine.load(out, speculative="ngram:8") as spec:
        want = plain.chat(messages, max_new_tokens=256, sampling=greedy)
        got = spec.chat(messages, max_new_tokens=256, sampling=greedy)
    assert got.token_ids == want.token_ids
    assert got.accepted_tokens > 50
