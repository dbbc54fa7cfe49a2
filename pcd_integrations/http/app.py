"""``pcd serve``: System One (``POST /v1/systemone``), OpenAI Decisions (``POST /v1/decisions``) and
OpenAI Chat Completions (``POST /v1/chat/completions``).

A thin translation layer: JSON in, the wire models of ``pcd_core.request.questions`` (System One),
``pcd_integrations.wire.decisions`` (OpenAI Decisions, which translates into the System One questions) or
``pcd_integrations.wire.chat`` (Chat Completions, run by ``pcd_integrations/http/chat_completions.py``), the engine
called in a worker thread, the wire models out. It never builds a prompt or touches a token id. The
invariants it keeps, each proven on the embedded model in ``tests/test_http.py`` and, with the real
``openai`` client, in ``tests/test_decisions_api.py`` and ``tests/test_chat_completions.py``:

- a bad request is refused before the model is touched, in each protocol's own shape: System One
  422 ``{"detail": [{"loc", "msg", "type"}]}``, OpenAI 400
  ``{"error": {"message", "type", "param", "code"}}`` (a body over the bound: 413, in the same
  shapes); nothing a client sends can get a 5xx;
- bodies are read strictly: a repeated key or a NaN is refused, never silently resolved;
- a request that names another model gets 404 (``model_not_found``) rather than this model's answer; the
  decision routes also answer the Jev specification's aliases (``jev-latest``, ``jev-preview``) as this model;
- other System One errors have the shape ``{"detail": {"error_type", "message"}}``;
- requests share the event loop while the engine serialises model access, so eight concurrent clients
  get exactly the answers that sequential requests get.

FastAPI and uvicorn are the ``http`` extra (``pip install 'pcd-engine[http]'``) and are imported only
when an app is built. This module deliberately has no ``from __future__ import annotations``: FastAPI
reads the route signatures at run time, and the routes live inside `create_app`, next to the lazily
imported FastAPI names they are annotated with.

The per-protocol translation lives in ``pcd_integrations/wire/`` and ``chat_completions.py``, the error
bodies and the engine-error-to-4xx mapping in ``errors.py``, the engine calls in a worker thread
(cancelled when the client goes) in ``calls.py``; what stays here is the app and its routes.
"""

import hmac
import importlib
import itertools
import logging
from collections.abc import Callable
from http import HTTPStatus
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any

from pcd_core import (
    DEFAULT_LIMITS,
    DecideRequest,
    Engine,
    Limits,
    __version__,
)
from pcd_integrations.http.calls import check_model, decide, in_engine, served_engine, server_sent
from pcd_integrations.http.chat_completions import chunks, completion, reply_steps
from pcd_integrations.http.errors import (
    ApiError,
    ErrorBody,
    ValidationErrorBody,
    openai_error,
    openai_param,
    wire_safe,
)
from pcd_integrations.http.playground import add_playground
from pcd_integrations.http.sessions import SESSION_MODEL_ROUTES, add_session_routes
from pcd_integrations.serving.engine_loader import EngineLoader
from pcd_integrations.serving.guards import BodyLimit, warn_if_exposed
from pcd_integrations.serving.operations import (
    Backpressure,
    Operations,
    Tracer,
    build_metrics,
    log_config,
    observe_decided,
    observe_reply,
    observed_chunks,
    stamp,
)
from pcd_integrations.serving.read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts, http_protocol
from pcd_integrations.serving.tracing import RequestTracer
from pcd_integrations.wire import JEV_ALIASES
from pcd_integrations.wire.body import BodyError, loads_strict
from pcd_integrations.wire.chat import ChatCompletionRequest
from pcd_integrations.wire.chat_reply import ChatCompletion
from pcd_integrations.wire.decisions import DecisionRequest, DecisionResponse, decision_response
from pcd_integrations.wire.errors import OpenAIErrorBody
from pcd_integrations.wire.served import HealthBody, ModelList, model_card, openai_model

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

__all__ = ["create_app", "serve"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

INSTALL_HINT = "pip install 'pcd-engine[http]'"

#: Routes that speak the OpenAI protocol, so that their errors take OpenAI's shape.
OPENAI_ROUTES = frozenset({"/v1/decisions", "/v1/chat/completions"})
#: Routes that run the model: what ``--max-queue`` and ``--timeout`` bound (``pcd_integrations/serving/operations.py``);
#: a session's creation and its appends (``sessions.py``'s ``SESSION_MODEL_ROUTES``) are bounded with them.
MODEL_ROUTES = OPENAI_ROUTES | {"/v1/systemone"}


def _import_optional(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"the HTTP server needs {module!r}, which is not installed; run: {INSTALL_HINT}") from error


def _speaks_openai(request: "Request") -> bool:
    route = request.scope.get("route")
    return getattr(route, "path", None) in OPENAI_ROUTES


def create_app(
    engine: Engine | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    playground: bool = True,
    backpressure: Backpressure | None = None,
    tracer: Tracer | None = None,
    read_timeouts: ReadTimeouts = DEFAULT_READ_TIMEOUTS,
) -> "FastAPI":
    """Build the ASGI app for one engine, or for one that ``engine_factory`` loads in the background.

    ``model_name`` names the model on ``/healthz`` while a factory is still loading it. With
    ``api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``; without it an Authorization
    header is accepted and ignored. ``/healthz`` and the OpenAPI spec never need a key, so that load
    balancers and client generators can read them. ``limits.max_body_bytes`` bounds each body (413),
    ``read_timeouts.body_s`` the time it takes to arrive (408); every other bound is the engine's own
    (``Engine(limits=...)``), checked before it tokenizes.
    ``playground`` serves the page at ``/`` and ``/playground`` (``pcd_integrations/http/playground``), a
    client of the routes above that needs no key to load.
    """
    if (engine is None) == (engine_factory is None):
        raise TypeError("create_app needs exactly one of engine= or engine_factory=")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string, or None to turn auth off")
    _import_optional("fastapi")
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from starlette.exceptions import HTTPException

    source = engine if engine is not None else engine_factory
    assert source is not None
    # started here, not in an ASGI lifespan, which an in-process test client never runs
    loader = EngineLoader(source, model_name=model_name, thread_name="pcd-http-load")
    loader.start()
    app = FastAPI(
        title="pcd-engine",
        summary="Typed questions (System One noul, choice, score; OpenAI Decisions predicate, choice, "
        "score) answered by parallel constrained decoding: the answers are read from the model's "
        "logits, nothing is generated.",
        version=__version__,
    )
    app.state.engine_slot = loader
    _guard_body(app, limits, read_timeouts.body_s)
    _add_operations(app, loader, backpressure, tracer)

    bearer = HTTPBearer(auto_error=False, description="Required only when the server has an API key.")

    def check_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        # compare_digest keeps the comparison time independent of how much of the key matched.
        assert api_key is not None
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise ApiError(
                401,
                "unauthorized",
                "a valid 'Authorization: Bearer <key>' header is required",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def strict_body(request: Request) -> None:
        # a body sent as text or a form would reach the models as raw bytes and fail with a 422 about
        # its shape: say what is wrong instead
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not (
            media_type.startswith("application/") and media_type.endswith("+json")
        ):
            sent = repr(media_type) if media_type else "missing"
            message = f"the body must be JSON sent with 'Content-Type: application/json'; the content type is {sent}"
            raise ApiError(415, "unsupported_media_type", message)
        # FastAPI's own parse keeps the last of two equal keys and accepts NaN; this one refuses both.
        try:
            loads_strict(await request.body())
        except BodyError as error:
            raise ApiError(422, error.kind, error.reason, loc=["body", *error.loc]) from None

    guarded = [Depends(check_key)] if api_key is not None else []
    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorBody},
        404: {"model": ErrorBody},
        422: {"model": ValidationErrorBody},
        502: {"model": ErrorBody},
        503: {"model": ErrorBody},
    }
    openai_errors: dict[int | str, dict[str, Any]] = {
        code: {"model": OpenAIErrorBody} for code in (400, 401, 404, 502, 503)
    }

    def error_response(request: Request, error: ApiError) -> JSONResponse:
        # every text in an error may come from the request: written so that it always encodes
        if _speaks_openai(request):
            # OpenAI answers every invalid request with 400; other codes keep their meaning
            status = 400 if error.status_code == 422 else error.status_code
            body = openai_error(status, error.error_type, error.message, error.loc)
            return JSONResponse(wire_safe(body), status_code=status, headers=error.headers)
        if error.status_code == 422:
            item = {"loc": error.loc or ["body"], "msg": error.message, "type": error.error_type}
            return JSONResponse({"detail": [wire_safe(item)]}, status_code=422, headers=error.headers)
        body = {"detail": {"error_type": error.error_type, "message": error.message}}
        return JSONResponse(wire_safe(body), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # Only loc/msg/type: pydantic's "input" would echo the whole (possibly huge) state back.
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
        if _speaks_openai(request):
            first = detail[0]
            message = str(first["msg"]).removeprefix("Value error, ")
            param = openai_param(first["loc"])
            more = f" (and {len(detail) - 1} more problems)" if len(detail) > 1 else ""
            shown = f"{param}: {message}{more}" if param else f"{message}{more}"
            return JSONResponse(openai_error(400, str(first["type"]), shown, first["loc"]), status_code=400)
        return JSONResponse({"detail": wire_safe(detail)}, status_code=422)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown routes and methods: the same error shape as every other non-validation error.
        error_type = HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
        headers = dict(error.headers) if error.headers is not None else None
        return error_response(request, ApiError(error.status_code, error_type, str(error.detail), headers))

    answered: dict[int | str, dict[str, Any]] = {
        200: {"description": "One answer per question id, in the request's order"}
    }
    checked = [*guarded, Depends(strict_body)]

    @app.post("/v1/systemone", dependencies=checked, responses={**answered, **errors})
    async def systemone(request: DecideRequest, http: Request) -> JSONResponse:
        """Answer every question about the one shared state; each answer is independent of the others."""
        check_model(request.model, loader, "model", JEV_ALIASES)
        where: dict[str, str | int] = {qid: qid for qid in request.questions}
        response = await decide(loader, request.state, request.questions, "state", where, http)
        observe_decided(response)
        return JSONResponse(stamp(response.to_wire()))

    @app.post("/v1/decisions", dependencies=checked, responses={200: {"model": DecisionResponse}, **openai_errors})
    async def decisions(request: DecisionRequest, http: Request) -> JSONResponse:
        """The OpenAI Decisions API: answers in question order, each independent of the others."""
        check_model(request.model, loader, "model", JEV_ALIASES)
        questions = request.engine_questions()
        where: dict[str, str | int] = {qid: index for index, qid in enumerate(questions)}
        state, context = request.state_and_context()
        response = await decide(
            loader, state, questions, "input", where, http, context=context, cache_key=request.prompt_cache_key
        )
        observe_decided(response)
        return JSONResponse(stamp(decision_response(request, response).model_dump(mode="json")))

    streamed: dict[int | str, dict[str, Any]] = {
        200: {
            "model": ChatCompletion,
            "description": "The reply; with stream=true, chat.completion.chunk server-sent events, then [DONE]",
            "content": {"text/event-stream": {}},
        }
    }

    @app.post("/v1/chat/completions", dependencies=checked, responses={**streamed, **openai_errors})
    async def chat_completions(request: ChatCompletionRequest, http: Request) -> Any:
        """OpenAI Chat Completions: a tool call chosen by PCD, a json_schema filled (closed fields
        decided, open ones generated), or greedy text (streamed with stream=true).
        """
        check_model(request.model, loader, "model")
        engine = served_engine(loader)
        steps = reply_steps(engine, request)
        if not request.stream:
            body = await in_engine(lambda: completion(steps, engine.model_name), {}, "messages", http)
            observe_reply(body.usage, body.x_pcd)
            return JSONResponse(stamp(body.model_dump(mode="json"), "x_pcd"))
        # the first step (the whole fill or tool call; a generation's first token) runs before the
        # status line, so that every error a request can cause is still a 4xx
        first = await in_engine(lambda: next(steps), {}, "messages", http)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        events = observed_chunks(chunks(itertools.chain([first], steps), engine.model_name, include_usage))
        return StreamingResponse(server_sent(events), media_type="text/event-stream")

    add_session_routes(app, loader, checked, guarded, errors)

    @app.get("/v1/models", dependencies=guarded, responses=errors)
    async def models() -> ModelList:
        """The one model this server answers with, in the System One and the OpenAI list shapes."""
        card = model_card(served_engine(loader))
        return ModelList(data=[openai_model(card)], models=[card])

    @app.get("/healthz", responses={503: {"model": HealthBody}})
    async def healthz() -> JSONResponse:
        """200 once the model is ready; 503 while it loads or after its load failed."""
        health = HealthBody(status=loader.status, model=loader.model_name, error=loader.error)
        code = 200 if health.status == "ready" else 503
        return JSONResponse(health.model_dump(exclude_none=True), status_code=code)

    if playground:
        add_playground(app, api_key_required=api_key is not None)
    return app


def serve(
    engine_or_factory: Engine | Callable[[], Engine],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    model_name: str | None = None,
    log_level: str = "info",
    limits: Limits = DEFAULT_LIMITS,
    playground: bool = True,
    backpressure: Backpressure | None = None,
    tracing: bool = False,
    read_timeouts: ReadTimeouts = DEFAULT_READ_TIMEOUTS,
) -> None:
    """Run the server with uvicorn until interrupted; a client must send its headers within
    ``read_timeouts.header_s`` and its body within ``read_timeouts.body_s`` (408 otherwise).

    Given a factory (``lambda: Engine.load(...)``), the server listens at once and loads the model in
    the background; ``/healthz`` and ``/readyz`` say when it is ready. Every log line carries the
    request id of the request it was written for (``-`` outside one). ``tracing`` sends a span per
    request to the OpenTelemetry tracer provider the process configured (the ``otel`` extra).
    """
    uvicorn = _import_optional("uvicorn")
    tracer = RequestTracer() if tracing else None
    operations: dict[str, Any] = {"backpressure": backpressure, "tracer": tracer, "read_timeouts": read_timeouts}
    if isinstance(engine_or_factory, Engine):
        app = create_app(engine_or_factory, api_key=api_key, limits=limits, playground=playground, **operations)
    elif callable(engine_or_factory):
        app = create_app(
            engine_factory=engine_or_factory,
            model_name=model_name,
            api_key=api_key,
            limits=limits,
            playground=playground,
            **operations,
        )
    else:
        raise TypeError(f"serve needs an Engine or a function that loads one, not {engine_or_factory!r}")
    warn_if_exposed(logger, "pcd serve", host, api_key)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config(uvicorn.config.LOGGING_CONFIG),
        http=http_protocol(read_timeouts.header_s),
    )


def _add_operations(
    app: "FastAPI", loader: EngineLoader, backpressure: Backpressure | None, tracer: Tracer | None
) -> None:
    """Request ids, ``--max-queue``/``--timeout``, ``/livez``, ``/readyz``, ``/metrics`` and tracing
    (``pcd_integrations/serving/operations.py``), outermost, so that a refused request costs no body read.
    Opening a session and appending a turn are model routes like ``/v1/systemone``: they take a place in
    the same queue, get the same 503 when it is full and the same 504 past the timeout.
    """
    known = MODEL_ROUTES | {template for template, _ in SESSION_MODEL_ROUTES} | {"/v1/models", "/healthz"}
    app.add_middleware(
        Operations,
        loader=loader,
        model_paths=MODEL_ROUTES,
        model_templates=SESSION_MODEL_ROUTES,
        openai_paths=OPENAI_ROUTES,
        backpressure=backpressure or Backpressure(),
        metrics=build_metrics(loader, known),
        tracer=tracer,
    )


def _guard_body(app: "FastAPI", limits: Limits, body_timeout_s: float) -> None:
    """Bodies over ``limits.max_body_bytes`` get 413 before FastAPI reads them (``pcd serve --max-body-bytes``),
    and bodies slower than ``body_timeout_s`` 408 (``--body-timeout``), in OpenAI's error shape on the
    OpenAI routes.
    """
    app.add_middleware(BodyLimit, limits=limits, openai_paths=OPENAI_ROUTES, body_timeout_s=body_timeout_s)
