"""Run the app in this process with uvicorn, with a graceful drain on SIGTERM / Ctrl-C.

First signal: the server stops admitting (new requests get 503, ``/health`` says "draining"), the
sequences in flight finish and are answered, then uvicorn shuts down (closing the listening socket,
waiting for open responses) and the app's lifespan closes the scheduler and the engine; the process
exits with status 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn

from kvforge.tools.serve.app import build_app
from kvforge.tools.serve.serving import ModelServer

log = logging.getLogger("kvforge.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first exit signal drains the model server before shutting down."""

    def __init__(self, config: uvicorn.Config, model_server: ModelServer, drain_poll_s: float = 0.05) -> None:
        super().__init__(config)
        self.model_server = model_server
        self.drain_poll_s = drain_poll_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.model_server.draining:  # the second signal: uvicorn's own (forced) exit
            super().handle_exit(sig, frame)
            return
        self.drain()

    def drain(self) -> None:
        """Stop admitting now; shut down once nothing is in flight (from a helper thread)."""
        self.model_server.draining = True
        log.warning("draining: %d sequences in flight; new requests get 503", self.model_server.in_flight)

        def wait_then_exit() -> None:
            while self.model_server.in_flight > 0 and not self.should_exit:
                time.sleep(self.drain_poll_s)
            self.should_exit = True

        threading.Thread(target=wait_then_exit, name="kvforge-drain", daemon=True).start()


class _UvicornLayout(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname + ':':<10}[kvforge] {super().format(record)}"


def log_like_uvicorn(level: str = "info") -> None:
    """Send kvforge's server logs (``kvforge.*``) to stderr in uvicorn's layout, ``LEVEL:    [kvforge] ...``,
    so that a served process prints one kind of line (Python's last-resort handler would print the
    bare message, warnings only)."""
    logger = logging.getLogger("kvforge")
    if any(getattr(h, "kvforge_uvicorn_layout", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.kvforge_uvicorn_layout = True
    handler.setFormatter(_UvicornLayout())
    logger.addHandler(handler)
    logger.setLevel(level.upper() if level.upper() in logging.getLevelNamesMapping() else logging.INFO)


def serve_local(
    server: ModelServer,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    strict_fields: bool = False,
) -> None:
    """Serve ``server`` on ``host:port`` until a signal; closes it on the way out. ``strict_fields``:
    see :func:`build_app`."""
    app = build_app(server, api_key=api_key, owns_server=True, strict_fields=strict_fields)
    log_like_uvicorn(log_level)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
    try:
        DrainingServer(config, server).run()
    finally:
        server.close()  # idempotent: the lifespan has closed it unless uvicorn failed to start
