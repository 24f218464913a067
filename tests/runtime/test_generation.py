"""Engine.generate / stream / chat on the tiny Llama (fp32): greedy tokens equal transformers'
through the in-flight batch loop (rows retired mid-batch, queued prompts taking freed rows, a full
cache row ending with "length" while the others go on), finished rows stop costing decode work,
per-request sampling reproducible alone and in a batch, several eos ids, stop strings across token
boundaries, streamed chunks joining to the non-streamed result (non-ASCII text included), logprobs,
chat equal to generate on the template's rendering, and bad parameters refused before anything
runs."""

from __future__ import annotations

import pytest

from kvforge.runtime import ChatTemplateError, Engine, SamplingParams
from kvforge.runtime.chat import ChatTemplate
from tests.helpers import hf_greedy

PROMPTS = [
    [0, 17, 201, 33, 90, 4, 150, 77, 12],
    [0, 5, 9],
    [0, 300, 2, 250, 61, 8],
    [0, 44],
    [0, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131],
]
LONG = [0, *range(10, 100)]  # 91 tokens: max_seq 96 leaves room for 6 new tokens


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


@pytest.fixture
def decode_batches(engine, monkeypatch):
    """The row count of every decode step the engine runs."""
    sizes: list[int] = []
    original = engine.decode_rows

    def spy(batch: int, first: int = 0):
        sizes.append(batch)
        return original(batch, first)

    monkeypatch.setattr(engine, "decode_rows", spy)
    return sizes


def test_a_full_cache_row_ends_with_length_while_the_others_go_on(engine, llama_reference, decode_batches):
    """5 prompts on 4 rows: the long prompt's row fills after 6 tokens (row 0 is retired, the
    highest row moves into it, the queued prompt takes the freed row) and every row still gets
    transformers' exact greedy tokens."""
    prompts = [LONG, *PROMPTS[1:4], PROMPTS[0]]
    results = engine.generate(prompts, max_new_tokens=20)
    for prompt, result in zip(prompts, results):
        expected = hf_greedy(llama_reference, prompt, 20 if prompt is not LONG else 6)
        if 1 in expected:  # the model's eos ends it first
            expected = expected[: expected.index(1) + 1]
        assert result.token_ids == expected
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 6
    assert results[0].prompt_tokens == 91
    # Decode work: one row-step per token after each request's first, never a step on a dead row.
    assert sum(decode_batches) == sum(len(r.token_ids) - 1 for r in results)
    assert max(decode_batches) == 4


def test_finished_rows_stop_costing_decode_work(engine, decode_batches):
    saved = engine.eos_token_ids
    first = [r.token_ids[0] for r in engine.generate(PROMPTS[:4], max_new_tokens=1)]
    engine.eos_token_ids = frozenset({first[1], first[2]} - {first[0], first[3]})  # rows 1 and 2 stop at once
    try:
        results = engine.generate(PROMPTS[:4], max_new_tokens=6)
    finally:
        engine.eos_token_ids = saved
    assert [len(r.token_ids) for r in results] == [6, 1, 1, 6]
    assert decode_batches == [2] * 5  # rows 1 and 2 never ran a decode step; row 3 moved to row 1


def test_several_eos_ids_stop_at_the_first_one(engine):
    [free] = engine.generate([PROMPTS[0]], max_new_tokens=12)
    saved = engine.eos_token_ids
    a, b = free.token_ids[4], free.token_ids[7]
    engine.eos_token_ids = frozenset({b, a})
    try:
        [result] = engine.generate([PROMPTS[0]], max_new_tokens=12)
    finally:
        engine.eos_token_ids = saved
    stop = next(i for i, t in enumerate(free.token_ids) if t in (a, b))
    assert result.token_ids == free.token_ids[: stop + 1] and result.finish_reason == "stop"
    assert result.stop_string is None


def test_explicit_greedy_equals_the_default(engine):
    default = engine.generate(PROMPTS[:3], max_new_tokens=10)
    greedy = engine.generate(PROMPTS[:3], max_new_tokens=10, sampling=SamplingParams(temperature=0.0))
    as_dict = engine.generate(PROMPTS[:3], max_new_tokens=10, sampling={"temperature": 0})
    assert [r.token_ids for r in default] == [r.token_ids for r in greedy] == [r.token_ids for r in as_dict]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    [alone] = engine.generate([PROMPTS[2]], max_new_tokens=16, sampling=params)
    others = [SamplingParams(temperature=0.8, seed=1), None, params, SamplingParams(temperature=1.3, seed=99)]
    batch = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[4]], 16, [*others, None])
    assert batch[2].token_ids == alone.token_ids
    # The same seed twice gives the same tokens; another seed, other tokens.
    assert engine.generate([PROMPTS[2]], 16, params)[0].token_ids == alone.token_ids
    other = engine.generate([PROMPTS[2]], 16, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8))[0]
    assert other.token_ids != alone.token_ids
    # Greedy rows beside sampled ones keep their greedy tokens.
    assert batch[1].token_ids == engine.generate([PROMPTS[1]], 16)[0].token_ids


def _chunks_of(engine, prompt, **kwargs):
    chunks = list(engine.stream(prompt, **kwargs))
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason is not None
    return chunks


@pytest.mark.parametrize(
    ("prompt", "sampling"),
    [
        ("The for statement", None),
        ("Grüße aus Köln — 東京 🙂", SamplingParams(temperature=1.5, seed=3)),
        ("naïve café", SamplingParams(temperature=2.0, seed=11)),
    ],
)
def test_streamed_chunks_join_to_the_generated_result(engine, prompt, sampling):
    chunks = _chunks_of(engine, prompt, max_new_tokens=40, sampling=sampling)
    [result] = engine.generate([prompt], max_new_tokens=40, sampling=sampling)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text == engine.tokenizer.decode(result.token_ids)
    assert chunks[-1].finish_reason == result.finish_reason
    assert all(len(c.token_ids) == 1 for c in chunks)


def test_streaming_holds_multibyte_characters_until_complete(engine):
    """Sampled at a high temperature the tiny model emits byte tokens: seed 5 gives complete
    multi-byte characters, never split across chunks."""
    sampling = SamplingParams(temperature=3.0, seed=5)
    chunks = _chunks_of(engine, "Grüße", max_new_tokens=60, sampling=sampling)
    text = "".join(c.text for c in chunks)
    assert text == engine.generate(["Grüße"], 60, sampling)[0].text
    multibyte = [ch for ch in text if ord(ch) > 127 and ch != "\ufffd"]
    assert multibyte, f"no multi-byte character in {text!r}: pick another seed"
    for c in chunks:  # each chunk is valid text on its own
        assert c.text.encode("utf-8").decode("utf-8") == c.text


def _boundary_stop(chunks) -> tuple[str, int, int]:
    """A 2-character stop string made of the last character of one chunk and the first of the
    next (so it spans a token boundary), that does not occur earlier; its offset in the text and
    the index of the token that completes it."""
    text, offset = "", 0
    for i in range(len(chunks) - 1):
        offset += len(chunks[i].text)
        text += chunks[i].text
        a, b = chunks[i].text, chunks[i + 1].text
        if a and b:
            stop = a[-1] + b[0]
            if stop not in text[:-1] and "\ufffd" not in stop:
                return stop, offset - 1, i + 1
    raise AssertionError("no token boundary with text on both sides")


def test_stop_strings_match_across_token_boundaries(engine):
    prompt = "The for statement"
    free = _chunks_of(engine, prompt, max_new_tokens=40)
    full_text = "".join(c.text for c in free)
    stop, offset, token = _boundary_stop(free)
    [result] = engine.generate([prompt], max_new_tokens=40, stop=["never in this text \x00", stop])
    assert result.finish_reason == "stop" and result.stop_string == stop
    assert result.text == full_text[:offset]
    assert result.token_ids == [t for c in free for t in c.token_ids][: token + 1]
    streamed = _chunks_of(engine, prompt, max_new_tokens=40, stop=stop)
    assert "".join(c.text for c in streamed) == result.text
    assert streamed[-1].stop_string == stop and streamed[-1].finish_reason == "stop"


def test_logprobs_come_with_each_token(engine):
    [plain] = engine.generate([PROMPTS[0]], max_new_tokens=8)
    [result] = engine.generate([PROMPTS[0]], max_new_tokens=8, sampling=SamplingParams(temperature=0, logprobs=3))
    assert result.token_ids == plain.token_ids
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for lp in result.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob <= 0
    assert plain.logprobs is None


def test_timing_is_recorded(engine):
    [result] = engine.generate([PROMPTS[0]], max_new_tokens=8)
    t = result.timing
    assert t.submitted <= t.admitted <= t.first_token <= t.finished
    assert 0 <= t.queue_s <= t.ttft_s and t.decode_s >= 0 and result.tokens_per_s > 0


def test_cache_is_never_reallocated(engine):
    pointer = engine.cache.buffer.ctypes.data
    engine.generate(PROMPTS, max_new_tokens=5, sampling=SamplingParams(temperature=1.0, seed=1))
    list(engine.stream("The for statement", max_new_tokens=5))
    assert engine.cache.buffer.ctypes.data == pointer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"sampling": {"temprature": 0.5}}, "temprature"),
        ({"sampling": "greedy"}, "sampling must be a SamplingParams"),
        ({"sampling": [None, None]}, "sampling has 2 entries for 1 prompts"),
    ],
)
def test_bad_parameters_are_refused_before_anything_runs(engine, kwargs, message):
    engine.last_bindings.clear()
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPTS[0]], **{"max_new_tokens": 4, **kwargs})
    if not isinstance(kwargs.get("sampling"), list):  # stream takes one prompt and one SamplingParams
        with pytest.raises(ValueError, match=message):
            engine.stream(PROMPTS[0], **{"max_new_tokens": 4, **kwargs})
    assert engine.last_bindings == {}  # nothing ran


def test_bad_sampling_values_name_the_parameter():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_chat_generates_from_the_rendered_template(llama_chat_artifact):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The for statement?"}]
    with Engine.load(llama_chat_artifact) as engine:
        result = engine.chat(messages, max_new_tokens=12)
        text = ChatTemplate.from_artifact(llama_chat_artifact).render(messages, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        assert engine.chat_prompt(messages) == ids
        assert result.token_ids == engine.generate([ids], max_new_tokens=12)[0].token_ids
        assert result.prompt_tokens == len(ids)


def test_chat_without_a_template_is_a_clear_error(engine):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])
