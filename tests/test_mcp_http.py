"""``pcd-mcp --stateless --json-response`` over real streamable HTTP on loopback.

The console script runs as a subprocess on a free port. Raw HTTP shows what the two flags change on the
wire: no session id, and each answer one ``application/json`` body instead of an SSE stream. The SDK's
own client then calls tools and gets the engine's answers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client

from mcp_server.__main__ import parse_args
from pcd_core import Engine, __version__

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240  # two shared cores; the model itself loads in the background after the port opens
STATE = "My order arrived broken and I want a refund now."
QUESTION = "Does the customer ask for their money back?"
JSON_RPC = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running ``pcd-mcp --stateless --json-response``; stopped when the module's tests are done."""
    script = shutil.which("pcd-mcp", path=str(Path(sys.executable).parent))
    assert script, "the pcd-mcp console script is installed beside the interpreter"
    port = free_port()
    argv = [script, "--transport", "streamable-http", "--port", str(port), "--stateless", "--json-response"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PCD_MCP_")}  # the flags alone decide
    log = tmp_path_factory.mktemp("pcd-mcp") / "stderr.log"  # a file, not a pipe that could fill and block
    with log.open("w") as stderr:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"pcd-mcp exited: {log.read_text()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "pcd-mcp never listened"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=30)


def post(url: str, message: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url, json={"jsonrpc": "2.0", **message}, headers={**JSON_RPC, **headers}, timeout=600)


def initialize(url: str) -> httpx.Response:
    params = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}
    return post(url, {"id": 1, "method": "initialize", "params": params})


def test_initialize_is_one_json_body_without_a_session(url):
    response = initialize(url)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert "mcp-session-id" not in response.headers
    result = response.json()["result"]
    assert result["serverInfo"]["name"] == "pcd" and result["serverInfo"]["version"] == __version__


def test_a_tool_call_needs_no_session_and_answers_in_json(url, engine: Engine):
    version = initialize(url).json()["result"]["protocolVersion"]
    call = {"name": "noul", "arguments": {"state": STATE, "question": QUESTION}}
    response = post(url, {"id": 2, "method": "tools/call", "params": call}, **{"mcp-protocol-version": version})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    content = response.json()["result"]["structuredContent"]
    expected = engine.decide(STATE, {"q": {"type": "noul", "instructions": QUESTION}}).answers["q"]
    assert content["noul"] == pytest.approx(expected.noul, abs=1e-5)
    assert content["candidate_mass"] == pytest.approx(expected.candidate_mass, abs=1e-5)


@pytest.mark.asyncio
async def test_the_sdk_client_calls_tools_on_the_stateless_server(url, engine: Engine):
    schema = {"type": "object", "properties": {"wants_refund": {"type": "boolean"}}}
    async with Client(url) as client:
        assert {tool.name for tool in (await client.list_tools()).tools} >= {"noul", "fill"}
        result = await client.call_tool("fill", {"state": STATE, "schema": schema})
        bad = await client.call_tool("choice", {"state": STATE, "question": "Which?", "options": {"a": None}})
    assert not result.is_error, result.content
    expected = engine.fill(schema, STATE).fields["wants_refund"]
    field = result.structured_content["fields"]["wants_refund"]
    assert field["value"] == expected.value
    assert field["probability"] == pytest.approx(expected.probability, abs=1e-5)
    assert bad.is_error and "options" in str(bad.content)


@pytest.mark.parametrize("flag", ["--stateless", "--json-response"])
def test_the_http_flags_are_refused_on_stdio(flag, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args([flag])
    assert caught.value.code == 2
    assert "apply to --transport streamable-http only" in capsys.readouterr().err


def test_the_http_flags_read_the_environment(monkeypatch):
    monkeypatch.setenv("PCD_MCP_STATELESS", "1")
    monkeypatch.setenv("PCD_MCP_JSON_RESPONSE", "no")
    args = parse_args(["--transport", "streamable-http"])
    assert (args.stateless, args.json_response) == (True, False)
