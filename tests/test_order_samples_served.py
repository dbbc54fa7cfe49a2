"""``order_samples`` as an engine default: ``LoadOptions.order_samples`` (``--order-samples`` on ``pcd decide``,
``pcd serve`` and ``pcd-mcp``, or ``PCD_ORDER_SAMPLES``) makes every decide read K orders of each choice's
and score's options, and every wire shows the spread it measured.

The defaults are checked against the explicit keyword on the oracle engine; the served path runs the
embedded model behind a loopback ``pcd serve`` app, read by the real ``openai`` client and by httpx.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pcd_core import Engine
from pcd_core.errors import OptionError
from pcd_core.loading.options import LoadOptions
from pcd_core.testing import oracle_engine
from pcd_integrations.commands.main import build_parser

STATE = "The blender arrived cracked and I was charged twice for it."
TEAM = {
    "type": "choice",
    "instructions": "Which team should handle it?",
    "criteria": {"billing": None, "shipping": None, "sales": None},
}
ANGER = {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]}


def _engine_with_default(k: int, window: int = 400) -> Engine:
    plain = oracle_engine(window=window)
    return Engine(plain.backend, plain.tokenizer, plain.model_name, order_samples=k)


def test_an_engine_default_is_what_the_keyword_gives_and_a_call_may_override_it() -> None:
    questions = {"team": TEAM, "anger": ANGER}
    defaulted = _engine_with_default(3).decide(STATE, questions).answers
    explicit = oracle_engine(window=400).decide(STATE, questions, order_samples=3).answers
    assert defaulted == explicit
    assert defaulted["team"].order_spread is not None and defaulted["anger"].order_spread is not None
    once = _engine_with_default(3).decide(STATE, questions, order_samples=1).answers
    assert once == oracle_engine(window=400).decide(STATE, questions).answers
    assert once["team"].order_spread is None


def test_adecide_takes_every_keyword_of_decide() -> None:
    engine = oracle_engine(window=400)
    asynchronous = asyncio.run(engine.adecide(STATE, {"team": TEAM}, order_samples=2, debias=False))
    assert asynchronous.answers == engine.decide(STATE, {"team": TEAM}, order_samples=2).answers
    assert asynchronous.answers["team"].order_spread is not None


@pytest.mark.parametrize("bad", [0, 9, True, 2.0])
def test_an_order_samples_default_outside_one_to_eight_is_refused_before_any_load(bad: Any) -> None:
    with pytest.raises(OptionError, match="order_samples"):
        LoadOptions(order_samples=bad)
    with pytest.raises(OptionError, match="order_samples"):
        _engine_with_default(bad)


def test_the_flag_is_offered_where_decisions_are_made_and_nowhere_else(capsys: Any) -> None:
    from mcp_server.__main__ import parse_args
    from pcd_integrations.commands.common import options_from_args

    parser = build_parser()
    for command in (["decide", "questions.json"], ["serve"]):
        args = parser.parse_args([*command, "--order-samples", "3"])
        assert options_from_args(args).order_samples == 3
    assert parse_args(["--order-samples", "2"]).load_options.order_samples == 2
    with pytest.raises(SystemExit):  # a fill reads no option list it could rotate
        parser.parse_args(["fill", "--schema", "s.json", "--order-samples", "3"])
    assert "--order-samples" in capsys.readouterr().err


def test_pcd_mcp_reads_the_default_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcp_server.__main__ import parse_args

    monkeypatch.setenv("PCD_ORDER_SAMPLES", "4")
    assert parse_args([]).load_options.order_samples == 4
    monkeypatch.setenv("PCD_ORDER_SAMPLES", "12")
    with pytest.raises(SystemExit):
        parse_args([])


@pytest.fixture(scope="module")
def sampled(engine: Engine) -> Engine:
    """The session's embedded model with a default of three orders."""
    return Engine(engine.backend, engine.tokenizer, engine.model_name, order_samples=3)


def test_served_decisions_carry_the_order_spread_to_real_clients(engine: Engine, sampled: Engine) -> None:
    openai = pytest.importorskip("openai", reason="the Decisions test needs the 'openai' package (dev extra)")
    httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")
    pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")
    from loopback import serving

    from pcd_integrations.http import create_app

    expected = engine.decide(STATE, {"team": TEAM}, order_samples=3).answers
    with serving(create_app(sampled)) as url:
        body = httpx.post(f"{url}/v1/systemone", json={"state": STATE, "questions": {"team": TEAM}}, timeout=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        choice = {
            "type": "choice",
            "instructions": TEAM["instructions"],
            "choices": [{"value": v} for v in TEAM["criteria"]],
        }
        score = {
            "type": "score",
            "instructions": ANGER["instructions"],
            "levels": [{"label": level} for level in ANGER["criteria"]],
        }
        decision = client.decisions.create(model="smollm2-135m", input=STATE, questions=[choice, score])
    team = body.json()["answers"]["team"]
    assert team["x_order_spread"] == pytest.approx(expected["team"].order_spread, abs=1e-6)
    assert team["probabilities"] == pytest.approx(expected["team"].probabilities, abs=1e-6)
    first, second = decision.answers  # the same model's reading, through the Decisions wording of each question
    assert first.type == "choice" and 0 <= first.x_order_spread <= 1
    assert second.type == "score" and 0 <= second.x_order_spread <= 1


def test_langchains_decision_model_reports_the_spread_and_builds_the_default(engine: Engine, sampled: Engine) -> None:
    pytest.importorskip("langchain_core.decisions", reason="the decision model needs langchain-core >= 1.8")
    from langchain_core.decisions import Choice

    from pcd_integrations.langchain import PCDDecisionModel

    question = Choice(instructions=TEAM["instructions"], criteria=dict(TEAM["criteria"]))
    answer = PCDDecisionModel(engine=sampled).invoke({"state": STATE, "questions": {"team": question}}).choices["team"]
    expected = engine.decide(STATE, {"team": TEAM}, order_samples=3).answers["team"]
    assert answer.order_spread == pytest.approx(expected.order_spread, abs=1e-6)  # type: ignore[attr-defined]
    assert answer.probabilities == pytest.approx(expected.probabilities, abs=1e-6)
    assert PCDDecisionModel(order_samples=4).load_options().order_samples == 4  # loads nothing
    with pytest.raises(ValueError, match="order_samples"):
        PCDDecisionModel(engine=engine, order_samples=2)
