"""``make gpu-check``: every GPU test plus a short bench on each GPU backend, one JSON report.

Designed for a GPU lent for a few minutes (< 5 minutes on one GPU for the tiny model): it runs
``pytest -m gpu tests/gpu`` (building TensorRT engines in float32 and float16 along the way), then
compiles the bundled ``models/kvforge-tiny`` for each backend and runs ``kvforge bench`` on it with
a few small cells, and writes everything to ``--out`` (default ``gpu_check.json``): the machine
(GPU, CUDA, TensorRT, onnxruntime versions), each test's outcome, each bench's result. Exit status:
pytest's (0 when every GPU test passed). Not yet run on a GPU.

    python scripts/gpu_check.py [--out gpu_check.json] [--skip-bench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "kvforge-tiny"


def environment() -> dict:
    from kvforge.graphs import environment as env

    gpu = env.cuda_gpu()
    trt = env.tensorrt_module()
    try:
        import onnxruntime

        ort = {"version": onnxruntime.__version__, "providers": onnxruntime.get_available_providers()}
    except ImportError:
        ort = None
    return {
        "gpu": gpu if isinstance(gpu, str) else gpu.__dict__,
        "tensorrt": trt if isinstance(trt, str) else trt.__version__,
        "onnxruntime": ort,
        "python": sys.version.split()[0],
    }


def run_tests(junit: Path) -> tuple[int, list[dict]]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    rc = subprocess.call([*cmd, f"--junitxml={junit}"], cwd=ROOT)
    cases = []
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    outcome_detail = (node.get("message") or "")[:500]
                    break
            else:
                outcome_detail = ""
            cases.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome,
                    "seconds": float(case.get("time", 0)),
                    "detail": outcome_detail,
                }
            )
    return rc, cases


def run_benches(work: Path) -> list[dict]:
    from kvforge.compile import compile_model
    from kvforge.tools import bench

    results = []
    for backend, target in (("tensorrt", "tensorrt"), ("ort", "cuda")):
        started = time.perf_counter()
        try:
            out = work / backend
            compile_model(TINY, out, target=target, max_batch=4, max_seq=256, max_prompt=128, progress=None)
            options = bench.BenchOptions(
                prompt_lens=(32, 128),
                batch_sizes=(1, 4),
                new_tokens=32,
                repeat=2,
                warmup=1,
                device="cuda",
                backend=backend,
            )
            result = bench.run_bench(out, TINY, options)
            results.append({"backend": backend, "ok": True, "seconds": time.perf_counter() - started, "bench": result})
        except Exception as e:  # a report, not a crash: the next backend still runs
            results.append(
                {
                    "backend": backend,
                    "ok": False,
                    "seconds": time.perf_counter() - started,
                    "error": f"{type(e).__name__}: {e}",
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rc, tests = run_tests(Path(tmp) / "junit.xml")
        benches = [] if args.skip_bench else run_benches(Path(tmp))
    report = {
        "kind": "kvforge.gpu_check",
        "schema_version": 1,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        "pytest_exit_status": rc,
        "tests": tests,
        "summary": {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")},
        "benches": benches,
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"gpu-check: {report['summary']} in {report['seconds']}s -> {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
