"""The session routes with a real ``httpx`` client against a loopback ``pcd serve`` on the real model."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from loopback import serving

from pcd_integrations.http import create_app

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
