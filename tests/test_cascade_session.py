"""Cascaded sessions (pcd_core/cascade_session.py) on the embedded model cascading to itself.

The first engine carries a calibration that makes chosen fields and questions always abstain; the
later stage is the embedded model reading raw. Each append's kept answers must equal a fresh
fill/decide of the whole conversation by the first engine with the session's nonce (which is what the
first engine's own session answers, tests/test_session.py), and the escalated ones a fresh fill/decide
of the whole conversation by the later engine with its own session's nonce and the whole schema. The
later stage must read each turn once, and only at the appends that ask it.
"""

from __future__ import annotations

import socket

import pytest
from test_cascade import QUESTIONS, SCHEMA
from test_cascade import _abstaining as always_abstaining
from test_session import TURNS

from pcd_core import Engine
from pcd_core.cascade import Cascade, CascadeDecideResponse, Stage
from pcd_core.cascade_asking import sub_schema
from pcd_core.errors import SessionClosedError
from pcd_core.request.schema import parse_schema
from pcd_core.sessions.session import SessionTurn

TOLERANCE = 1e-5
ESCALATED_FIELDS = ("sentiment", "team", "refund")  # team depends on sentiment


@pytest.fixture(scope="module")
def first() -> Engine:
    labels = {"sentiment": ("angry", "calm", "happy"), "refund": ("true", "false"), "urgency": ("0", "1", "2")}
    return Engine.load("smollm2-135m", calibration=always_abstaining(labels))


@pytest.fixture(scope="module")
def cascade(first: Engine, engine: Engine) -> Cascade:
    return Cascade(first, [Stage(engine, name="raw")], name="abstaining")


def _same_probabilities(got, want, what) -> None:
    assert got.keys() == want.keys(), what
    for label, p in want.items():
        assert got[label] == pytest.approx(p, abs=TOLERANCE), (what, label)


def _same_answer(got, want, what) -> None:
    if want.type == "noul":
        assert got.noul == pytest.approx(want.noul, abs=TOLERANCE), what
    else:
        _same_probabilities(got.probabilities, want.probabilities, what)


class Cued:
    """A rule that sends ``refund`` on at the appends the test cues, whatever the answer: the rule is
    scripted, never an engine.
    """

    def __init__(self) -> None:
        self.now = False

    def reasons(self, name, reading) -> tuple[str, ...]:
        return ("cued",) if self.now and name == "refund" else ()


class Stateless:
    """A stage with ``fill`` and ``decide`` only, as a remote has: the real engine's answers, each call kept."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.model_name, self.calls = engine, "stateless", []

    def fill(self, schema, text, **keywords):
        self.calls.append((schema, text))
        return self.engine.fill(schema, text, **keywords)

    def decide(self, state, questions, **keywords):
        self.calls.append((questions, state))
        return self.engine.decide(state, questions, **keywords)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_append_keeps_the_firsts_answers_and_escalates_to_a_fresh_fill_by_the_stage(cascade, first, engine):
    with cascade.session(SCHEMA) as session:
        for role, text in TURNS:
            result = session.append(text, role=role)
            stage = session.stage_sessions[1]
            assert stage.text == session.text and stage.nonce != session.nonce
            own = first.fill(SCHEMA, session.text, fence_nonce=session.nonce)
            fresh = engine.fill(SCHEMA, session.text, fence_nonce=stage.nonce)  # the whole schema
            kept = result.fields["urgent"]
            assert kept.engine == "abstaining" and kept.escalation is None and kept.value == own.fields["urgent"].value
            _same_probabilities(kept.probabilities, own.fields["urgent"].probabilities, "urgent")
            for name in ESCALATED_FIELDS:
                got = result.fields[name]
                assert got.engine == "raw" and got.escalation["escalated"] and got.value == fresh.fields[name].value
                _same_probabilities(got.probabilities, fresh.fields[name].probabilities, name)
                _same_probabilities(
                    got.escalation["readings"][0]["probabilities"], own.fields[name].probabilities, name
                )
            assert result.fields["team"].escalation["reasons"] == ["depends on 'sentiment'"]
            assert result.value == {name: result.fields[name].value for name in SCHEMA}
            assert [(c.engine, c.asked) for c in result.stages] == [("abstaining", 4), ("raw", 3)]
            assert result.stats.forward_passes == sum(c.forward_passes for c in result.stages)
            assert session.result is result
        assert session.kv_tokens > stage.kv_tokens > 0  # the first engine's session's KV and the stage's
    assert session.closed and stage.closed and session.kv_tokens == 0


def test_the_stage_reads_each_turn_once_and_only_when_asked(first, engine):
    rule = Cued()
    session = Cascade(first, [Stage(engine, rule, name="raw")], name="first").session(SCHEMA)
    counter = engine.backend.counter
    kv_after_read = 0
    for index, (role, text) in enumerate(TURNS):
        rule.now = index in (1, 3)  # the second and the fourth append send refund on
        passes_before = counter.forward_passes
        result = session.append(text, role=role)
        spent = counter.forward_passes - passes_before
        if not rule.now:  # nothing escalates: the stage reads nothing, though it keeps the turn
            assert spent == 0 and [c.engine for c in result.stages] == ["first"]
            assert session.stage_sessions.get(1) is None or session.stage_sessions[1].kv_tokens == kv_after_read
            continue
        stage = session.stage_sessions[1]
        assert stage.turns == session.turns
        assert [(c.engine, c.asked) for c in result.stages] == [("first", 4), ("raw", 1)]
        assert result.stages[1].forward_passes == spent > 0
        fresh = engine.fill(SCHEMA, session.text, fence_nonce=stage.nonce)
        _same_probabilities(result.fields["refund"].probabilities, fresh.fields["refund"].probabilities, "refund")
        read = stage.result.stats
        assert read.input_tokens == fresh.stats.input_tokens  # the same prompt, however it was read
        if index == 3:  # the two turns since its last read, in this one append, after the KV it kept
            assert read.cached_tokens == kv_after_read
            unread = "\n" + "\n".join(SessionTurn(r, t).line for r, t in TURNS[2:4])
            assert len(engine.tokenizer.encode_head(unread)) - 1 <= read.prompt_tokens < fresh.stats.prompt_tokens
        kv_after_read = stage.kv_tokens
    session.close()


def test_a_stage_without_sessions_is_asked_the_sub_schema_on_the_conversation(cascade, first, engine):
    stateless = Stateless(engine)
    session = Cascade(first, [Stage(stateless, name="stateless")], name="first").session(SCHEMA)
    for role, text in TURNS[:2]:
        result = session.append(text, role=role)
        schema, text_asked = stateless.calls[-1]
        assert [f.name for f in schema.fields] == list(ESCALATED_FIELDS) and text_asked == session.text
        alone = engine.fill(sub_schema(parse_schema(SCHEMA), set(ESCALATED_FIELDS)), session.text)
        for name in ESCALATED_FIELDS:
            assert result.fields[name].engine == "stateless"
            _same_probabilities(result.fields[name].probabilities, alone.fields[name].probabilities, name)
    assert len(stateless.calls) == 2 and session.stage_sessions == {}
    session.close()


def test_a_failing_stage_leaves_the_first_answers_marked(first):
    pytest.importorskip("openai")
    from pcd_integrations.remote_decisions import RemoteDecisions

    down = RemoteDecisions(f"http://127.0.0.1:{_free_port()}/v1", "smollm2-135m", timeout_s=1.0, name="remote")
    with Cascade(first, [Stage(down)], name="first").session(QUESTIONS) as session:
        for role, text in TURNS[:2]:
            result = session.append(text, role=role)
            own = first.decide(session.text, QUESTIONS, fence_nonce=session.nonce)
            for qid in QUESTIONS:
                assert result.answers[qid].engine == "first"
                _same_answer(result.answers[qid], own.answers[qid], qid)
            for qid in ("refund", "urgency"):
                escalation = result.answers[qid].escalation
                assert not escalation["escalated"] and escalation["to"] == "remote" and escalation["error"]
            assert result.stages[1].engine == "remote" and result.stages[1].error
            assert any("'remote' was not used" in w for w in result.warnings)


def test_a_fork_branches_every_stage_and_close_closes_them(cascade, first, engine):
    session = cascade.session(QUESTIONS)
    session.when("urgency", abstained=True)  # the first engine always abstains; the cascaded answer does not
    for role, text in TURNS[:2]:
        session.append(text, role=role)
    branch = session.fork()
    assert branch.nonce == session.nonce and branch.text == session.text
    assert branch.stage_sessions[1] is not session.stage_sessions[1]
    assert branch.stage_sessions[1].nonce == session.stage_sessions[1].nonce
    refund = branch.append("Fine, refund it then.", role="customer")
    deliver = session.append("Please deliver it tomorrow.", role="customer")
    assert branch.text != session.text and session.result is deliver
    assert isinstance(refund, CascadeDecideResponse) and [c["engine"] for c in refund.to_wire()["x_cascade"]] == [
        "abstaining",
        "raw",
    ]
    for one, result in ((branch, refund), (session, deliver)):
        own = first.decide(one.text, QUESTIONS, fence_nonce=one.nonce)
        fresh = engine.decide(one.text, QUESTIONS, fence_nonce=one.stage_sessions[1].nonce)
        assert own.answers["urgency"].abstained and not result.answers["urgency"].abstained
        assert result.triggers == []  # triggers watch the cascaded answers
        _same_answer(result.answers["team"], own.answers["team"], "team")
        for qid in ("refund", "urgency"):
            assert result.answers[qid].engine == "raw"
            _same_answer(result.answers[qid], fresh.answers[qid], qid)
    stage = session.stage_sessions[1]
    session.close()
    assert session.kv_tokens == 0 and stage.closed and session.stage_sessions == {}
    with pytest.raises(SessionClosedError):
        session.append("more")
    assert branch.append("Thanks.", role="customer").answers["refund"].engine == "raw"  # the branch lives on
    branch.close()


def test_pcd_serve_sessions_and_the_langchain_runnable_cascade(cascade, engine):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from loopback import serving

    from pcd_integrations.http import create_app

    app = create_app(cascade)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={"questions": QUESTIONS}).json()["id"]
        body = client.post(f"/v1/sessions/{sid}/turns", json={"role": "customer", "text": TURNS[2][1]}).json()
        session = app.state.sessions._open[sid].session
        fresh = engine.decide(session.text, QUESTIONS, fence_nonce=session.stage_sessions[1].nonce)
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    assert body["answers"]["refund"]["x_engine"] == "raw" and body["answers"]["team"]["x_engine"] == "abstaining"
    assert body["answers"]["refund"]["noul"] == pytest.approx(fresh.answers["refund"].noul, abs=TOLERANCE)
    assert [c["engine"] for c in body["x_cascade"]] == ["abstaining", "raw"] and session.closed
    pytest.importorskip("langchain_core")
    from pcd_integrations.langchain import PCDSessionRunnable

    runnable = PCDSessionRunnable.open(cascade, QUESTIONS)
    answered = runnable.invoke({"text": TURNS[2][1], "role": "customer"})
    assert answered.answers["refund"].engine == "raw" and answered.stats.forward_passes == sum(
        c.forward_passes for c in answered.stages
    )
    runnable.close()
