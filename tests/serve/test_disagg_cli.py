"""``kvforge serve --prefill-workers/--decode-workers`` as a user runs it.

Proves: the worker flags are checked before anything starts (one-line errors, exit 2); the real
command serves a greedy completion equal to the colocated one, and SIGTERM drains it and exits 0
with its worker processes gone and no shared memory of theirs left; it runs with
``--no-lend-rows`` (hand-offs through the prefill worker's arena, two copies: the fallback; the
default, lent rows, is what tests/serve/test_disagg.py's server runs).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.kv import shm
from kvforge.tools.cli import main
from tests.tools.test_serve import free_port, start_cli_server

MODEL = "tiny-chat"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-workers", "1"], "needs both --prefill-workers and --decode-workers"),
        (["--prefill-workers", "0", "--decode-workers", "1"], "--prefill-workers must be at least 1"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--threads", "2"], "use --threads-per-worker"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--worker-timeout", "0"], "--worker-timeout must be"),
    ],
)
def test_worker_flags_are_checked_first(llama_chat_artifact, capsys, flags, message):
    assert main(["serve", str(llama_chat_artifact), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: ") and message in err and err.count("\n") == 1


def test_serve_with_workers_answers_then_sigterm_exits_0_leaving_nothing(llama_chat_artifact):
    with Engine.load(llama_chat_artifact, threads=1) as engine:
        [expected] = engine.generate(["The for statement"], max_new_tokens=8, sampling=SamplingParams(temperature=0.0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(llama_chat_artifact), "--prefill-workers", "1", "--decode-workers", "1", "--threads-per-worker", "1"]
    args += ["--no-lend-rows", "--served-model-name", MODEL, "--log-level", "warning"]
    proc = start_cli_server(args, port, timeout=90)
    try:
        pids = [w["pid"] for w in httpx.get(url + "/health").json()["workers"]]
        body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["text"] == expected.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in pids:  # the workers exited with the front end, and took their shared memory with them
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert shm.segments(pid) == []
