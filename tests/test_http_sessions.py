"""The session routes with a real ``httpx`` client against a loopback ``pcd serve`` on the real model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
from loopback import serving

from pcd_core import Engine, Limits
from pcd_integrations.http import create_app
from pcd_integrations.serving.operations import Backpressure

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "mood": {"type": "choice", "instructions": "How does the customer feel?", "criteria": {"angry": "", "calm": ""}},
}
ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}


@pytest.fixture(scope="module")
def served(engine):
    app = create_app(engine)
    with serving(app) as url:
        yield app, url


def test_a_session_answers_each_turn_as_a_fresh_decide_and_belongs_to_its_key(served, engine):
    app, url = served
    with httpx.Client(base_url=url, timeout=120) as client:
        created = client.post("/v1/sessions", json={"questions": QUESTIONS}, headers=ALICE)
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        body = client.post(f"/v1/sessions/{sid}/turns", json={"role": "customer", "text": "Refund me!"}, headers=ALICE)
        assert body.status_code == 200, body.text
        session = app.state.sessions._open[sid].session
        fresh = engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce)
        assert body.json()["answers"]["refund"]["noul"] == pytest.approx(fresh.answers["refund"].noul, abs=1e-5)
        assert body.json()["triggers"] == []
        read = client.get(f"/v1/sessions/{sid}", headers=ALICE).json()
        assert read["turns"] == [{"role": "customer", "text": "Refund me!"}] and read["kind"] == "decide"
        for method, path, extra in (
            ("GET", f"/v1/sessions/{sid}", {}),
            ("POST", f"/v1/sessions/{sid}/turns", {"json": {"text": "hi"}}),
            ("DELETE", f"/v1/sessions/{sid}", {}),
        ):
            other = client.request(method, path, headers=BOB, **extra)
            assert other.status_code == 404 and other.json()["detail"]["error_type"] == "session_not_found"
        assert client.get("/v1/sessions/sess_nope", headers=ALICE).status_code == 404
        assert client.delete(f"/v1/sessions/{sid}", headers=ALICE).status_code == 204
        assert client.get(f"/v1/sessions/{sid}", headers=ALICE).status_code == 404


def test_a_turn_over_a_bound_is_a_422_naming_it_and_a_bad_body_is_refused(served):
    _, url = served
    with httpx.Client(base_url=url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={"questions": QUESTIONS, "keep_last_tokens": 5}).json()["id"]
        over = client.post(f"/v1/sessions/{sid}/turns", json={"text": "a turn well over five tokens long"})
        assert over.status_code == 422 and "keep_last_tokens=5" in over.json()["detail"][0]["msg"]
        both = client.post("/v1/sessions", json={"questions": QUESTIONS, "schema": {"type": "object"}})
        assert both.status_code == 422
        bad = client.post(
            "/v1/sessions", json={"questions": QUESTIONS, "triggers": [{"field": "nope", "changed": True}]}
        )
        assert bad.status_code == 422 and "nope" in bad.text


def test_eight_concurrent_appends_all_land_once_each(served):
    _, url = served

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:  # 8 appends in turn, 2 busy cores
            sid = (await client.post("/v1/sessions", json={"questions": QUESTIONS})).json()["id"]
            texts = [f"Message number {k}: where is my parcel?" for k in range(8)]
            replies = await asyncio.gather(*(client.post(f"/v1/sessions/{sid}/turns", json={"text": t}) for t in texts))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            turns = (await client.get(f"/v1/sessions/{sid}")).json()["turns"]
            return [t["text"] for t in turns], texts

    landed, sent = asyncio.run(run())
    assert sorted(landed) == sorted(sent) and len(landed) == 8


def test_the_event_stream_carries_each_fired_trigger_until_the_session_closes(served):
    _, url = served
    with httpx.Client(base_url=url, timeout=120) as client:
        triggers = [{"field": "refund", "above": 0.01, "name": "refund seen"}]
        sid = client.post("/v1/sessions", json={"questions": QUESTIONS, "triggers": triggers}).json()["id"]
        events: list[dict] = []
        ready = threading.Event()

        def listen() -> None:
            with httpx.Client(base_url=url, timeout=120) as reader:
                with reader.stream("GET", f"/v1/sessions/{sid}/events") as stream:
                    for line in stream.iter_lines():
                        ready.set()
                        if line == "data: [DONE]":
                            return
                        if line.startswith("data: "):
                            events.append(json.loads(line.removeprefix("data: ")))

        thread = threading.Thread(target=listen)
        thread.start()
        assert ready.wait(60)
        reply = client.post(f"/v1/sessions/{sid}/turns", json={"role": "customer", "text": "I want a refund."})
        assert [f["trigger"] for f in reply.json()["triggers"]] == ["refund seen"]
        client.delete(f"/v1/sessions/{sid}")
        thread.join(60)
        assert [e["trigger"] for e in events] == ["refund seen"] and events[0]["turn"] == 1


def _wait_for(condition: Any, what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_session_requests_take_places_in_the_one_queue_and_get_its_503(engine: Engine) -> None:
    app = create_app(engine, backpressure=Backpressure(max_queue=1))
    decide = {"state": "Where is my parcel?", "questions": {"refund": QUESTIONS["refund"]}}
    with serving(app) as url, httpx.Client(base_url=url, timeout=600) as client:
        first, second = (client.post("/v1/sessions", json={"questions": QUESTIONS}).json()["id"] for _ in range(2))
        results: dict[str, httpx.Response] = {}
        with engine.model.lock:  # the model is busy: the two appends wait for it, filling the queue
            for queued, sid in enumerate((first, second), start=1):
                turn = {"role": "customer", "text": f"Refund me, says customer {queued}."}
                threading.Thread(
                    target=lambda sid=sid, turn=turn: results.__setitem__(
                        sid, client.post(f"/v1/sessions/{sid}/turns", json=turn)
                    )
                ).start()
                _wait_for(lambda queued=queued: engine.waiting >= queued, "the append queues")  # type: ignore[misc]
            refused = {
                "append": client.post(f"/v1/sessions/{first}/turns", json={"text": "One more."}),
                "open": client.post("/v1/sessions", json={"questions": QUESTIONS}),
                "systemone": client.post("/v1/systemone", json=decide),
            }
            ready = client.get("/readyz")
            read = client.get(f"/v1/sessions/{first}")  # reading runs no pass: never queued
        _wait_for(lambda: len(results) == 2, "the queued appends are answered", 600)
        turns = client.get(f"/v1/sessions/{first}").json()["turns"]
    for name, response in refused.items():
        assert response.status_code == 503, (name, response.text)
        assert response.headers["retry-after"] == "1", name
        assert response.json()["detail"]["error_type"] == "queue_full", name
        assert "--max-queue" in response.json()["detail"]["message"], name
    assert (ready.status_code, ready.json()["status"]) == (503, "full")
    assert read.status_code == 200 and read.json()["turns"] == []
    assert [r.status_code for r in results.values()] == [200, 200]
    assert all(r.json()["x_queue_ms"] > 0.0 for r in results.values())  # they did wait behind the held model
    assert turns == [{"role": "customer", "text": "Refund me, says customer 1."}]  # the refused turn never landed


def test_an_append_past_the_timeout_gets_504_and_leaves_the_session_as_it_was(engine: Engine) -> None:
    app = create_app(engine, backpressure=Backpressure(timeout_s=0.5))
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={"questions": QUESTIONS}).json()["id"]
        with engine.model.lock:
            late = client.post(f"/v1/sessions/{sid}/turns", json={"text": "Refund me."})
            _wait_for(lambda: engine.waiting == 0, "the dropped append leaves the queue", 5.0)
        read = client.get(f"/v1/sessions/{sid}").json()
    assert late.status_code == 504 and late.json()["detail"]["error_type"] == "timeout"
    assert late.headers["retry-after"] == "1"
    assert read["turns"] == [] and read["result"] is None


def test_a_session_over_the_limits_is_refused_when_it_opens_and_a_big_body_is_a_413(engine: Engine) -> None:
    app = create_app(engine, limits=Limits(max_body_bytes=4096))
    many = {f"q{k}": {"type": "noul", "instructions": "Is it late?"} for k in range(401)}
    fields = {f"f{k}": {"type": "boolean"} for k in range(129)}
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={"questions": QUESTIONS}).json()["id"]
        big_turn = client.post(f"/v1/sessions/{sid}/turns", json={"text": "late " * 1000})
        big_open = client.post("/v1/sessions", json={"questions": QUESTIONS, "task": "x" * 5000})
        read = client.get(f"/v1/sessions/{sid}").json()
    with serving(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as client:
        questions = client.post("/v1/sessions", json={"questions": many})
        schema = client.post("/v1/sessions", json={"schema": {"type": "object", "properties": fields}})
    for response in (big_turn, big_open):
        assert response.status_code == 413 and response.json()["detail"]["error_type"] == "payload_too_large"
        assert "max_body_bytes" in response.json()["detail"]["message"]
    assert read["turns"] == []
    assert questions.status_code == 422 and "max_questions" in questions.json()["detail"][0]["msg"]
    assert schema.status_code == 422 and "max_fields" in schema.json()["detail"][0]["msg"]
