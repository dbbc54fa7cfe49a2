"""The MCP server on the real embedded model: in process, over real stdio, and over streamable HTTP.

Every tool's structured result must validate against the output schema it publishes and carry the
same numbers as `engine.decide` / `engine.fill` on the same input. Bad arguments must come back as
tool errors that say what is wrong, and the server must keep answering afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from mcp import Client, StdioServerParameters

from mcp_server import build_server
from mcp_server.__main__ import parse_args
from mcp_server.results import NO_AT, YES_AT
from mcp_server.sessions import SESSION_TOOLS
from pcd_core import ChoiceQuestion, Engine, NoulQuestion, ScoreQuestion

REPO = Path(__file__).resolve().parents[1]
TOOLS = {"noul", "choice", "score", "decide", "fill"}
SUBPROCESS_TIMEOUT_S = 240  # a cold start converts the weights; two cores are shared

STATE = "Order #1182 arrived with a cracked screen. I want my money back today or I am calling my bank."
NOUL_ARGS = {"state": STATE, "question": "Is the customer angry?"}
CHOICE_OPTIONS = {"refund": "The customer wants their money back", "shipping": None, "praise": None}
CHOICE_ARGS = {"state": STATE, "question": "What is the message about?", "options": CHOICE_OPTIONS}
SCORE_LEVELS = ["not urgent", "somewhat urgent", "very urgent"]
SCORE_ARGS = {"state": STATE, "question": "How urgent is this?", "levels": SCORE_LEVELS}
QUESTIONS = {
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "topic": {"type": "choice", "instructions": "What is the message about?", "criteria": CHOICE_OPTIONS},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": SCORE_LEVELS},
}
DECIDE_ARGS = {"state": STATE, "questions": QUESTIONS}
FILL_SCHEMA = {
    "type": "object",
    "properties": {
        "wants_refund": {"type": "boolean"},
        "product": {"enum": ["phone", "laptop", "headphones"]},
    },
    "required": ["wants_refund", "product"],
}
FILL_ARGS = {"state": STATE, "schema": FILL_SCHEMA}
CALLS = {"noul": NOUL_ARGS, "choice": CHOICE_ARGS, "score": SCORE_ARGS, "decide": DECIDE_ARGS, "fill": FILL_ARGS}


@pytest.fixture(scope="module")
def server(engine: Engine):
    return build_server(engine)


def close(value: float) -> Any:
    return pytest.approx(value, rel=1e-5, abs=1e-6)


_EXPECTED: dict[str, dict[str, Any]] = {}


def expected(engine: Engine, name: str) -> dict[str, Any]:
    """What each tool must return, from the engine directly; computed once, the engine is deterministic."""
    if name not in _EXPECTED:
        _EXPECTED[name] = _expected(engine, name)
    return _EXPECTED[name]


def _expected(engine: Engine, name: str) -> dict[str, Any]:
    if name == "fill":
        ex = engine.fill(FILL_SCHEMA, STATE)
        return {
            "value": ex.value,
            "fields": {
                n: {"value": f.value, "probability": f.probability, "candidate_mass": f.candidate_mass}
                for n, f in ex.fields.items()
            },
        }
    if name == "decide":
        return {"answers": engine.decide(STATE, QUESTIONS).to_wire()["answers"]}
    question = {
        "noul": NoulQuestion(instructions=NOUL_ARGS["question"]),
        "choice": ChoiceQuestion(instructions=CHOICE_ARGS["question"], criteria=CHOICE_OPTIONS),
        "score": ScoreQuestion(instructions=SCORE_ARGS["question"], criteria=SCORE_LEVELS),
    }[name]
    answer = engine.decide(STATE, {"q": question}).answers["q"]
    return answer.model_dump(exclude={"type", "logits"}, by_alias=False)  # field names, as the tools use them


def assert_matches(got: Any, want: Any) -> None:
    """Equal, with floats compared to float precision (batched and single passes round differently)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(want) <= set(got), (got, want)
        for key, value in want.items():
            assert_matches(got[key], value)
    elif isinstance(want, float):
        assert got == close(want)
    else:
        assert got == want


async def output_schemas(client: Client) -> dict[str, dict[str, Any]]:
    return {tool.name: tool.output_schema for tool in (await client.list_tools()).tools}


def check_result(name: str, result: Any, schema: dict[str, Any], engine: Engine) -> dict[str, Any]:
    assert not result.is_error, result.content
    content = result.structured_content
    jsonschema.validate(content, schema)
    assert content["model"] == engine.model_name
    assert content["usage"]["output_tokens"] == 0
    assert content["usage"]["input_tokens"] > 0 and content["usage"]["forward_passes"] > 0
    assert_matches(content, expected(engine, name))
    return content


@pytest.mark.asyncio
async def test_tools_are_typed_read_only_and_closed_world(server) -> None:
    async with Client(server, raise_exceptions=True) as client:
        tools = (await client.list_tools()).tools
    assert {tool.name for tool in tools} == TOOLS | SESSION_TOOLS  # the session tools: test_mcp_sessions.py
    for tool in (tool for tool in tools if tool.name in TOOLS):
        assert tool.annotations.read_only_hint is True and tool.annotations.open_world_hint is False
        assert tool.output_schema["type"] == "object" and "usage" in tool.output_schema["properties"]
        assert len(tool.description) > 80, tool.name


def check_properties(name: str, content: dict[str, Any]) -> None:
    """What each tool adds on top of the engine's answer."""
    if name == "noul":
        noul = content["noul"]
        assert content["verdict"] == ("yes" if noul >= YES_AT else "no" if noul <= NO_AT else "uncertain")
    elif name == "choice":
        ranked = sorted(content["probabilities"], key=content["probabilities"].get, reverse=True)
        assert [content["choice"], content["runner_up"]] == ranked[:2]
    elif name == "score":
        assert content["nearest_level"] == SCORE_LEVELS[round(content["score"])]
        assert content["legend"] == {str(i): level for i, level in enumerate(SCORE_LEVELS)}
    elif name == "decide":
        wire = _EXPECTED["decide"]["answers"]
        assert {qid: set(answer) for qid, answer in content["answers"].items()} == {
            qid: set(answer) for qid, answer in wire.items()
        }
    else:
        jsonschema.validate(content["value"], FILL_SCHEMA)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(TOOLS))
async def test_tool_result_validates_and_equals_the_engine(server, engine: Engine, name: str) -> None:
    async with Client(server, raise_exceptions=True) as client:
        schemas = await output_schemas(client)
        result = await client.call_tool(name, CALLS[name])
    check_properties(name, check_result(name, result, schemas[name], engine))


@pytest.mark.asyncio
async def test_concurrent_calls_give_the_sequential_answers(server, engine: Engine) -> None:
    results: dict[str, Any] = {}
    async with Client(server, raise_exceptions=True) as client:
        schemas = await output_schemas(client)

        async def call(name: str) -> None:
            results[name] = await client.call_tool(name, CALLS[name])

        async with anyio.create_task_group() as tg:
            for name in sorted(TOOLS):
                tg.start_soon(call, name)
    for name in TOOLS:
        check_result(name, results[name], schemas[name], engine)


@pytest.mark.asyncio
async def test_calls_behind_a_busy_model_report_their_wait(server, engine: Engine) -> None:
    """The test thread holds the model while two tool calls queue behind it; both say they waited."""
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with engine.model.lock:
            held.set()
            let_go.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    results: dict[str, Any] = {}
    try:
        async with Client(server, raise_exceptions=True) as client:

            async def call(name: str) -> None:
                results[name] = await client.call_tool(name, CALLS[name])

            async with anyio.create_task_group() as tg:
                for name in ("fill", "noul"):
                    tg.start_soon(call, name)
                with anyio.fail_after(60):
                    while engine.model.lock.waiting < 2:
                        await anyio.sleep(0.005)
                await anyio.sleep(0.2)
                let_go.set()
    finally:
        let_go.set()
        holder.join(60)
    for name in ("fill", "noul"):
        assert not results[name].is_error, results[name].content
        assert results[name].structured_content["usage"]["queue_ms"] >= 200.0, name


def _levels(n: int) -> list[str]:
    return [f"level {i}" for i in range(n)]


# case: (tool, arguments, a word the error message must contain)
BAD_CALLS = {
    "one_option": ("choice", {**CHOICE_ARGS, "options": {"refund": None}}, "options"),
    "too_many_options": ("choice", {**CHOICE_ARGS, "options": {f"option {i}": None for i in range(256)}}, "options"),
    "blank_option": ("choice", {**CHOICE_ARGS, "options": {" ": None, "refund": None}}, "blank"),
    "no_levels": ("score", {**SCORE_ARGS, "levels": []}, "levels"),
    "one_level": ("score", {**SCORE_ARGS, "levels": ["only"]}, "levels"),
    "too_many_levels": ("score", {**SCORE_ARGS, "levels": _levels(11)}, "levels"),
    "unknown_noul_criterion": ("noul", {**NOUL_ARGS, "criteria": {"maybe": "unsure"}}, "criteria"),
    "missing_question": ("noul", {"state": STATE}, "question"),
    "schema_not_an_object": ("fill", {**FILL_ARGS, "schema": ["wants_refund"]}, "schema"),
    "no_questions": ("decide", {"state": STATE, "questions": {}}, "questions"),
    "unknown_question_type": ("decide", {**DECIDE_ARGS, "questions": {"a": {"type": "essay"}}}, "essay"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
async def test_bad_arguments_are_tool_errors_that_say_why(server, case: str) -> None:
    name, arguments, word = BAD_CALLS[case]
    async with Client(server, raise_exceptions=True) as client:
        result = await client.call_tool(name, arguments)
    # A crash reads only "Error executing tool <name>"; a ToolError says what was wrong.
    assert result.is_error and word in result.content[0].text.split(f"tool {name}", 1)[1], result.content


@pytest.mark.asyncio
async def test_state_over_the_context_budget_is_rejected(server, engine: Engine) -> None:
    state = "The parcel was late again. " * engine.context_length
    async with Client(server, raise_exceptions=True) as client:
        for name in ("noul", "fill"):
            result = await client.call_tool(name, {**CALLS[name], "state": state})
            assert result.is_error and "context" in result.content[0].text, result.content
        assert not (await client.call_tool("noul", NOUL_ARGS)).is_error


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["auto", "legacy"])  # direct dispatch, and JSON-RPC after `initialize`
async def test_a_call_during_the_load_waits_and_reports_progress(engine: Engine, mode: str) -> None:
    release = threading.Event()

    def load() -> Engine:
        release.wait(60)
        return engine

    server = build_server(load)
    progress: list[tuple[float, str | None]] = []
    reported = anyio.Event()
    results: dict[str, Any] = {}

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))
        reported.set()

    async with Client(server, raise_exceptions=True, mode=mode) as client:
        schemas = await output_schemas(client)  # answered while the model is still loading
        bad = await client.call_tool(*BAD_CALLS["one_option"][:2])  # argument checks do not wait either
        assert bad.is_error

        async def call() -> None:
            results["noul"] = await client.call_tool("noul", NOUL_ARGS, progress_callback=on_progress)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            with anyio.fail_after(30):
                await reported.wait()
            assert "noul" not in results
            release.set()
    assert progress and "loading" in progress[0][1]
    check_result("noul", results["noul"], schemas["noul"], engine)


@pytest.mark.asyncio
async def test_a_failed_load_is_a_tool_error_not_a_crash() -> None:
    def load() -> Engine:
        raise OSError("weights not found at /nowhere")

    async with Client(build_server(load), raise_exceptions=True) as client:
        for _ in range(2):
            result = await client.call_tool("noul", NOUL_ARGS)
            assert result.is_error and "weights not found" in result.content[0].text
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS | SESSION_TOOLS


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--transport", "carrier-pigeon"], {}),
        (["--port", "0"], {}),
        (["--port", "70000"], {}),
        (["--backend", "tpu"], {}),
        (["--model", "/nowhere/model.gguf"], {}),
        (["--dtype", "float8"], {}),
        (["--backend", "vllm", "--base-url", "http://127.0.0.1:9", "--dtype", "bfloat16"], {}),
        (["--max-tokens-per-pass", "-5"], {}),
        ([], {"PCD_MCP_PORT": "eighty"}),
        ([], {"PCD_MCP_TRANSPORT": "sse"}),
        ([], {"PCD_LOG_LEVEL": "chatty"}),
    ],
)
def test_cli_rejects_bad_arguments_before_loading(monkeypatch, capsys, argv, env) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert "pcd-mcp: error:" in capsys.readouterr().err


def test_cli_reads_flags_and_environment(monkeypatch) -> None:
    monkeypatch.setenv("PCD_MAX_TOKENS_PER_PASS", "2048")
    monkeypatch.setenv("PCD_MCP_PORT", "9000")
    args = parse_args(["--transport", "streamable-http", "--port", "8999", "--device", "cpu"])
    assert (args.transport, args.port, args.device) == ("streamable-http", 8999, "cpu")
    assert args.max_tokens_per_pass == 2048


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PCD_MCP_", "PCD_LOG"))}
    env["HF_HUB_OFFLINE"] = "1"
    return env


async def call_tools(client: Client, engine: Engine, names: set[str]) -> None:
    schemas = await output_schemas(client)
    assert set(schemas) == TOOLS | SESSION_TOOLS
    for name in sorted(names):
        check_result(name, await client.call_tool(name, CALLS[name]), schemas[name], engine)
    assert (await client.call_tool(*BAD_CALLS["no_levels"][:2])).is_error


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stdio_subprocess_serves_every_tool(engine: Engine) -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], env=server_env(), cwd=REPO)
    with anyio.fail_after(SUBPROCESS_TIMEOUT_S):
        async with Client(params, mode="legacy") as client:  # the `initialize` handshake, as hosts do today
            await call_tools(client, engine, TOOLS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_streamable_http_serves_on_loopback(engine: Engine) -> None:
    port = free_port()
    command = [sys.executable, "-m", "mcp_server", "--transport", "streamable-http", "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while True:
            assert process.poll() is None, "the HTTP server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the HTTP server never listened"
                await anyio.sleep(0.2)
        with anyio.fail_after(SUBPROCESS_TIMEOUT_S):
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                await call_tools(client, engine, {"noul", "decide"})  # stdio covers every tool
    finally:
        process.terminate()
        process.wait(timeout=30)


OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 20},
        "wants_refund": {"type": "boolean"},
        "issues": {"type": "array", "items": {"enum": ["damaged", "late", "wrong_item"]}},
    },
    "required": ["customer", "wants_refund", "issues"],
}


@pytest.mark.asyncio
async def test_fill_accepts_open_fields_and_reports_them_as_generated(server, engine: Engine) -> None:
    """The fill tool takes what ``engine.fill`` takes: open fields come back
    generated (their text and token count), closed ones decided, each as the engine reported it.
    """
    async with Client(server, raise_exceptions=True) as client:
        schemas = await output_schemas(client)
        result = await client.call_tool("fill", {"state": STATE, "schema": OPEN_SCHEMA})
    assert not result.is_error, result.content
    content = result.structured_content
    jsonschema.validate(content, schemas["fill"])
    jsonschema.validate(content["value"], OPEN_SCHEMA)
    ex = engine.fill(OPEN_SCHEMA, STATE)
    assert content["value"] == ex.value
    customer, refund, issues = (content["fields"][name] for name in ("customer", "wants_refund", "issues"))
    assert customer["kind"] == "generated" and customer["text"] == ex.fields["customer"].text
    assert customer["n_tokens"] == ex.fields["customer"].n_tokens > 0
    assert refund["kind"] == "decided" and refund["probability"] == close(ex.fields["wants_refund"].probability)
    assert issues["kind"] == "multi-label" and set(issues["memberships"]) == {"damaged", "late", "wrong_item"}
    assert content["usage"]["output_tokens"] == ex.stats.output_tokens > 0


@pytest.mark.asyncio
async def test_an_abandoned_call_stops_the_engine_at_its_next_pass(server, engine: Engine) -> None:
    """A client that gives up on a call mid-generation (the SDK sends ``notifications/cancelled``)
    stops the fill at its next pass boundary instead of letting it run on.
    """
    story = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 1000}}, "required": ["story"]}
    async with Client(server, raise_exceptions=True) as client:
        await client.call_tool("noul", NOUL_ARGS)  # the server is loaded and warm
        before = engine.backend.forward_passes
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call_tool, "fill", {"state": STATE, "schema": story})
            with anyio.fail_after(120):
                while engine.backend.forward_passes < before + 5:  # the story is being generated
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # the client abandons the call
        given_up_at = engine.backend.forward_passes
        with anyio.fail_after(120):
            while not await _still(engine):
                pass
        assert engine.backend.forward_passes - given_up_at <= 3  # the pass under way, then it stopped
        assert not (await client.call_tool("noul", NOUL_ARGS)).is_error


async def _still(engine: Engine, quiet_s: float = 1.0) -> bool:
    """Whether no pass runs on ``engine`` for ``quiet_s``."""
    passes = engine.backend.forward_passes
    await anyio.sleep(quiet_s)
    return engine.backend.forward_passes == passes
