"""Both GPU backends (TensorRT, ONNX Runtime CUDA) on a tiny Llama, against transformers on the CPU.

Needs a GPU (skipped cleanly elsewhere by tests/conftest.py, with the reason). Proves: engines
build from the onnx lowering in float32 and float16 (the manifest records them, the timing cache is
kept); float32 greedy tokens equal transformers'; float16 logits within the tolerance below and the
first greedy tokens equal; the cache's device addresses never change over 100 decode steps;
CUDA-graph decode equals eager decode bit for bit; a ragged batch equals its batch-1 runs; TensorRT's
``next_token_ids`` output equals the argmax of its logits; greedy decode copies back [B, V] logits
and nothing else (the bytes per step are counted).

float16 tolerance: |logit - reference| <= 5e-2 + 5e-2 * |reference| (fp16 has ~3 significant
digits; the tiny model's logits are O(1)), and the first 8 greedy tokens identical.

Not yet run on a GPU: the first session lent one runs ``make gpu-check`` and records the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import assert_close, hf_greedy, hf_logits

PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31]]
NEW_TOKENS = 24
FP16_ATOL = FP16_RTOL = 5e-2
TARGET = {"tensorrt": "tensorrt", "ort": "cuda"}


@pytest.fixture(scope="session")
def gpu_artifacts(llama_dir, tmp_path_factory):
    """(backend, dtype) -> artifact directory, compiled (and for TensorRT built) on first use."""
    from kvforge.compile import compile_model

    made = {}

    def get(backend: str, dtype: str):
        if (backend, dtype) not in made:
            out = tmp_path_factory.mktemp("gpu") / f"{backend}-{dtype}"
            compile_model(
                llama_dir,
                out,
                target=TARGET[backend],
                dtype=dtype,
                max_batch=2,
                max_seq=128,
                max_prompt=32,
                score_graph=False,
                progress=None,
            )
            made[backend, dtype] = out
        return made[backend, dtype]

    return get


def _load(artifact, backend):
    from kvforge.runtime import Engine

    return Engine.load(artifact, device="cuda", backend=backend)


@pytest.mark.gpu("tensorrt")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tensorrt_engine_builds_and_is_recorded(gpu_artifacts, dtype):
    from kvforge.graphs import manifest as mf

    out = gpu_artifacts("tensorrt", dtype)
    record = mf.engine_record(mf.read(out))
    assert record is not None and (out / record.plan_file).is_file() and (out / record.timing_cache_file).is_file()
    assert [p.name for p in record.profiles] == ["prefill", "decode"]
    assert record.profile("prefill").shapes["input_ids"][2] == [2, 32]
    assert record.outputs == ["next_token_ids"] and record.device_memory_bytes > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorrt", "ort"])
def test_fp32_greedy_equals_transformers(gpu_artifacts, llama_reference, backend):
    with _load(gpu_artifacts(backend, "float32"), backend) as engine:
        results = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(llama_reference, prompt, NEW_TOKENS)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorrt", "ort"])
def test_fp16_within_tolerance(gpu_artifacts, llama_reference, backend):
    with _load(gpu_artifacts(backend, "float16"), backend) as engine:
        logits = engine.prefill([PROMPTS[0]])[0].astype(np.float32)
        assert_close(logits, hf_logits(llama_reference, PROMPTS[0])[-1], FP16_ATOL, FP16_RTOL, "fp16 prefill logits")
        [result] = engine.generate([PROMPTS[0]], max_new_tokens=8)
    assert result.token_ids == hf_greedy(llama_reference, PROMPTS[0], 8)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorrt", "ort"])
def test_cache_addresses_never_change_over_100_steps(gpu_artifacts, backend):
    with _load(gpu_artifacts(backend, "float32"), backend) as engine:
        buffers = {k: b.ptr for k, b in engine.backend.buffers.items()}
        logits = engine.prefill([PROMPTS[1]])
        seen = []
        for _ in range(100):
            logits = engine.decode([int(np.argmax(logits[0]))])
            seen.append(engine.backend.bound_addresses(engine.last_bindings["decode"]))
        assert {k: b.ptr for k, b in engine.backend.buffers.items()} == buffers
        if engine.backend.mode == "alias":
            assert all(s == seen[0] for s in seen)
        else:  # alternating caches: two address sets, one per parity
            assert all(s == seen[i % 2] for i, s in enumerate(seen))
        stats = engine.backend.stats
        vocab = engine.vocab_size
        assert stats.d2h_bytes == stats.steps * vocab * 4  # one [1, V] float32 logits row per step, nothing else


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorrt", "ort"])
def test_cuda_graph_decode_equals_eager(gpu_artifacts, backend):
    runs = []
    for graphs in (False, True):
        with _load(gpu_artifacts(backend, "float32"), backend) as engine:
            engine.backend.cuda_graphs = graphs
            out = [engine.prefill(PROMPTS)[:].copy()]
            for _ in range(20):
                out.append(engine.decode([int(t) for t in np.argmax(out[-1], axis=-1)]).copy())
            runs.append(np.stack(out))
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorrt", "ort"])
def test_ragged_batch_equals_batch_1_runs(gpu_artifacts, backend):
    with _load(gpu_artifacts(backend, "float32"), backend) as engine:
        batch = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        alone = [engine.generate([p], max_new_tokens=NEW_TOKENS)[0] for p in PROMPTS]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


@pytest.mark.gpu("tensorrt")
def test_tensorrt_next_token_ids_are_the_argmax(gpu_artifacts):
    with _load(gpu_artifacts("tensorrt", "float32"), "tensorrt") as engine:
        logits = engine.prefill(PROMPTS).copy()
        binding = engine.last_bindings["prefill"]
        binding.read_logits = False
        engine.backend.run(binding)  # the same inputs again, reading back 4 bytes a row
        ids = engine.backend.next_token_ids(binding).copy()
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=-1))
