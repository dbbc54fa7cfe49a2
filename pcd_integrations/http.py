"""``pcd serve``: System One (``POST /v1/systemone``), OpenAI Decisions (``POST /v1/decisions``) and
OpenAI Chat Completions (``POST /v1/chat/completions``).

A thin translation layer: JSON in, the wire models of ``pcd_core.questions`` (System One),
``pcd_integrations.wire.decisions`` (OpenAI Decisions, which translates into the System One questions) or
``pcd_integrations.wire.chat`` (Chat Completions, run by ``pcd_integrations/chat_completions.py``), the engine
called in a worker thread, the wire models out. It never builds a prompt or touches a token id. The
invariants it keeps, each proven on the embedded model in ``tests/test_http.py`` and, with the real
``openai`` client, in ``tests/test_decisions_api.py`` and ``tests/test_chat_completions.py``:

- a bad request is refused before the model is touched, in each protocol's own shape: System One
  422 ``{"detail": [{"loc", "msg", "type"}]}``, OpenAI 400
  ``{"error": {"message", "type", "param", "code"}}`` (a body over the bound: 413, in the same
  shapes); nothing a client sends can get a 5xx;
- bodies are read strictly: a repeated key or a NaN is refused, never silently resolved;
- a request that names another model gets 404 (``model_not_found``) rather than this model's answer;
- other System One errors have the shape ``{"detail": {"error_type", "message"}}``;
- requests share the event loop while the engine serialises model access, so eight concurrent clients
  get exactly the answers that sequential requests get.

FastAPI and uvicorn are the ``http`` extra (``pip install 'pcd-engine[http]'``) and are imported only
when an app is built. This module deliberately has no ``from __future__ import annotations``: FastAPI
reads the route signatures at run time, and the routes live inside `create_app`, next to the lazily
imported FastAPI names they are annotated with.

Why one module of ~620 lines: the routes live inside ``create_app`` next to the lazily imported
FastAPI names they are annotated with (see above); the per-protocol translation already lives in
``pcd_integrations/wire/`` and ``chat_completions.py``, what stays is the routes and their error shapes.
"""

import asyncio
import hmac
import importlib
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field

from pcd_core import (
    BackendError,
    DecideRequest,
    DecideResponse,
    Engine,
    PcdError,
    PromptError,
    SchemaError,
    TokenizationError,
    UpstreamError,
    __version__,
)
from pcd_core.errors import Cancelled, LimitError, RequestError, TextError
from pcd_core.fairness import Cancellation, in_worker
from pcd_core.limits import DEFAULT_LIMITS, Limits
from pcd_core.models import EMBEDDED
from pcd_integrations.loading import EngineLoader
from pcd_integrations.wire import accepts_model, chat, decisions
from pcd_integrations.wire.body import BodyError, loads_strict
from pcd_integrations.wire.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from pcd_integrations.wire.decisions import DecisionRequest, DecisionResponse, decision_response
from pcd_integrations.wire.errors import OpenAIErrorBody, openai_error_body

from .chat_completions import chunks, completion, reply_steps
from .guards import BodyLimit, warn_if_exposed
from .operations import (
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
from .playground import add_playground
from .read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts, http_protocol
from .threads import iterate_in_thread
from .tracing import RequestTracer

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

__all__ = ["create_app", "serve"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

INSTALL_HINT = "pip install 'pcd-engine[http]'"

# Engine errors that mean "this request cannot be answered", by their System One detail type; any
# other PcdError that is not a BackendError is the caller's too, typed by its class name.
_REQUEST_ERRORS = (
    (TextError, "text_error"),
    (LimitError, "limit_error"),
    (RequestError, "request_error"),
    (PromptError, "prompt_error"),
    (TokenizationError, "tokenization_error"),
    (SchemaError, "schema_error"),
)
#: Routes that speak the OpenAI protocol, so that their errors take OpenAI's shape.
OPENAI_ROUTES = frozenset({"/v1/decisions", "/v1/chat/completions"})
#: Routes that run the model: what ``--max-queue`` and ``--timeout`` bound (``operations.py``).
MODEL_ROUTES = OPENAI_ROUTES | {"/v1/systemone"}
#: The parts of an error location that are a path in an OpenAI body (the rest are union tags).
_OPENAI_FIELDS = decisions.FIELD_NAMES | chat.FIELD_NAMES
_T = TypeVar("_T")


class ValidationErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """A request the server will not run: HTTP 422."""

    detail: list[ValidationErrorItem]


class ErrorInfo(BaseModel):
    error_type: str
    message: str


class ErrorBody(BaseModel):
    """Every error that is not a validation error: 401, 404, 503, 500."""

    detail: ErrorInfo


class HealthBody(BaseModel):
    status: Literal["loading", "ready", "error"]
    model: str | None
    error: str | None = None


class ModelCard(BaseModel):
    name: str
    description: str
    release_date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="The upstream release date, in Unix seconds (0: unknown).")
    owned_by: str = "pcd-engine"


class ModelList(BaseModel):
    """The served model in both protocols' shapes: System One's ``models`` and OpenAI's ``object``/``data``."""

    object: Literal["list"] = "list"
    data: list[OpenAIModel]
    models: list[ModelCard]


class ApiError(Exception):
    """An error the server reports in the protocol's shape; ``loc`` points into the body."""

    def __init__(
        self,
        status_code: int,
        error_type: str,
        message: str,
        headers: dict[str, str] | None = None,
        loc: Sequence[str | int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = headers
        self.loc = list(loc) if loc is not None else None


def _import_optional(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"the HTTP server needs {module!r}, which is not installed; run: {INSTALL_HINT}") from error


def _engine(loader: EngineLoader) -> Engine:
    """The engine, or a 503 that says whether it is still loading or failed to."""
    if loader.engine is not None:
        return loader.engine
    if loader.status == "error":
        raise ApiError(503, "model_load_failed", f"the model failed to load: {loader.error}")
    raise ApiError(503, "model_loading", "the model is still loading; retry shortly", headers={"Retry-After": "1"})


def _check_model(requested: str | None, loader: EngineLoader, loc: str) -> None:
    served = loader.model_name
    if served is not None and not accepts_model(requested, served):
        message = f"the model {requested!r} is not served here; this server answers with {served!r}"
        raise ApiError(404, "model_not_found", message, loc=["body", loc])


# The contract requires a date; a model outside the embedded registry reports the epoch, which no
# client can mistake for a real release.
_UNKNOWN_RELEASE = "1970-01-01"


def _model_card(engine: Engine) -> ModelCard:
    spec = EMBEDDED.get(engine.model_name)
    description = spec.description if spec is not None else f"{engine.model_name}, loaded by pcd-engine"
    release_date = spec.release_date if spec is not None else _UNKNOWN_RELEASE
    return ModelCard(name=engine.model_name, description=description, release_date=release_date)


def _openai_model(card: ModelCard) -> OpenAIModel:
    released = datetime.strptime(card.release_date, "%Y-%m-%d").replace(tzinfo=UTC)
    return OpenAIModel(id=card.name, created=int(released.timestamp()))


def _wire_safe(value: Any) -> Any:
    """Lone surrogates written as escapes, everywhere in a JSON value: a response must always encode."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_wire_safe(k): _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wire_safe(v) for v in value]
    return value


def _request_error(error: PcdError, where: dict[str, str | int], state_field: str) -> ApiError:
    """An engine error caused by the request, pointed at the part of the body it is about.

    ``where`` maps each engine question id to its place in the body's ``questions`` (empty: the
    route has no questions, and a schema error points at the body). A request the question models
    refused keeps pydantic's first location; bad text names where it is.
    """
    if isinstance(error, RequestError) and error.errors:
        first = error.errors[0]
        return ApiError(
            422, str(first.get("type", "request_error")), str(first.get("msg", error)), loc=["body", *first["loc"]]
        )
    if isinstance(error, TextError):
        return ApiError(422, "text_error", str(error), loc=["body", *error.loc])
    if isinstance(error, LimitError):
        loc: list[str | int] = ["body"]
    elif isinstance(error, PromptError):
        loc = ["body", state_field]
    elif where:
        field = getattr(error, "field", None)
        loc = ["body", "questions", where[field]] if field in where else ["body", "questions"]
    else:
        loc = ["body"]
    kind = next((name for cls, name in _REQUEST_ERRORS if isinstance(error, cls)), None)
    kind = kind or re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower().removesuffix("_error") + "_error"
    return ApiError(422, kind, str(error), loc=loc)


#: how often a running request looks whether its client is still there (a pass takes longer)
DISCONNECT_POLL_S = 0.1


async def _cancel_on_disconnect(request: "Request", token: Cancellation) -> None:
    """Set ``token`` once the client of ``request`` has gone; runs until it has, or is cancelled."""
    while not token.cancelled:
        if await request.is_disconnected():
            token.cancel("the client closed the connection")
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _in_engine(call: Callable[[], _T], where: dict[str, str | int], state_field: str, request: "Request") -> _T:
    """One blocking engine call in a worker thread; caller errors become 422s pointed into the body.

    The call runs under a ``Cancellation`` that is set when the client disconnects, or when this
    coroutine itself is cancelled (a dropped stream, a stopping server), so that the engine stops at
    its next pass boundary instead of computing an answer nobody reads (``pcd_core/fairness.py``).
    """
    token = Cancellation()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, token))
    try:
        return await in_worker(call, token, "the request was abandoned")
    except Cancelled as error:  # nobody reads this answer; it is shaped for the log and the tests
        logger.info("stopped a request whose client went away: %s", error)
        raise ApiError(499, "client_closed_request", str(error)) from error
    except PcdError as error:
        if isinstance(error, UpstreamError):  # the remote model server's fault: a bad gateway, not ours
            logger.error("the model server failed a valid request: %s", error)
            raise ApiError(502, "upstream_error", str(error)) from error
        if isinstance(error, BackendError):
            logger.exception("the engine failed on a valid request")
            raise ApiError(500, "backend_error", f"{type(error).__name__}: {error}") from error
        raise _request_error(error, where, state_field) from error
    except Exception as error:  # a server fault, reported in the error shape, never as bare text
        logger.exception("the engine failed on a valid request")
        raise ApiError(500, "internal_error", f"{type(error).__name__}: {error}") from error
    finally:
        watcher.cancel()


async def _decide(
    loader: EngineLoader,
    state: Any,
    questions: dict[str, Any],
    state_field: str,
    where: dict[str, str | int],
    request: "Request",
) -> DecideResponse:
    """The one engine call behind both decision routes."""
    engine = _engine(loader)
    return await _in_engine(lambda: engine.decide(state, questions), where, state_field, request)


async def _server_sent(events: Iterator[ChatCompletionChunk]) -> AsyncIterator[str]:
    """Each chunk as a server-sent event, produced in a worker thread, then ``data: [DONE]``.

    The status line is sent by now, so a failure past this point is an error event in OpenAI's shape
    (the ``openai`` SDK raises it as an ``APIError``), never a cut-off stream.
    """
    try:
        async for event in iterate_in_thread(events):
            yield f"data: {json.dumps(event.model_dump(mode='json'), ensure_ascii=False)}\n\n"
    except Exception as error:  # the request was valid (its first step ran before the stream began)
        logger.exception("the engine failed while streaming a reply")
        body = _openai_error(500, "stream_error", f"{type(error).__name__}: {error}", None)
        yield f"data: {json.dumps(_wire_safe(body))}\n\n"
        return
    yield "data: [DONE]\n\n"


def _openai_param(loc: Sequence[str | int]) -> str | None:
    """``["body", "questions", 0, "choices"]`` as OpenAI writes it: ``questions[0].choices``."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _OPENAI_FIELDS:
            param += f".{part}"
    return param.lstrip(".") or None


def _openai_error(status_code: int, error_type: str, message: str, loc: Sequence[str | int] | None) -> dict[str, Any]:
    return openai_error_body(status_code, error_type, message, _openai_param(loc or []))


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
    ``playground`` serves the page at ``/`` and ``/playground`` (``pcd_integrations/playground``), a
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
            body = _openai_error(status, error.error_type, error.message, error.loc)
            return JSONResponse(_wire_safe(body), status_code=status, headers=error.headers)
        if error.status_code == 422:
            item = {"loc": error.loc or ["body"], "msg": error.message, "type": error.error_type}
            return JSONResponse({"detail": [_wire_safe(item)]}, status_code=422, headers=error.headers)
        body = {"detail": {"error_type": error.error_type, "message": error.message}}
        return JSONResponse(_wire_safe(body), status_code=error.status_code, headers=error.headers)

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
            param = _openai_param(first["loc"])
            more = f" (and {len(detail) - 1} more problems)" if len(detail) > 1 else ""
            shown = f"{param}: {message}{more}" if param else f"{message}{more}"
            return JSONResponse(_openai_error(400, str(first["type"]), shown, first["loc"]), status_code=400)
        return JSONResponse({"detail": _wire_safe(detail)}, status_code=422)

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
        _check_model(request.model, loader, "model")
        where: dict[str, str | int] = {qid: qid for qid in request.questions}
        response = await _decide(loader, request.state, request.questions, "state", where, http)
        observe_decided(response)
        return JSONResponse(stamp(response.to_wire()))

    @app.post("/v1/decisions", dependencies=checked, responses={200: {"model": DecisionResponse}, **openai_errors})
    async def decisions(request: DecisionRequest, http: Request) -> JSONResponse:
        """The OpenAI Decisions API: answers in question order, each independent of the others."""
        _check_model(request.model, loader, "model")
        questions = request.engine_questions()
        where: dict[str, str | int] = {qid: index for index, qid in enumerate(questions)}
        response = await _decide(loader, request.state(), questions, "input", where, http)
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
        _check_model(request.model, loader, "model")
        engine = _engine(loader)
        steps = reply_steps(engine, request)
        if not request.stream:
            body = await _in_engine(lambda: completion(steps, engine.model_name), {}, "messages", http)
            observe_reply(body.usage, body.x_pcd)
            return JSONResponse(stamp(body.model_dump(mode="json"), "x_pcd"))
        # the first step (the whole fill or tool call; a generation's first token) runs before the
        # status line, so that every error a request can cause is still a 4xx
        first = await _in_engine(lambda: next(steps), {}, "messages", http)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        events = observed_chunks(chunks(itertools.chain([first], steps), engine.model_name, include_usage))
        return StreamingResponse(_server_sent(events), media_type="text/event-stream")

    @app.get("/v1/models", dependencies=guarded, responses=errors)
    async def models() -> ModelList:
        """The one model this server answers with, in the System One and the OpenAI list shapes."""
        card = _model_card(_engine(loader))
        return ModelList(data=[_openai_model(card)], models=[card])

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
    (``pcd_integrations/operations.py``), outermost, so that a refused request costs no body read.
    """
    known = MODEL_ROUTES | {"/v1/models", "/healthz"}
    app.add_middleware(
        Operations,
        loader=loader,
        model_paths=MODEL_ROUTES,
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
