"""``Engine.load(prefill="openvino")``: prefill calls of many tokens on OpenVINO, decode on ORT, one
cache. Against the ORT engine and transformers on the tiny Llama (fp32, gqa): logits and the cache
rows a prefill wrote within fp32 tolerance, greedy tokens equal, ragged batches, a chunked
continuation, short calls left on ORT, speculative decoding (prompts on OpenVINO, verify steps on
ORT; with every batch-loop feature in one batch), and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvforge.runtime import Engine
from kvforge.runtime.ov_prefill import MIN_TOKENS
from tests.helpers import assert_close, hf_greedy, hf_logits

pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")

ATOL, RTOL = 1e-4, 1e-4  # fp32 on both runtimes: summation order only
RNG = np.random.default_rng(7)
LONG = [0, *RNG.integers(2, 384, 47).tolist()]  # 48 tokens: over MIN_TOKENS
SECOND = [0, *RNG.integers(2, 384, 34).tolist()]  # 35 tokens


@pytest.fixture(scope="module")
def engines(llama_artifact):
    with Engine.load(llama_artifact, prefill="openvino") as ov, Engine.load(llama_artifact) as ort:
        yield ov, ort


def test_a_long_prefill_runs_on_openvino_and_matches_ort_and_transformers(engines, llama_reference):
    ov, ort = engines
    assert len(LONG) >= MIN_TOKENS
    before = ov.backend.long_prefill.calls
    got, want = ov.prefill([LONG])[0].copy(), ort.prefill([LONG])[0].copy()
    assert ov.backend.long_prefill.calls == before + 1
    assert_close(got, want, ATOL, RTOL, "prefill logits, OpenVINO vs ORT")
    assert_close(got, hf_logits(llama_reference, LONG)[-1], ATOL, RTOL, "prefill logits vs transformers")
    n = len(LONG)  # the K/V OpenVINO computed are in the engine's own cache, at each position
    assert_close(ov.cache.buffer[:, :, 0, :, :n], ort.cache.buffer[:, :, 0, :, :n], ATOL, RTOL, "cache rows")
    assert not ov.cache.buffer[:, :, 0, :, n:].any(), "OpenVINO wrote past the prompt's positions"


def test_greedy_generation_equals_transformers(engines, llama_reference):
    ov, _ = engines
    calls = ov.backend.long_prefill.calls
    [result] = ov.generate([LONG], max_new_tokens=20)
    assert ov.backend.long_prefill.calls == calls + 1  # the prompt on OpenVINO, every step on ORT
    assert result.token_ids == hf_greedy(llama_reference, LONG, 20)


def test_a_batch_runs_as_one_call_and_decode_continues_from_rows_openvino_wrote(engines):
    ov, ort = engines
    calls = ov.backend.long_prefill.calls
    # one call of both rows, padded as ORT's: its paged attention takes each row as a sequence
    got = ov.prefill([LONG, SECOND]).copy()
    assert ov.backend.long_prefill.calls == calls + 1
    want = ort.prefill([LONG, SECOND]).copy()
    assert_close(got, want, ATOL, RTOL, "per-row prefill logits vs ORT's batch")
    for row, n in enumerate((len(LONG), len(SECOND))):
        assert_close(ov.cache.buffer[:, :, row, :, :n], ort.cache.buffer[:, :, row, :, :n], ATOL, RTOL, f"row {row}")
    tokens = got.argmax(axis=1)
    for _ in range(6):  # decode (on ORT) continues from the rows OpenVINO wrote
        a, b = ov.decode(tokens).copy(), ort.decode(tokens).copy()
        assert_close(a, b, ATOL, RTOL, "decode after an OpenVINO prefill")
        tokens = a.argmax(axis=1)


def test_a_batch_with_a_short_row_stays_on_ort(engines):
    ov, ort = engines
    calls = ov.backend.long_prefill.calls
    rows = [LONG, SECOND[: MIN_TOKENS - 1]]
    assert_close(ov.prefill(rows), ort.prefill(rows), ATOL, RTOL, "a batch on ORT")
    assert ov.backend.long_prefill.calls == calls


def test_a_chunked_continuation_equals_one_shot_prefill(engines):
    ov, ort = engines
    whole = LONG + SECOND[1:]
    one_shot = ort.prefill([whole])[0].copy()
    ov.prefill([LONG])
    calls = ov.backend.long_prefill.calls
    chunked = ov.prefill([SECOND[1:]], start=[len(LONG)])[0].copy()  # reads the past OpenVINO wrote
    assert ov.backend.long_prefill.calls == calls + 1
    assert_close(chunked, one_shot, ATOL, RTOL, "chunked continuation vs one-shot prefill")


def test_short_calls_stay_on_ort(engines):
    ov, ort = engines
    calls = ov.backend.long_prefill.calls
    short = LONG[:8]
    assert_close(ov.prefill([short])[0], ort.prefill([short])[0], ATOL, RTOL, "short prefill")
    ov.decode([5])
    assert ov.backend.long_prefill.calls == calls


@pytest.mark.parametrize(
    "artifact, message",
    [
        ("llama_onnx_artifact", "its lowering is 'onnx'; OpenVINO reads only the gqa lowering's graph"),
        ("llama_int8_artifact", "its KV cache is 8-bit with scales (--kv-dtype int8)"),
    ],
)
def test_artifacts_it_cannot_run_are_refused_at_load(artifact, message, request):
    with pytest.raises(ValueError) as error:
        Engine.load(request.getfixturevalue(artifact), prefill="openvino")
    assert str(error.value) == (
        f"prefill='openvino' cannot run this artifact: {message}; load it with prefill='ort' (the default)"
    )


def test_bad_choices_are_refused(llama_artifact):
    choices = "'ort', 'int8', 'fp32', 'openvino', 'openvino:bf16'"
    with pytest.raises(ValueError, match=rf"^prefill='tvm' is not accepted: one of {choices}$"):
        Engine.load(llama_artifact, prefill="tvm")
    with pytest.raises(ValueError, match=r"^prefill='openvino' runs the prefill graph on the CPU, and device='cuda'"):
        Engine.load(llama_artifact, prefill="openvino", device="cuda")


def test_speculative_decoding_prefills_on_openvino_and_verifies_on_ort(llama_artifact, engines):
    _, ort = engines
    prompt = [0, *([5, 6, 7, 8, 9, 10, 11, 12] * 5)]  # 41 tokens whose n-grams repeat: drafts for certain
    with Engine.load(llama_artifact, prefill="openvino", speculative="ngram", prefix_cache=0) as spec:
        assert spec.step_graph == "verify"
        [got] = spec.generate([prompt], max_new_tokens=16)
        assert spec.backend.long_prefill.calls == 1  # the prompt: the prefill graph, on OpenVINO
        [short] = spec.generate([prompt[:9]], max_new_tokens=4)  # under MIN_TOKENS: the verify graph, on ORT
        assert spec.backend.long_prefill.calls == 1
    assert got.drafted_tokens > 0 and got.verify_steps > 0
    assert got.token_ids == ort.generate([prompt], max_new_tokens=16)[0].token_ids
    assert short.token_ids == ort.generate([prompt[:9]], max_new_tokens=4)[0].token_ids


def _bf16_cpu() -> bool:
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


BF16_ATOL = 0.02  # bf16 keeps 8 bits of mantissa; measured 0.003 on logits of scale 0.5 (tiny Llama)


@pytest.mark.skipif(not _bf16_cpu(), reason="this CPU has no bf16 arithmetic (the refusal is tested instead)")
def test_a_bf16_prefill_rounds_as_bf16_and_decode_continues_on_ort(llama_artifact, engines):
    _, ort = engines
    with Engine.load(llama_artifact, prefill="openvino:bf16") as bf:
        got = bf.prefill([LONG, SECOND]).copy()
        assert bf.backend.long_prefill.calls == 1
        want = ort.prefill([LONG, SECOND]).copy()
        assert_close(got, want, BF16_ATOL, 0, "bf16 prefill logits vs ORT's fp32")
        assert np.abs(got - want).max() > ATOL, "no bf16 rounding: OpenVINO ran f32"
        for row, n in enumerate((len(LONG), len(SECOND))):
            theirs = ort.cache.buffer[:, :, row, :, :n]
            assert_close(bf.cache.buffer[:, :, row, :, :n], theirs, BF16_ATOL, 0, f"cache row {row}")
        tokens = want.argmax(axis=1)
        for _ in range(6):  # the same tokens into both: decode (ORT, fp32) reads the rows bf16 wrote
            a, b = bf.decode(tokens).copy(), ort.decode(tokens).copy()
            assert_close(a, b, BF16_ATOL, 0, "decode after a bf16 prefill")
            tokens = b.argmax(axis=1)


@pytest.mark.skipif(_bf16_cpu(), reason="this CPU has bf16 arithmetic (the bf16 prefill is tested instead)")
def test_a_bf16_prefill_is_refused_on_a_cpu_without_bf16(llama_artifact):
    with pytest.raises(ValueError, match=r"^prefill='openvino:bf16' needs a CPU with bfloat16 arithmetic"):
        Engine.load(llama_artifact, prefill="openvino:bf16")


LONG_TEXT = "The for statement runs the body once for each item. " * 2  # 32-88 tokens on the tiny tokenizer


@pytest.fixture
def openvino_calls(monkeypatch):
    """The rows of each OpenVINO call made while a test runs (a spy on OpenVinoPrefill.run)."""
    from kvforge.runtime.ov_prefill import OpenVinoPrefill

    calls = []
    run = OpenVinoPrefill.run
    monkeypatch.setattr(
        OpenVinoPrefill, "run", lambda self, binding: (calls.append(len(binding.starts)), run(self, binding))
    )
    return calls


def test_generate_and_bench_take_prefill(llama_artifact, engines, openvino_calls, capsys, tmp_path):
    from kvforge.tools.cli import main

    _, ort = engines
    assert MIN_TOKENS <= len(ort.tokenizer.encode(LONG_TEXT)) <= ort.max_seq - 8
    assert main(["generate", str(llama_artifact), LONG_TEXT, "--max-new-tokens", "8", "--prefill", "openvino"]) == 0
    [expected] = ort.generate([LONG_TEXT], max_new_tokens=8)
    assert capsys.readouterr().out == LONG_TEXT + expected.text + "\n"
    assert openvino_calls == [1]

    out = tmp_path / "bench.json"
    argv = ["bench", str(llama_artifact), "--prompt-lens", "40", "--batch-sizes", "2", "--new-tokens", "2"]
    assert main([*argv, "--repeat", "1", "--warmup", "0", "--prefill", "openvino", "--json", str(out)]) == 0
    assert "kvforge's prompts of 32+ tokens prefilled on OpenVINO (--prefill openvino)" in capsys.readouterr().out
    assert json.loads(out.read_text())["settings"]["prefill"] == "openvino"
    assert openvino_calls[1:] == [
        2,
        1,
    ]  # the cell's batch of 2 prompts (one call), then the prefix figure's row


def test_the_server_prefills_long_prompts_on_openvino(llama_artifact, engines, openvino_calls):
    import openai

    from tests.helpers import KEY
    from tests.tools.test_serve import MODEL, running

    _, ort = engines
    prompts = [LONG_TEXT, "Lists hold items in order, and a loop reads them. " * 2]
    with running(llama_artifact, prefill="openvino", prefix_cache=0) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        for prompt in prompts:  # one after the other: each prompt's own call
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            assert r.choices[0].text == ort.generate([prompt], max_new_tokens=8)[0].text
    assert openvino_calls == [1, 1]


def test_serve_takes_prefill_in_one_process_only(llama_artifact, capsys):
    from kvforge.tools.cli import main

    assert main(["serve", str(llama_artifact), "--prefill", "openvino", "--ray"]) == 2
    assert capsys.readouterr().err == (
        "kvforge: error: --prefill openvino runs in the one-process server for now; drop it or --ray and the "
        "worker flags\n"
    )


@pytest.mark.parametrize("start, stop", [(0, 96), (5, 10), (30, 40), (32, 64), (0, 31), (48, 82), (64, 65)])
def test_positions_go_between_the_cache_and_the_paged_blocks_unchanged(start, stop):
    from kvforge.runtime.ov_prefill import BLOCK, blocks_to_cache, cache_to_blocks

    heads, seq, dim = 2, 96, 8
    cache = RNG.standard_normal((heads, seq, dim)).astype(np.float32)
    blocks = np.full((seq // BLOCK, heads, BLOCK, dim), 7.0, np.float32)
    cache_to_blocks(cache, blocks, start, stop)
    for p in range(seq):  # position p lives at block p // BLOCK, slot p % BLOCK
        want = cache[:, p] if start <= p < stop else np.full((heads, dim), 7.0, np.float32)
        np.testing.assert_array_equal(blocks[p // BLOCK, :, p % BLOCK], want, err_msg=f"position {p}")
    back = np.zeros_like(cache)
    blocks_to_cache(blocks, back, start, stop)
    np.testing.assert_array_equal(back[:, start:stop], cache[:, start:stop])
    assert not back[:, :start].any() and not back[:, stop:].any()


def test_attention_the_paged_translation_cannot_run_is_named():
    from onnx import helper

    from kvforge.runtime.ov_prefill import unsupported

    def graph(inputs=7, **attributes):
        names = [f"x{i}" for i in range(inputs)]
        attributes = dict(num_heads=4, kv_num_heads=2, **attributes)
        node = helper.make_node("GroupQueryAttention", names, ["y"], name="attn0", domain="com.microsoft", **attributes)
        return helper.make_graph([node], "g", [], [])

    assert unsupported(graph()) is None
    assert unsupported(graph(local_window_size=-1, softcap=0.0)) is None
    assert unsupported(graph(local_window_size=16)) == "its attention 'attn0' has local_window_size=16"
    assert unsupported(graph(softcap=30.0)) == "its attention 'attn0' has softcap=30.0"
    assert unsupported(graph(inputs=12)) == (
        "its attention 'attn0' takes 5 input(s) past the seventh (rotary caches or sinks)"
    )


def _layer_kinds(prefill) -> dict[str, int]:
    """How many layers of each kind OpenVINO compiled ``prefill``'s graph into."""
    from collections import Counter

    ops = prefill.compiled.get_runtime_model().get_ops()
    return Counter(op.get_rt_info()["layerType"].astype(str) for op in ops)


@pytest.mark.parametrize("artifact", ["llama_artifact", "llama_int4_artifact"])
def test_packed_projections_run_as_one_product_each_with_the_same_logits(artifact, request):
    from kvforge.runtime.ov_prefill import OpenVinoPrefill

    root = request.getfixturevalue(artifact)
    with Engine.load(root, prefill="openvino") as ov:
        unpacked = ov.backend.long_prefill
        packed = OpenVinoPrefill(root / "prefill.onnx", unpack=False)
        assert unpacked.unpacked == 4  # q|k|v and gate|up in each of the tiny Llama's 2 layers
        kinds, packed_kinds = _layer_kinds(unpacked), _layer_kinds(packed)
        assert packed_kinds["Split"] == 4 and "Split" not in kinds
        assert kinds["FullyConnected"] == packed_kinds["FullyConnected"] + 2 * (2 + 1)  # +2 for q|k|v, +1 gate|up
        got = ov.prefill([LONG, SECOND]).copy()
        ov.backend.long_prefill = packed
        try:
            want = ov.prefill([LONG, SECOND]).copy()
        finally:
            ov.backend.long_prefill = unpacked
            packed.close()
    assert packed.calls == unpacked.calls == 1
    assert_close(got, want, 1e-6, 0, "logits, unpacked vs packed projections")  # measured: bit-equal


def test_every_batch_loop_feature_with_the_prompts_on_openvino(tiny_artifact, openvino_calls):
    """tests/runtime/test_batch_features.py's batch (drafts, a regex, a seeded sample with a logit
    bias, stop strings, a prediction, a cancellation, then a prefix hit) with n-gram drafts on and
    every prefill call on OpenVINO (``min_tokens`` 1: prompts and the hit's suffix after its cached
    prefix), the steps verified on ORT: each request gives its solo answer on a plain ORT engine."""
    from tests.runtime.test_batch_features import GREEDY, REPEAT, _run, _same, _solo_answers

    requests, solo, hit_solo = _solo_answers(tiny_artifact)
    with Engine.load(tiny_artifact, prefill="openvino", speculative="ngram", threads=1) as engine:
        engine.backend.long_prefill.min_tokens = 1
        assert engine.chunk_tokens == engine.manifest.limits.max_prompt > 256  # whole prompts, not the CPU's 256
        together = _run(engine, requests, cancel="cancelled")
        assert sum(openvino_calls) >= len(requests)  # every prompt's row (grouped into calls), none of the steps
        del openvino_calls[:]
        hit = engine.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
        assert openvino_calls == [1]  # the suffix after the cached prefix
        [alone] = engine.generate([REPEAT], max_new_tokens=24, sampling=GREEDY)
    for name in requests:
        got, want = _same(together[name], solo[name])
        assert got == want, name
    assert together["cancelled"].finish_reason == "cancelled"
    assert hit.cached_tokens > 0 and (hit.token_ids, hit.text) == (hit_solo.token_ids, hit_solo.text)
    assert alone.drafted_tokens > 0 and alone.token_ids == solo["drafts"].token_ids
