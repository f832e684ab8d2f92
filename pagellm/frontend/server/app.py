"""The OpenAI-compatible routes over `AsyncLLM`.

    POST /v1/completions, /v1/chat/completions   (stream=true: server-sent events)
    POST /v1/responses   (OpenAI's Responses API, stateless, over the chat path: see
         serving_responses.py; GET /v1/responses/{id} and the like answer 404: nothing
         is stored)
    GET  /v1/models, /health, /version, /metrics, /tokenizer_info
    GET and POST /ping (SageMaker's health check, as vLLM serves it)
    POST /tokenize, /detokenize
    RL controls (sleep, wake_up, pause, weight updates, /server_info, ...) with
    enable_dev_endpoints (or VLLM_SERVER_DEV_MODE=1): see dev_routes.py

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, on every
route (unknown routes and wrong methods too): 400 for a bad parameter (the message names
it), 401 without the API key, 404 for another model or route, 405, 408 / 413 for a
body that arrives too slowly / is too large, 503 while the engine is paused or asleep
and once the engine core is dead. A client that goes away aborts its requests.

What a client sends is bounded where it enters (edge.py: the API key, body size,
decoding; connections.py: connections and the body's arrival time); the handlers
(serving.py, shared; serving_completions.py; serving_chat.py; serving_responses.py,
over the chat handler) run tokenization and chat templates off the event loop, and
templates sent by clients only with `trust_request_chat_template`, in a killable
sandbox process (template_sandbox.py);
unknown body fields are accepted and named once in a rate-limited log (extra_fields.py).
/health answers 503 while the engine core is dead or its loop is stuck in one call
(--engine-stall-timeout); a response is bounded in token entries (--max-response-entries).
`build_app` registers each group of routes through a helper of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.frontend.async_llm import AsyncLLM
from pagellm.frontend.engine_client.core_client import EngineDeadError
from pagellm.frontend.output_processor import EngineUnavailableError
from pagellm.frontend.server.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagellm.frontend.server.dev_routes import add_dev_routes
from pagellm.frontend.server.edge import (
    APIError,
    APIKeyGuard,
    bad_request,
    decode_body,
    error_response,
    read_body,
)
from pagellm.frontend.server.extra_fields import IgnoredFieldsLog, unknown_fields
from pagellm.frontend.server.lora_modules import LoRAModules
from pagellm.frontend.server.metrics import ServerMetrics
from pagellm.frontend.server.options import ServerOptions
from pagellm.frontend.server.serving import OpenAIServing
from pagellm.frontend.server.serving_chat import OpenAIServingChat
from pagellm.frontend.server.serving_completions import OpenAIServingCompletion
from pagellm.frontend.server.serving_responses import OpenAIServingResponses, ResponsesRequest
from pagellm.frontend.server.template_sandbox import ChatTemplateSandbox
from pagellm.version import __version__

VERSION = __version__
logger = logging.getLogger("pagellm")

# How long /metrics waits for the engine's stats before it answers without them.
METRICS_STATS_WAIT_S = 5.0
# Error types by status for errors raised by routing itself (Starlette's HTTPException).
_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}


# Reads a route's body: bounded, decoded into the given type, unknown fields logged.
BodyReader = Callable[[Request, type[Any]], Awaitable[Any]]


def build_app(engine: AsyncLLM, options: ServerOptions,
              sandbox: ChatTemplateSandbox | None = None) -> FastAPI:
    """The routes. `sandbox` renders request-supplied chat templates (required, and
    only used, with options.trust_request_chat_template)."""
    loras = LoRAModules(options.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        """--lora-modules are read into the engine before the first request (a bad one
        stops the start, naming it)."""
        for name, path, base_model_name in options.lora_modules:
            lora = loras.add(name, path, base_model_name)
            try:
                await engine.add_lora(lora)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
            loras.commit(lora)
        yield

    app = FastAPI(title="pagellm", version=VERSION, lifespan=lifespan)
    metrics = ServerMetrics(options.served_model_name, engine.info.max_model_len,
                            data_parallel=engine.engine_args.data_parallel_size > 1)
    server = OpenAIServing(engine, options, metrics, sandbox, loras)
    if options.api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=options.api_key)
    body_of = _body_reader(options)
    _add_error_handlers(app)
    _add_health_routes(app, engine, options)
    _add_info_routes(app, engine, options, metrics, server)
    _add_token_routes(app, engine, server, body_of)
    chat = OpenAIServingChat(engine, options, metrics, sandbox, loras)
    _add_generation_routes(app, OpenAIServingCompletion(engine, options, metrics, sandbox,
                                                        loras),
                           chat, OpenAIServingResponses(chat), body_of)
    if options.allow_runtime_lora_updating:
        _add_lora_routes(app, engine, loras, body_of)
    if options.enable_dev_endpoints:
        add_dev_routes(app, engine, body_of, options.served_model_name)
    return app


def _body_reader(options: ServerOptions) -> BodyReader:
    ignored = IgnoredFieldsLog()

    async def body_of(request: Request, kind: type[Any]) -> Any:
        data = await read_body(request, options.max_body_bytes)
        body = decode_body(data, kind)
        extra = unknown_fields(data, kind)
        if extra:
            ignored.note(extra)
        return body

    return body_of


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, routing's, a dead or unavailable engine, and
    anything else as a 500."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Routing's own errors (404 unknown route, 405 wrong method) in OpenAI's shape
        rather than FastAPI's {"detail": ...}; clients parse only the former."""
        kind = _ERROR_TYPES.get(e.status_code, "".join(str(e.detail).split()) + "Error")
        message = f"{e.detail}: {request.method} {request.url.path[:200]}"
        response = error_response(e.status_code, message, kind)
        for name, value in (e.headers or {}).items():  # Allow: on a 405
            response.headers[name] = value
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine core is dead: {e}", "ServiceUnavailableError")

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(_: Request, e: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(e), "ServiceUnavailableError")

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}",
                              "InternalServerError")


def _add_health_routes(app: FastAPI, engine: AsyncLLM, options: ServerOptions) -> None:
    """/health, and /ping under SageMaker's name for it."""

    def unhealthy() -> str | None:
        """Why the server cannot serve now: its engine core died, or its loop has been
        inside one step or control call for longer than the stall timeout (it still
        heartbeats, so it is not dead, but every request waits behind that call)."""
        if engine.is_dead:
            return "the engine core is dead"
        busy = engine.engine_busy_s
        if busy > options.engine_stall_timeout_s:
            return (f"the engine core's loop has been inside one step or control call for "
                    f"{busy:.0f} s (more than --engine-stall-timeout "
                    f"{options.engine_stall_timeout_s:g} s)")
        return None

    def health_response() -> Response:
        problem = unhealthy()
        if problem is None:
            return Response(status_code=200)
        return error_response(503, problem, "ServiceUnavailableError")

    @app.get("/health")
    async def health() -> Response:
        return health_response()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check (vLLM serves it too): /health under another name."""
        return health_response()


def _add_info_routes(app: FastAPI, engine: AsyncLLM, options: ServerOptions,
                     metrics: ServerMetrics, server: OpenAIServing) -> None:
    """What the server serves: the tokenizer's configuration, the version, the model,
    the Prometheus metrics."""

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's route: the tokenizer's configuration, for clients that tokenize on
        their side with the server's tokenizer (lm-eval's remote tokenizer)."""
        return server.tokenizer_info()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """vLLM's model card: OpenAI's fields, plus root, parent (no adapters: null),
        max_model_len and one permission entry (clients that parse OpenAI's older
        schema require it)."""
        created = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}
        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": created, "owned_by": "pagellm",
                    "root": root, "parent": parent,
                    "max_model_len": engine.info.max_model_len, "permission": [permission]}

        return {"object": "list", "data": [
            card(options.served_model_name, engine.engine_args.model, None),
            *(card(name, lora.lora_path, lora.base_model_name)
              for name, lora in server.loras.served.items())]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The engine's gauges are asked of its loop: one that is inside a long call
        would hold the scrape until it returns, so a scrape waits at most
        METRICS_STATS_WAIT_S and otherwise shows the server's own metrics alone."""
        stats = None
        if not engine.is_dead and engine.engine_busy_s < METRICS_STATS_WAIT_S:
            with contextlib.suppress(asyncio.TimeoutError):
                stats = await asyncio.wait_for(engine.get_stats(), METRICS_STATS_WAIT_S)
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")


def _add_lora_routes(app: FastAPI, engine: AsyncLLM, loras: LoRAModules,
                     body_of: BodyReader) -> None:
    """vLLM's runtime adapter routes (behind the API key; only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: a body names a path on this host's disk). A bad
    adapter is a 400 naming why; the adapters served before stay."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await body_of(request, LoadLoRAAdapterRequest)
        try:
            lora = loras.add(body.lora_name, body.lora_path, load_inplace=body.load_inplace)
            await engine.add_lora(lora)
        except EngineDeadError:
            raise
        except (ValueError, RuntimeError) as e:  # the engine's reason the adapter failed
            raise bad_request(str(e).removeprefix("engine core utility call add_lora "
                                                  "failed: ")) from None
        loras.commit(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await body_of(request, UnloadLoRAAdapterRequest)
        lora = loras.served.get(body.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                           "NotFoundError", "lora_name")
        try:
            await engine.remove_lora(lora.lora_int_id)
        except EngineDeadError:
            raise
        except RuntimeError as e:  # requests still use it
            raise bad_request(str(e).removeprefix("engine core utility call remove_lora "
                                                  "failed: ")) from None
        loras.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")


def _add_token_routes(app: FastAPI, engine: AsyncLLM, server: OpenAIServing,
                      body_of: BodyReader) -> None:
    """/tokenize and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request, TokenizeRequest)
        server.check_model(body.model)
        ids = await server.tokenize(body)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request, DetokenizeRequest)
        server.check_model(body.model)
        vocab, limit = engine.info.vocab_size, engine.info.max_model_len
        if len(body.tokens) > limit:  # the text grows by the longest token's length
            raise bad_request(f"tokens: {len(body.tokens)} ids, more than max_model_len="
                              f"{limit}")
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < vocab:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            raise bad_request(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        text = await engine.run_in_tokenizer_thread(server.tokenizer().decode, body.tokens)
        return {"prompt": text}


def _add_generation_routes(app: FastAPI, completion: OpenAIServingCompletion,
                           chat: OpenAIServingChat, responses: OpenAIServingResponses,
                           body_of: BodyReader) -> None:
    """/v1/completions, /v1/chat/completions and /v1/responses: a client that leaves
    aborts its requests (`_respond`)."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_of(request, CompletionRequest)
        return await _respond(request, body.stream, completion.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await body_of(request, ChatCompletionRequest)
        return await _respond(request, body.stream, chat.chat(body))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await body_of(request, ResponsesRequest)
        return await _respond(request, bool(body.stream), responses.responses(body))

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "POST", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        """Retrieving, cancelling or deleting a response: nothing is stored here."""
        raise APIError(404, f"response {response_id[:100]!r} not found: this server is "
                            f"stateless and stores no responses (store is ignored)",
                       "NotFoundError", "response_id")


async def _respond(request: Request, stream: bool, work: Any) -> Response:
    """Run a handler coroutine (or start a stream) so that the client leaving cancels it,
    which aborts its requests in the engine."""
    if stream:
        events = await work  # validation happens before the first byte goes out
        return StreamingResponse(events, media_type="text/event-stream")
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client left: stop its requests
        task.cancel()
        return Response(status_code=499)
    return JSONResponse(task.result())
