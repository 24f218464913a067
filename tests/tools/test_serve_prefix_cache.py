"""The server with the prefix cache (on by default): a conversation resent by the official
``openai`` client takes its earlier turns from the cache (``usage.prompt_tokens_details.cached_tokens``,
whole and streamed) and answers exactly what an engine without the cache answers; ``/metrics``
exposes the pool's queries, hits, bytes and budget and ``/health`` its hit rate; with
``prefix_cache=0`` nothing is cached, the usage says 0 and the series are absent; ``kvforge
loadtest --shared-prefix`` sends prompts that share their first words and sums the cached tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvforge.runtime import Engine
from tests.tools.test_serve import KEY, MODEL, metric, running

SYSTEM = "You answer questions about Python."
TURNS = ["A list?", "A tuple?", "A dict?"]


@pytest.fixture(scope="module")
def reference(llama_chat_artifact):
    with Engine.load(llama_chat_artifact, threads=1, prefix_cache=0) as engine:
        yield engine


def _conversation(client: openai.OpenAI, stream_last: bool = False):
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        if stream_last and i == len(TURNS) - 1:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            text, usage = r.choices[0].message.content, r.usage
        replies.append((text, usage))
        messages.append({"role": "assistant", "content": text})
    return messages, replies


def test_a_resent_conversation_is_served_from_the_cache(llama_chat_artifact, reference):
    with running(llama_chat_artifact, max_queue=4) as (url, _server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        messages, replies = _conversation(client, stream_last=True)
        health = httpx.get(url + "/health").json()["prefix_cache"]
        text = httpx.get(url + "/metrics").text
    cached = [usage.prompt_tokens_details.cached_tokens for _, usage in replies]
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:])  # the system prompt and earlier turns (16-token blocks)
    assert all(c < usage.prompt_tokens for c, (_, usage) in zip(cached, replies))
    for i, (reply, _) in enumerate(replies):  # the same answers as an engine without the cache
        prompt = messages[: 2 + 2 * i]
        assert reply == reference.chat(prompt, max_new_tokens=6, sampling={"temperature": 0}).text
    hits = metric(text, "kvforge_prefix_cache_hits_total")
    assert hits == sum(cached) == metric(text, "kvforge_prompt_tokens_cached_total")
    assert metric(text, "kvforge_prefix_cache_queries_total") == sum(u.prompt_tokens - 1 for _, u in replies)
    assert metric(text, "kvforge_prefix_cache_budget_bytes") == 512 * 2**20
    assert 0 < metric(text, "kvforge_prefix_cache_bytes") == health["bytes"]
    assert health["hit_rate"] == pytest.approx(hits / metric(text, "kvforge_prefix_cache_queries_total"), abs=1e-4)


def test_prefix_cache_off(llama_chat_artifact):
    with running(llama_chat_artifact, max_queue=4, prefix_cache=0) as (url, _server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        _, replies = _conversation(client)
        assert httpx.get(url + "/health").json()["prefix_cache"] is None
        text = httpx.get(url + "/metrics").text
    assert [usage.prompt_tokens_details.cached_tokens for _, usage in replies] == [0, 0, 0]
    assert "kvforge_prefix_cache_hits_total" not in text


def test_loadtest_shared_prefix_is_served_from_the_cache(llama_chat_artifact):
    from kvforge.tools.loadtest import LoadOptions, plan, run_loadtest

    options = LoadOptions(
        rate=float("inf"), requests=4, prompt_lens=(3,), output_lens=(2,), shared_prefix=12, model=MODEL, api_key=KEY
    )
    prompts = [item["prompt"].split() for item in plan(options)]
    assert all(p[:12] == prompts[0][:12] and len(p) == 15 for p in prompts)
    with running(llama_chat_artifact, max_queue=4) as (url, _server):
        run_loadtest(url, LoadOptions(**{**options.__dict__, "requests": 1}))  # the shared prefix, cached
        summary = run_loadtest(url, options)["summary"]
    assert summary["completed"] == 4 and summary["cached_tokens"] >= 4 * 16
