"""What a disaggregated worker process and the router's side of it exchange: the roles, the
messages to a worker (plain tuples), its events (:class:`WorkerEvent`) and how to start it
(:class:`WorkerSpec`, pickled to the child). Both ends import this module and nothing of each
other, so the worker process (:mod:`.worker`) and its client (:mod:`.workers`) stay one-way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class WorkerEvent:
    """One message from a worker; see the module docstring for the kinds."""

    kind: str
    seq: int | None = None
    payload: Any = None


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker process (pickled to the child: plain data)."""

    role: str  # PREFILL or DECODE
    name: str  # e.g. "decode-1": the slot's name, kept across restarts
    artifact_dir: str
    threads: int | None  # ONNX Runtime intra-op threads of its engine
    prefix_cache: int | str | None  # the engine's prefix-cache budget (prefill workers)
    heartbeat_s: float  # how often it sends "beat"
    lend_rows: bool = True  # a prefill worker lends its cache rows (one copy per hand-off); False: an arena


# the messages to a worker (tuples: small and cheap to pickle)
SUBMIT, RESUME, CANCEL, CLOSE = "submit", "resume", "cancel", "close"
