"""Prometheus metrics of one server (``GET /metrics``): its traffic, its waiting, its cost and its answers.

Each app gets its own ``CollectorRegistry``, never the process-wide one, so that several apps in one
process (tests, an embedding host) count apart. What a request cost and what it answered is read from
the response the engine built (``DecideResponse``, a chat reply's usage and ``x_pcd``), not measured
again here. The drift an operator of a decision service watches is in two histograms per decision,
confidence and candidate mass, labelled by question type or, for a schema fill, by field name. Field
names come from requests, so the label set is bounded: the first ``max_names`` names seen keep their
own label and every later one is counted as ``"other"``; routes outside the known set are ``"other"``
too. ``prometheus-client`` is imported only when an app builds its metrics (the ``http`` and ``mcp``
extras carry it). ``tests/test_operations.py`` reads ``/metrics`` with prometheus_client's own parser
after real requests on the embedded model.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from pcd_core import DecideResponse, Extraction, Stats

__all__ = ["INSTALL_HINT", "Metrics", "prometheus_available"]

INSTALL_HINT = "pip install prometheus-client (or 'pcd-engine[http]')"
#: label value for a route, field or question id past the bounded set
OTHER = "other"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_UNIT = tuple(round(0.05 * k, 2) for k in range(1, 21))  # 0.05 .. 1.0: probabilities and masses


def _prometheus() -> ModuleType:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as error:
        raise ImportError(
            f"GET /metrics needs 'prometheus-client', which is not installed; run: {INSTALL_HINT}"
        ) from error


def prometheus_available() -> bool:
    try:
        _prometheus()
    except ImportError:
        return False
    return True


class BoundedNames:
    """The first ``limit`` distinct names keep their own label; the rest are ``"other"``."""

    def __init__(self, limit: int, known: Iterable[str] = ()) -> None:
        self.limit = limit
        self._names = set(known)
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        with self._lock:
            if name in self._names:
                return name
            if len(self._names) < self.limit:
                self._names.add(name)
                return name
        return OTHER


class Metrics:
    """The registry and the instruments of one app; ``waiting`` reads how many requests wait for the model."""

    def __init__(self, routes: Iterable[str], waiting: Callable[[], int], max_names: int = 64) -> None:
        client = _prometheus()
        self.registry = client.CollectorRegistry()
        self.content_type: str = client.CONTENT_TYPE_LATEST
        self._render = client.generate_latest
        self.routes = frozenset(routes)
        self.field_name = BoundedNames(max_names)

        def make(kind: str, name: str, text: str, labels: tuple[str, ...] = (), **extra: Any) -> Any:
            return getattr(client, kind)(name, text, labels, registry=self.registry, **extra)

        self.requests = make(
            "Counter", "pcd_requests", "HTTP requests answered, by route and status code", ("route", "status")
        )
        self.in_flight = make("Gauge", "pcd_requests_in_flight", "Requests on a model route being answered now")
        self.queued = make("Gauge", "pcd_requests_queued", "Requests waiting for the model now")
        self.queued.set_function(lambda: float(waiting()))
        self.rejected = make(
            "Counter",
            "pcd_requests_rejected",
            "Requests refused by back-pressure: queue_full (503) or timeout (504)",
            ("reason",),
        )
        self.latency = make(
            "Histogram", "pcd_request_duration_seconds", "Time to answer a request", ("route",), buckets=_SECONDS
        )
        self.queue_time = make(
            "Histogram",
            "pcd_queue_seconds",
            "Time a request waited for the model behind others",
            ("route",),
            buckets=_SECONDS,
        )
        self.passes = make("Counter", "pcd_forward_passes", "Forward passes the answered requests ran", ("route",))
        self.input_tokens = make("Counter", "pcd_input_tokens", "Tokens read, a cached head included", ("route",))
        self.output_tokens = make("Counter", "pcd_output_tokens", "Tokens generated", ("route",))
        self.head_cache = make("Counter", "pcd_head_cache", "Head-cache lookups of answered requests", ("result",))
        self.confidence = make(
            "Histogram",
            "pcd_decision_confidence",
            "Normalised peak (n*max p - 1)/(n - 1) of each decision, by question type or schema field",
            ("kind", "field"),
            buckets=_UNIT,
        )
        self.candidate_mass = make(
            "Histogram",
            "pcd_decision_candidate_mass",
            "Probability the model put on any allowed answer before renormalising, by question type or schema field",
            ("kind", "field"),
            buckets=_UNIT,
        )

    def route(self, path: str) -> str:
        return path if path in self.routes else OTHER

    def render(self) -> bytes:
        body: bytes = self._render(self.registry)
        return body

    def answered(self, path: str, status: int, seconds: float) -> None:
        route = self.route(path)
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def cost(self, path: str, *, passes: int, input_tokens: int, output_tokens: int, queue_ms: float) -> None:
        route = self.route(path)
        self.passes.labels(route).inc(passes)
        self.input_tokens.labels(route).inc(input_tokens)
        self.output_tokens.labels(route).inc(output_tokens)
        self.queue_time.labels(route).observe(queue_ms / 1000.0)

    def spent(self, path: str, stats: Stats) -> None:
        """A request's cost record (``pcd_core/cost.py``) and the head cache's answer to it."""
        self.cost(
            path,
            passes=stats.forward_passes,
            input_tokens=stats.input_tokens,
            output_tokens=stats.output_tokens,
            queue_ms=stats.queue_ms,
        )
        self.head_cache.labels(stats.head_cache).inc()

    def decision(self, kind: str, field: str, candidate_mass: float, confidence: float | None) -> None:
        self.candidate_mass.labels(kind, field).observe(candidate_mass)
        if confidence is not None:  # a noul answer has none on the wire
            self.confidence.labels(kind, field).observe(confidence)

    def decided(self, path: str, response: DecideResponse) -> None:
        """A question route's answers (System One, OpenAI Decisions, MCP tools): one decision per question."""
        self.spent(path, response.stats)
        for answer in response.answers.values():
            self.decision(answer.type, "", answer.candidate_mass, getattr(answer, "confidence", None))

    def filled(self, path: str, extraction: Extraction) -> None:
        """A schema fill's cost and its decided fields (the MCP ``fill`` tool)."""
        self.spent(path, extraction.stats)
        for name, field in extraction.fields.items():
            self._field(name, field.to_dict())

    def replied(self, path: str, usage: Any, pcd: Any) -> None:
        """A chat reply's ``usage`` (None when a stream did not ask for it) and ``x_pcd``."""
        if usage is not None:
            self.head_cache.labels("hit" if usage.prompt_tokens_details.cached_tokens else "miss").inc()
        self.cost(
            path,
            passes=pcd.forward_passes,
            input_tokens=usage.prompt_tokens if usage is not None else 0,
            output_tokens=usage.completion_tokens if usage is not None else 0,
            queue_ms=pcd.queue_ms,
        )
        for name, field in (pcd.fields or {}).items():
            self._field(name, field)
        if pcd.tool_choice is not None and "candidate_mass" in pcd.tool_choice:
            self.decision("tool_choice", "", pcd.tool_choice["candidate_mass"], pcd.tool_choice.get("confidence"))

    def _field(self, name: str, field: Mapping[str, Any]) -> None:
        if "candidate_mass" in field:  # a decided field; a generated one carries no distribution
            self.decision("field", self.field_name(name), field["candidate_mass"], field.get("confidence"))
