"""The 8-bit KV cache (``kvforge compile --kv-dtype int8``) on the tiny Llama (fp32, GQA 4/2 heads).

Proves: the graphs' quantize-on-write and read-back (``kvforge::cached_attention_int8``'s ONNX
translation: onnx folds the scales into scores and probabilities, exact dequantizes) give the
pure-torch reference's codes and scales bit for bit and its attention output within 1e-5;
:func:`reference.quantize_rows` is symmetric ``max|x| / 127`` per row with round-half-to-even
codes, and its round trip is within half a scale; the artifact records the 8-bit cache (manifest
schema 4, ``kv_cache`` int8 with its scale shape, the bytes) and the engine allocates an int8
cache plus float32 scales (~0.31 of the float32 KV bytes at head size 16) bound in place; the
greedy tokens of three prompts (16 each) are identical to the float cache's (same onnx lowering),
and the prefill logits are within 5e-3 of them (a logit range of about ±0.5 on this random
model); rows moved by in-flight batching's compaction keep their answers; a KV block exported and
imported carries the scales (the continued prefill equals a from-scratch one within 1e-5; the
file round trip is byte for byte, format version 2), the prefix pool hits and keeps the uncached
tokens, a saved session continues as the uninterrupted one, and an in-process hand-off resumes
with the colocated tokens; a block of the other KV dtype is refused both ways, as are GPU
targets, the gqa lowering, hybrid families, ``kv_shared`` and exports into caller memory.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvforge.compile import compile_model
from kvforge.graphs import contract, lowering, reference
from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.kv import KVBlock, KVBlockError, PrefixPool, parse_bytes
from kvforge.runtime.kv.handoff import Handoff

PROMPTS = [[0, *range(20, 40)], [0, *range(100, 110)], [0, 7, 300, 301, 5, 9]]
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def int8(llama_int8_artifact):
    with Engine.load(llama_int8_artifact, prefix_cache=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def floats(llama_onnx_artifact):
    """The float twin: the same model under the same (onnx) lowering."""
    with Engine.load(llama_onnx_artifact, prefix_cache=0) as engine:
        yield engine


# ------------------------------------------------------------------ the quantizer and the graph op


def test_quantize_rows_is_symmetric_per_row():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.25, 0.0]])
    codes, scale = reference.quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert codes[0].tolist() == [127, -64, 0, 2]  # half to even: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2
    assert codes[1].tolist() == [0, 0, 0, 0] and scale[1].item() == 0.0  # a zero row: scale 0, no NaN
    assert codes[2].tolist() == [-127, 64, 16, 0] and scale[2].item() == pytest.approx(2.0 / 127)
    rows = torch.randn(5, 3, 7, 64) * torch.rand(5, 3, 7, 1) * 10
    codes, scale = reference.quantize_rows(rows)
    back = reference.dequantize_rows(codes, scale, torch.float32)
    assert torch.all((back - rows).abs() <= scale / 2 + 1e-6)  # within half a step
    assert torch.all(codes.abs().amax(-1) == 127)  # each row's largest value maps to ±127


class _Int8Layer(torch.nn.Module):
    """One call of the 8-bit op with its mask (the graph under test)."""

    def forward(self, query, key, value, past_key, past_value, past_key_scale, past_value_scale, write_indices):
        mask = reference.attention_mask(write_indices, query.shape[2], past_key.shape[2])
        return lowering.cached_attention_int8(
            query, key, value, past_key, past_value, past_key_scale, past_value_scale, write_indices, mask, 0.25, 0.0, 0
        )


@pytest.mark.parametrize("lowering_name", ["onnx", "exact"])
def test_graph_op_matches_the_torch_reference(lowering_name, tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    batch, q_heads, kv_heads, seq, capacity, dim = 2, 4, 2, 3, 12, 16
    past_codes, past_scales = reference.quantize_rows(torch.randn(batch, kv_heads, capacity, dim))  # old rows
    past_v_codes, past_v_scales = reference.quantize_rows(torch.randn(batch, kv_heads, capacity, dim) * 3)
    args = (
        torch.randn(batch, q_heads, seq, dim),
        torch.randn(batch, kv_heads, seq, dim),
        torch.randn(batch, kv_heads, seq, dim) * 2,
        past_codes,
        past_v_codes,
        past_scales,
        past_v_scales,
        torch.tensor([4, 7]),
    )
    names = ["query", "key", "value", "past_key", "past_value", "past_key_scale", "past_value_scale", "write_indices"]
    path = tmp_path / "layer.onnx"
    torch.onnx.export(
        _Int8Layer(),
        args,
        str(path),
        dynamo=True,
        opset_version=24,
        input_names=names,
        output_names=["output", "present_key", "present_value", "present_key_scale", "present_value_scale"],
        custom_translation_table=lowering.translation_table(lowering_name),
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: a.numpy() for n, a in zip(names, args)})
    want = [t.numpy() for t in _Int8Layer()(*args)]
    for name, a, b in zip(
        ["present_key", "present_value", "present_key_scale", "present_value_scale"], got[1:], want[1:]
    ):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{name} differs from the reference"
    assert got[1].dtype == np.int8 and got[3].shape == (batch, kv_heads, capacity, 1)
    worst = np.abs(got[0] - want[0]).max()
    assert worst <= 1e-5, f"attention output differs from the reference by {worst}"


# ------------------------------------------------------------------ artifact, cache and bytes


def test_manifest_and_cache_record_the_8bit_kv(llama_int8_artifact, int8, floats):
    manifest = mf.read(llama_int8_artifact)
    kv = manifest.kv_cache
    assert manifest.schema_version == mf.KV_INT8_SCHEMA == 4 and manifest.kv_dtype == "int8"
    assert manifest.lowering == "onnx" and manifest.layout.quantized_kv
    assert kv["dtype"] == "int8" and kv["scale_dtype"] == "float32" and kv["scale_shape"] == kv["shape"][:-1]
    values = int(np.prod(kv["shape"]))
    assert kv["bytes"] == values + values // 16 * 4  # int8 values + one float32 scale per 16 (head size)
    cache = int8.cache
    assert cache.buffer.dtype == np.int8 and cache.scales.dtype == np.float32
    assert cache.nbytes == kv["bytes"] and floats.cache.nbytes == values * 4
    assert cache.nbytes / floats.cache.nbytes == pytest.approx((16 + 4) / (16 * 4))
    views = cache.views(2, first=1)
    scale = views[contract.past_scale_name(1, "value")]
    assert scale.shape == (2, 2, 96, 1) and scale.flags.c_contiguous
    assert np.shares_memory(scale, cache.scales) and scale.ctypes.data == cache.scales[1, 1, 1].ctypes.data
    assert contract.kv_row_bytes(manifest.layout, 2, 16, 4) == 2 * 2 * 2 * (16 + 4)
    # the graph's I/O names the scales after the KV, bound by name like the KV
    assert contract.past_names(manifest.layout)[-4:] == [
        "past_key_values.0.key_scale",
        "past_key_values.0.value_scale",
        "past_key_values.1.key_scale",
        "past_key_values.1.value_scale",
    ]


def test_inspect_shows_the_8bit_cache(llama_int8_artifact):
    from kvforge.tools.inspect_artifact import format_report, inspect

    text = format_report(inspect(llama_int8_artifact))
    assert "KV cache [2, 2, 4, 2, 96, 16] int8 + scales [2, 2, 4, 2, 96] float32 = 60.0 KiB" in text


def test_greedy_tokens_and_logits_against_the_float_cache(int8, floats):
    ours, theirs = int8.prefill(PROMPTS).copy(), floats.prefill(PROMPTS).copy()
    assert np.abs(theirs).max() > 0.3  # the scale the tolerance below is measured against
    np.testing.assert_allclose(ours, theirs, atol=5e-3, rtol=0)
    for a, b in zip(int8.generate(PROMPTS, GREEDY_TOKENS), floats.generate(PROMPTS, GREEDY_TOKENS)):
        assert a.token_ids == b.token_ids and len(a.token_ids) == GREEDY_TOKENS


def test_compaction_moves_the_scales_with_the_rows(int8):
    """The first request finishes first and the last one moves into its row (one cache copy of
    its codes and scales): each answer equals its solo greedy run."""
    solo = [int8.generate([p], n)[0].token_ids for p, n in zip(PROMPTS, [2, 12, 12])]
    with int8.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, [2, 12, 12])]
        assert [h.result(timeout=60).token_ids for h in handles] == solo


# ------------------------------------------------------------------ blocks, pool, sessions, hand-off


def test_block_round_trip_carries_the_scales(int8, tmp_path):
    prompt = PROMPTS[0]
    full = int8.prefill([prompt])[0].copy()
    k = 13
    int8.prefill_rows([prompt[:k]], [0], first=0)
    block = int8.export_kv(0, prompt[:k])
    assert block.data.dtype == np.int8 and block.scales.shape == (2, 2, 2, k) and block.kv_dtype == "int8"
    assert block.fingerprint["kv_dtype"] == "int8" and block.nbytes == block.data.nbytes + block.scales.nbytes
    assert int8.kv_nbytes(k) == block.nbytes
    int8.prefill_rows([PROMPTS[1]], [0], first=2)  # row 2 holds something else first
    int8.import_kv(block, 2)
    np.testing.assert_array_equal(int8.cache.scales[:, :, 2, :, :k], int8.cache.scales[:, :, 0, :, :k])
    logits = int8.prefill_rows([prompt[k:]], [k], first=2)[0]
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=0)
    path = block.slice(3, 10).save(tmp_path / "b.kvb")
    assert int.from_bytes(path.read_bytes()[8:12], "little") == 2  # format version 2: with scales
    loaded = KVBlock.load(path)
    assert loaded.start == 3 and np.array_equal(loaded.data, block.data[:, :, :, 3:10])
    assert np.array_equal(loaded.scales, block.scales[:, :, :, 3:10]) and loaded.fingerprint == block.fingerprint


def test_prefix_pool_hit_keeps_the_tokens(llama_int8_artifact, int8):
    with Engine.load(llama_int8_artifact) as pooled:
        pooled.prefix_pool = PrefixPool(parse_bytes("16MiB"), block_tokens=4)
        expected = int8.generate([PROMPTS[0]], 8)[0].token_ids
        first = pooled.generate([PROMPTS[0]], 8)[0]
        again = pooled.generate([PROMPTS[0]], 8)[0]
        assert first.cached_tokens == 0 and again.cached_tokens == 20
        assert first.token_ids == again.token_ids == expected
        assert pooled.prefix_pool.stats().blocks > 0


def test_saved_session_continues_as_if_never_stopped(int8, tmp_path):
    path = tmp_path / "chat.kvs"
    with int8.session() as s:
        s.append(PROMPTS[0])
        s.generate(max_new_tokens=6)
        s.save(path)
        s.append([7, 8, 9])
        expected = s.generate(max_new_tokens=8, sampling=SamplingParams(temperature=0.9, seed=3))
    assert KVBlock.load(path).scales is not None
    with int8.session(restore=path) as s:
        s.append([7, 8, 9])
        resumed = s.generate(max_new_tokens=8, sampling=SamplingParams(temperature=0.9, seed=3))
    assert resumed.token_ids == expected.token_ids


def test_in_process_hand_off_resumes_with_the_colocated_tokens(llama_int8_artifact, int8):
    expected = int8.generate([PROMPTS[1]], 10)[0].token_ids
    with Engine.load(llama_int8_artifact, prefix_cache=0) as decode:
        with int8.scheduler() as sp:
            handoff = sp.submit(PROMPTS[1], 10, hand_off=True).result(timeout=60).handoff
        assert handoff.block.scales is not None
        header = json.loads(json.dumps(handoff.header()))
        moved = Handoff.from_parts(header, handoff.block.data, scales=handoff.block.scales)
        with pytest.raises(KVBlockError, match="pass the block's scales with its data"):
            Handoff.from_parts(header, handoff.block.data)
        with decode.scheduler() as sd:
            result = sd.resume(moved).result(timeout=60)
    assert result.token_ids == expected and result.token_ids[0] == handoff.first_token


def test_a_hand_off_through_shared_memory_carries_the_scales(llama_int8_artifact, int8):
    """A prefill scheduler exporting into a shared-memory arena (a disaggregated prefill worker's
    way): the block's data, scales and checksum lie in one slot, taken without a copy on the
    other side and resumed with the colocated tokens; a hand-off in a segment of its own whose
    scales were corrupted in transit is refused by its checksum."""
    from kvforge.runtime.kv import shm

    expected = int8.generate([PROMPTS[0]], 10)[0].token_ids
    alloc = shm.SegmentAllocator(arena_bytes=2**20)
    try:
        with Engine.load(llama_int8_artifact, prefix_cache=0) as decode:
            with int8.scheduler(block_alloc=alloc) as sp:
                handoff = sp.submit(PROMPTS[0], 10, hand_off=True).result(timeout=60).handoff
            ref = alloc.put(handoff)  # exported into the arena: no copy
            assert ref.slot is not None and ref.nbytes == int8.kv_nbytes(len(PROMPTS[0]))
            taken = shm.take(ref, decode.kv_fingerprint, verify=False)
            np.testing.assert_array_equal(taken.block.scales, handoff.block.scales)
            with decode.scheduler() as sd:
                result = sd.resume(taken).result(timeout=60)
            assert result.token_ids == expected
            own = shm.put(handoff)  # copied into a segment of its own: data, then scales
            with open(shm.SHM_DIR / own.name, "r+b") as f:
                f.seek(handoff.block.data.nbytes)
                first = f.read(1)
                f.seek(handoff.block.data.nbytes)
                f.write(bytes([first[0] ^ 0xFF]))
            with pytest.raises(KVBlockError, match=r"does not match its \w+ checksum: the data was corrupted"):
                shm.take(own, decode.kv_fingerprint)
    finally:
        alloc.close()


def test_the_disaggregated_server_hands_8bit_kv_from_prefill_to_decode(llama_int8_artifact, int8):
    import httpx

    from kvforge.tools.serve.disagg.router import DisaggServer
    from tests.helpers import KEY
    from tests.tools.test_serve import metric, serving

    expected = int8.generate([PROMPTS[0], PROMPTS[1]], 10)
    # lend_rows defaults to on: an 8-bit cache's prefill worker exports into its arena instead
    server = DisaggServer.load(
        llama_int8_artifact, threads_per_worker=1, model_name="int8", prefill_workers=1, decode_workers=1
    )
    with serving(server) as url:
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"model": "int8", "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 10, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        assert [c["text"] for c in answer.json()["choices"]] == [e.text for e in expected]
        metrics = httpx.get(url + "/metrics", headers=headers).text
    assert metric(metrics, "kvforge_handoffs_total") >= 1


# ------------------------------------------------------------------ refusals


def test_block_of_the_other_kv_dtype_is_refused(int8, floats):
    floats.prefill_rows([PROMPTS[0]], [0], first=0)
    float_block = floats.export_kv(0, PROMPTS[0])
    with pytest.raises(
        KVBlockError, match=r"holds float KV, and this artifact's KV cache is 8-bit \(--kv-dtype int8\)"
    ):
        int8.import_kv(float_block, 1)
    int8.prefill_rows([PROMPTS[0]], [0], first=0)
    int8_block = int8.export_kv(0, PROMPTS[0])
    with pytest.raises(KVBlockError, match=r"holds 8-bit \(int8 with per-row scales\) KV, .* is float"):
        floats.import_kv(int8_block, 1)
    with pytest.raises(ValueError, match=r"export_kv\(view=True\) lends a row's KV positions only, .* scales"):
        int8.export_kv(0, PROMPTS[0], view=True)


def test_options_it_cannot_run_are_refused_up_front(llama_dir, llama_int8_artifact, tmp_path):
    with pytest.raises(ValueError, match="runs on ONNX Runtime's CPU provider only, not --target cuda"):
        compile_model(llama_dir, tmp_path / "a", kv_dtype="int8", target="cuda", progress=None)
    with pytest.raises(ValueError, match="cannot use --lowering gqa: ONNX Runtime's GroupQueryAttention"):
        compile_model(llama_dir, tmp_path / "b", kv_dtype="int8", lowering="gqa", progress=None)
    with pytest.raises(ValueError, match="unknown KV dtype 'fp8'; choose one of float, int8"):
        compile_model(llama_dir, tmp_path / "c", kv_dtype="fp8", progress=None)
    with pytest.raises(ValueError, match=r"kv_shared=True: this artifact's KV cache is 8-bit"):
        Engine.load(llama_int8_artifact, kv_shared=True)
    with pytest.raises(ValueError, match=r"device='cuda': this artifact's KV cache is 8-bit"):
        Engine.load(llama_int8_artifact, device="cuda")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hybrid_family_refused(lfm2_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--kv-dtype int8 is not available for .*keep a conv state"):
        compile_model(lfm2_dir, tmp_path / "lfm2", kv_dtype="int8", max_seq=64, progress=None)
