"""The runtime against transformers on a tiny random Llama (fp32): logits per step within tolerance,
token-exact greedy generation (one prompt, ragged batches, more prompts than max_batch), one cache
allocation bound in place, chunked prefill equal to one-shot prefill, and clear errors."""

from __future__ import annotations

import shutil

import pytest

from kvforge.runtime import ArtifactError, Engine
from kvforge.runtime.engine import CPU_PREFILL_CHUNK
from tests.helpers import assert_close, hf_greedy, hf_logits

ATOL, RTOL = 1e-4, 1e-4  # fp32: ORT and torch differ only in summation order
PROMPTS = [
    [0, 17, 201, 33, 90, 4, 150, 77, 12],
    [0, 5, 9],
    [0, 300, 2, 250, 61, 8],
    [0, 44],
    [0, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131],
]


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


def test_prefill_and_every_decode_step_match_transformers(engine, llama_reference):
    prompt, steps = PROMPTS[0], 12
    tokens = list(prompt)
    logits = [engine.prefill([prompt])[0].copy()]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(engine.decode([tokens[-1]])[0].copy())
    reference = hf_logits(llama_reference, tokens)[len(prompt) - 1 :]
    assert_close(logits[0], reference[0], ATOL, RTOL, "prefill logits")
    for step in range(1, steps + 1):
        assert_close(logits[step], reference[step], ATOL, RTOL, f"decode step {step} logits")


def test_ragged_prefill_gives_each_row_its_own_logits(engine, llama_reference):
    rows = PROMPTS[:4]
    logits = engine.prefill(rows).copy()
    for b, row in enumerate(rows):
        assert_close(logits[b], hf_logits(llama_reference, row)[-1], ATOL, RTOL, f"row {b} prefill logits")
    # One decode step per row continues each row at its own length.
    nxt = logits.argmax(-1)
    step = engine.decode(nxt).copy()
    for b, row in enumerate(rows):
        ref = hf_logits(llama_reference, [*row, int(nxt[b])])[-1]
        assert_close(step[b], ref, ATOL, RTOL, f"row {b} decode logits")


def test_greedy_matches_transformers_generate_for_one_prompt(engine, llama_reference):
    [result] = engine.generate([PROMPTS[0]], max_new_tokens=40)
    expected = hf_greedy(llama_reference, PROMPTS[0], 40)
    assert len(result.token_ids) >= 32
    assert result.token_ids == expected
    assert result.finish_reason == ("stop" if expected[-1] == 1 else "length")
    assert result.prompt_tokens == len(PROMPTS[0])


def test_ragged_batch_rows_equal_their_batch_1_runs(engine, llama_reference):
    results = engine.generate(PROMPTS[:4], max_new_tokens=36)
    for prompt, result in zip(PROMPTS[:4], results):
        alone = engine.generate([prompt], max_new_tokens=36)[0]
        assert result.token_ids == alone.token_ids
        assert result.token_ids == hf_greedy(llama_reference, prompt, 36)


def test_more_prompts_than_max_batch_run_in_consecutive_batches(engine, llama_reference):
    assert engine.max_batch == 4
    results = engine.generate(PROMPTS, max_new_tokens=8)  # 5 prompts: a batch of 4, then 1
    assert len(results) == 5
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(llama_reference, prompt, 8)


@pytest.fixture(scope="module")
def two_session_engine(llama_artifact):
    with Engine.load(llama_artifact, one_session=False) as engine:
        yield engine


@pytest.mark.parametrize("sessions", ["one", "two"])
def test_cache_is_allocated_once_and_bound_in_place(engine, two_session_engine, sessions):
    engine = engine if sessions == "one" else two_session_engine
    buffer = engine.cache.buffer
    pointer = buffer.ctypes.data
    assert buffer.shape == (2, 2, 4, 2, 96, 16)
    logits = engine.prefill(PROMPTS[:2])
    views = engine.cache.views(2)
    for step in ("prefill", "decode"):
        if step == "decode":
            for _ in range(3):
                logits = engine.decode(logits.argmax(-1))
                assert engine.cache.buffer.ctypes.data == pointer
        assert engine.cache.buffer is buffer and buffer.ctypes.data == pointer
        binding = engine.last_bindings[step]
        assert binding.graph == ("decode" if (step, sessions) == ("decode", "two") else "prefill")
        out_ptrs = engine.backend.bound_output_pointers(binding)
        # get_outputs() comes back in binding order: logits, then the presents in contract order.
        for i, past in enumerate(views):
            assert out_ptrs[1 + i] == views[past].ctypes.data, f"{step}: present {i} is not bound to {past}"
            assert binding.tensors[past].ctypes.data == views[past].ctypes.data
        # Every view lies inside the one allocation.
        lo, hi = pointer, pointer + buffer.nbytes
        assert all(lo <= p < hi for p in out_ptrs[1:])


def test_decode_graph_session_gives_the_same_logits(engine, two_session_engine):
    rows = PROMPTS[:3]
    got = {}
    for name, e in (("one", engine), ("two", two_session_engine)):
        logits = [e.prefill(rows).copy()]
        for _ in range(4):
            logits.append(e.decode(logits[-1].argmax(-1)).copy())
        got[name] = logits
    assert "decode" in two_session_engine.backend.sessions
    for step, (one, two) in enumerate(zip(got["one"], got["two"])):
        assert_close(one, two, 1e-5, 1e-5, f"step {step}: prefill-graph decode vs decode graph")


def test_decode_reuses_its_binding(engine):
    logits = engine.prefill(PROMPTS[:3])
    engine.decode(logits.argmax(-1))
    first = engine.last_bindings["decode"]
    engine.decode(engine.decode(logits.argmax(-1)).argmax(-1))
    assert engine.last_bindings["decode"] is first


def test_chunked_prefill_equals_one_shot(engine):
    prompt = PROMPTS[4]
    one_shot = engine.prefill([prompt]).copy()
    engine.prefill([prompt[:5]])
    chunked = engine.prefill([prompt[5:]], start=[5]).copy()
    assert_close(chunked, one_shot, 1e-5, 1e-5, "chunked prefill logits")


def test_prefill_prompt_prefills_as_generation_does(engine, llama_reference, monkeypatch):
    prompt = [0, *range(10, 40)]  # 31 tokens
    one_shot = engine.prefill([prompt, prompt]).copy()
    calls = []
    prefill_rows = engine.prefill_rows

    def counted(rows, start, first):
        calls.append((len(rows), len(rows[0]), list(start), first))
        return prefill_rows(rows, start, first)

    monkeypatch.setattr(engine, "prefill_rows", counted)
    monkeypatch.setattr(engine, "prefill_chunk", 62)  # 2 rows x 31 tokens fit in one chunk: one call
    assert_close(engine.prefill_prompt([prompt, prompt]), one_shot, 1e-5, 1e-5, "one call")
    assert calls == [(2, 31, [0, 0], 0)]
    calls.clear()
    monkeypatch.setattr(engine, "prefill_chunk", 12)  # else each row alone, in calls of 12, 12 and 7 tokens
    chunked = engine.prefill_prompt([prompt, prompt])
    assert calls == [
        (1, 12, [0], 0),
        (1, 12, [12], 0),
        (1, 7, [24], 0),
        (1, 12, [0], 1),
        (1, 12, [12], 1),
        (1, 7, [24], 1),
    ]
    assert engine.lengths[:2].tolist() == [31, 31] and engine.batch == 2
    assert_close(chunked, one_shot, 1e-5, 1e-5, "chunked")
    hf = hf_logits(llama_reference, prompt)[-1]
    assert_close(chunked[1], hf, ATOL, RTOL, "chunked vs transformers")
    with pytest.raises(
        ValueError, match=r"^prefill_prompt takes prompts of one length; prefill ragged rows with prefill\(\)$"
    ):
        engine.prefill_prompt([prompt, prompt[:5]])


def test_the_cpu_prefills_long_prompts_in_calls_of_256_tokens(engine, tiny_artifact):
    assert CPU_PREFILL_CHUNK == 256
    assert engine.chunk_tokens == engine.manifest.limits.max_prompt < 256  # a shorter max_prompt bounds it
    prompt = [1, *range(40, 339)]  # 300 tokens
    with Engine.load(tiny_artifact, prefix_cache=0) as big:
        assert big.manifest.limits.max_prompt > 256 == big.prefill_chunk == big.chunk_tokens
        calls = []
        prefill_rows = big.prefill_rows

        def counted(rows, start, first):
            calls.append((len(rows[0]), list(start)))
            return prefill_rows(rows, start, first)

        big.prefill_rows = counted
        [chunked] = big.generate([prompt], max_new_tokens=8)
        assert calls == [(256, [0]), (44, [256])]  # generation's calls of 256 tokens
        big.prefill_chunk = big.manifest.limits.max_prompt
        [one_call] = big.generate([prompt], max_new_tokens=8)
        assert calls[2:] == [(300, [0])]
    assert chunked.token_ids == one_call.token_ids


def test_eos_stops_a_row(engine):
    first = engine.generate([PROMPTS[1]], max_new_tokens=5)[0].token_ids[0]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({first})
    try:
        [result] = engine.generate([PROMPTS[1]], max_new_tokens=5)
    finally:
        engine.eos_token_ids = saved
    assert result.token_ids == [first] and result.finish_reason == "stop"


def test_generation_stops_when_the_cache_row_is_full(engine, llama_reference):
    prompt = [0, *range(10, 100)]  # 91 tokens; max_seq 96 leaves cache room for 5 more, so 6 new tokens
    [result] = engine.generate([prompt], max_new_tokens=50)
    expected = hf_greedy(llama_reference, prompt, 6)
    if 1 in expected:  # the model's eos (id 1) ends it first
        expected = expected[: expected.index(1) + 1]
    assert result.token_ids == expected
    assert result.finish_reason == ("stop" if expected[-1] == 1 else "length")


def test_text_prompts_use_the_artifact_tokenizer(engine):
    [result] = engine.generate(["The for statement"], max_new_tokens=4)
    ids = engine.tokenizer.encode("The for statement")
    assert result.prompt_tokens == len(ids) and len(result.token_ids) == 4
    assert result.text == engine.tokenizer.decode(result.token_ids)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([[]], "prompt 0 is empty"),
        ([""], "prompt 0 is empty"),
        ([[0, 5], [0, 384]], "prompt 1 has token id 384 outside the vocabulary \\[0, 384\\)"),
        ([[0]] * 4 + [[5] * 97], "prompt 4 has 97 tokens .* max_seq=96 \\(recompile with --max-seq\\)"),
        ([], "no prompts"),
    ],
)
def test_bad_prompts_are_refused_before_anything_runs(engine, prompts, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, max_new_tokens=4)


def test_truncated_weights_file_is_refused(llama_artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_artifact, broken)
    weights = broken / "weights.data"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="truncated or corrupted; recompile"):
        Engine.load(broken)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="not a kvforge artifact"):
        Engine.load(tmp_path)


def test_score_gives_every_positions_logits(engine, llama_reference):
    rows = [PROMPTS[0], PROMPTS[2]]
    logits = engine.score(rows)
    assert logits.shape == (2, len(PROMPTS[0]), 384)
    for b, row in enumerate(rows):
        assert_close(logits[b, : len(row)], hf_logits(llama_reference, row), ATOL, RTOL, f"row {b} score logits")
    # The cache was filled as by prefill: decoding continues each row.
    step = engine.decode([5, 6])
    assert_close(step[1], hf_logits(llama_reference, [*PROMPTS[2], 6])[-1], ATOL, RTOL, "decode after score")


def test_padding_past_capacity_is_refused(engine):
    with pytest.raises(ValueError, match="would write past max_seq=96"):
        engine.prefill([[1, 2], [3] * 20], start=[90, 0])


def test_generation_uses_one_session_and_score_gets_its_own_on_first_use(llama_artifact):
    """Each ORT session holds its own packed weights. Decode steps run the prefill graph (S = 1), so
    generation creates one session; the score graph's is created when score is first called."""
    with Engine.load(llama_artifact) as engine:
        engine.generate([PROMPTS[1]], max_new_tokens=3)
        assert set(engine.backend.sessions) == {"prefill"}
        engine.score([PROMPTS[1]])
        assert set(engine.backend.sessions) == {"prefill", "score"}


def test_the_runtime_runs_without_importing_torch(llama_artifact):
    """Loading and generating imports numpy and onnxruntime only: torch would add ~200 MiB to the
    resident set of every serving process."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from kvforge.runtime import Engine\n"
        f"with Engine.load({str(llama_artifact)!r}) as engine:\n"
        "    [result] = engine.generate([[0, 5, 9]], max_new_tokens=4)\n"
        "print(len(result.token_ids), 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["4", "False", "False"]
