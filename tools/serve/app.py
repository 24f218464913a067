"""The FastAPI app: OpenAI's routes over one :class:`ModelServer`.

    app = build_app(ModelServer.load("out"), api_key="secret")   # then: uvicorn.run(app) or Ray Serve

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``: server-sent
events ending with ``data: [DONE]``), ``POST /v1/responses`` with ``GET``/``DELETE
/v1/responses/{id}`` (OpenAI's Responses API over the chat path: :mod:`.responses`), Anthropic's
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (:mod:`.anthropic`, translated onto
chat), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, and vLLM's tokenizer
routes ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (:mod:`.tokens`; as vLLM's,
outside ``/v1`` and so without the key). The
``/v1`` routes need ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) when an ``api_key`` is set.
Every error on the Anthropic routes is Anthropic's error object (:func:`.anthropic.error_response`); every other is
OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input
(malformed JSON, unknown model, invalid value, a field value kvforge cannot honour, too long a
prompt, and fields outside OpenAI's schema when ``strict_fields``), 401 for a missing or
wrong key, 404/405 for unknown routes, 429 when the queue is full, 503 while draining, 500 when the
runtime fails. ``GET /health`` answers 200 with ``status`` "ok", or 503 with "draining", or (a
disaggregated server with a pool that has no ready worker) "degraded" and a ``degraded`` message.
Every response carries ``x-kvforge-replica`` (which process or Ray replica answered) and
``x-request-id`` (the client's own ``x-request-id`` when it sent a printable one, else a new id).

Any other exception in a route (a bug) is caught: logged with its traceback and the request id,
counted in ``kvforge_unexpected_errors_total{route}``, and answered as the route's error object
(:func:`error_shape_for`; OpenAI's: status 500, ``type: "server_error"``, the request id in the
message) or, when a stream has begun, as a last ``data:`` error event and ``[DONE]``.

Fields outside OpenAI's schema are ignored, logged (a warning) and named in the response header
``x-kvforge-ignored-fields``; ``strict_fields=True`` (``kvforge serve --strict-fields``) refuses
them with a 400 instead. OpenAI fields with no meaning here are accepted and counted
(:mod:`.fields`).

A client that goes away is noticed while its request runs: the request's task is cancelled
(``listen_for_disconnect``) and its sequences are cancelled in the scheduler, which frees their
rows at its next step.

The app's lifespan closes the server (scheduler, then engine) at shutdown when ``owns_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.tools.serve import anthropic, chat, completions, fields, responses, tokens
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.serving import SSE_DONE, ModelServer, ServingError, sse

REPLICA_HEADER = "x-kvforge-replica"
REQUEST_ID_HEADER = "x-request-id"
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/{id}",
    *anthropic.ROUTES,
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)

T = TypeVar("T")
log = logging.getLogger("kvforge.serve")

ErrorShape = Callable[[ServingError], dict[str, Any]]


def openai_error(error: ServingError) -> dict[str, Any]:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``."""
    return error.body()


# Route prefix -> how that API writes its errors (the first prefix that matches; OpenAI's
# otherwise). An API with its own error shape adds its routes here, e.g. "/v1/messages": Anthropic's.
ERROR_SHAPES: dict[str, ErrorShape] = {}


def error_shape_for(path: str) -> ErrorShape:
    """The error body of the API ``path`` belongs to (:data:`ERROR_SHAPES`, else OpenAI's)."""
    for prefix, shape in ERROR_SHAPES.items():
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return shape
    return openai_error


def error_response(error: ServingError, path: str = "") -> JSONResponse:
    """The API's own error object: Anthropic's on its routes (``path``), else :func:`error_shape_for`'s."""
    if anthropic.serves(path):
        return anthropic.error_response(error)
    return JSONResponse(error_shape_for(path)(error), status_code=error.status)


def unexpected_error(exc: BaseException, request_id: str) -> ServingError:
    """The 500 a client gets for a bug: what failed, and the id to find its traceback in the log by."""
    return ServingError(
        f"the server failed on this request ({type(exc).__name__}: {exc}); this is a kvforge bug, not a problem "
        f"with the request: report it with the request id {request_id} (the server log has the traceback)",
        status=500,
        type="server_error",
        code="internal_error",
    )


def _request_id(scope: Scope) -> str:
    """The client's ``x-request-id`` when it is short printable ASCII, else a new id."""
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isascii() and text.isprintable():
                return text
    return f"req_{uuid.uuid4().hex}"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message for pydantic's errors, and the first offending field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return (f"the request body is not valid JSON ({ctx}); send a JSON object", None)
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        if kind == "missing":
            parts.append(f"field '{where}' is required")
        else:
            parts.append(f"field '{where}': {err.get('msg')} (got {err.get('input')!r})")
    return "; ".join(dict.fromkeys(parts)) or "invalid request body", param


class _Observe:
    """ASGI middleware: count answered requests by route and status, stamp the replica and request
    id headers, and answer any exception the app lets out (a bug) with the route's error object."""

    def __init__(self, app: ASGIApp, server: ModelServer) -> None:
        self.app, self.server = app, server
        self.header = (REPLICA_HEADER.encode(), server.replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else "/v1/responses/{id}" if path.startswith("/v1/responses/") else "other"
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id  # request.state.request_id
        started = False

        async def send_observed(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = [self.header, (REQUEST_ID_HEADER.encode(), request_id.encode())]
                message["headers"] = [*message.get("headers", []), *extra]
                self.server.metrics.requests.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        except Exception as exc:
            log.exception("%s %s failed (request id %s)", scope.get("method"), path, request_id)
            self.server.metrics.unexpected_errors.labels(route=route).inc()
            if started:  # the answer has begun: the connection is closed (streams report their own errors)
                return
            await error_response(unexpected_error(exc, request_id), path)(scope, receive, send_observed)


async def _guarded(stream: AsyncIterator[str], request: Request, server: ModelServer) -> AsyncIterator[str]:
    """A streamed answer whose unexpected exception (a bug) ends it with an error event and
    ``[DONE]``, logged and counted like :class:`_Observe` does a whole answer's."""
    async with contextlib.aclosing(stream):
        try:
            async for event in stream:
                yield event
        except Exception as exc:
            path, request_id = request.url.path, request.state.request_id
            log.exception("%s %s failed mid-stream (request id %s)", request.method, path, request_id)
            server.metrics.unexpected_errors.labels(route=path if path in ROUTES else "other").inc()
            yield sse(error_shape_for(path)(unexpected_error(exc, request_id)))
            yield SSE_DONE


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it (its sequences are cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return await task  # CancelledError after a disconnect: nobody reads the answer


def _header_value(names: list[str], limit: int = 20) -> str:
    """Field names for a response header: ASCII, control characters escaped, at most ``limit``."""
    shown = [ascii(name)[1:-1] for name in names[:limit]]
    return ", ".join(shown) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def build_app(
    server: ModelServer, *, api_key: str | None = None, owns_server: bool = True, strict_fields: bool = False
) -> FastAPI:
    """The OpenAI-compatible app over ``server``. ``api_key``: required bearer token on /v1 routes.
    ``owns_server``: close the server when the app shuts down (uvicorn or Ray Serve lifespan).
    ``strict_fields``: refuse fields outside OpenAI's schema (400) instead of ignoring them."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_server:
            await asyncio.to_thread(server.close)

    app = FastAPI(title="kvforge", summary="OpenAI-compatible server over a kvforge artifact", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Observe, server=server)

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(ServingError(message, param=param, code="invalid_request"), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path} (routes: {', '.join(ROUTES)})"
        return error_response(ServingError(message, status=exc.status_code, type=kind), request.url.path)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        keys = [token.strip() if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "")]
        if not any(hmac.compare_digest(key.encode(), api_key.encode()) for key in keys if key):
            raise ServingError(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' (or Anthropic's "
                "'x-api-key: <key>') with the key the server was started with (--api-key)",
                status=401,
                code="invalid_api_key",
            )

    v1 = [Depends(authorized)]

    @app.get("/v1/models", dependencies=v1)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=server.model_name, max_model_len=server.max_seq)])

    @app.get("/v1/models/{model_id:path}", dependencies=v1)
    async def model(model_id: str) -> p.ModelCard:
        if model_id != server.model_name:
            raise ServingError(
                f"the model {model_id!r} does not exist; this server serves {server.model_name!r} (GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )
        return p.ModelCard(id=server.model_name, max_model_len=server.max_seq)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        return tokens.tokenize(server, body)

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return tokens.detokenize(server, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokens.tokenizer_info(server))

    async def respond(request: Request, handler, body: Any) -> Response:
        unknown = fields.unknown_fields(body)
        if unknown and strict_fields:
            raise fields.strict_refusal(unknown)
        prep = handler.prepare(server, body)
        headers = {}
        if unknown:
            headers[fields.IGNORED_HEADER] = _header_value(unknown)
            log.warning(
                "%s: ignored field(s) outside OpenAI's schema: %s (kvforge serve --strict-fields refuses them)",
                request.url.path,
                headers[fields.IGNORED_HEADER],
            )
            server.metrics.unknown_fields.inc(len(unknown))
        for name in getattr(handler, "ignored_fields", fields.ignored_fields)(body):
            server.metrics.ignored_fields.labels(field=name).inc()
        server.admit(len(prep.sequences))
        flight = server.start(prep.sequences)
        if body.stream:
            if server.late_refusals:  # a worker's scheduler may refuse it: the 400, not a 200 then an error
                first = await flight.peek()
                if first.kind == "error" and isinstance(first.payload, ServingError):
                    flight.cancel()
                    raise first.payload
            stream = _guarded(handler.stream(server, body, prep, flight), request, server)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            response = await _until_disconnected(request, handler.full(server, body, prep, flight))
        finally:
            flight.cancel()  # a no-op once finished; frees the rows of a client that left
        return JSONResponse(response.model_dump(), headers=headers)

    @app.post("/v1/completions", dependencies=v1)
    async def create_completion(body: p.CompletionRequest, request: Request) -> Response:
        return await respond(request, completions, body)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def create_chat_completion(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, chat, body)

    @app.post("/v1/messages", dependencies=v1)
    async def create_message(body: anthropic.MessagesRequest, request: Request) -> Response:
        return await respond(request, anthropic, body)

    @app.post("/v1/messages/count_tokens", dependencies=v1)
    async def count_message_tokens(body: anthropic.CountTokensRequest) -> JSONResponse:
        unknown = fields.unknown_fields(body)
        if unknown and strict_fields:
            raise fields.strict_refusal(unknown)
        return JSONResponse(anthropic.count_tokens(server, body))

    store = app.state.responses = responses.ResponseStore()
    responses_handler = responses.ResponsesHandler(store)

    @app.post("/v1/responses", dependencies=v1)
    async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
        return await respond(request, responses_handler, body)

    @app.get("/v1/responses/{response_id}", dependencies=v1)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}", dependencies=v1)
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(store.delete(response_id))

    @app.get("/health")
    async def health() -> JSONResponse:
        queued, running = server.scheduler_stats()
        degraded = getattr(server, "degraded", None)  # a disaggregated server: a pool with no ready worker
        problem = None if degraded is None else degraded()
        body = {
            "status": "draining" if server.draining else "degraded" if problem else "ok",
            "model": server.model_name,
            "replica": server.replica_id,
            "in_flight": server.in_flight,
            "queued": queued,
            "running": running,
            "capacity": server.capacity,
            "prefix_cache": server.prefix_cache_stats(),
        }
        workers = getattr(server, "workers", None)
        if problem:
            body["degraded"] = problem
        if workers is not None:  # a disaggregated server (tools/serve/disagg): each worker's role, pid, state
            body["workers"] = workers()
        return JSONResponse(body, status_code=503 if server.draining or problem else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = server.metrics.render()
        return Response(data, media_type=content_type)

    return app
