"""A second ``pcd serve`` on loopback as a cascade's next engine, through the real ``openai`` client
(pcd_integrations/remote_decisions.py).

The escalated fields must equal what that server answers when asked alone (the same questions, sent
with the SDK directly); a remote that is down, slower than its timeout or answering 500 must leave the
local answers, marked as not escalated and why, and the call must still succeed. The failing servers
are real HTTP servers on loopback too.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="a remote Decisions stage needs the 'openai' package")
pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from loopback import serving  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_core.cascade import Cascade, Stage  # noqa: E402
from pcd_core.cascade_asking import sub_schema  # noqa: E402
from pcd_core.request.schema import parse_schema  # noqa: E402
from pcd_core.trust.calibration import Calibration, FieldCalibration  # noqa: E402
from pcd_core.trust.selective import NEVER  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.remote_decisions import (  # noqa: E402
    RemoteDecisions,
    decision_questions,
    field_questions,
)

TEXT = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."
SCHEMA = {
    "urgent": {"type": "boolean", "description": "Does it need an answer today?"},
    "team": {"enum": ["billing", "shipping", "sales"], "description": "Who handles it"},
    "refund": {"type": "boolean", "description": "Does the customer ask for money back?"},
}
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "charges", "shipping": None}},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["low", "medium", "high"]},
}


@pytest.fixture(scope="module")
def first() -> Engine:
    """The local engine: the embedded model, with a calibration that makes team and refund abstain."""
    fields = {
        "team": FieldCalibration(("billing", "shipping", "sales"), 1.0, (0.0, 0.0, 0.0), abstain_below=NEVER),
        "refund": FieldCalibration(("true", "false"), 1.0, (0.0, 0.0), abstain_below=NEVER),
    }
    # the same names cover the questions: team's two options differ, so only refund abstains there
    return Engine.load("smollm2-135m", calibration=Calibration("smollm2-135m", False, fields, abstain_risk=0.1))


@pytest.fixture(scope="module")
def remote_url(engine: Engine) -> Any:
    with serving(create_app(engine)) as url:
        yield f"{url}/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _failing_app(delay_s: float, status: int) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/decisions")
    def decisions() -> JSONResponse:
        time.sleep(delay_s)
        return JSONResponse({"error": {"message": "the model crashed", "type": "server_error"}}, status_code=status)

    return app


def test_escalated_fields_equal_what_the_server_answers_alone(first: Engine, remote_url: str) -> None:
    remote = RemoteDecisions(remote_url, "smollm2-135m", name="remote")
    cascade = Cascade(first, [Stage(remote)], name="local")
    result = cascade.fill(SCHEMA, TEXT)
    sub = sub_schema(parse_schema(SCHEMA), {"team", "refund"})
    client = openai.OpenAI(base_url=remote_url, api_key="unused", max_retries=0)
    alone = client.decisions.create(
        model="smollm2-135m", input=TEXT, questions=decision_questions(field_questions(sub))
    )
    by_name = {a.name: a for a in alone.answers}
    assert result.fields["refund"].engine == "remote" and result.fields["team"].engine == "remote"
    assert result.fields["refund"].probabilities["true"] == pytest.approx(by_name["refund"].probability, abs=1e-6)
    team = {p.value: p.probability for p in by_name["team"].probabilities}
    assert result.fields["team"].probabilities == pytest.approx(team, abs=1e-6)
    assert result.fields["team"].value == by_name["team"].choice
    assert result.fields["urgent"].engine == "local" and result.fields["urgent"].escalation is None
    assert result.fields["team"].escalation["escalated"] and result.fields["team"].escalation["reasons"] == [
        "abstained"
    ]
    costs = {c.engine: c for c in result.stages}
    assert costs["remote"].asked == 2 and costs["remote"].input_tokens > 0 and costs["remote"].error is None

    decided = cascade.decide(TEXT, QUESTIONS)
    asked = decision_questions({"refund": QUESTIONS["refund"]})
    refund = client.decisions.create(model="smollm2-135m", input=TEXT, questions=asked).answers[0]
    assert decided.answers["refund"].engine == "remote"
    assert decided.answers["refund"].noul == pytest.approx(refund.probability, abs=1e-6)
    assert decided.answers["team"].engine == "local" and decided.answers["urgency"].engine == "local"


@pytest.mark.parametrize("how", ["down", "slow", "500"])
def test_a_remote_that_cannot_answer_leaves_the_local_answers_marked(first: Engine, how: str) -> None:
    local = first.fill(SCHEMA, TEXT)

    def check(url: str) -> None:
        remote = RemoteDecisions(url, "smollm2-135m", timeout_s=1.0, name="remote")
        result = Cascade(first, [Stage(remote)], name="local").fill(SCHEMA, TEXT)
        for name in SCHEMA:
            assert result.fields[name].engine == "local"
            assert result.fields[name].probabilities == pytest.approx(local.fields[name].probabilities, abs=1e-5)
        for name in ("team", "refund"):
            escalation = result.fields[name].escalation
            assert escalation is not None and not escalation["escalated"] and escalation["to"] == "remote"
            assert escalation["error"].startswith("RemoteDecisionsError")
            assert len(escalation["readings"]) == 1
        assert any("stage 'remote' was not used" in w for w in result.warnings)
        assert result.stages[-1].error is not None
        assert result.values == local.values

    if how == "down":
        check(f"http://127.0.0.1:{_free_port()}/v1")
        return
    app = _failing_app(3.0 if how == "slow" else 0.0, 200 if how == "slow" else 500)
    with serving(app) as url:
        check(f"{url}/v1")
