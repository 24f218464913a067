"""An OpenAI-compatible HTTP server over a kvforge artifact, in one process or on Ray Serve.

    kvforge serve OUT [--host 127.0.0.1] [--port 8000] [--max-queue N] [--api-key KEY]
    kvforge serve OUT --ray --replicas N [--address ray://HOST:10001]
    kvforge serve OUT --prefill-workers P --decode-workers D [--threads-per-worker T]

Modules, by job: :mod:`.protocol` (OpenAI's request/response bodies, pydantic), :mod:`.serving`
(:class:`ModelServer`: the engine, its scheduler, admission and cancellation), :mod:`.completions`
and :mod:`.chat` (the two generation routes), :mod:`.app` (the FastAPI app: routes, errors, auth),
:mod:`.metrics` (Prometheus), :mod:`.runner` (uvicorn with a graceful drain), :mod:`.ray_app`
(the Ray Serve deployment of the same app), :mod:`.disagg` (disaggregated prefill/decode: worker
processes behind a router with the same surface as :class:`ModelServer`).

Needs the ``serve`` extra: ``pip install 'kvforge[serve]'``.
"""
