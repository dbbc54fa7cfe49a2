"""What an operator needs from a server, in one ASGI middleware: request ids, back-pressure, health,
metrics and tracing, for ``pcd serve`` and ``pcd-mcp`` over HTTP alike.

- **Request ids.** ``X-Request-Id`` is taken from the request when it is 1 to 128 safe characters
  (letters, digits, ``._:+=@/-``), else made (32 hex digits); it is echoed on the response, set on every
  log record emitted while the request runs (``RequestIdFilter``, through a ``ContextVar`` that
  ``asyncio.to_thread`` carries into the engine's worker thread), and written into the bodies that
  have extensions (``stamp``).
- **Back-pressure.** With ``max_queue`` set, at most one request per model route works and
  ``max_queue`` wait: one more gets 503 with ``Retry-After`` before its body is read, in OpenAI's
  error shape on the OpenAI routes and System One's elsewhere. A model route is a POST to one of
  ``model_paths`` or to a path one of ``model_templates`` matches (a route with a path parameter, such
  as a session's turns), and all of them count against the one capacity, since they share one model. With ``timeout_s`` set, a request
  whose response has not started by then gets 504 and its work is dropped: the route's task is
  cancelled, which sets the request's ``Cancellation`` (``pcd_core/concurrency/model_lock.py``, set by the route's
  engine call when its await is cancelled), so a request still queued leaves the queue and one that
  holds the model stops at its next pass boundary.
- **Health.** ``GET /livez`` is 200 while the process serves; ``GET /readyz`` is 200 once the model
  is loaded and a new request would be admitted, 503 otherwise. Neither needs a key.
- **Metrics.** ``GET /metrics`` (``metrics.py``); the routes report each answer with ``observe_*``.
- **Tracing.** With a tracer (``tracing.py``), a span per request and a child span per pass.

``tests/test_operations.py`` drives each with real clients on a loopback server and the embedded model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pcd_core import DecideResponse, Stats
from pcd_core.hooks import listening
from pcd_integrations.serving.engine_loader import EngineLoader
from pcd_integrations.serving.guards import App, Message, Receive, Scope, Send, send_body, send_error
from pcd_integrations.serving.metrics import INSTALL_HINT, Metrics

__all__ = [
    "Backpressure",
    "Operations",
    "RequestIdFilter",
    "current_request_id",
    "observe_decided",
    "observe_reply",
    "stamp",
    "trace_cost",
]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_SAFE_ID = re.compile(r"[A-Za-z0-9._:+=@/-]{1,128}")
HEALTH_PATHS = frozenset({"/livez", "/readyz", "/metrics"})


class SpanHandle(Protocol):
    """What the middleware needs from a request's trace (``tracing.RequestSpan``)."""

    def on_pass(self, n_tokens: int) -> None: ...
    def annotate(self, attributes: dict[str, Any]) -> None: ...
    def finish(self, status: int) -> None: ...


class Tracer(Protocol):
    def start(self, scope: Scope, name: str) -> SpanHandle: ...


@dataclass
class _Request:
    """One request in flight: what the routes, the log filter and the pass listener read."""

    id: str
    path: str
    operations: Operations
    dropped: bool = False
    span: SpanHandle | None = None

    def on_pass(self, n_tokens: int) -> None:
        if self.span is not None:
            self.span.on_pass(n_tokens)


_current: ContextVar[_Request | None] = ContextVar("pcd_request", default=None)


def current_request_id() -> str | None:
    request = _current.get()
    return request.id if request is not None else None


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-Id`` when it is safe to log and echo, else a new one."""
    given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
    return given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` (``-`` outside a request) so that a format can show it."""

    def filter(self, record: logging.LogRecord) -> Literal[True]:
        record.request_id = current_request_id() or "-"
        return True


def log_config(base: dict[str, Any]) -> dict[str, Any]:
    """The uvicorn logging config ``base`` with the request id in every line, the engine's loggers included."""
    config = json.loads(json.dumps(base))
    config.setdefault("filters", {})["request_id"] = {"()": f"{__name__}.RequestIdFilter"}
    for formatter in config.get("formatters", {}).values():
        if "fmt" in formatter:
            formatter["fmt"] = formatter["fmt"].replace("%(levelprefix)s", "%(levelprefix)s [%(request_id)s]", 1)
    for handler in config.get("handlers", {}).values():
        handler.setdefault("filters", []).append("request_id")
    loggers = config.setdefault("loggers", {})
    for name in ("pcd_core", "pcd_integrations", "mcp_server"):
        loggers[name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@dataclass(frozen=True)
class Backpressure:
    """``pcd serve --max-queue N --timeout S``: None turns each bound off."""

    max_queue: int | None = None
    timeout_s: float | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {self.max_queue}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be more than 0 seconds, got {self.timeout_s}")


@dataclass
class Operations:
    """The middleware in front of an app whose model routes are ``model_paths`` (POST)."""

    app: App
    loader: EngineLoader
    model_paths: frozenset[str]
    openai_paths: frozenset[str] = frozenset()
    backpressure: Backpressure = field(default_factory=Backpressure)
    metrics: Metrics | None = None
    tracer: Tracer | None = None
    #: requests to a model path that never reach the model (told from their headers, before any body
    #: is read): they pass the queue and the timeout, as pcd-mcp's ``server/discover`` and ``tools/list``
    light: Callable[[Scope], bool] | None = None
    #: model routes with a path parameter, each as (its template, the pattern of its paths): metrics
    #: label a request by the template, so that ids in paths do not become labels
    model_templates: tuple[tuple[str, re.Pattern[str]], ...] = ()
    admitted: int = 0

    def model_route(self, path: str) -> str | None:
        """The model route ``path`` belongs to (its template, for a route with a path parameter), or None."""
        if path in self.model_paths:
            return path
        return next((template for template, pattern in self.model_templates if pattern.fullmatch(path)), None)

    @property
    def capacity(self) -> int | None:
        """Requests a model route takes at once: one at the model and ``max_queue`` waiting."""
        queue = self.backpressure.max_queue
        return None if queue is None else 1 + queue

    def full(self) -> bool:
        return self.capacity is not None and self.admitted >= self.capacity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path in HEALTH_PATHS and method == "GET":
            await self._health(path, send)
            return
        route = self.model_route(path)
        request = _Request(request_id_of(scope), path, self)
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if request.dropped:  # a 504 has been sent instead
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request.id.encode())]}
            await send(message)

        token = _current.set(request)
        try:
            with ExitStack() as stack:
                if self.tracer is not None:
                    request.span = self.tracer.start(scope, f"{method} {path}")
                stack.enter_context(listening(request.on_pass))
                modelled = method == "POST" and route is not None
                modelled = modelled and not (self.light is not None and self.light(scope))
                if modelled and self.full():
                    status = 503
                    self._reject("queue_full")
                    await self._refuse(send_with_id, path, 503, "queue_full", self._full_message())
                elif modelled:
                    await self._admit(request, scope, receive, send_with_id, send)
                    status = 504 if request.dropped else status
                else:
                    await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.answered(route if route is not None else path, status, seconds)
            if request.span is not None:
                request.span.finish(status)
            logger.info("%s %s -> %d in %.1f ms", method, path, status, seconds * 1000.0)
            _current.reset(token)

    async def _admit(self, request: _Request, scope: Scope, receive: Receive, send: Send, raw_send: Send) -> None:
        """Run one model request, counted against the capacity, within its timeout."""
        self.admitted += 1
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        responding = False

        async def watched(message: Message) -> None:
            nonlocal responding
            responding = True
            await send(message)

        work = asyncio.ensure_future(self.app(scope, receive, watched))
        try:
            # shielded, so that a stream that began in time outlives the timeout
            await asyncio.wait_for(asyncio.shield(work), self.backpressure.timeout_s)
        except asyncio.CancelledError:  # the server stops the request: so does its work
            work.cancel()
            raise
        except TimeoutError:
            if responding:  # a stream that began in time runs to its end
                await work
                return
            request.dropped = True
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
            self._reject("timeout")
            message = f"the request was not answered within {self.backpressure.timeout_s:g} s and was dropped"
            headers = {"x-request-id": request.id, "retry-after": str(self.backpressure.retry_after_s)}
            await send_error(raw_send, 504, "timeout", message, headers, openai=request.path in self.openai_paths)
        finally:
            self.admitted -= 1
            if self.metrics is not None:
                self.metrics.in_flight.dec()

    def _full_message(self) -> str:
        return (
            f"the server is busy: {self.backpressure.max_queue} requests are already waiting for the model "
            f"(--max-queue); retry after {self.backpressure.retry_after_s} s"
        )

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    async def _refuse(self, send: Send, path: str, status: int, error_type: str, message: str) -> None:
        headers = {"Retry-After": str(self.backpressure.retry_after_s)}
        await send_error(send, status, error_type, message, headers, openai=path in self.openai_paths)

    async def _health(self, path: str, send: Send) -> None:
        if path == "/metrics":
            if self.metrics is None:
                await send_error(send, 501, "not_implemented", f"metrics need prometheus-client: {INSTALL_HINT}")
                return
            await send_body(send, 200, self.metrics.render(), self.metrics.content_type)
            return
        if path == "/livez":
            await _send_json(send, 200, {"status": "alive"})
            return
        body: dict[str, Any] = {"status": self.loader.status, "model": self.loader.model_name}
        if self.loader.status == "ready" and self.full():
            body["status"] = "full"
        if self.capacity is not None:
            body |= {"admitted": self.admitted, "capacity": self.capacity}
        await _send_json(send, 200 if body["status"] == "ready" else 503, body)


async def _send_json(send: Send, status: int, value: dict[str, Any]) -> None:
    await send_body(send, status, json.dumps(value).encode(), "application/json")


# -- what the routes report ------------------------------------------------------------------------
def observe_decided(response: DecideResponse) -> None:
    """A question route's answer: its cost and decisions into the metrics, its cost onto the span."""
    request = _current.get()
    if request is None:
        return
    metrics = request.operations.metrics
    if metrics is not None:
        metrics.decided(request.path, response)
    trace_cost(response.stats)


def trace_cost(stats: Stats) -> None:
    """An answer's cost onto its request's span, when the request is traced (``pcd-mcp``'s tools
    report their metrics themselves, and their cost here).
    """
    request = _current.get()
    if request is not None and request.span is not None:
        request.span.annotate(_cost(stats.forward_passes, stats.input_tokens, stats.output_tokens, stats.queue_ms))


def observe_reply(usage: Any, pcd: Any) -> None:
    """A chat reply's ``usage`` (None when a stream did not ask for it) and ``x_pcd``."""
    request = _current.get()
    if request is None:
        return
    metrics = request.operations.metrics
    if metrics is not None:
        metrics.replied(request.path, usage, pcd)
    if request.span is not None:
        read, made = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
        request.span.annotate(_cost(pcd.forward_passes, read, made, pcd.queue_ms))


def observed_chunks(events: Iterator[Any]) -> Iterator[Any]:
    """A streamed reply's chunks, passed on, the request id written into the one with ``x_pcd``; that one
    (and the usage, if asked) is observed.
    """
    pcd = usage = None
    request_id = current_request_id()
    for event in events:
        if event.x_pcd is not None:
            pcd = event.x_pcd = event.x_pcd.model_copy(update={"request_id": request_id})
        usage = event.usage if event.usage is not None else usage
        yield event
    if pcd is not None:
        observe_reply(usage, pcd)


def _cost(passes: int, input_tokens: int, output_tokens: int, queue_ms: float) -> dict[str, Any]:
    return {
        "pcd.forward_passes": passes,
        "pcd.input_tokens": input_tokens,
        "pcd.output_tokens": output_tokens,
        "pcd.queue_ms": queue_ms,
    }


def stamp(body: dict[str, Any], where: Literal["top", "x_pcd"] = "top") -> dict[str, Any]:
    """``body`` with the request id as its ``x_request_id`` extension, or as ``x_pcd.request_id``."""
    request_id = current_request_id()
    if request_id is not None:
        if where == "x_pcd":
            body["x_pcd"]["request_id"] = request_id
        else:
            body["x_request_id"] = request_id
    return body


def build_metrics(loader: EngineLoader, paths: frozenset[str]) -> Metrics | None:
    """An app's metrics over its known ``paths``, reading the engine's queue; None without prometheus-client
    (``/metrics`` then answers 501 with the install hint).
    """
    from pcd_integrations.serving.metrics import prometheus_available

    if not prometheus_available():
        return None
    # getattr: a stand-in engine (a test's oracle) has no queue to read
    return Metrics(paths, lambda: getattr(loader.engine, "waiting", 0))
