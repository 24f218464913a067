"""``kvforge plan --serve`` from the command line, its bench-report source, and loadtest's mixed workload.

Proves: on a tiny artifact the planner measures one thread, prints a plan for the colocated server
and every split, and its ``--json`` is the plan document; latencies read from a real
``kvforge bench --json`` report are used instead of measuring (the report's path is the model's
source, its thread count its key), and a report of another kind or another model is refused; bad
input gets a one-line error naming the flag (missing SLOs, an out-of-range fraction, memory-plan
flags with --serve and serve flags without it, requests longer than the artifact's max_seq);
loadtest's long-prompt mix: the share and lengths drawn, the prompts' words, the same schedule as
the planner simulates, and a real load test whose long prompts reach the server.
"""

from __future__ import annotations

import json

import pytest

from kvforge.tools.cli import main
from kvforge.tools.loadtest import LoadOptions, plan, schedule
from kvforge.tools.serveplan.simulate import poisson_requests
from tests.tools.test_serve import KEY, running

SERVE = ["--rate", "2", "--slo-ttft", "5000", "--slo-tpot", "1000", "--requests", "40", "--cores", "1"]


def test_plan_serve_measures_and_prints(llama_artifact, capsys):
    assert main(["plan", "--serve", str(llama_artifact), *SERVE]) == 0
    out = capsys.readouterr()
    assert "measuring" in out.err and "on 1 thread(s)" in out.err
    assert "colocated (1 threads)" in out.out and "recommended: colocated (1 threads)" in out.out
    assert "TTFT p50" in out.out and "goodput" in out.out and "not modelled" in out.out


def test_plan_serve_from_a_bench_report(llama_artifact, tmp_path, capsys):
    report = tmp_path / "bench.json"
    bench = ["bench", str(llama_artifact), "--prompt-lens", "8,32", "--batch-sizes", "1,2", "--new-tokens", "4"]
    assert main([*bench, "--repeat", "1", "--warmup", "0", "--threads", "1", "--json", str(report)]) == 0
    capsys.readouterr()
    args = ["plan", "--serve", str(llama_artifact), *SERVE[:-2], "--cores", "2", "--bench", str(report), "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "measuring" not in out.err
    result = json.loads(out.out)
    assert result["kind"] == "kvforge.serve_plan"
    [model] = result["latency"]["models"]
    assert (model["threads"], model["source"]) == (1, str(report))
    assert "only 1 thread(s) measured" in result["latency"]["scaling"]
    names = [c["layout"] for c in result["configurations"]]
    assert names == ["colocated (2 threads)", "1P:1D (1 thread each)"]
    assert result["workload"]["requests"] == 40 and len(result["configurations"][0]["ttft_ms"]) == 4

    other = json.loads(report.read_text())
    other["artifact"]["num_layers"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main([*args[:-3], "--bench", str(tmp_path / "other.json")]) == 2
    assert "timed another model: num_layers" in capsys.readouterr().err
    (tmp_path / "loadtest.json").write_text(json.dumps({"kind": "kvforge.loadtest"}))
    assert main([*args[:-3], "--bench", str(tmp_path / "loadtest.json")]) == 2
    assert "is not a kvforge bench report" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rate", "1"], "plan --serve needs --slo-ttft, --slo-tpot"),
        ([*SERVE, "--slo-tpot", "0"], "--slo-tpot must be a positive number of milliseconds, got 0.0"),
        ([*SERVE, "--long-fraction", "1.5"], "--long-fraction must be in [0, 1], got 1.5"),
        ([*SERVE, "--rate", "0"], "--rate must be a positive number of requests per second, got 0.0"),
        ([*SERVE, "--dtype", "float16"], "--dtype belong to the GPU memory plan, not to --serve"),
        ([*SERVE, "--cores", "0"], "--cores must be at least 1, got 0"),
        ([*SERVE, "--attainment", "0"], "--attainment must be in (0, 1], got 0.0"),
        (
            [*SERVE, "--long-fraction", "0.5", "--long-lens", "90"],
            "needs 122 cache positions; this artifact was compiled with max_seq=96 (recompile with --max-seq 122",
        ),
    ],
)
def test_plan_serve_errors(llama_artifact, capsys, extra, message):
    assert main(["plan", "--serve", str(llama_artifact), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: ") and message in err


def test_bad_thread_speedup(llama_artifact, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--serve", str(llama_artifact), *SERVE, "--thread-speedup", "3,1"])
    assert "expected two speed-ups in [1, 2] such as 1.8,1.6 (prefill,decode), got '3,1'" in capsys.readouterr().err


def test_serve_flags_without_serve(llama_artifact, capsys):
    assert main(["plan", str(llama_artifact), "--rate", "1", "--cores", "2"]) == 2
    assert "--rate, --cores plan serving layouts: add --serve" in capsys.readouterr().err


def test_mixed_schedule_and_prompts():
    options = LoadOptions(rate=2.0, requests=400, prompt_lens=(5, 9), long_fraction=0.25, long_lens=(30, 40), seed=3)
    items = plan(options)
    long = [i for i in items if i["prompt_words"] in (30, 40)]
    assert 0.2 < len(long) / len(items) < 0.3
    assert {i["prompt_words"] for i in items} == {5, 9, 30, 40}
    assert all(len(i["prompt"].split()) == i["prompt_words"] for i in items)
    assert [{k: v for k, v in i.items() if k != "prompt"} for i in items] == schedule(options)
    simulated = poisson_requests(2.0, 400, (5, 9), (16, 32), seed=3, long_fraction=0.25, long_lens=(30, 40))
    assert [(r.arrival_s, r.prompt, r.output) for r in simulated] == [
        (i["arrival_s"], i["prompt_words"], i["max_tokens"]) for i in items
    ]
    plain = schedule(LoadOptions(requests=50, prompt_lens=(5, 9), seed=3))
    assert {i["prompt_words"] for i in plain} == {5, 9}  # no mix by default
    with pytest.raises(ValueError, match=r"--long-fraction must be in \[0, 1\]"):
        LoadOptions(long_fraction=-0.1).check()


def test_loadtest_mixed_workload_reaches_the_server(llama_chat_artifact, tmp_path, capsys):
    out = tmp_path / "mix.json"
    args = ["loadtest", "--rate", "50", "--requests", "8", "--prompt-lens", "3", "--output-lens", "2"]
    args += ["--long-fraction", "0.5", "--long-lens", "60", "--api-key", KEY, "--seed", "1", "--json", str(out)]
    with running(llama_chat_artifact, max_queue=8) as (url, _):
        assert main([args[0], url, *args[1:]]) == 0
    report = capsys.readouterr().out
    assert "50% long prompts of 60 words" in report
    records = json.loads(out.read_text())["requests"]
    assert all(r["ok"] for r in records)
    long = [r for r in records if r["prompt_words"] == 60]
    assert 0 < len(long) < 8
    assert all(r["prompt_tokens"] >= 60 for r in long)
    assert all(r["prompt_tokens"] < 20 for r in records if r["prompt_words"] == 3)
