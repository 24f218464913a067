"""Opt-in (``-m real_model``): the disaggregated server (1 prefill + 1 decode worker, 1 thread each)
on SmolLM2-135M-Instruct gives the colocated tokens: greedy chat, a ~1,200-token prompt (its
55 MB KV block handed off through shared memory, counted byte for byte in /metrics) and seeded
sampling."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvforge.runtime import Engine, SamplingParams
from tests.serve.test_disagg import KEY, MODEL, running
from tests.tools.test_serve import metric

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def artifact(smollm2_dir, tmp_path_factory):
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("smollm2-disagg") / "art"
    compile_model(smollm2_dir, out, max_batch=2, max_seq=2048, score_graph=False, progress=None)
    return out


def test_smollm2_disaggregated_equals_colocated(artifact):
    long = " ".join(f"Item {i} is a line of a long document about lists, loops and functions." for i in range(70))
    messages = [{"role": "user", "content": "Name three primary colors."}]
    seeded = SamplingParams(temperature=0.8, seed=5)
    with Engine.load(artifact, threads=2) as engine:
        chat = engine.chat(messages, max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
        [doc] = engine.generate([long], max_new_tokens=16, sampling=SamplingParams(temperature=0.0))
        [sampled] = engine.generate(["Write a haiku about the sea."], max_new_tokens=24, sampling=seeded)
        m = engine.manifest.model
        per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4  # float32 K and V
    assert 1000 <= doc.prompt_tokens <= 1500
    with running(artifact, prefill_workers=1, decode_workers=1) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == chat.text
        before = httpx.get(url + "/metrics").text
        r = client.completions.create(model=MODEL, prompt=long, max_tokens=16, temperature=0)
        assert r.choices[0].text == doc.text
        after = httpx.get(url + "/metrics").text
        handed = metric(after, "kvforge_handoff_bytes_total") - metric(before, "kvforge_handoff_bytes_total")
        assert handed == doc.prompt_tokens * per_token
        r = client.completions.create(
            model=MODEL, prompt="Write a haiku about the sea.", max_tokens=24, temperature=0.8, seed=5
        )
        assert r.choices[0].text == sampled.text
