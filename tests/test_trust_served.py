"""Calibration and debiasing as served, on the embedded model.

A calibration file written by the code ``pcd calibrate`` saves with, loaded by the engine behind
``pcd serve`` (``/v1/systemone`` over httpx, ``/v1/decisions`` with the real ``openai`` client, both on
a loopback server) and behind ``pcd-mcp`` (in process), changes the served probabilities exactly as
the file says, and every answer says whether it was calibrated and debiased. The start-up commands
read the file before any model loads, and log the docs' model recommendation on the default.

A file with fitted thresholds (the shape ``pcd calibrate --abstain-risk --coverage`` saves): the real
``openai`` client (>= 3.57) parses a ``/v1/decisions`` response where one question is a refusal (the
declined reading kept in ``x_answer``) and the other is answered; ``/v1/systemone`` carries
``x_abstained`` and ``x_answer_set``; chat completions' ``x_pcd`` fields, the MCP tools and LangChain's
decision model carry ``abstained`` and ``answer_set``. The thresholds sit either side of what any
reading can reach (``NEVER`` and 0), so which answer abstains does not depend on the model's numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the Decisions tests need the 'openai' package (dev extra)")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")
pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")

from loopback import serving  # noqa: E402
from mcp import Client  # noqa: E402

from mcp_server import build_server  # noqa: E402
from mcp_server.__main__ import parse_args  # noqa: E402
from pcd_core import Engine  # noqa: E402
from pcd_core.loading.model_files import RECOMMENDED_MODEL, recommendation  # noqa: E402
from pcd_core.trust.calibration import Calibration, FieldCalibration  # noqa: E402
from pcd_core.trust.selective import NEVER  # noqa: E402
from pcd_integrations.commands.main import main  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.langchain.decisions import PCDDecisionModel  # noqa: E402

STATE = "The blender arrived cracked. I want my money back, and I am not buying from you again."
REFUND = {"type": "noul", "instructions": "Does the customer ask for money back?"}
TEAM = {"type": "choice", "instructions": "Who should handle it?", "criteria": {"billing": None, "shipping": None}}
QUESTIONS = {"refund": REFUND, "team": TEAM}
SCHEMA = {
    "type": "object",
    "properties": {"wants_refund": {"type": "boolean"}, "angry": {"type": "boolean"}},
    "required": ["wants_refund", "angry"],
}
TEMPERATURE = 3.0
YES_NO = FieldCalibration(("true", "false"), TEMPERATURE, (0.0, 0.0))


def tempered(p: float) -> float:
    """P(true) after softmax(log p / T) over (true, false)."""
    return p ** (1 / TEMPERATURE) / (p ** (1 / TEMPERATURE) + (1 - p) ** (1 / TEMPERATURE))


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The question ``refund``, the first question of a /v1/decisions request, the MCP tools' one
    question ``q``, and the field ``wants_refund``.
    """
    path = tmp_path_factory.mktemp("calibration") / "refund.calibration.json"
    fields = {"refund": YES_NO, "questions[0]": YES_NO, "q": YES_NO, "wants_refund": YES_NO}
    Calibration("smollm2-135m", False, fields, {"data": "hand-written", "n": 0}).save(path)
    return path


@pytest.fixture(scope="module")
def calibrated(engine: Engine, calibration_file: Any) -> Engine:
    """An engine on the session's model with the file loaded; the session's engine stays raw."""
    return Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=Calibration.load(calibration_file))


@pytest.fixture(scope="module")
def base_url(calibrated: Engine) -> Any:
    with serving(create_app(calibrated)) as url:
        yield url


def test_systemone_serves_the_calibrated_probability_and_flags_each_answer(engine: Engine, base_url: str) -> None:
    raw = engine.decide(STATE, QUESTIONS).answers
    p = raw["refund"].noul
    assert abs(tempered(p) - p) > 0.01  # the file visibly changes this answer
    body = httpx.post(f"{base_url}/v1/systemone", json={"state": STATE, "questions": QUESTIONS}, timeout=300).json()
    refund, team = body["answers"]["refund"], body["answers"]["team"]
    assert refund["noul"] == pytest.approx(tempered(p), abs=1e-6)
    assert (refund["x_calibrated"], refund["x_debiased"]) == (True, False)
    assert refund["x_candidate_mass"] == pytest.approx(raw["refund"].candidate_mass, abs=1e-6)  # mass stays raw
    # a question the file was not fitted on is served raw, and says so
    assert (team["x_calibrated"], team["x_debiased"]) == (False, False)
    assert team["probabilities"] == pytest.approx(raw["team"].probabilities, abs=1e-6)


def test_decisions_serves_the_calibrated_probability_to_the_openai_client(engine: Engine, base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    predicate = {"type": "predicate", "instructions": REFUND["instructions"]}
    choice = {
        "type": "choice",
        "instructions": TEAM["instructions"],
        "choices": [{"value": "billing"}, {"value": "shipping"}],
    }
    decision = client.decisions.create(model="smollm2-135m", input=STATE, questions=[predicate, choice])
    p = engine.decide(STATE, {"questions[0]": REFUND}).answers["questions[0]"].noul
    first, second = decision.answers
    assert first.probability == pytest.approx(tempered(p), abs=1e-6)
    assert first.x_calibrated is True and first.x_debiased is False  # the SDK keeps the extensions
    assert second.x_calibrated is False


@pytest.mark.asyncio
async def test_mcp_tools_apply_the_calibration_and_flag_it(engine: Engine, calibrated: Engine) -> None:
    raw_fill = engine.fill(SCHEMA, STATE)
    async with Client(build_server(calibrated), raise_exceptions=True) as client:
        decided = (await client.call_tool("decide", {"state": STATE, "questions": QUESTIONS})).structured_content
        filled = (await client.call_tool("fill", {"state": STATE, "schema": SCHEMA})).structured_content
    assert decided["answers"]["refund"]["x_calibrated"] is True and decided["answers"]["team"]["x_calibrated"] is False
    wants = filled["fields"]["wants_refund"]
    assert wants["calibrated"] is True and filled["fields"]["angry"]["calibrated"] is False
    p = raw_fill.fields["wants_refund"].probabilities["true"]
    assert wants["probability"] == pytest.approx(max(tempered(p), 1 - tempered(p)), abs=1e-6)


@pytest.mark.asyncio
async def test_the_mcp_noul_tool_applies_a_calibration_fitted_under_the_id_q(
    engine: Engine, calibrated: Engine
) -> None:
    question = REFUND["instructions"]
    p = engine.decide(STATE, {"q": REFUND}).answers["q"].noul
    async with Client(build_server(calibrated), raise_exceptions=True) as client:
        answer = (await client.call_tool("noul", {"state": STATE, "question": question})).structured_content
    assert answer["noul"] == pytest.approx(tempered(p), abs=1e-6) and abs(tempered(p) - p) > 0.01
    assert answer["calibrated"] is True and answer["debiased"] is False


def test_a_bad_calibration_file_stops_pcd_serve_and_pcd_mcp_before_any_load(tmp_path: Any, capsys: Any) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 7, "fields": {}}')
    assert main(["serve", "--port", "8999", "--calibration", str(bad)]) == 2
    assert "version" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--calibration", str(bad)])
    assert exit_info.value.code == 2 and "--calibration" in capsys.readouterr().err


def test_pcd_serve_hands_the_file_and_debias_to_the_engine_and_logs_the_recommendation(
    calibration_file: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen: dict[str, Any] = {}

    def fake_serve(factory: Any, **options: Any) -> None:  # uvicorn is not started; the factory is inspected
        seen["factory"] = factory

    monkeypatch.setattr("pcd_integrations.http.app.serve", fake_serve)
    monkeypatch.setattr("pcd_integrations.commands.common.Engine.load", lambda options: options)
    with caplog.at_level(logging.WARNING):
        assert main(["serve", "--calibration", str(calibration_file), "--debias"]) == 0
    options = seen["factory"]()  # the LoadOptions the server's engine would load with
    assert options.calibration == Calibration.load(calibration_file) and options.debias is True
    assert any(RECOMMENDED_MODEL in record.getMessage() for record in caplog.records)


def test_the_recommendation_is_logged_only_for_the_default_model() -> None:
    advice = recommendation(None)
    assert advice is not None and RECOMMENDED_MODEL in advice and "qwen-05b" in advice
    assert recommendation("smollm2-135m") == advice
    assert recommendation(RECOMMENDED_MODEL) is None and recommendation("/models/other.gguf") is None


def test_a_lazy_adapter_reads_its_calibration_file_at_construction_and_loads_no_model(
    calibration_file: Any, tmp_path: Any
) -> None:
    model = PCDDecisionModel(calibration=str(calibration_file))
    assert model.engine is None and model.calibration == str(calibration_file)
    with pytest.raises(Exception, match="cannot read calibration file"):
        PCDDecisionModel(calibration=str(tmp_path / "missing.json"))


def test_the_langchain_decision_model_reports_the_engines_flags(calibrated: Engine) -> None:
    from langchain_core.decisions import Noul

    model = PCDDecisionModel(engine=calibrated)
    questions = {
        "refund": Noul(instructions=REFUND["instructions"]),
        "other": Noul(instructions="Is it about a phone?"),
    }
    answers = model.invoke({"state": STATE, "questions": questions}).answers
    assert answers["refund"].calibrated is True and answers["other"].calibrated is False
    # the solo call packs one question, the adapter's call two: fp32 sums in another order move the fifth decimal
    solo = calibrated.decide(STATE, {"refund": REFUND}).answers["refund"].noul
    assert answers["refund"].noul == pytest.approx(solo, abs=1e-5)


#: always abstains: above every probability
ABSTAIN = FieldCalibration(("true", "false"), 1.0, (0.0, 0.0), abstain_below=NEVER)
#: never abstains, and its set holds every label
ANSWER_ALL = FieldCalibration(("billing", "shipping"), 1.0, (0.0, 0.0), abstain_below=0.0, set_threshold=0.0)


@pytest.fixture(scope="module")
def abstaining(engine: Engine) -> Engine:
    fields = {
        "refund": ABSTAIN,
        "team": ANSWER_ALL,
        "questions[0]": ABSTAIN,
        "questions[1]": ANSWER_ALL,
        "wants_refund": ABSTAIN,
        "angry": FieldCalibration(("true", "false"), 1.0, (0.0, 0.0), abstain_below=0.0, set_threshold=0.0),
    }
    calibration = Calibration("smollm2-135m", False, fields, {"data": "hand-written"}, abstain_risk=0.05, coverage=0.9)
    return Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=calibration)


@pytest.fixture(scope="module")
def abstaining_url(abstaining: Engine) -> Any:
    with serving(create_app(abstaining)) as url:
        yield url


def test_the_openai_client_parses_one_refusal_beside_an_answered_question(
    abstaining: Engine, abstaining_url: str
) -> None:
    client = openai.OpenAI(base_url=f"{abstaining_url}/v1", api_key="unused", max_retries=0)
    predicate = {"type": "predicate", "name": "refund", "instructions": REFUND["instructions"]}
    choice = {
        "type": "choice",
        "name": "team",
        "instructions": TEAM["instructions"],
        "choices": [{"value": "billing"}, {"value": "shipping"}],
    }
    decision = client.decisions.create(model="smollm2-135m", input=STATE, questions=[predicate, choice])
    refused, answered = decision.answers
    assert refused.type == "refusal" and refused.name == "refund"
    assert type(refused).__name__ == "AnswerAnswerResourceRefusal"  # the SDK's own refusal type
    read = abstaining.decide(STATE, {"questions[0]": REFUND}).answers["questions[0]"]
    assert refused.x_abstained is True  # the declined reading stays in the extension
    # read alone, not packed beside the choice: float32 sums differ in the last digits
    assert refused.x_answer["probability"] == pytest.approx(read.noul, abs=1e-4)
    assert answered.type == "choice" and answered.choice in ("billing", "shipping")
    assert type(answered).__name__ == "AnswerAnswerResourceChoice"


def test_systemone_carries_x_abstained_and_x_answer_set(abstaining_url: str) -> None:
    questions = {"refund": REFUND, "team": TEAM}
    body = httpx.post(
        f"{abstaining_url}/v1/systemone", json={"state": STATE, "questions": questions}, timeout=300
    ).json()
    refund, team = body["answers"]["refund"], body["answers"]["team"]
    assert refund["x_abstained"] is True and refund["x_answer_set"] is None and 0 <= refund["noul"] <= 1
    assert team["x_abstained"] is False
    assert team["x_answer_set"][0] == team["choice"] and sorted(team["x_answer_set"]) == ["billing", "shipping"]


def test_chat_completions_fields_carry_abstained_and_answer_set(abstaining_url: str) -> None:
    client = openai.OpenAI(base_url=f"{abstaining_url}/v1", api_key="unused", max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}}
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": STATE}], response_format=response_format
    )
    fields = reply.x_pcd["fields"]
    assert fields["wants_refund"]["abstained"] is True and fields["angry"]["abstained"] is False
    assert sorted(fields["angry"]["answer_set"]) == [False, True] and fields["wants_refund"]["answer_set"] is None


@pytest.mark.asyncio
async def test_mcp_results_carry_abstained_and_answer_set(abstaining: Engine) -> None:
    async with Client(build_server(abstaining), raise_exceptions=True) as client:
        decided = await client.call_tool("decide", {"state": STATE, "questions": {"refund": REFUND, "team": TEAM}})
        filled = (await client.call_tool("fill", {"state": STATE, "schema": SCHEMA})).structured_content
    answers = decided.structured_content["answers"]
    assert answers["refund"]["x_abstained"] is True and answers["team"]["x_abstained"] is False
    assert len(answers["team"]["x_answer_set"]) == 2
    assert filled["fields"]["wants_refund"]["abstained"] is True and filled["fields"]["angry"]["abstained"] is False
    assert len(filled["fields"]["angry"]["answer_set"]) == 2


def test_the_langchain_decision_model_says_which_answer_it_abstained_from(abstaining: Engine) -> None:
    from langchain_core.decisions import Choice, Noul

    model = PCDDecisionModel(engine=abstaining)
    questions = {
        "refund": Noul(instructions=REFUND["instructions"]),
        "team": Choice(instructions=TEAM["instructions"], criteria=TEAM["criteria"]),
    }
    answers = model.invoke({"state": STATE, "questions": questions}).answers
    assert answers["refund"].abstained is True and answers["team"].abstained is False
    assert answers["refund"].noul == pytest.approx(
        abstaining.decide(STATE, {"refund": REFUND}).answers["refund"].noul, abs=1e-4
    )
    assert sorted(answers["team"].answer_set) == ["billing", "shipping"]
