"""The MCP server over streamable HTTP: the SDK's app at ``/mcp`` behind ``pcd serve``'s guards and
operations (bearer key, body bounds, request ids, ``/livez``, ``/readyz``, ``/metrics``, backpressure,
tracing).

``build_server`` (``mcp_server/server.py``) records each server's loader in ``SERVED``, so that
``http_app`` can report its readiness and hand its tools the metrics they count into; stdio needs
none of this. ``tests/test_mcp_protocols.py`` runs it on a loopback socket with the real ``mcp``
client; ``tests/test_hardening_servers.py`` checks its key and body bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from mcp_server.loading import EngineLoader
from pcd_core import DEFAULT_LIMITS, Limits
from pcd_integrations.serving.guards import BearerAuth, BodyLimit, warn_if_exposed
from pcd_integrations.serving.operations import Backpressure, Operations, build_metrics
from pcd_integrations.serving.read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

    from pcd_integrations.serving.metrics import Metrics
    from pcd_integrations.serving.operations import Tracer

__all__ = ["MCP_PATH", "SERVED", "Served", "http_app"]


#: where the streamable-HTTP transport answers; the one path its metrics count
MCP_PATH = "/mcp"


@dataclass
class Served:
    """What ``http_app`` reads of a server that ``build_server`` built: its loader (``/readyz``), and
    the metrics its tools report to once it is served over HTTP (None on stdio).
    """

    loader: EngineLoader
    metrics: Metrics | None = None
    sessions: dict[str, Any] = field(default_factory=dict)  # the session tools' open sessions, by id


SERVED: WeakKeyDictionary[MCPServer, Served] = WeakKeyDictionary()


def http_app(
    server: MCPServer,
    host: str,
    api_key: str | None,
    limits: Limits = DEFAULT_LIMITS,
    *,
    stateless: bool = False,
    json_response: bool = False,
    read_timeouts: ReadTimeouts = DEFAULT_READ_TIMEOUTS,
    backpressure: Backpressure | None = None,
    tracer: Tracer | None = None,
) -> Any:
    """The streamable-HTTP ASGI app at /mcp, behind the body-size and body-time bounds and, with a key,
    the bearer check; in front of them request ids, ``/livez``, ``/readyz`` and ``/metrics``
    (``pcd_integrations/serving/operations.py``), which need no key, as ``pcd serve``'s health routes need none,
    and ``backpressure`` and ``tracer`` for every ``POST /mcp``, as for ``pcd serve``'s model routes.
    A request over ``backpressure.timeout_s`` gets 504 only while its response has not started: an
    SSE response (without ``json_response``) has started once the SDK sends its first event. A
    2026-07-28 request for anything but ``tools/call`` neither queues nor counts against the cap.
    """
    app: Any = server.streamable_http_app(
        max_request_body_size=limits.max_body_bytes,
        host=host,
        stateless_http=stateless,
        json_response=json_response,
    )
    if api_key:
        app = BearerAuth(app, api_key)
    warn_if_exposed(logging.getLogger(__name__), "pcd-mcp", host, api_key)
    app = BodyLimit(app, limits, body_timeout_s=read_timeouts.body_s)
    served = SERVED.get(server)
    if served is None:  # a server built elsewhere: no loader to report on
        return app
    served.metrics = build_metrics(served.loader, frozenset({MCP_PATH}))
    return Operations(
        app,
        served.loader,
        frozenset({MCP_PATH}),
        backpressure=backpressure or Backpressure(),
        metrics=served.metrics,
        tracer=tracer,
        light=_names_another_method,
    )


def _names_another_method(scope: Any) -> bool:
    """A 2026-07-28 request names its method in the ``Mcp-Method`` header (the SDK refuses one whose
    body disagrees): anything but ``tools/call`` never waits for the model, so it never queues. An
    earlier version's request carries no such header and counts as model work.
    """
    method = dict(scope.get("headers") or ()).get(b"mcp-method")
    return method is not None and method != b"tools/call"
