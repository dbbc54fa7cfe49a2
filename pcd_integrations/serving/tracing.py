"""OpenTelemetry spans for ``pcd serve`` and ``pcd-mcp`` over HTTP: one per request, one per forward pass.

The ``otel`` extra (``pip install 'pcd-engine[otel]'``) brings ``opentelemetry-api``; the operator's
SDK and exporter (configured the usual way, or a ``TracerProvider`` passed in) decide where spans go.
A request's span continues the trace of its ``traceparent`` header (W3C trace context, through the
globally configured propagator) and carries, once answered, ``pcd.forward_passes``,
``pcd.input_tokens``, ``pcd.output_tokens`` and ``pcd.queue_ms``. Each forward pass is a child span
``pcd.pass`` with the tokens it read (``pcd.tokens``), from the moment the engine starts it to the
start of the request's next pass or the end of the request; the engine tells of each pass through
the framework-free listener of ``pcd_core/hooks.py``, so ``pcd_core`` imports no OpenTelemetry.
``tests/test_operations.py`` reads the spans with the SDK's in-memory exporter.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from pcd_integrations.serving.guards import Scope

__all__ = ["INSTALL_HINT", "RequestSpan", "RequestTracer"]

INSTALL_HINT = "pip install 'pcd-engine[otel]'"


def _otel(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"tracing needs {module!r}, which is not installed; run: {INSTALL_HINT}") from error


class RequestSpan:
    """One request's span and the span of the pass it is in, if any."""

    def __init__(self, tracer: Any, span: Any, trace: Any) -> None:
        self._tracer, self._span, self._trace = tracer, span, trace
        self._context = trace.set_span_in_context(span)
        self._pass: Any = None
        self._n_passes = 0
        self._lock = threading.Lock()  # passes come from worker threads, the end from the event loop

    def on_pass(self, n_tokens: int) -> None:
        with self._lock:
            self._end_pass()
            self._n_passes += 1
            attributes = {"pcd.pass": self._n_passes, "pcd.tokens": n_tokens}
            self._pass = self._tracer.start_span("pcd.pass", context=self._context, attributes=attributes)

    def annotate(self, attributes: dict[str, Any]) -> None:
        self._span.set_attributes(attributes)

    def finish(self, status: int) -> None:
        with self._lock:
            self._end_pass()
        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        self._span.end()

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None


class RequestTracer:
    """Starts request spans on ``tracer_provider`` (the global one when None)."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._trace = _otel("opentelemetry.trace")
        self._propagate = _otel("opentelemetry.propagate")
        self._tracer = self._trace.get_tracer("pcd_integrations", tracer_provider=tracer_provider)

    def start(self, scope: Scope, name: str) -> RequestSpan:
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers") or ()}
        parent = self._propagate.extract(carrier)
        attributes = {"http.request.method": scope.get("method", ""), "url.path": scope.get("path", "")}
        span = self._tracer.start_span(name, context=parent, kind=self._trace.SpanKind.SERVER, attributes=attributes)
        return RequestSpan(self._tracer, span, self._trace)
