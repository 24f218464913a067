"""``kvforge loadtest`` against the real server (a handful of requests).

Proves: every request is sent and answered and the counts agree with the server's own metrics
(requests, generated tokens); every figure of the summary is present and consistent (TTFT <=
latency per request, TPOT from the same stamps, p50 <= p90 <= p99, goodput = requests meeting both
SLOs / duration); failures are counted by status (401 with a wrong key) and never meet the SLO.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvforge.tools.cli import main
from tests.tools.test_serve import KEY, metric, running


@pytest.fixture(scope="module")
def server_url(llama_chat_artifact):
    with running(llama_chat_artifact, max_queue=8) as (url, _):
        yield url


def test_loadtest_counts_and_figures(server_url, tmp_path, capsys):
    before = httpx.get(server_url + "/metrics").text
    out, plot = tmp_path / "load.json", tmp_path / "load.png"
    args = ["loadtest", server_url + "/v1", "--rate", "40", "--requests", "6", "--prompt-lens", "3,6"]
    args += ["--output-lens", "4,7", "--api-key", KEY, "--slo-ttft", "5000", "--slo-tpot", "1000"]
    assert main([*args, "--json", str(out), "--plot", str(plot)]) == 0
    report = capsys.readouterr().out
    assert "completed 6, failed 0 (none)" in report and "goodput" in report and "TTFT" in report
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["errors"], s["error_examples"]) == (6, 6, 0, {}, {})
    assert (result["kind"], result["schema_version"], result["model"]) == ("kvforge.loadtest", 1, "tiny-chat")
    assert plot.stat().st_size > 0
    after = httpx.get(server_url + "/metrics").text
    served = metric(after, "kvforge_requests_total", route="/v1/completions", status="200") - metric(
        before, "kvforge_requests_total", route="/v1/completions", status="200"
    )
    generated = metric(after, "kvforge_generation_tokens_total") - metric(before, "kvforge_generation_tokens_total")
    assert served == 6 and s["output_tokens"] == generated
    for r in result["requests"]:
        assert r["ok"] and r["status"] == 200 and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["completion_tokens"] <= r["max_tokens"] and r["prompt_tokens"] >= r["prompt_words"]
        assert 0 < r["ttft_s"] <= r["latency_s"]
        if r["completion_tokens"] >= 2:
            assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1))
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        p = s[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert s["ttft_ms"]["p50"] <= s["latency_ms"]["p50"]
    meeting = sum(r["meets_slo"] for r in result["requests"])
    assert s["meeting_slo"] == meeting == 6  # generous SLOs: all meet them
    assert s["goodput_rps"] == pytest.approx(meeting / s["duration_s"])
    assert s["throughput_rps"] == pytest.approx(6 / s["duration_s"])
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])


def test_loadtest_counts_errors_by_status(server_url, tmp_path):
    out = tmp_path / "bad.json"
    args = ["loadtest", server_url, "--rate", "inf", "--requests", "3", "--model", "tiny-chat", "--api-key", "nope"]
    assert main([*args, "--json", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (0, 3, {"401": 3})
    assert "API key" in s["error_examples"]["401"]
    assert s["meeting_slo"] == 0 and s["goodput_rps"] == 0 and s["ttft_ms"]["p50"] is None
