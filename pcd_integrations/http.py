"""A Jev-compatible HTTP server: ``POST /v1/systemone`` answers typed questions with one `Engine`.

A thin translation layer (STYLE §7): JSON in, the `pcd_core` question models, one
``await engine.adecide(state, questions)``, ``to_wire()`` out. It never builds a prompt or touches a
token id. The invariants it keeps, each proven in ``tests/test_http.py`` on the embedded model:

- a bad request gets 422 with ``detail[]`` (REFERENCE.md §3) before the model is touched; nothing a
  client sends can get a 5xx;
- every other error has the shape ``{"detail": {"error_type", "message"}}``;
- requests share the event loop while the engine serialises model access, so eight concurrent clients
  get exactly the answers that sequential requests get.

FastAPI and uvicorn are the ``http`` extra (``pip install 'pcd-engine[http]'``) and are imported only
when an app is built. This module deliberately has no ``from __future__ import annotations``: FastAPI
reads the route signatures at run time, and the routes live inside `create_app`, next to the lazily
imported FastAPI names they are annotated with.
"""

import hmac
import importlib
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field

from pcd_core import (
    DecideRequest,
    Engine,
    PcdError,
    PromptError,
    SchemaError,
    TokenizationError,
    __version__,
)
from pcd_core.errors import LimitError, RequestError, TextError
from pcd_core.limits import DEFAULT_LIMITS, Limits
from pcd_core.models import EMBEDDED

from .guards import BodyLimit, warn_if_exposed

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["create_app", "serve"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

INSTALL_HINT = "pip install 'pcd-engine[http]'"

# The engine errors that mean "this request cannot be answered": HTTP 422, with these detail types.
_REQUEST_ERRORS = (
    (TextError, "text_error"),
    (LimitError, "limit_error"),
    (RequestError, "request_error"),
    (PromptError, "prompt_error"),
    (TokenizationError, "tokenization_error"),
    (SchemaError, "schema_error"),
)


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


class ModelList(BaseModel):
    models: list[ModelCard]


class ApiError(Exception):
    """An error the server reports as ``{"detail": {"error_type", "message"}}``."""

    def __init__(self, status_code: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = headers


def _import_optional(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"the HTTP server needs {module!r}, which is not installed; run: {INSTALL_HINT}") from error


class _EngineSlot:
    """The engine, or how its background load is going, so that the server can listen while it loads.

    The load runs on its own thread as soon as the app is built (not in an ASGI lifespan, which an
    in-process test client never runs). Requests that need the engine get 503 until it is ready.
    """

    def __init__(self, engine: Engine | None, factory: Callable[[], Engine] | None, model_name: str | None) -> None:
        self.engine = engine
        self.model_name = engine.model_name if engine is not None else model_name
        self.status: Literal["loading", "ready", "error"] = "ready" if engine is not None else "loading"
        self.error: str | None = None
        self.loaded = threading.Event()
        if engine is not None:
            self.loaded.set()
        else:
            threading.Thread(target=self._load, args=(factory,), name="pcd-http-load", daemon=True).start()

    def _load(self, factory: Callable[[], Engine]) -> None:
        try:
            engine = factory()
        except Exception as error:  # reported on /healthz and in every 503; the server keeps running
            logger.exception("loading the engine failed")
            self.error = f"{type(error).__name__}: {error}"
            self.status = "error"
        else:
            self.engine = engine
            self.model_name = engine.model_name
            self.status = "ready"
        finally:
            self.loaded.set()

    def get(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.status == "error":
            raise ApiError(503, "model_load_failed", f"the model failed to load: {self.error}")
        raise ApiError(503, "model_loading", "the model is still loading; retry shortly", headers={"Retry-After": "1"})


# The contract requires a date; a model outside the embedded registry reports the epoch, which no
# client can mistake for a real release.
_UNKNOWN_RELEASE = "1970-01-01"


def _model_card(engine: Engine) -> ModelCard:
    spec = EMBEDDED.get(engine.model_name)
    description = spec.description if spec is not None else f"{engine.model_name}, loaded by pcd-engine"
    release_date = spec.release_date if spec is not None else _UNKNOWN_RELEASE
    return ModelCard(name=engine.model_name, description=description, release_date=release_date)


_CALLER_ERRORS = tuple(cls for cls, _ in _REQUEST_ERRORS)


def _request_error_detail(error: PcdError, request: DecideRequest) -> list[dict[str, Any]]:
    """The 422 ``detail[]`` of an engine error, wire-safe: no text in it can fail to encode."""
    if isinstance(error, RequestError) and error.errors:
        return [{**item, "loc": ["body", *item["loc"]]} for item in error.errors]
    if isinstance(error, TextError):
        return [{"loc": ["body", *error.loc], "msg": _wire_safe(str(error)), "type": "text_error"}]
    return [_wire_safe(_request_error_item(error, request))]


def _wire_safe(value: Any) -> Any:
    """Lone surrogates written as escapes, everywhere in a JSON value: a response must always encode."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_wire_safe(k): _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wire_safe(v) for v in value]
    return value


def _request_error_item(error: PcdError, request: DecideRequest) -> dict[str, Any]:
    """Point an engine error at the part of the body it is about: a question id, or the state."""
    if isinstance(error, LimitError):
        loc: list[str | int] = ["body"]
    elif isinstance(error, PromptError):
        loc = ["body", "state"]
    else:
        field = getattr(error, "field", None)
        loc = ["body", "questions", field] if field in request.questions else ["body", "questions"]
    kind = next(name for cls, name in _REQUEST_ERRORS if isinstance(error, cls))
    return {"loc": loc, "msg": str(error), "type": kind}


def create_app(
    engine: Engine | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> "FastAPI":
    """Build the ASGI app for one engine, or for one that ``engine_factory`` loads in the background.

    ``model_name`` names the model on ``/healthz`` while a factory is still loading it. With
    ``api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``; without it an Authorization
    header is accepted and ignored. ``/healthz`` and the OpenAPI spec never need a key, so that load
    balancers and client generators can read them. ``limits.max_body_bytes`` bounds each body (413);
    every other bound is the engine's own (``Engine(limits=...)``), checked before it tokenizes.
    """
    if (engine is None) == (engine_factory is None):
        raise TypeError("create_app needs exactly one of engine= or engine_factory=")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string, or None to turn auth off")
    _import_optional("fastapi")
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from starlette.exceptions import HTTPException

    slot = _EngineSlot(engine, engine_factory, model_name)
    app = FastAPI(
        title="pcd-engine System One",
        summary="Jev-compatible typed questions (noul, choice, score) answered by parallel constrained "
        "decoding: the answers are read from the model's logits, nothing is generated.",
        version=__version__,
    )
    app.state.engine_slot = slot
    _guard_body(app, limits)

    bearer = HTTPBearer(auto_error=False, description="Required only when the server has an API key.")

    def check_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        # compare_digest keeps the comparison time independent of how much of the key matched.
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise ApiError(
                401,
                "unauthorized",
                "a valid 'Authorization: Bearer <key>' header is required",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(check_key)] if api_key is not None else []
    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorBody},
        422: {"model": ValidationErrorBody},
        503: {"model": ErrorBody},
    }

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        body = {"detail": {"error_type": error.error_type, "message": error.message}}
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # Only loc/msg/type: pydantic's "input" would echo the whole (possibly huge) state back.
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
        return JSONResponse({"detail": _wire_safe(detail)}, status_code=422)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown routes and methods: the same error shape as every other non-validation error.
        error_type = HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
        body = {"detail": {"error_type": error_type, "message": str(error.detail)}}
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    answered = {200: {"description": "One answer per question id, in the request's order"}}

    @app.post("/v1/systemone", dependencies=guarded, responses={**answered, **errors})
    async def systemone(request: DecideRequest) -> JSONResponse:
        """Answer every question about the one shared state; each answer is independent of the others."""
        engine = slot.get()
        try:
            response = await engine.adecide(request.state, request.questions)
        except _CALLER_ERRORS as error:
            return JSONResponse({"detail": _request_error_detail(error, request)}, status_code=422)
        except Exception as error:  # a server fault, reported in the error shape, never as bare text
            logger.exception("the engine failed on a valid request")
            error_type = "backend_error" if isinstance(error, PcdError) else "internal_error"
            raise ApiError(500, error_type, f"{type(error).__name__}: {error}") from error
        return JSONResponse(response.to_wire())

    @app.get("/v1/models", dependencies=guarded, responses=errors)
    async def models() -> ModelList:
        """The one model this server answers with."""
        return ModelList(models=[_model_card(slot.get())])

    @app.get("/healthz", responses={503: {"model": HealthBody}})
    async def healthz() -> JSONResponse:
        """200 once the model is ready; 503 while it loads or after its load failed."""
        health = HealthBody(status=slot.status, model=slot.model_name, error=slot.error)
        code = 200 if health.status == "ready" else 503
        return JSONResponse(health.model_dump(exclude_none=True), status_code=code)

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
) -> None:
    """Run the server with uvicorn until interrupted.

    Given a factory (``lambda: Engine.load(...)``), the server listens at once and loads the model in
    the background; ``/healthz`` says when it is ready.
    """
    uvicorn = _import_optional("uvicorn")
    if isinstance(engine_or_factory, Engine):
        app = create_app(engine_or_factory, api_key=api_key, limits=limits)
    elif callable(engine_or_factory):
        app = create_app(engine_factory=engine_or_factory, model_name=model_name, api_key=api_key, limits=limits)
    else:
        raise TypeError(f"serve needs an Engine or a function that loads one, not {engine_or_factory!r}")
    warn_if_exposed(logger, "pcd serve", host, api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _guard_body(app: "FastAPI", limits: Limits) -> None:
    """Bodies over ``limits.max_body_bytes`` get 413 before FastAPI reads them (``pcd serve --max-body-bytes``)."""
    app.add_middleware(BodyLimit, limits=limits)  # type: ignore[arg-type]
