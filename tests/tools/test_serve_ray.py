"""``kvforge serve --ray``: the same app as a Ray Serve deployment of 2 replicas on a local Ray
cluster (fractional CPUs per replica), behind Ray's HTTP proxy.

Proves: requests are answered by both replicas (each names itself in ``x-kvforge-replica``, each
with its own engine), with the same greedy outputs as ``Engine.generate`` (as one process gives),
streamed and not, with OpenAI's error objects passing through the proxy unchanged; SIGTERM shuts
the deployment and the cluster down. Slow (a Ray cluster starts: ~15-40 s), still run in CI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.tools.serve.app import REPLICA_HEADER
from tests.tools.test_serve import free_port, sse_events

pytest.importorskip("ray.serve")

MODEL = "tiny-ray"
PROMPTS = ["The for statement", "A list is a mutable", "Functions are defined", "The while loop"]


@pytest.mark.slow
def test_two_replicas_serve_the_same_answers(llama_chat_artifact):
    with Engine.load(llama_chat_artifact, threads=1) as engine:
        expected = engine.generate(PROMPTS, max_new_tokens=10, sampling=SamplingParams(temperature=0.0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvforge.tools.cli", "serve", str(llama_chat_artifact), "--ray", "--replicas", "2"]
    cmd += ["--port", str(port), "--num-cpus", "2", "--replica-cpus", "0.5", "--served-model-name", MODEL]
    # Its own session: the Ray processes it starts can be ended together if the test fails.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        replicas: set[str] = set()
        while len(replicas) < 2:  # both replicas up (the proxy routes to whichever is ready)
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the Ray deployment did not come up with 2 replicas in 120 s"
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200:
                    replicas.add(r.json()["replica"])
            time.sleep(0.2)

        def complete(i: int) -> tuple[str, str]:
            body = {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": 10, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.headers[REPLICA_HEADER], r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, range(24)))
        assert {replica for replica, _ in answers} == replicas  # both served
        assert [text for _, text in answers] == [expected[i % 4].text for i in range(24)]

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == expected[0].text
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert sse_events(r.iter_lines())[-1] == "[DONE]"
        r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
