"""``pcd-mcp`` over streamable HTTP at MCP 2026-07-28 and at 2025-11-25, and its operator flags.

The server is ``mcp_server.http_transport.http_app`` on a loopback socket (its lifespan run, which the SDK's
session manager needs), in front of it the same ``Operations`` middleware as ``pcd serve``. Raw HTTP
shows the 2026-07-28 wire: ``server/discover`` and ``tools/call`` as single stateless POSTs whose
``MCP-Protocol-Version``, ``Mcp-Method`` and ``Mcp-Name`` headers must match the body. The SDK's own
client then calls every tool at the newest version and, after an ``initialize`` handshake, at
2025-11-25; each result's ``structuredContent`` validates against the tool's ``outputSchema`` and
equals the engine's answer (``test_mcp_server.check_result``). ``--max-queue``, ``--timeout`` and
``--otel`` are driven with a busy model and the OpenTelemetry SDK's in-memory exporter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the MCP server needs the 'mcp' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")
jsonschema = pytest.importorskip("jsonschema", reason="the MCP tests validate results with jsonschema")

from loopback import serving  # noqa: E402
from mcp import Client  # noqa: E402
from mcp_types import CLIENT_CAPABILITIES_META_KEY, HEADER_MISMATCH, PROTOCOL_VERSION_META_KEY  # noqa: E402
from mcp_types.version import LATEST_HANDSHAKE_VERSION, LATEST_PROTOCOL_VERSION  # noqa: E402
from test_mcp_server import CALLS, NOUL_ARGS, TOOLS, check_properties, check_result, output_schemas  # noqa: E402

from mcp_server.__main__ import parse_args  # noqa: E402
from mcp_server.http_transport import http_app  # noqa: E402
from mcp_server.server import build_server  # noqa: E402
from mcp_server.sessions import SESSION_TOOLS  # noqa: E402
from pcd_core import Engine  # noqa: E402
from pcd_integrations.serving.operations import Backpressure  # noqa: E402

NEWEST, PREVIOUS = "2026-07-28", "2025-11-25"


def test_the_sdk_speaks_the_versions_this_module_tests() -> None:
    assert (LATEST_PROTOCOL_VERSION, LATEST_HANDSHAKE_VERSION) == (NEWEST, PREVIOUS)


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(http_app(build_server(engine), "127.0.0.1", None), lifespan="on") as base:
        yield f"{base}/mcp"


def envelope(method: str, params: dict[str, Any] | None = None, request_id: int = 1) -> dict[str, Any]:
    """A 2026-07-28 request: the protocol version and client capabilities travel in every request."""
    meta = {PROTOCOL_VERSION_META_KEY: NEWEST, CLIENT_CAPABILITIES_META_KEY: {}}
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**(params or {}), "_meta": meta}}


def modern_headers(method: str, name: str | None = None) -> dict[str, str]:
    headers = {
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "mcp-protocol-version": NEWEST,
        "mcp-method": method,
    }
    return {**headers, "mcp-name": name} if name is not None else headers


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=600)


def test_server_discover_is_one_stateless_post(url: str) -> None:
    response = post(url, envelope("server/discover"), modern_headers("server/discover"))
    assert response.status_code == 200 and "mcp-session-id" not in response.headers
    result = response.json()["result"]
    assert NEWEST in result["supportedVersions"] and "tools" in result["capabilities"]


@pytest.mark.parametrize(
    ("version", "headers"),
    [
        (PREVIOUS, {}),  # the header says 2026-07-28, the envelope another version
        (NEWEST, {"mcp-method": "tools/list"}),  # disagrees with the body's method
        (NEWEST, {"mcp-name": "score"}),  # names another tool than the call
    ],
)
def test_the_required_headers_must_match_the_request(url: str, version: str, headers: dict[str, str]) -> None:
    body = envelope("tools/call", {"name": "noul", "arguments": NOUL_ARGS})
    body["params"]["_meta"][PROTOCOL_VERSION_META_KEY] = version
    response = post(url, body, {**modern_headers("tools/call", "noul"), **headers})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == HEADER_MISMATCH


def test_a_stateless_tool_call_needs_no_handshake_and_matches_its_output_schema(url: str, engine: Engine) -> None:
    listed = post(url, envelope("tools/list"), modern_headers("tools/list")).json()["result"]["tools"]
    schemas = {tool["name"]: tool["outputSchema"] for tool in listed}
    assert set(schemas) == TOOLS | SESSION_TOOLS
    for request_id, name in enumerate(sorted(TOOLS), start=2):
        body = envelope("tools/call", {"name": name, "arguments": CALLS[name]}, request_id)
        result = post(url, body, modern_headers("tools/call", name)).json()["result"]
        assert not result.get("isError"), result
        jsonschema.validate(result["structuredContent"], schemas[name])


@pytest.mark.asyncio
@pytest.mark.parametrize(("mode", "version"), [(NEWEST, NEWEST), ("legacy", PREVIOUS)])
async def test_the_sdk_client_gets_every_tool_at_both_versions(
    url: str, engine: Engine, mode: str, version: str
) -> None:
    async with Client(url, mode=mode) as client:
        assert client.protocol_version == version
        schemas = await output_schemas(client)
        results = {name: await client.call_tool(name, CALLS[name]) for name in sorted(TOOLS)}
    for name, result in results.items():
        check_properties(name, check_result(name, result, schemas[name], engine))


# -- the operator flags ---------------------------------------------------------------------------
def call_noul(url: str, request_id: int = 1) -> httpx.Response:
    body = envelope("tools/call", {"name": "noul", "arguments": NOUL_ARGS}, request_id)
    return post(url, body, modern_headers("tools/call", "noul"))


def _wait_for(condition: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_a_burst_past_max_queue_gets_503_with_retry_after(engine: Engine) -> None:
    app = http_app(build_server(engine), "127.0.0.1", None, backpressure=Backpressure(max_queue=0))
    with serving(app, lifespan="on") as base:
        answered: list[httpx.Response] = []
        with engine.model.lock:  # the model is busy: the first call waits for it and fills the queue
            first = threading.Thread(target=lambda: answered.append(call_noul(f"{base}/mcp")))
            first.start()
            _wait_for(lambda: engine.waiting == 1, "the first call waits for the model", 60.0)
            refused = call_noul(f"{base}/mcp", 2)
            ready = httpx.get(f"{base}/readyz", timeout=10)
            # what never reaches the model is answered at once, past the full queue
            listed = post(f"{base}/mcp", envelope("tools/list", request_id=3), modern_headers("tools/list"))
            discovered = post(
                f"{base}/mcp", envelope("server/discover", request_id=4), modern_headers("server/discover")
            )
        first.join(timeout=120)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max-queue" in refused.text and ready.status_code == 503
    assert listed.status_code == discovered.status_code == 200 and len(listed.json()["result"]["tools"]) == len(
        TOOLS | SESSION_TOOLS
    )
    assert answered[0].status_code == 200 and "structuredContent" in answered[0].json()["result"]


def test_a_call_past_its_timeout_gets_504_and_leaves_the_queue(engine: Engine) -> None:
    bounded = http_app(
        build_server(engine), "127.0.0.1", None, json_response=True, backpressure=Backpressure(timeout_s=0.5)
    )
    unbounded = http_app(build_server(engine), "127.0.0.1", None, json_response=True)
    with serving(bounded, lifespan="on") as base, serving(unbounded, lifespan="on") as other:
        with engine.model.lock:
            started = time.monotonic()
            late = call_noul(f"{base}/mcp")
            waited_s = time.monotonic() - started
            _wait_for(lambda: engine.waiting == 0, "the dropped call leaves the queue", 10.0)
            passes_before = engine.backend.counter.forward_passes
        after = call_noul(f"{other}/mcp", 2)  # on the same engine, behind the dropped call if it still waited
        passes = engine.backend.counter.forward_passes - passes_before
    assert late.status_code == 504 and late.headers["retry-after"] == "1" and waited_s < 30
    assert after.status_code == 200 and "structuredContent" in after.json()["result"]
    assert passes == after.json()["result"]["structuredContent"]["usage"]["forward_passes"]  # none for the dropped


def test_a_span_per_call_and_per_pass_continues_the_callers_trace(engine: Engine, traced: Any) -> None:
    tracer, exporter = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    app = http_app(build_server(engine), "127.0.0.1", None, tracer=tracer)
    arguments = {**NOUL_ARGS, "state": NOUL_ARGS["state"] + " (traced)"}  # not in the head cache: 2 passes
    with serving(app, lifespan="on") as base:
        body = envelope("tools/call", {"name": "noul", "arguments": arguments})
        headers = {**modern_headers("tools/call", "noul"), "traceparent": f"00-{trace_id}-{parent_id}-01"}
        result = post(f"{base}/mcp", body, headers).json()["result"]
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name == "POST /mcp"]
    passes = [s for s in spans if s.name == "pcd.pass"]
    usage = result["structuredContent"]["usage"]
    assert format(request.context.trace_id, "032x") == trace_id
    assert request.parent is not None and format(request.parent.span_id, "016x") == parent_id
    assert request.attributes["pcd.forward_passes"] == usage["forward_passes"] == len(passes) > 0
    assert all(p.parent.span_id == request.context.span_id for p in passes)


def test_the_operator_flags_are_read_and_refused_on_stdio(monkeypatch: Any, capsys: Any) -> None:
    args = parse_args(["--transport", "streamable-http", "--max-queue", "0", "--timeout", "2.5", "--otel"])
    assert (args.max_queue, args.timeout, args.otel) == (0, 2.5, True)
    monkeypatch.setenv("PCD_MCP_MAX_QUEUE", "3")
    monkeypatch.setenv("PCD_MCP_TIMEOUT", "4")
    args = parse_args(["--transport", "streamable-http"])
    assert (args.max_queue, args.timeout, args.otel) == (3, 4.0, False)
    for argv in (["--max-queue", "-1"], ["--timeout", "0"], ["--transport", "stdio", "--otel"]):
        with pytest.raises(SystemExit) as caught:
            parse_args(["--transport", "streamable-http", *argv])
        assert caught.value.code == 2
    assert "apply to --transport streamable-http only" in capsys.readouterr().err


def test_main_hands_the_bounds_and_tracing_to_serve(monkeypatch: Any) -> None:
    import mcp_server.__main__ as cli
    import mcp_server.server

    given: dict[str, Any] = {}
    monkeypatch.setattr(mcp_server.server, "serve", lambda load, **options: given.update(options))
    cli.main(["--transport", "streamable-http", "--max-queue", "2", "--timeout", "3", "--otel"])
    assert given["backpressure"] == Backpressure(max_queue=2, timeout_s=3.0) and given["tracing"] is True
