"""Every front door takes a cascade unchanged (pcd_core/cascade.py, pcd_integrations/commands/cascading.py):
``pcd fill`` / ``pcd decide`` with ``--then``, ``pcd serve`` (the app over a cascade), ``pcd-mcp`` (the
server over a cascade, and its ``--then`` flags), ``ChatPCD``, ``PCDDecisionModel`` and ``PCDLLM``.

The cascade is the embedded model to itself: the first engine under a calibration that makes some
fields and questions abstain, the second reading raw. Through each door the escalated answers must be
the second engine's and the others the first's, as the cascade answers when called directly.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_core.cascade import Cascade, Stage
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.selective import NEVER
from pcd_integrations.commands.main import main

TEXT = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."


class Ticket(BaseModel):
    urgent: bool = Field(description="Does it need an answer today?")
    team: Literal["billing", "shipping", "sales"] = Field(description="Who handles it")


SCHEMA = Ticket.model_json_schema()
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": None}},
}
ABSTAINING = Calibration(
    "smollm2-135m",
    False,
    {
        "team": FieldCalibration(("billing", "shipping", "sales"), 1.0, (0.0, 0.0, 0.0), abstain_below=NEVER),
        "refund": FieldCalibration(("true", "false"), 1.0, (0.0, 0.0), abstain_below=NEVER),
        "questions[0]": FieldCalibration(("true", "false"), 1.0, (0.0, 0.0), abstain_below=NEVER),  # /v1/decisions
    },
    abstain_risk=0.1,
    abstain_confidence=0.9,
)


@pytest.fixture(scope="module")
def cascade(engine: Engine) -> Cascade:
    first = Engine.load("smollm2-135m", calibration=ABSTAINING)
    return Cascade(first, [Stage(engine, name="smollm2-raw")], name="smollm2-abstaining")


@pytest.fixture(scope="module")
def direct(cascade: Cascade) -> tuple[Any, Any]:
    return cascade.fill(SCHEMA, TEXT), cascade.decide(TEXT, QUESTIONS)


def test_pcd_fill_and_decide_take_then(tmp_path, capsys, direct):
    calibration, schema, state, questions = (tmp_path / n for n in ("c.json", "s.json", "t.txt", "q.json"))
    ABSTAINING.save(calibration)
    schema.write_text(json.dumps(SCHEMA))
    state.write_text(TEXT)
    questions.write_text(json.dumps({"state": TEXT, "questions": QUESTIONS}))
    then = ["--calibration", str(calibration), "--then", "smollm2-135m", "--json"]
    assert main(["fill", "--schema", str(schema), "--input", str(state), *then]) == 0
    filled = json.loads(capsys.readouterr().out)
    assert (
        filled["fields"]["team"]["engine"] == "smollm2-135m (stage 2)"
        and filled["fields"]["team"]["escalation"]["escalated"]
    )
    assert "escalation" not in filled["fields"]["urgent"]  # kept: no record
    assert filled["value"] == direct[0].values
    assert [c["asked"] for c in filled["cascade"]] == [2, 1]
    assert main(["decide", str(questions), *then]) == 0
    decided = json.loads(capsys.readouterr().out)
    assert decided["answers"]["refund"]["x_escalation"]["escalated"]
    assert decided["answers"]["refund"]["noul"] == pytest.approx(direct[1].answers["refund"].noul, abs=1e-6)
    assert "x_escalation" not in decided["answers"]["team"]  # two options: not the calibration's three
    # the table says who answered
    assert main(["fill", "--schema", str(schema), "--input", str(state), *then[:-1]]) == 0
    assert "answered by: smollm2-135m 1, smollm2-135m (stage 2) 1" in capsys.readouterr().out


def test_cascade_flags_are_checked_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda *a, **k: pytest.fail("loaded"))
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"state": TEXT, "questions": QUESTIONS}))
    assert main(["decide", str(questions), "--escalate-below", "0.6"]) == 2
    assert "--escalate-below needs --then" in capsys.readouterr().err
    assert main(["decide", str(questions), "--then", "smollm2-135m", "--escalate-below", "1.5"]) == 2
    assert "probability_below lies in [0, 1]" in capsys.readouterr().err
    url = ["--then", "http://127.0.0.1:9/v1", "--then-calibration", str(questions)]
    assert main(["decide", str(questions), *url]) == 2
    assert "its calibration is the server's" in capsys.readouterr().err


def test_pcd_serve_answers_through_a_cascade(cascade, direct):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from loopback import serving

    from pcd_integrations.http import create_app

    openai = pytest.importorskip("openai")
    with serving(create_app(cascade)) as url:
        body = httpx.post(f"{url}/v1/systemone", json={"state": TEXT, "questions": QUESTIONS}, timeout=120).json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        predicate = {"type": "predicate", "instructions": QUESTIONS["refund"]["instructions"]}
        decision = client.decisions.create(model="smollm2-135m", input=TEXT, questions=[predicate])
    assert body["answers"]["refund"]["x_engine"] == "smollm2-raw"
    assert body["answers"]["refund"]["noul"] == pytest.approx(direct[1].answers["refund"].noul, abs=1e-6)
    assert body["answers"]["team"]["x_engine"] == "smollm2-abstaining"
    assert [c["engine"] for c in body["x_cascade"]] == ["smollm2-abstaining", "smollm2-raw"]
    # /v1/decisions: the first engine abstains from questions[0] (its id there), the second answers it
    (answer,) = decision.answers
    assert answer.type == "predicate" and answer.x_engine == "smollm2-raw" and answer.x_escalation["escalated"]
    assert answer.probability == pytest.approx(body["answers"]["refund"]["noul"], abs=1e-6)


def test_pcd_mcp_serves_a_cascade_and_takes_then(cascade, direct):
    pytest.importorskip("mcp")
    from mcp import Client

    from mcp_server import build_server
    from mcp_server.__main__ import parse_args

    args = parse_args(["--then", "smollm2-135m", "--escalate-below", "0.7"])
    assert args.then == ["smollm2-135m"] and args.escalate_below == 0.7

    async def call() -> Any:
        async with Client(build_server(cascade), raise_exceptions=True) as client:
            filled = await client.call_tool("fill", {"state": TEXT, "schema": SCHEMA})
            decided = await client.call_tool("decide", {"state": TEXT, "questions": QUESTIONS})
            return filled, decided

    result, decided = asyncio.run(call())
    assert not result.is_error and not decided.is_error
    filled = result.structured_content
    assert filled["value"] == direct[0].values
    # every decided field names the engine that gave it; an escalated one carries its record
    for name, found in direct[0].fields.items():
        assert filled["fields"][name]["engine"] == found.engine, name
        assert ("escalation" in filled["fields"][name]) == (found.escalation is not None), name
    assert filled["fields"]["team"]["escalation"]["to"] == "smollm2-raw"
    assert [c["engine"] for c in filled["cascade"]] == ["smollm2-abstaining", "smollm2-raw"]
    answers = decided.structured_content["answers"]
    assert answers["refund"]["x_engine"] == "smollm2-raw" and answers["refund"]["x_escalation"]["escalated"]
    assert [c["engine"] for c in decided.structured_content["cascade"]] == ["smollm2-abstaining", "smollm2-raw"]


def test_the_framework_adapters_take_a_cascade(cascade, direct):
    pytest.importorskip("langchain_core")
    from pcd_integrations.langchain import ChatPCD, PCDDecisionModel

    ticket = ChatPCD(engine=cascade).with_structured_output(Ticket).invoke(TEXT)
    assert ticket.model_dump() == direct[0].values
    response = PCDDecisionModel(engine=cascade).invoke({"state": TEXT, "questions": QUESTIONS})
    assert response.answers["refund"].noul == pytest.approx(direct[1].answers["refund"].noul, abs=1e-6)
    pytest.importorskip("llama_index.core")
    from llama_index.core.prompts import PromptTemplate

    from pcd_integrations.llama_index import PCDLLM

    report = PCDLLM(engine=cascade).structured_predict(Ticket, PromptTemplate("{message}"), message=TEXT)
    assert report.model_dump() == cascade.fill(Ticket, TEXT).values


def test_pcd_mcp_sessions_cascade_every_append(cascade, engine):
    """``session_open`` / ``session_append`` / ``session_close`` on a cascade's server: each append's
    answers name their engine, and the escalated one is the later stage's, read in its own session.
    """
    pytest.importorskip("mcp")
    from mcp import Client

    from mcp_server import build_server
    from mcp_server.http_transport import SERVED

    server = build_server(cascade)

    async def call() -> Any:
        async with Client(server, raise_exceptions=True) as client:
            opened = await client.call_tool("session_open", {"questions": QUESTIONS})
            sid = opened.structured_content["session_id"]
            appended = [
                await client.call_tool("session_append", {"session_id": sid, "text": text, "role": role})
                for text, role in ((TEXT, "user"), ("I am sorry, let me check the order.", "assistant"))
            ]
            session = SERVED[server].sessions[sid]
            seen = session.text, session.nonce, session.stage_sessions[1].nonce
            closed = await client.call_tool("session_close", {"session_id": sid})
            return appended, seen, closed

    appended, (text, nonce, stage_nonce), closed = asyncio.run(call())
    assert not any(a.is_error for a in appended) and closed.structured_content == {"closed": True}
    for result in appended:
        answers = result.structured_content["answers"]
        assert answers["refund"]["x_engine"] == "smollm2-raw" and answers["refund"]["x_escalation"]["escalated"]
        assert answers["team"]["x_engine"] == "smollm2-abstaining" and "x_escalation" not in answers["team"]
    # the later stage's session answered refund: a fresh decide of the conversation by that engine,
    # with its session's nonce; team is the first engine's, with the first session's nonce
    answers = appended[-1].structured_content["answers"]
    later = engine.decide(text, QUESTIONS, fence_nonce=stage_nonce).answers["refund"]
    assert answers["refund"]["noul"] == pytest.approx(later.noul, abs=1e-5)
    first = cascade.first.decide(text, QUESTIONS, fence_nonce=nonce).answers
    assert answers["team"]["choice"] == first["team"].choice
    assert answers["refund"]["x_escalation"]["readings"][0]["probability"] == pytest.approx(
        max(first["refund"].noul, 1 - first["refund"].noul), abs=1e-5
    )


def test_the_session_middleware_puts_the_cascades_decisions_in_the_agents_state(cascade, engine):
    """``PCDSessionMiddleware`` over a cascade in a real ``create_agent`` loop: the decisions it puts into
    the state are the cascade's, the escalated one the later engine's answer on the conversation.
    """
    pytest.importorskip("langchain")
    from langchain.agents import create_agent

    from pcd_integrations.langchain import ChatPCD
    from pcd_integrations.langchain.session import PCDSessionMiddleware

    middleware = PCDSessionMiddleware(cascade, QUESTIONS)
    agent: Any = create_agent(ChatPCD(engine=engine, max_tokens=8), tools=[], middleware=[middleware])
    state = agent.invoke({"messages": [("user", TEXT)]})
    decisions = state["pcd_decisions"]
    session, read = next(iter(middleware._sessions.values()))
    assert [t.role for t in read] == ["user", "assistant"]  # the reply was read after the agent's step
    assert decisions["refund"]["x_engine"] == "smollm2-raw" and decisions["refund"]["x_escalation"]["escalated"]
    assert decisions["team"]["x_engine"] == "smollm2-abstaining"
    later = engine.decide(session.text, QUESTIONS, fence_nonce=session.stage_sessions[1].nonce)
    assert decisions["refund"]["noul"] == pytest.approx(later.answers["refund"].noul, abs=1e-5)
    first = cascade.first.decide(session.text, QUESTIONS, fence_nonce=session.nonce)
    assert decisions["team"]["choice"] == first.answers["team"].choice
