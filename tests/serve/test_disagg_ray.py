"""Disaggregated prefill/decode on Ray Serve (tools/serve/disagg/ray_roles.py): 1 prefill + 1 decode
replica and the ingress on a local Ray cluster, the block through Ray's object store.

Proves: completions through Ray's HTTP proxy give exactly the one-process outputs (``Engine.generate``
on the same artifact) for greedy prompts, for seeded sampling with ``n=2`` (seeds ``seed + j``),
streamed and not, and a prompt whose first token ends it (``max_tokens=1``) ends on the prefill
replica; the prefill and the decode replica both served (the hand-off count in the ingress's
``/metrics``); a follow-up whose prompt starts with a finished sequence goes straight to the
decode replica (its prefix cache: no hand-off, ``kvforge_prefix_routed_total``) with the
one-process output; ``/health`` lists both workers ready. Slow (a Ray cluster starts: ~20-40 s).
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from kvforge.runtime import Engine, SamplingParams
from tests.tools.test_serve import free_port, sse_events

pytest.importorskip("ray.serve")

PROMPTS = ["Once upon a time there was", "The for statement", "A list is a mutable"]


@pytest.mark.slow
def test_one_prefill_one_decode_replica_give_the_one_process_outputs(tiny_artifact):
    import ray
    from ray import serve

    from kvforge.tools.serve.disagg import ray_roles
    from kvforge.tools.serve.ray_app import ReplicaSettings

    with Engine.load(tiny_artifact, threads=1, prefix_cache=0) as engine:
        greedy = engine.generate(PROMPTS, 16, SamplingParams(temperature=0.0))
        seeded = engine.generate([PROMPTS[0]] * 2, 16, [SamplingParams(temperature=0.9, seed=s) for s in (5, 6)])
        first = engine.generate([PROMPTS[1]], 1, SamplingParams(temperature=0.0))[0]
        turn1 = " ".join([PROMPTS[2]] * 4)
        [reply] = engine.generate([turn1], 8, SamplingParams(temperature=0.0))
        turn2 = turn1 + reply.text + " and"
        [follow_up] = engine.generate([turn2], 8, SamplingParams(temperature=0.0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        settings = ReplicaSettings(str(tiny_artifact), threads=1, model_name="tiny", prefix_cache="64MiB")
        ray_roles.deploy(settings, prefill_workers=1, decode_workers=1, worker_cpus=0.5, port=port)
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                health = httpx.get(url + "/health", timeout=5)
                if health.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the Ray deployment did not come up in 120 s"
            time.sleep(0.2)
        workers = health.json()["workers"]
        assert sorted((w["role"], w["state"]) for w in workers) == [("decode", "ready"), ("prefill", "ready")]

        def complete(**body) -> dict:
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        for prompt, expected in zip(PROMPTS, greedy):
            assert complete(prompt=prompt, max_tokens=16, temperature=0)["choices"][0]["text"] == expected.text
        choices = complete(prompt=PROMPTS[0], max_tokens=16, temperature=0.9, seed=5, n=2)["choices"]
        assert [c["text"] for c in sorted(choices, key=lambda c: c["index"])] == [r.text for r in seeded]
        one = complete(prompt=PROMPTS[1], max_tokens=1, temperature=0)["choices"][0]
        assert (one["text"], one["finish_reason"]) == (first.text, "length")
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == greedy[2].text
        metrics = httpx.get(url + "/metrics", timeout=10).text
        handoffs = [line for line in metrics.splitlines() if line.startswith("kvforge_handoffs_total")]
        assert handoffs and float(handoffs[0].split()[-1]) == 6  # 3 greedy + 2 seeded + 1 streamed

        # A chat's next turn: its prompt is the previous one's prompt + reply, which the decode
        # replica finished and holds in its prefix cache (offered as it retires the row).
        assert complete(prompt=turn1, max_tokens=8, temperature=0)["choices"][0]["text"] == reply.text
        time.sleep(0.5)  # the decode role offers the finished row to its pool, the heartbeat says so
        out = complete(prompt=turn2, max_tokens=8, temperature=0)
        assert out["choices"][0]["text"] == follow_up.text
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        metrics = httpx.get(url + "/metrics", timeout=10).text
        routed = [line for line in metrics.splitlines() if line.startswith("kvforge_prefix_routed_total")]
        assert routed and float(routed[0].split()[-1]) == 1
        handoffs = [line for line in metrics.splitlines() if line.startswith("kvforge_handoffs_total")]
        assert float(handoffs[0].split()[-1]) == 7  # turn 1 was handed off, turn 2 was not
    finally:
        serve.shutdown()
        ray.shutdown()
