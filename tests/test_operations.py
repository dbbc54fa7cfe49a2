"""The operator's surface of ``pcd serve`` (``pcd_integrations/serving/operations.py``, ``metrics.py``,
``tracing.py``): metrics read by prometheus_client's own parser, request ids, back-pressure, health
and tracing, each driven by real clients against a real loopback server on the embedded model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the HTTP server needs the 'http' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser", reason="metrics need prometheus-client")

from loopback import serving  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.serving.metrics import OTHER, BoundedNames  # noqa: E402
from pcd_integrations.serving.operations import Backpressure, Operations, RequestIdFilter  # noqa: E402

STATE = "My invoice charged me twice this month and nobody answers my emails. Fix it today."
QUESTIONS = {
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "payments and invoices", "shipping": None, "sales": None},
    },
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["low", "medium", "high"]},
}
DECISIONS = {
    "model": "smollm2-135m",
    "input": STATE,
    "questions": [{"type": "predicate", "instructions": "Is the customer angry?"}],
}
TICKET = {
    "type": "json_schema",
    "json_schema": {
        "name": "Ticket",
        "schema": {
            "type": "object",
            "properties": {"urgent": {"type": "boolean"}, "team": {"enum": ["billing", "shipping"]}},
            "required": ["urgent", "team"],
        },
    },
}
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": STATE}], "response_format": TICKET}


@pytest.fixture(scope="module")
def base_url(engine: Engine) -> Iterator[str]:
    with serving(create_app(engine)) as url:
        yield url


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a metrics page, by name and sorted labels, as prometheus_client parses it."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(values: dict[Any, float], name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_what_the_responses_report(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        before = samples(client.get("/metrics").text)
        one = client.post("/v1/systemone", json={"state": STATE, "questions": QUESTIONS}).json()
        decided = client.post("/v1/decisions", json=DECISIONS).json()
        chat = client.post("/v1/chat/completions", json=CHAT).json()
        assert client.post("/v1/systemone", json={"state": STATE}).status_code == 422
        page = client.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    after = samples(page.text)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert grew("pcd_requests_total", route="/v1/systemone", status="200") == 1
    assert grew("pcd_requests_total", route="/v1/systemone", status="422") == 1
    assert grew("pcd_requests_total", route="/v1/decisions", status="200") == 1
    assert grew("pcd_requests_total", route="/v1/chat/completions", status="200") == 1
    assert grew("pcd_request_duration_seconds_count", route="/v1/systemone") == 2
    assert grew("pcd_forward_passes_total", route="/v1/systemone") == one["x_forward_passes"] > 0
    assert grew("pcd_forward_passes_total", route="/v1/decisions") == decided["x_forward_passes"] > 0
    assert grew("pcd_forward_passes_total", route="/v1/chat/completions") == chat["x_pcd"]["forward_passes"] > 0
    assert grew("pcd_input_tokens_total", route="/v1/systemone") == one["usage"]["input_tokens"] > 0
    assert grew("pcd_input_tokens_total", route="/v1/chat/completions") == chat["usage"]["prompt_tokens"]
    assert grew("pcd_queue_seconds_count", route="/v1/decisions") == 1
    assert grew("pcd_head_cache_total", result="hit") + grew("pcd_head_cache_total", result="miss") == 3
    # one decision per question type, and one per decided field of the chat's schema, by field name
    for kind in ("noul", "choice", "score"):
        assert grew("pcd_decision_candidate_mass_count", kind=kind, field="") >= 1
    assert grew("pcd_decision_confidence_count", kind="choice", field="") == 1
    assert grew("pcd_decision_confidence_count", kind="noul", field="") == 0  # a noul answer has no confidence
    for name in ("urgent", "team"):
        assert grew("pcd_decision_candidate_mass_count", kind="field", field=name) == 1
    mass = chat["x_pcd"]["fields"]["team"]["candidate_mass"]
    assert grew("pcd_decision_candidate_mass_sum", kind="field", field="team") == pytest.approx(mass)
    assert sample(after, "pcd_requests_in_flight") == 0 and sample(after, "pcd_requests_queued") == 0


def test_field_labels_are_bounded() -> None:
    names = BoundedNames(2)
    assert [names(n) for n in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER, "a", OTHER]


def test_a_safe_request_id_is_echoed_and_an_unsafe_one_replaced(base_url: str, caplog: Any) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    with (
        caplog.at_level(logging.INFO, logger="pcd_integrations.serving.operations"),
        httpx.Client(base_url=base_url, timeout=120) as client,
    ):
        one = client.post(
            "/v1/systemone", json={"state": STATE, "questions": QUESTIONS}, headers={"X-Request-Id": "ticket-42.a"}
        )
        decided = client.post("/v1/decisions", json=DECISIONS, headers={"X-Request-Id": "x" * 129})
        chat = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "bad id\x7f"})
        streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "s-1"})
    assert one.headers["x-request-id"] == one.json()["x_request_id"] == "ticket-42.a"
    made = decided.headers["x-request-id"]
    assert made == decided.json()["x_request_id"] and len(made) == 32 and made != "x" * 129
    assert chat.headers["x-request-id"] == chat.json()["x_pcd"]["request_id"] != made
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert [e["x_pcd"]["request_id"] for e in events if e.get("x_pcd")] == ["s-1"] == [streamed.headers["x-request-id"]]
    lines = {r.request_id: r.getMessage() for r in caplog.records if r.name == "pcd_integrations.serving.operations"}
    assert "POST /v1/systemone -> 200" in lines["ticket-42.a"] and "-> 200" in lines[made]


def test_log_lines_written_in_the_worker_thread_carry_the_request_id() -> None:
    """The engine runs in a worker thread; its log lines must still name the request."""
    from pcd_integrations.serving.engine_loader import EngineLoader

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.request_id)  # type: ignore[attr-defined]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.to_thread(logging.getLogger("pcd_core.probe").warning, "inside the engine's thread")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    handler = Keep()
    handler.addFilter(RequestIdFilter())
    probe = logging.getLogger("pcd_core.probe")
    probe.addHandler(handler)
    try:
        wrapped = Operations(app, EngineLoader(lambda: None), frozenset())  # type: ignore[arg-type,return-value]
        with serving(wrapped) as url:
            answer = httpx.get(f"{url}/anything", headers={"X-Request-Id": "worker-7"})
        probe.warning("outside any request")
    finally:
        probe.removeHandler(handler)
    assert answer.headers["x-request-id"] == "worker-7"
    assert seen == ["worker-7", "-"]


def _wait_for(condition: Any, what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_a_burst_past_max_queue_gets_503_with_retry_after(engine: Engine) -> None:
    import openai

    app = create_app(engine, backpressure=Backpressure(max_queue=1))
    body = {"state": STATE, "questions": {"angry": QUESTIONS["angry"]}}
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        results: list[httpx.Response] = []
        with engine.model.lock:  # the model is busy: the first two requests wait for it
            threads = [
                threading.Thread(target=lambda: results.append(client.post("/v1/systemone", json=body)))
                for _ in range(2)
            ]
            for queued, thread in enumerate(threads, start=1):
                thread.start()
                _wait_for(lambda queued=queued: engine.waiting >= queued, "the request queues")  # type: ignore[misc]
            ready = client.get("/readyz")
            refused = client.post("/v1/systemone", json=body)
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as raised:
                sdk.decisions.create(**DECISIONS)
        for thread in threads:
            thread.join(timeout=120)
        metrics = samples(client.get("/metrics").text)
    assert (ready.status_code, ready.json()["status"], ready.json()["capacity"]) == (503, "full", 2)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert (
        refused.json()["detail"]["error_type"] == "queue_full" and "--max-queue" in refused.json()["detail"]["message"]
    )
    assert raised.value.status_code == 503 and raised.value.response.headers["retry-after"] == "1"
    assert (raised.value.body["type"], raised.value.body["code"]) == ("server_error", "queue_full")
    assert set(raised.value.body) == {"message", "type", "param", "code"}
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["x_queue_ms"] > 0.0 for r in results)  # they did wait behind the held model
    assert sample(metrics, "pcd_requests_rejected_total", reason="queue_full") == 2


def test_a_request_past_its_timeout_gets_504_and_runs_no_pass(engine: Engine) -> None:
    body = {"state": STATE, "questions": {"angry": QUESTIONS["angry"]}}
    bounded, unbounded = create_app(engine, backpressure=Backpressure(timeout_s=0.5)), create_app(engine)
    with serving(bounded) as url, serving(unbounded) as other_url, httpx.Client(timeout=120) as client:
        with engine.model.lock:
            started = time.monotonic()
            late = client.post(f"{url}/v1/systemone", json=body)
            waited_s = time.monotonic() - started
            # the dropped request leaves the queue while the model is still held (its Cancellation)
            _wait_for(lambda: engine.waiting == 0, "the dropped request leaves the queue", 5.0)
            passes_before = engine.backend.counter.forward_passes
        # on the same engine, behind the dropped request if that still waits for the model
        after = client.post(f"{other_url}/v1/systemone", json=body)
        passes_after = engine.backend.counter.forward_passes
        metrics = samples(client.get(f"{url}/metrics").text)
    assert late.status_code == 504 and late.json()["detail"]["error_type"] == "timeout"
    assert late.headers["x-request-id"] and 0.5 <= waited_s < 5.0
    assert after.status_code == 200
    # every pass after the hold is the next request's own: the dropped one read nothing
    assert passes_after - passes_before == after.json()["x_forward_passes"]
    assert sample(metrics, "pcd_requests_rejected_total", reason="timeout") == 1
    assert sample(metrics, "pcd_requests_total", route="/v1/systemone", status="504") == 1


def test_livez_and_readyz_follow_the_load(engine: Engine) -> None:
    release = threading.Event()

    def slow_load() -> Engine:
        release.wait(60)
        return engine

    app = create_app(engine_factory=slow_load, model_name="smollm2-135m")
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        loading = (client.get("/livez"), client.get("/readyz"))
        release.set()
        _wait_for(lambda: client.get("/readyz").status_code == 200, "the model is ready")
        ready = client.get("/readyz")
        assert client.get("/healthz").json()["status"] == "ready"
    assert [r.status_code for r in loading] == [200, 503]
    assert loading[0].json() == {"status": "alive"} and loading[1].json()["status"] == "loading"
    assert ready.json() == {"status": "ready", "model": engine.model_name}


def test_a_span_per_request_and_per_pass_continues_the_callers_trace(engine: Engine, traced: Any) -> None:
    tracer, exporter = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    app = create_app(engine, tracer=tracer)
    with serving(app) as url:
        answer = httpx.post(
            f"{url}/v1/systemone",
            json={"state": STATE + " (traced)", "questions": QUESTIONS},
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
            timeout=120,
        ).json()
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name == "POST /v1/systemone"]
    passes = [s for s in spans if s.name == "pcd.pass"]
    assert format(request.context.trace_id, "032x") == trace_id
    assert request.parent is not None and format(request.parent.span_id, "016x") == parent_id
    assert request.attributes["pcd.forward_passes"] == answer["x_forward_passes"] == len(passes)
    assert request.attributes["pcd.input_tokens"] == answer["usage"]["input_tokens"]
    assert request.attributes["pcd.queue_ms"] == answer["x_queue_ms"]
    assert request.attributes["http.response.status_code"] == 200
    assert all(p.parent.span_id == request.context.span_id for p in passes)
    assert [p.attributes["pcd.pass"] for p in passes] == list(range(1, len(passes) + 1))
    assert all(p.attributes["pcd.tokens"] > 0 for p in passes)
    assert all(request.start_time <= p.start_time <= p.end_time <= request.end_time for p in passes)


@pytest.mark.parametrize(
    "argv", [["--max-queue", "-1"], ["--timeout", "0"], ["--timeout", "nan"], ["--max-queue", "x"]]
)
def test_serve_refuses_a_bad_bound(argv: list[str]) -> None:
    from pcd_integrations.commands.main import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", *argv])
    assert caught.value.code == 2


def test_serve_hands_its_bounds_and_tracing_to_the_server(monkeypatch: Any) -> None:
    import pcd_integrations.http.app
    from pcd_integrations.commands.main import main

    given: dict[str, Any] = {}
    monkeypatch.setattr(pcd_integrations.http.app, "serve", lambda load, **options: given.update(options))
    assert main(["serve", "--max-queue", "3", "--timeout", "2.5", "--otel"]) == 0
    assert given["backpressure"] == Backpressure(max_queue=3, timeout_s=2.5) and given["tracing"] is True
    assert main(["serve"]) == 0
    assert given["backpressure"] == Backpressure() and given["tracing"] is False


@pytest.fixture
def mcp_url(engine: Engine) -> Iterator[str]:
    """``pcd-mcp`` over streamable HTTP on loopback, its lifespan run (the SDK's session manager needs it)."""
    pytest.importorskip("mcp", reason="the MCP server needs the 'mcp' extra")
    import uvicorn

    from mcp_server.http_transport import http_app
    from mcp_server.server import build_server

    app = http_app(build_server(engine), "127.0.0.1", None, stateless=True, json_response=True)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started, "the MCP server listens", 30.0)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.asyncio
async def test_mcp_over_http_exposes_the_same_metrics_and_health(mcp_url: str) -> None:
    from mcp import Client

    schema = {"type": "object", "properties": {"wants_refund": {"type": "boolean"}}}
    async with Client(f"{mcp_url}/mcp") as client:
        picked = await client.call_tool(
            "choice", {"state": STATE, "question": "Which team?", "options": QUESTIONS["team"]["criteria"]}
        )
        filled = await client.call_tool("fill", {"state": STATE, "schema": schema})
    assert not picked.is_error and not filled.is_error, (picked.content, filled.content)
    async with httpx.AsyncClient(base_url=mcp_url, timeout=60) as http:
        page, live, ready = await asyncio.gather(http.get("/metrics"), http.get("/livez"), http.get("/readyz"))
        echoed = await http.post("/mcp", json={}, headers={"X-Request-Id": "mcp-1"})
    values = samples(page.text)
    usages = [picked.structured_content["usage"], filled.structured_content["usage"]]
    assert sample(values, "pcd_requests_total", route="/mcp", status="200") >= 2
    assert sample(values, "pcd_forward_passes_total", route="/mcp") == sum(u["forward_passes"] for u in usages) > 0
    assert sample(values, "pcd_decision_confidence_count", kind="choice", field="") == 1
    mass = filled.structured_content["fields"]["wants_refund"]["candidate_mass"]
    assert sample(values, "pcd_decision_candidate_mass_sum", kind="field", field="wants_refund") == pytest.approx(mass)
    assert (live.status_code, ready.status_code, ready.json()["status"]) == (200, 200, "ready")
    assert echoed.headers["x-request-id"] == "mcp-1"
