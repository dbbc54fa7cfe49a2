"""Hostile input on the servers: what a hostile but fair client sends gets a 4xx in the protocol's shape.

HTTP runs in process through httpx's ASGI transport (middleware included); MCP through the SDK's
in-process client and, for the bearer key, over real streamable HTTP on loopback. The error paths
need no model, so they run on the oracle engine (``pcd_core/testing.py``).
"""

import contextlib
import json
import logging
import socket
import time

import anyio
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
mcp = pytest.importorskip("mcp")

from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared._httpx_utils import create_mcp_http_client  # noqa: E402

from mcp_server import build_server  # noqa: E402
from mcp_server.http_transport import http_app  # noqa: E402
from pcd_core.request.limits import Limits  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.serving.guards import is_loopback, warn_if_exposed  # noqa: E402
from pcd_integrations.serving.loopback import serving  # noqa: E402
from pcd_integrations.serving.read_timeouts import ReadTimeouts, http_protocol  # noqa: E402

NOUL = {"type": "noul", "instructions": "Is it broken?"}


def post(app, body: bytes | str, **headers: str):
    """POST raw bytes, so that a body may hold what json.dumps would never write (NaN, lone surrogates)."""

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            content = body.encode() if isinstance(body, str) else body
            return await client.post(
                "/v1/systemone", content=content, headers={"content-type": "application/json", **headers}
            )

    return anyio.run(go)


def assert_detail_422(response, *loc_part):
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    assert all({"loc", "msg", "type"} <= set(item) for item in detail)
    assert any(all(part in item["loc"] for part in loc_part) for item in detail), detail
    return detail


# -- invalid Unicode, NaN, bounds: 422 in the detail[] shape, never a 5xx or plain text ------------
@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ('{"state": "abc \\ud800 def", "questions": {"q": {"type": "noul", "instructions": "x?"}}}', ("state",)),
        ('{"state": "abc", "questions": {"q": {"type": "noul", "instructions": "x\\ud800?"}}}', ("q", "instructions")),
        (
            '{"state": "abc", "questions": {"q": {"type": "choice", "instructions": "x", '
            '"criteria": {"a\\ud800": null, "b": null}}}}',
            ("q", "criteria"),
        ),
        (
            # the strict body reader refuses the key before the models see it: the questions are named
            '{"state": "abc", "questions": {"\\ud800": {"type": "noul", "instructions": "x?"}}}',
            ("questions",),
        ),
        # pydantic itself writes the surrogate of a key it rejects as U+FFFD; what matters is the 422
        ('{"state": "abc", "questions": {"\\ud800": {"type": "essay"}}}', ("questions",)),
        ('{"state": {"a": NaN}, "questions": {"q": {"type": "noul", "instructions": "x?"}}}', ("state", "a")),
        ('{"state": [1, Infinity], "questions": {"q": {"type": "noul", "instructions": "x?"}}}', ("state", 1)),
        ('{"state": 5, "questions": {"q": {"type": "noul", "instructions": "x?"}}}', ("state",)),
    ],
)
def test_bad_text_and_numbers_get_422_in_the_detail_shape(oracle, body, loc):
    assert_detail_422(post(create_app(oracle), body), *loc)


def test_too_many_questions_get_422_naming_the_limit(oracle):
    questions = {f"q{i}": NOUL for i in range(2000)}
    detail = assert_detail_422(post(create_app(oracle), json.dumps({"state": "s", "questions": questions})))
    assert "max_questions" in detail[0]["msg"] and "400" in detail[0]["msg"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_bound_gets_413_in_the_error_shape(oracle, chunked):
    app = create_app(oracle, limits=Limits(max_body_bytes=2000))
    body = json.dumps({"state": "x" * 5000, "questions": {"q": NOUL}}).encode()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def stream():
                for start in range(0, len(body), 1000):
                    yield body[start : start + 1000]

            return await client.post("/v1/systemone", content=stream() if chunked else body)

    response = anyio.run(go)
    assert response.status_code == 413
    assert response.json()["detail"]["error_type"] == "payload_too_large"
    assert "max_body_bytes" in response.json()["detail"]["message"]
    assert post(app, json.dumps({"state": "small", "questions": {"q": NOUL}})).status_code == 200


# -- MCP: tool errors carry the message -----------------------------------------------------------
@pytest.mark.parametrize(
    ("tool", "arguments", "words"),
    [
        ("decide", {"state": "s", "questions": {f"q{i}": NOUL for i in range(2000)}}, "max_questions"),
        ("noul", {"state": "abc \ud800", "question": "x?"}, "invalid Unicode"),
        # the SDK's client cannot send a surrogate in a key, so the values carry them here
        ("score", {"state": "s", "question": "how?", "levels": ["low", "hi\ud800"]}, "invalid Unicode"),
        ("fill", {"state": "text", "schema": {"a": {"type": "boolean", "depends_on": 5}}}, "depends_on"),
        (
            "fill",
            {"state": "a\ud800", "schema": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}},
            "invalid Unicode",
        ),
    ],
)
async def test_mcp_tool_errors_carry_the_real_message(oracle, tool, arguments, words):
    async with Client(build_server(oracle), raise_exceptions=True) as client:
        result = await client.call_tool(tool, arguments)
        assert result.is_error and words in result.content[0].text, result.content
        assert not (await client.call_tool("noul", {"state": "fine", "question": "ok?"})).is_error


# -- bearer key on MCP over HTTP, and the loud warning ---------------------------------------------
async def test_mcp_over_http_requires_the_bearer_key(oracle):
    app = http_app(build_server(oracle), "127.0.0.1", "s3cret")
    with serving(app, lifespan="on") as url:
        async with httpx.AsyncClient() as plain:
            refused = await plain.post(f"{url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert refused.status_code == 401 and refused.json()["detail"]["error_type"] == "unauthorized"
        keyed = create_mcp_http_client(headers={"Authorization": "Bearer s3cret"})
        async with Client(streamable_http_client(f"{url}/mcp", http_client=keyed)) as client:
            result = await client.call_tool("noul", {"state": "fine", "question": "ok?"})
            assert not result.is_error


async def test_mcp_over_http_refuses_a_body_over_the_bound(oracle):
    app = http_app(build_server(oracle), "127.0.0.1", None, Limits(max_body_bytes=500))
    with serving(app, lifespan="on") as url:
        async with httpx.AsyncClient() as plain:
            response = await plain.post(f"{url}/mcp", content=b"{" + b" " * 1000 + b"}")
    assert response.status_code == 413 and response.json()["detail"]["error_type"] == "payload_too_large"


def test_both_servers_warn_when_exposed_without_a_key(oracle, caplog, monkeypatch):
    import uvicorn

    from mcp_server.server import serve as serve_mcp
    from pcd_integrations.http import serve as serve_http

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    with caplog.at_level(logging.WARNING):
        serve_http(oracle, host="0.0.0.0")
        serve_mcp(oracle, transport="streamable-http", host="0.0.0.0")
        serve_http(oracle, host="127.0.0.1")
        serve_http(oracle, host="0.0.0.0", api_key="k")
    loud = [r.getMessage() for r in caplog.records if "WITHOUT an API key" in r.getMessage()]
    assert len(loud) == 2 and "pcd serve" in loud[0] and "pcd-mcp" in loud[1]
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.0.0.1")
    assert not warn_if_exposed(logging.getLogger("t"), "x", "127.0.0.1", None)


def test_pcd_mcp_reads_the_key_from_the_named_variable(monkeypatch, capsys):
    from mcp_server.__main__ import parse_args

    monkeypatch.setenv("MY_KEY", "abc")
    args = parse_args(["--transport", "streamable-http", "--api-key-env", "MY_KEY"])
    assert args.api_key == "abc"
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--transport", "streamable-http", "--api-key-env", "MY_KEY"])
    assert exited.value.code == 2 and "unset or empty" in capsys.readouterr().err


# -- slow clients: header and body read timeouts --------------------------------------------------
QUICK = ReadTimeouts(header_s=0.5, body_s=0.5)
DRIP_INTERVAL_S = 0.05  # a byte every 50 ms: a slow client that never stops sending
DRIP_LIMIT_S = 5.0  # what a drip may take before the test calls the server's patience unbounded


def drip(url: str, head: bytes, trickle: bytes) -> tuple[bytes, float]:
    """Send ``head`` at once, then ``trickle`` a byte at a time, until the server ends the connection;
    returns what it sent back and the seconds until it ended (bounded by ``DRIP_LIMIT_S``). A client
    that keeps sending to a closed socket may get a reset instead of the last bytes, so what comes
    back is the 408 or nothing.
    """
    host, port = url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=DRIP_LIMIT_S) as sock:
        sock.settimeout(DRIP_INTERVAL_S)
        started = time.monotonic()
        sock.sendall(head)
        with contextlib.suppress(OSError):  # a reset: the server has closed the connection
            for byte in trickle:
                if time.monotonic() - started > DRIP_LIMIT_S:
                    break
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    sock.sendall(bytes([byte]))
                    continue
                received += chunk
                if not chunk:
                    break
        return received, time.monotonic() - started


def stall(url: str, head: bytes) -> bytes:
    """Send ``head`` (part of a request) and wait, sending nothing more, for the server's answer."""
    host, port = url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=DRIP_LIMIT_S) as sock:
        sock.sendall(head)
        while chunk := sock.recv(65536):
            received += chunk
    return received


def slow_headers(path: str) -> tuple[bytes, bytes]:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode(), b"X-Slow: " + b"a" * 1000


def slow_body(path: str) -> tuple[bytes, bytes]:
    body = json.dumps({"state": "x" * 500, "questions": {"q": NOUL}}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode(), body


def response_body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def assert_slow_clients_are_cut_off(url: str, path: str) -> dict:
    """Headers and a body dripped a byte at a time end within a few seconds; stalled ones get a 408.
    Returns the body of the stalled body's 408.
    """
    for head, trickle in (slow_headers(path), slow_body(path)):
        raw, took = drip(url, head, trickle)
        assert took < 3.0 and (raw == b"" or raw.startswith(b"HTTP/1.1 408")), (raw, took)
    head, body = slow_headers(path)
    raw = stall(url, head)
    assert raw.startswith(b"HTTP/1.1 408") and b"--header-timeout" in raw, raw
    assert response_body(raw)["detail"]["error_type"] == "request_timeout"
    head, body = slow_body(path)
    raw = stall(url, head + body[:10])
    assert raw.startswith(b"HTTP/1.1 408") and b"--body-timeout" in raw, raw
    return response_body(raw)


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/chat/completions"])
def test_pcd_serve_cuts_off_headers_and_bodies_sent_a_byte_at_a_time(oracle, path):
    app = create_app(oracle, read_timeouts=QUICK)
    with serving(app, lifespan="on", http=http_protocol(QUICK.header_s)) as url:
        error = assert_slow_clients_are_cut_off(url, path)
        shaped = error["error"]["code"] if path == "/v1/chat/completions" else error["detail"]["error_type"]
        assert shaped == "request_timeout"
        body = {"state": "fine", "questions": {"q": NOUL}}
        assert httpx.post(f"{url}/v1/systemone", json=body).status_code == 200  # a prompt client is served


async def test_pcd_mcp_cuts_off_headers_and_bodies_sent_a_byte_at_a_time(oracle):
    app = http_app(build_server(oracle), "127.0.0.1", None, read_timeouts=QUICK)
    with serving(app, lifespan="on", http=http_protocol(QUICK.header_s)) as url:
        error = await anyio.to_thread.run_sync(assert_slow_clients_are_cut_off, url, "/mcp")
        assert error["detail"]["error_type"] == "request_timeout"
        async with Client(streamable_http_client(f"{url}/mcp")) as client:
            assert not (await client.call_tool("noul", {"state": "fine", "question": "ok?"})).is_error


def test_both_servers_run_uvicorn_with_the_timeouts_and_document_the_flags(oracle, monkeypatch, capsys):
    import uvicorn

    from mcp_server.__main__ import build_parser
    from mcp_server.server import serve as serve_mcp
    from pcd_integrations.commands.main import build_parser as build_pcd_parser
    from pcd_integrations.http import serve as serve_http

    runs: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: runs.append(kwargs))
    serve_http(oracle, read_timeouts=ReadTimeouts(header_s=3.0, body_s=4.0))
    serve_mcp(oracle, transport="streamable-http", read_timeouts=ReadTimeouts(header_s=3.0, body_s=4.0))
    for run in runs:
        assert run["http"].__name__ == "HeaderTimeoutProtocol", run
    mcp_help = build_parser().format_help()
    for flag in ("--header-timeout", "--body-timeout"):
        assert flag in mcp_help
    with pytest.raises(SystemExit):
        build_pcd_parser().parse_args(["serve", "--help"])
    serve_help = " ".join(capsys.readouterr().out.split())
    for words in ("--host HOST address to listen on", "--port PORT TCP port", "--header-timeout S", "--body-timeout S"):
        assert words in serve_help, serve_help
