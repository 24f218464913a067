"""The disaggregated server (``kvforge serve --prefill-workers 1 --decode-workers 2``), driven over
real HTTP by the official ``openai`` client, its workers real spawned processes.

Proves: greedy completions and chat (whole and streamed), seeded ``n`` choices, stop strings and
logprobs equal the colocated outputs (``Engine.generate``/``Engine.chat``, which the one-process
server is proven equal to in tests/tools/test_serve.py), with exact ``usage``; a request that ends
at its first token never leaves the prefill worker; the prefix cache of the prefill worker serves a
repeated prompt; a follow-up whose prompt starts with what a decode worker finished skips the
prefill worker (that decode worker's prefix cache serves it, with the colocated output); routing
goes to the least-loaded decode worker; ``/health`` lists each worker's role, pid and state (503
"degraded", naming the pool, while a pool has no ready worker) and ``/metrics`` counts hand-offs
and their bytes per role; a client that disconnects has its sequence cancelled on the decode worker
that holds it; 429 when full; a request only the worker's scheduler refuses (an empty stop string)
is the colocated server's 400 with the same message, streamed or not.

Faults, with real signals: a decode worker stopped (SIGSTOP) leaves routing after the timeout,
the others serve meanwhile, and it comes back after SIGCONT; a stopped prefill worker's requests
are run again, exactly once, when it answers; kill -9 of a decode worker holding a
sequence mid-stream ends that request with an error naming the worker and the signal, while
the requests on the other worker finish exactly, and the front end restarts it and unlinks its
segments; a block not yet imported by a killed decode worker is resumed on another; kill -9 of
the prefill worker holding requests that streamed nothing re-runs them (exact outputs).
A decode worker refuses a corrupted block and a foreign one (KVBlockError) and goes on serving;
a lent cache row corrupted in place is refused by its checksum too, and its row freed. The
module's server runs with lent rows (the default: one copy per hand-off); tests/serve/test_disagg_cli.py
runs the arena (``--no-lend-rows``: two copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.kv import shm
from kvforge.tools.serve.disagg.router import DisaggServer
from kvforge.tools.serve.disagg.workers import DECODE, PipeWorker, WorkerSpec
from tests.helpers import KEY
from tests.tools.test_serve import metric, serving, sse_events, stream_joins_to

MODEL = "tiny-chat"
PROMPTS = ["The for statement", "A list is a mutable"]
GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
TIMEOUT = 2.0  # --worker-timeout of the module's server


@contextlib.contextmanager
def running(artifact: Path, **options):
    """A real uvicorn server over a DisaggServer on a free port, in a background thread."""
    server = DisaggServer.load(artifact, threads_per_worker=1, model_name=MODEL, **options)
    with serving(server) as url:
        yield url, server


@pytest.fixture(scope="module")
def served(llama_chat_artifact):
    with running(llama_chat_artifact, prefill_workers=1, decode_workers=2, max_queue=4, worker_timeout=TIMEOUT) as (
        url,
        server,
    ):
        yield url, server


def wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def worker(server: DisaggServer, name: str) -> dict:
    return next(w for w in server.workers() if w["name"] == name)


def all_ready(server: DisaggServer) -> bool:
    return all(w["state"] == "ready" for w in server.workers())


def stream(url: str, body: dict) -> tuple[str, list]:
    """A streamed completion's joined text and its events (error objects included)."""
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    return text, events


def long_prompt(engine: Engine, tokens: int) -> str:
    for prompt in ["The for statement", "A list is", "Functions are defined", "The while loop", "Classes"]:
        [r] = engine.generate([prompt], max_new_tokens=tokens, sampling=GREEDY)
        if r.finish_reason == "length":
            return prompt
    pytest.fail("every candidate prompt meets eos early")


# ------------------------------------------------------------------------------- equal outputs


def test_health_lists_each_worker_role_pid_and_state(served):
    url, _ = served
    body = httpx.get(url + "/health").json()
    assert body["status"] == "ok" and body["model"] == MODEL
    workers = body["workers"]
    assert [(w["name"], w["role"], w["state"]) for w in workers] == [
        ("prefill-0", "prefill", "ready"),
        ("decode-0", "decode", "ready"),
        ("decode-1", "decode", "ready"),
    ]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 3 and os.getpid() not in pids
    for pid in pids:
        os.kill(pid, 0)  # each is a live process
    # The prefill worker's KV cache is in shared memory (its hand-offs lend rows of it), and it has no arena.
    [cache] = shm.segments(workers[0]["pid"])
    assert cache.startswith(f"kvforge-{workers[0]['pid']}-cache-")


def test_greedy_completions_equal_colocated_with_exact_usage(client, engine):
    expected = engine.generate(PROMPTS, max_new_tokens=12, sampling=GREEDY)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.finish_reason for e in expected]
    prompt_tokens = sum(len(engine.encode(p)) for p in PROMPTS)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        prompt_tokens,
        sum(len(e.token_ids) for e in expected),
    )


def test_stream_joins_to_the_colocated_answer(served, client, engine):
    [expected] = engine.generate(PROMPTS[:1], max_new_tokens=16, sampling=GREEDY)
    stream_joins_to(client, PROMPTS[0], expected)  # the prefill side's "handoff" never reaches the client


def test_chat_whole_and_streamed_equal_colocated(client, engine):
    expected = engine.chat(MESSAGES, max_new_tokens=12, sampling=GREEDY)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == expected.text and r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == expected.prompt_tokens and r.usage.completion_tokens == len(expected.token_ids)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_seeded_n_choices_stop_strings_and_logprobs_equal_colocated(client, engine):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=7, n=2)
    expected = [
        engine.generate(PROMPTS[:1], max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=7 + j))[0]
        for j in range(2)
    ]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert r.choices[0].text != r.choices[1].text

    [full] = engine.generate(PROMPTS[:1], max_new_tokens=20, sampling=GREEDY)
    stop = full.text[4:7]
    [cut] = engine.generate(PROMPTS[:1], max_new_tokens=20, sampling=GREEDY, stop=[stop])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == cut.text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop

    [lp] = engine.generate(PROMPTS[:1], max_new_tokens=6, sampling=SamplingParams(temperature=0.0, logprobs=3))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    got = r.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([t.logprob for t in lp.logprobs], abs=1e-5)
    assert all(0 < len(top) <= 3 for top in got.top_logprobs)  # distinct token texts among the top 3


def test_a_request_only_the_workers_scheduler_refuses_is_400(served, engine):
    """An empty stop string passes the front end's checks; the prefill worker's scheduler refuses
    it (ValueError), as the colocated scheduler does: 400 with the same message, not 500."""
    url, server = served
    with engine.scheduler() as sched, pytest.raises(ValueError) as colocated:
        sched.submit(engine.encode(PROMPTS[0]), 4, GREEDY, [""])
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stop": [""]}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["message"], error["type"], error["code"]) == (
        str(colocated.value),
        "invalid_request_error",
        "invalid_value",
    )
    # streamed: the app holds the 200 until the worker's first event, so the refusal is the same 400
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers)
    assert (r.status_code, r.json()["error"]) == (400, error)
    wait_until(lambda: server.in_flight == 0, "the refused sequences to be released")


def test_first_token_end_stays_on_the_prefill_worker_and_metrics_count_handoffs(served, client, engine):
    url, _ = served
    before = httpx.get(url + "/metrics").text
    [one] = engine.generate(PROMPTS[:1], max_new_tokens=1, sampling=GREEDY)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert r.choices[0].text == one.text and r.choices[0].finish_reason == "length"
    middle = httpx.get(url + "/metrics").text
    assert metric(middle, "kvforge_handoffs_total") == metric(before, "kvforge_handoffs_total")

    [expected] = engine.generate(PROMPTS[1:], max_new_tokens=5, sampling=GREEDY)
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0)
    after = httpx.get(url + "/metrics").text
    m = engine.manifest.model
    kv_bytes = m.num_layers * 2 * m.num_kv_heads * expected.prompt_tokens * m.head_dim * 4  # float32
    assert metric(after, "kvforge_handoffs_total") - metric(middle, "kvforge_handoffs_total") == 1
    assert metric(after, "kvforge_handoff_bytes_total") - metric(middle, "kvforge_handoff_bytes_total") == kv_bytes
    assert metric(after, "kvforge_handoff_seconds_count") - metric(middle, "kvforge_handoff_seconds_count") == 1
    for name in ("prefill-0", "decode-0", "decode-1"):
        role = name.split("-")[0]
        assert metric(after, "kvforge_worker_up", role=role, worker=name) == 1
        assert f'kvforge_worker_running_rows{{role="{role}",worker="{name}"}}' in after
    assert metric(after, "kvforge_workers", role="decode", state="ready") == 2


def test_prefix_cache_of_the_prefill_worker_serves_a_repeated_prompt(client, engine):
    """The first request ends at its first token on the prefill worker (no decode worker saw it),
    whose prefix cache then serves the second."""
    prompt = " ".join(["The for statement repeats a block of code for each item."] * 6)
    [expected] = engine.generate([prompt], max_new_tokens=6, sampling=GREEDY)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    time.sleep(0.2)  # the pool is offered the prompt's KV as the prefill worker retires the row
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert expected.text.startswith(first.choices[0].text) and second.choices[0].text == expected.text
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_routing_picks_the_least_loaded_decode_worker(served, client):
    """Four concurrent requests all go through the one prefill worker; the decode workers share
    them by load (sequences held now, ties: fewer given so far), so once two sequences reached the
    decode pool both workers got one. How the rest split depends on which sequences are still
    decoding when the next hand-off arrives (a 3-1 split is least-loaded routing too, when one
    worker's first sequence is slow), so the test does not assume an even split."""
    _, server = served
    before = {w["name"]: w["routed"] for w in server.workers()}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=8), PROMPTS * 2))
    after = {w["name"]: w["routed"] for w in server.workers()}
    assert after["prefill-0"] - before["prefill-0"] == 4
    spread = [after[n] - before[n] for n in ("decode-0", "decode-1")]
    # a sequence that ends at its first token ends on the prefill worker and never reaches the pool
    assert sum(spread) <= 4 and (sum(spread) < 2 or min(spread) >= 1), spread


def test_a_prefix_hit_on_a_decode_worker_skips_the_prefill_worker(served, client, engine):
    """A follow-up whose prompt starts with a sequence a decode worker finished (the previous turn
    it decoded) goes straight to that worker: its prefix cache serves the common part, it prefills
    the rest; the output is the colocated one. (After the routing test: it leaves the decode
    workers' routed counts, the routing tie-break, unequal by up to 2.)"""
    url, server = served
    wait_until(lambda: all_ready(server), "every worker ready")
    turn1 = " ".join(["A tuple is an immutable sequence of values."] * 6)
    first = client.completions.create(model=MODEL, prompt=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + first.choices[0].text + " Lists"
    [expected] = engine.generate([turn2], max_new_tokens=8, sampling=GREEDY)
    time.sleep(0.2)  # the decode worker offers the finished row to its pool as it retires it
    before = {w["name"]: w["routed"] for w in server.workers()}
    routed = metric(httpx.get(url + "/metrics").text, "kvforge_prefix_routed_total")
    second = client.completions.create(model=MODEL, prompt=turn2, max_tokens=8, temperature=0)
    after = {w["name"]: w["routed"] for w in server.workers()}
    assert second.choices[0].text == expected.text
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert after["prefill-0"] == before["prefill-0"]  # the prefill worker never saw it
    assert sum(after[n] - before[n] for n in ("decode-0", "decode-1")) == 1
    assert metric(httpx.get(url + "/metrics").text, "kvforge_prefix_routed_total") == routed + 1


# ------------------------------------------------------------------------------ cancel, admission


def stop_decode_workers(server: DisaggServer):
    pids = [w["pid"] for w in server.workers() if w["role"] == DECODE]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def resume(pids) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def handed_off(server: DisaggServer) -> bool:
    decode = [w for w in server.workers() if w["role"] == DECODE]
    return sum(w["held"] for w in decode) == 1 or any(w["state"] == "unresponsive" for w in decode)


def test_client_disconnect_cancels_on_the_decode_worker(served, engine):
    url, server = served
    before = httpx.get(url + "/metrics").text
    body = {"model": MODEL, "prompt": long_prompt(engine, 60), "max_tokens": 60, "temperature": 0, "logprobs": 0}
    pids = stop_decode_workers(server)  # the hand-off waits in a stopped worker's pipe
    try:
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))  # from the prefill worker
            assert len(json.loads(first[6:])["choices"][0]["logprobs"]["tokens"]) == 1
            # Handed off: held by a stopped decode worker, or (a slow machine) waiting in the router
            # because both were taken out of routing after the timeout. Either way the cancel reaches it.
            wait_until(lambda: handed_off(server), "the hand-off")
    finally:
        resume(pids)  # the worker resumes the sequence, then reads the cancel
    wait_until(lambda: server.in_flight == 0, "the sequence to be released")
    after = httpx.get(url + "/metrics").text
    cancelled = metric(after, "kvforge_sequences_finished_total", reason="cancelled")
    assert cancelled == metric(before, "kvforge_sequences_finished_total", reason="cancelled") + 1
    generated = metric(after, "kvforge_generation_tokens_total") - metric(before, "kvforge_generation_tokens_total")
    assert generated < 60
    wait_until(lambda: all_ready(server), "the decode workers to answer again")


def test_full_is_429_and_draining_is_503(served, engine):
    url, server = served
    headers = {"authorization": f"Bearer {KEY}"}
    pids = stop_decode_workers(server)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
        body["n"] = server.capacity
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            wait_until(lambda: server.in_flight == server.capacity, "every sequence admitted")
            small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            refused = httpx.post(url + "/v1/completions", json=small, headers=headers)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            resume(pids)
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e]
    finally:
        resume(pids)
    wait_until(lambda: server.in_flight == 0, "the sequences to be released")
    server.draining = True
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    finally:
        server.draining = False
    wait_until(lambda: all_ready(server), "the decode workers to answer again")


# ------------------------------------------------------------------------------------- faults


def test_stopped_decode_worker_leaves_routing_then_comes_back(served, client, engine):
    url, server = served
    pid = worker(server, "decode-1")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: worker(server, "decode-1")["state"] == "unresponsive", "the timeout", TIMEOUT * 5)
        assert httpx.get(url + "/health").json()["workers"][2]["state"] == "unresponsive"
        expected = engine.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY)
        before = worker(server, "decode-1")["routed"]
        r = client.completions.create(model=MODEL, prompt=PROMPTS * 2, max_tokens=8, temperature=0)
        assert [c.text for c in r.choices] == [e.text for e in expected] * 2
        assert worker(server, "decode-1")["routed"] == before  # nothing went to the stopped worker
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: worker(server, "decode-1")["state"] == "ready", "the worker to answer again")
    assert worker(server, "decode-1")["pid"] == pid  # the same process: it was never restarted


def test_stopped_prefill_worker_past_the_timeout_runs_its_requests_once_back(served, client, engine):
    """Its requests (nothing streamed) are taken back after the timeout and, with no other prefill
    worker, given to it again when it answers: what it did with the first submissions is ignored."""
    url, server = served
    wait_until(lambda: all_ready(server), "every worker ready")
    expected = engine.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY)
    before = metric(httpx.get(url + "/metrics").text, "kvforge_sequence_reruns_total", role="prefill")
    pid = worker(server, "prefill-0")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=10, temperature=0)
                for p in PROMPTS
            ]
            wait_until(lambda: worker(server, "prefill-0")["state"] == "unresponsive", "the timeout", TIMEOUT * 5)
            health = httpx.get(url + "/health")  # the prefill pool has no ready worker: degraded, 503
            body = health.json()
            assert health.status_code == 503 and body["status"] == "degraded"
            assert "the prefill pool has no ready worker (prefill-0 unresponsive)" in body["degraded"]
            assert "decode" not in body["degraded"]
            assert (body["workers"][0]["name"], body["workers"][0]["state"]) == ("prefill-0", "unresponsive")
            os.kill(pid, signal.SIGCONT)
            texts = [f.result(timeout=60).choices[0].text for f in runs]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert texts == [e.text for e in expected]
    after = metric(httpx.get(url + "/metrics").text, "kvforge_sequence_reruns_total", role="prefill")
    assert after - before == 2 and worker(server, "prefill-0")["pid"] == pid
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and "degraded" not in health.json()


def test_kill_9_decode_worker_mid_stream_fails_its_request_only_and_restarts(served, engine):
    url, server = served
    prompt = long_prompt(engine, 200)
    [expected] = engine.generate([prompt], max_new_tokens=200, sampling=GREEDY)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "logprobs": 20}
    for _ in range(10):  # catch a decode worker mid-sequence (the tiny model is fast), then stop it there
        lines: queue.SimpleQueue = queue.SimpleQueue()
        victim = threading.Thread(target=lambda q=lines: q.put(stream(url, body)), daemon=True)
        victim.start()
        deadline = time.monotonic() + 10
        target = None
        while target is None and time.monotonic() < deadline and victim.is_alive():
            target = next((w for w in server.workers() if w["decoding"]), None)
        if target is not None:
            os.kill(target["pid"], signal.SIGSTOP)
            time.sleep(0.3)  # what it sent before it stopped (its "done", perhaps) reaches the router
            if worker(server, target["name"])["decoding"]:  # resumed there, streaming from there
                break
            os.kill(target["pid"], signal.SIGCONT)  # it finished first: try again
        victim.join(30)
        lines.get()
    else:
        pytest.fail("never caught a decode worker holding a sequence")
    dead_pid, name = target["pid"], target["name"]
    other = "decode-1" if name == "decode-0" else "decode-0"
    # Load on the other worker while this one is stopped: those requests finish exactly.
    expected_short = engine.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=10, temperature=0) for p in PROMPTS
        ]
        time.sleep(0.3)
        os.kill(dead_pid, signal.SIGKILL)
        texts = [f.result().choices[0].text for f in runs]
    assert texts == [e.text for e in expected_short]
    victim.join(30)
    text, events = lines.get()
    [error] = [e for e in events if isinstance(e, dict) and "error" in e]
    message = error["error"]["message"]
    assert f"decode worker {name} (pid {dead_pid})" in message and "SIGKILL" in message and "retry" in message
    assert expected.text.startswith(text)  # what was streamed before the kill was right
    assert events[-1] == "[DONE]"
    # The front end is up, restarted the worker in its slot and left no segment of the dead one.
    wait_until(lambda: worker(server, name)["state"] == "ready" and worker(server, name)["pid"] != dead_pid, "restart")
    assert shm.segments(dead_pid) == []
    assert worker(server, name)["restarts"] >= 1 and worker(server, other)["state"] == "ready"
    assert server.in_flight == 0
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in r.choices] == [e.text for e in expected_short]


def test_kill_9_of_a_decode_worker_before_it_imports_resumes_the_block_elsewhere(served, client, engine):
    url, server = served
    wait_until(lambda: all_ready(server), "every worker ready")
    expected = engine.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY)
    pid = worker(server, "decode-0")["pid"]
    os.kill(pid, signal.SIGSTOP)  # decode-0 receives hand-offs but cannot take them
    with ThreadPoolExecutor(4) as pool:
        runs = [
            pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=10, temperature=0)
            for p in PROMPTS * 2
        ]
        wait_until(lambda: worker(server, "decode-0")["held"] > 0, "a hand-off to the stopped worker")
        os.kill(pid, signal.SIGKILL)
        texts = [f.result().choices[0].text for f in runs]
    assert texts == [e.text for e in expected] * 2  # nothing lost: the blocks went to decode-1
    before = httpx.get(url + "/metrics").text
    assert metric(before, "kvforge_sequence_reruns_total", role="decode") >= 1
    wait_until(lambda: worker(server, "decode-0")["state"] == "ready", "the restart")


def test_kill_9_of_the_prefill_worker_reruns_what_streamed_nothing(served, client, engine):
    url, server = served
    wait_until(lambda: all_ready(server), "every worker ready")
    expected = engine.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY)
    pid = worker(server, "prefill-0")["pid"]
    os.kill(pid, signal.SIGSTOP)  # it holds the requests without answering them
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=10, temperature=0) for p in PROMPTS
        ]
        wait_until(lambda: server.in_flight == 2, "both requests admitted")
        os.kill(pid, signal.SIGKILL)
        texts = [f.result(timeout=60).choices[0].text for f in runs]
    assert texts == [e.text for e in expected]  # re-run on the restarted prefill worker
    assert worker(server, "prefill-0")["pid"] != pid
    wait_until(lambda: shm.segments(pid) == [], "the dead worker's arena to be unlinked")
    assert metric(httpx.get(url + "/metrics").text, "kvforge_sequence_reruns_total", role="prefill") >= 2


# ------------------------------------------------------------------------------ refused blocks


def test_decode_worker_refuses_corrupted_and_foreign_blocks(llama_chat_artifact, engine):
    """A decode worker process of its own, fed hand-offs made here: a corrupted one and one whose
    fingerprint is another artifact's are refused with KVBlockError; a good one decodes exactly."""
    prompt = engine.encode(PROMPTS[0])
    [expected] = engine.generate([prompt], max_new_tokens=6, sampling=GREEDY)
    alloc = shm.SegmentAllocator(arena_bytes=2**20)  # as a prefill worker's: blocks in slots of one arena

    def handoff():
        with engine.scheduler(block_alloc=alloc) as sched:
            return sched.submit(prompt, max_new_tokens=6, sampling=GREEDY, hand_off=True).result().handoff

    events: queue.SimpleQueue = queue.SimpleQueue()
    spec = WorkerSpec(DECODE, "decode-t", str(llama_chat_artifact), 1, 0, heartbeat_s=0.5)
    w = PipeWorker(spec)
    w.start(lambda _, event: events.put(event) if event.kind not in ("beat",) else None)
    try:

        def next_event(kinds):
            while True:
                event = events.get(timeout=60)
                if event.kind in kinds:
                    return event

        assert next_event({"ready", "failed"}).kind == "ready"
        corrupted = alloc.put(handoff())
        with open(shm.SHM_DIR / corrupted.name, "r+b") as f:
            f.seek(corrupted.offset + corrupted.nbytes // 2)
            f.write(b"\xff\xff\xff\xff")
        w.resume(1, corrupted)
        error = next_event({"error", "done"})
        assert (
            error.kind == "error" and error.payload["type"] == "KVBlockError" and "checksum" in error.payload["message"]
        )

        h = handoff()
        h.block = dataclasses.replace(h.block, fingerprint={**h.block.fingerprint, "weights_sha256": "0" * 64})
        w.resume(2, alloc.put(h))
        error = next_event({"error", "done"})
        assert error.kind == "error" and error.payload["type"] == "KVBlockError"

        w.resume(3, alloc.put(handoff()))  # the worker goes on: a good block decodes exactly
        done = next_event({"error", "done"})
        assert done.kind == "done" and done.payload.token_ids == expected.token_ids

        # A lent row (a prefill worker's default): corrupted in place, it is refused by the import's
        # checksum and its row freed; the next one lent from that row decodes exactly.
        with (
            Engine.load(llama_chat_artifact, threads=1, prefix_cache=0, kv_shared=True) as lender,
            lender.scheduler(lend_rows=True) as sched,
        ):
            lent = lender.cache.segment.put(sched.submit(prompt, 6, GREEDY, hand_off=True).result().handoff)
            lender.cache.buffer[-1, 0, lent.row, 0, 1, :4] += 1.0
            w.resume(4, lent)
            error = next_event({"error", "done"})
            assert error.kind == "error" and error.payload["type"] == "KVBlockError"
            assert "checksum" in error.payload["message"] and not lender.cache.segment.lent(lent.row)
            again = lender.cache.segment.put(sched.submit(prompt, 6, GREEDY, hand_off=True).result().handoff)
            assert again.row == lent.row and again.cache is not None
            w.resume(5, again)
            done = next_event({"error", "done"})
            assert done.kind == "done" and done.payload.token_ids == expected.token_ids
            assert not lender.cache.segment.lent(again.row)
    finally:
        w.close()
        alloc.close()
    assert shm.segments(os.getpid()) == [] and shm.segments(w.pid) == []
