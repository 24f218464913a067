"""What serve_scale.py and soak.py share: an artifact to serve, a ``kvforge serve`` subprocess
started and stopped cleanly, its RSS, and the machine's load average.

Loaded by path by the two scripts (benchmarks/ is not a package).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "models" / "kvforge-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def artifact(path: str | None, model: str | None, max_batch: int, max_seq: int) -> Iterator[Path]:
    """``path`` if given, else ``model`` (default: the bundled kvforge-tiny) compiled into a temp dir."""
    if path:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="kvforge-serve-bench-") as tmp:
        out = Path(tmp) / "artifact"
        src = model or str(BUNDLED)
        print(f"compiling {src} (max_batch {max_batch}, max_seq {max_seq}) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "kvforge.tools.cli", "compile", src, "-o", str(out), "-q"]
        cmd += ["--max-batch", str(max_batch), "--max-seq", str(max_seq), "--no-score-graph"]
        subprocess.run(cmd, check=True)
        yield out


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (Ray replicas are separate processes), MiB."""
    total = 0
    pids = [pid]
    with contextlib.suppress(FileNotFoundError, subprocess.CalledProcessError):
        out = subprocess.run(["pgrep", "-s", str(os.getsid(pid))], capture_output=True, text=True).stdout
        pids = sorted({pid, *(int(p) for p in out.split())})
    for p in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


class Server:
    """``kvforge serve ARTIFACT --port P [extra]`` in its own session; ``stop()`` sends SIGTERM (the
    graceful drain) and kills the session if it has not exited after ``grace_s``."""

    def __init__(self, artifact: Path, extra: list[str], name: str, ready_replicas: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvforge.tools.cli", "serve", str(artifact), "--port", str(self.port)]
        cmd += ["--served-model-name", name, "--log-level", "warning", *extra]
        # The server's output, kept for the error message if it dies (lives as long as the server).
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvforge-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(ready_replicas)

    def wait_ready(self, replicas: int, timeout: float = 300.0) -> None:
        """Until /health answers from ``replicas`` distinct replicas (Ray starts them one by one)."""
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(seen) < replicas:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"the server did not come up:\n{self.log.read()[-3000:]}")
            with contextlib.suppress(httpx.TransportError, ValueError):
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    seen.add(r.json()["replica"])
            time.sleep(0.2)

    def stop(self, grace_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the server's session left behind
        return self.proc.returncode
