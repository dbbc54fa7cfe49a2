"""PCDDecisionModel in LangChain's decision-model slot, on the embedded model: every answer type equals
``engine.decide`` on the same question, states of every shape, typed errors, batch and async, and
``create_agent`` with ``ModelRouterMiddleware`` and ``AutoModeMiddleware`` end to end.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AutoModeMiddleware, ModelChoice, ModelRouterMiddleware
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.decisions import (
    Box,
    Choice,
    ChoiceAnswer,
    ClassifierResponse,
    Noul,
    NoulAnswer,
    NoulCriteria,
    Score,
    ScoreAnswer,
)
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from pcd_core import Engine
from pcd_integrations.langchain import PCDDecisionModel
from pcd_integrations.langchain.decisions import (
    UnsupportedContentError,
    UnsupportedQuestionError,
    render_state,
)

REFUND = "I was charged twice this month. Refund the duplicate payment today, please!"
CRASH = "The app crashes with an error whenever I press save."

# the same three questions, as LangChain asks them and as the engine takes them
QUESTIONS = {
    "refund": Noul(
        instructions="Does the customer ask for money back?",
        criteria=NoulCriteria(true="A refund or chargeback is requested."),
    ),
    "team": Choice(
        instructions="Which team should handle this request?",
        criteria={"billing": "Payments, charges, refunds.", "technical": "Crashes, bugs, errors.", "sales": None},
    ),
    "anger": Score(instructions="How upset is the customer?", criteria=["calm", "annoyed", "furious"]),
}
ENGINE_QUESTIONS: dict[str, Any] = {
    "refund": {
        "type": "noul",
        "instructions": "Does the customer ask for money back?",
        "criteria": {"true": "A refund or chargeback is requested.", "false": None},
    },
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this request?",
        "criteria": {"billing": "Payments, charges, refunds.", "technical": "Crashes, bugs, errors.", "sales": None},
    },
    "anger": {
        "type": "score",
        "instructions": "How upset is the customer?",
        "criteria": ["calm", "annoyed", "furious"],
    },
}


@pytest.fixture
def dm(engine: Engine) -> PCDDecisionModel:
    return PCDDecisionModel(engine=engine)


class ClassifierRuns(BaseCallbackHandler):
    """The decision model's runs as LangChain reports them: each request and its response."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.responses: list[ClassifierResponse] = []
        self.threads: list[int] = []

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        if isinstance(inputs, dict) and "questions" in inputs:
            self.requests.append(inputs)

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        if isinstance(outputs, ClassifierResponse):
            self.responses.append(outputs)


def assert_matches_engine(response: ClassifierResponse, expected: Any) -> None:
    """Every answer equals the engine's own answer to 1e-6, and usage is what the engine read."""
    assert list(response.answers) == list(expected.answers)
    for qid, want in expected.answers.items():
        got = response.answers[qid]
        assert got.candidate_mass == pytest.approx(want.candidate_mass, abs=1e-6)  # type: ignore[union-attr]
        if want.type == "noul":
            assert isinstance(got, NoulAnswer)
            assert got.noul == pytest.approx(want.noul, abs=1e-6)
        elif want.type == "choice":
            assert isinstance(got, ChoiceAnswer)
            assert got.choice == want.choice == max(got.probabilities, key=got.probabilities.__getitem__)
            assert got.probabilities == pytest.approx(want.probabilities, abs=1e-6)
            assert got.confidence == pytest.approx(want.confidence, abs=1e-6)
        else:
            assert isinstance(got, ScoreAnswer)
            assert got.probabilities == pytest.approx({int(k): p for k, p in want.probabilities.items()}, abs=1e-6)
            assert got.score == pytest.approx(sum(level * p for level, p in got.probabilities.items()), abs=1e-9)
            assert got.confidence == pytest.approx(want.confidence, abs=1e-6)
    assert response.model == expected.model
    usage = dict(response.usage or {})
    assert usage.pop("input_token_details").keys() == {"cache_read"}
    assert usage == {
        "input_tokens": expected.usage.input_tokens,
        "output_tokens": 0,
        "total_tokens": expected.usage.input_tokens,
    }


# -- answers ----------------------------------------------------------------------------------


def test_noul_choice_and_score_equal_engine_decide(dm: PCDDecisionModel, engine: Engine) -> None:
    response = dm.invoke({"state": REFUND, "questions": QUESTIONS})
    expected = engine.decide(REFUND, ENGINE_QUESTIONS)
    assert_matches_engine(response, expected)
    # both calls after the first read the decide head from the cache, and say so
    warm = dm.invoke({"state": REFUND, "questions": QUESTIONS}).usage
    assert warm is not None and warm["input_token_details"] == {"cache_read": expected.stats.cached_tokens} != {
        "cache_read": 0
    }
    assert response.scores["anger"].legend == {0: "calm", 1: "annoyed", 2: "furious"}
    assert sum(response.choices["team"].probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    # the extras survive a dump when asked for; LangChain's own fields are always there
    refund = response.nouls["refund"]
    dumped = response.model_dump(serialize_as_any=True)["answers"]["refund"]
    assert dumped == {
        "type": "noul",
        "noul": refund.noul,
        "candidate_mass": refund.candidate_mass,  # type: ignore[attr-defined]
        "debiased": False,  # what the engine did to the probabilities: nothing here
        "calibrated": False,
        "abstained": False,  # no calibration, so no threshold and no set
        "answer_set": None,
        "order_spread": None,  # read in one order
        "method": "trie",  # read zero-shot: no trained head (docs/heads.md)
        "zero_shot": None,
    }


def test_questions_as_dicts_answer_like_question_models(dm: PCDDecisionModel) -> None:
    as_models = dm.invoke({"state": CRASH, "questions": {"team": QUESTIONS["team"]}})
    as_dicts = dm.invoke({"state": CRASH, "questions": {"team": QUESTIONS["team"].model_dump()}})
    assert as_dicts.choices["team"].probabilities == pytest.approx(as_models.choices["team"].probabilities, abs=1e-9)


# -- states -----------------------------------------------------------------------------------


def test_messages_are_read_as_role_tagged_text(dm: PCDDecisionModel, engine: Engine) -> None:
    call = {"name": "refund_payment", "args": {"amount": 42}, "id": "call-1"}
    conversation = [SystemMessage("Be brief."), HumanMessage(REFUND), AIMessage("", tool_calls=[call])]
    transcript = f'[system] Be brief.\n[user] {REFUND}\n[assistant tool call] refund_payment {{"amount": 42}}'
    questions = {"refund": QUESTIONS["refund"]}
    engine_questions = {"refund": ENGINE_QUESTIONS["refund"]}
    assert_matches_engine(
        dm.invoke({"state": conversation, "questions": questions}), engine.decide(transcript, engine_questions)
    )
    assert_matches_engine(
        dm.invoke({"state": HumanMessage(REFUND), "questions": questions}),
        engine.decide(f"[user] {REFUND}", engine_questions),
    )


def test_nested_json_is_read_as_json_with_messages_as_text(dm: PCDDecisionModel, engine: Engine) -> None:
    state = {"ticket": {"priority": 2, "thread": [HumanMessage(CRASH), AIMessage("Which version?")]}, "vip": True}
    as_json = {"ticket": {"priority": 2, "thread": [f"[user] {CRASH}", "[assistant] Which version?"]}, "vip": True}
    assert render_state(state) == as_json
    assert_matches_engine(
        dm.invoke({"state": state, "questions": {"team": QUESTIONS["team"]}}),
        engine.decide(as_json, {"team": ENGINE_QUESTIONS["team"]}),
    )


def test_box_questions_and_media_are_typed_errors_before_any_load() -> None:
    dm = PCDDecisionModel(model="smollm2-135m")
    image = {"type": "image", "url": "https://example.com/receipt.png"}
    with pytest.raises(UnsupportedQuestionError, match="'where'.*Box"):
        dm.invoke({"state": REFUND, "questions": {"where": Box(instructions="Find the total.")}})
    for state, where in [
        ({"receipt": image}, r"state\['receipt'\]"),
        (HumanMessage(content=[{"type": "text", "text": "see"}, image]), r"state\.content\[1\]"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}], r"state\[0\]"),
    ]:
        with pytest.raises(UnsupportedContentError, match=where + ".*'image(_url)?' block.*text only"):
            dm.invoke({"state": state, "questions": {"refund": QUESTIONS["refund"]}})
    with_media = Choice(instructions=["Which receipt matches?", image], criteria={"a": None, "b": None})
    with pytest.raises(UnsupportedContentError, match=r"questions\['pick'\]"):
        dm.invoke({"state": REFUND, "questions": {"pick": with_media}})
    assert dm.engine is None


# -- batch and async --------------------------------------------------------------------------


def test_batch_reads_requests_that_share_questions_in_one_decide_many(
    dm: PCDDecisionModel, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int]] = []
    decide, decide_many = engine.decide, engine.decide_many

    def recording_decide(state: Any, questions: Any) -> Any:
        calls.append(("decide", 1))
        return decide(state, questions)

    def recording_decide_many(states: Any, questions: Any) -> Any:
        calls.append(("decide_many", len(states)))
        return decide_many(states, questions)

    monkeypatch.setattr(engine, "decide", recording_decide)
    monkeypatch.setattr(engine, "decide_many", recording_decide_many)
    runs = ClassifierRuns()
    requests: list[Any] = [
        {"state": REFUND, "questions": {"team": QUESTIONS["team"]}},
        {"state": REFUND, "questions": {"where": Box(instructions="Find the total.")}},
        {"state": CRASH, "questions": {"team": QUESTIONS["team"]}},
    ]
    results = dm.batch(requests, config={"callbacks": [runs]}, return_exceptions=True)
    assert calls == [("decide_many", 2)]  # the Box request is refused by its own run, unread
    assert isinstance(results[1], UnsupportedQuestionError)
    assert runs.responses == [results[0], results[2]] and len(runs.requests) == 3
    single = dm.invoke(requests[2])
    assert results[2].choices["team"].probabilities == pytest.approx(single.choices["team"].probabilities, abs=1e-5)
    with pytest.raises(UnsupportedQuestionError):
        dm.batch(requests)


def test_async_calls_agree_and_leave_the_event_loop_free(dm: PCDDecisionModel) -> None:
    request: Any = {"state": CRASH, "questions": {"team": QUESTIONS["team"]}}
    expected = dm.invoke(request).choices["team"].probabilities

    async def run() -> tuple[int, list[ClassifierResponse]]:
        ticks = 0
        task = asyncio.ensure_future(dm.abatch([request, request]))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.005)
        return ticks, [await dm.ainvoke(request), *await task]

    ticks, responses = asyncio.run(run())
    assert ticks > 1
    for response in responses:  # the two of abatch read together: their solo call's to 1e-5
        assert response.choices["team"].probabilities == pytest.approx(expected, abs=1e-5)


# -- construction -----------------------------------------------------------------------------


def test_weights_load_on_first_use_and_a_shared_engine_names_the_model(engine: Engine) -> None:
    lazy = PCDDecisionModel(model="smollm2-135m")
    assert lazy.engine is None and lazy.model == "smollm2-135m"
    assert PCDDecisionModel(engine=engine).model == engine.model_name
    with pytest.raises(ValueError, match="engine runs"):
        PCDDecisionModel(model="some-other-model", engine=engine)


# -- agents -----------------------------------------------------------------------------------


def test_model_router_sends_each_request_to_the_model_the_decision_chose(dm: PCDDecisionModel) -> None:
    models = {
        "billing": FakeMessagesListChatModel(responses=[AIMessage("billing model answered")]),
        "technical": FakeMessagesListChatModel(responses=[AIMessage("technical model answered")]),
    }
    criteria = {"billing": "Payments, charges, refunds and invoices.", "technical": "Crashes, bugs and errors."}
    instructions = "Which team should handle this support request?"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the middleware is beta and says so on construction
        router = ModelRouterMiddleware(
            choices={name: ModelChoice(model=models[name], criteria=criteria[name]) for name in models},
            instructions=instructions,
            classifier=dm,
        )
    default = FakeMessagesListChatModel(responses=[AIMessage("default model answered")])
    agent = create_agent(default, middleware=[router])
    for text in (REFUND, CRASH):
        runs = ClassifierRuns()
        state = agent.invoke({"messages": [HumanMessage(text)]}, config={"callbacks": [runs]})
        route = state["model_route"]
        assert isinstance(route, ChoiceAnswer)
        [response] = runs.responses
        assert route == response.choices["model_route"]
        assert route.choice == max(route.probabilities, key=route.probabilities.__getitem__)
        assert state["messages"][-1].content == f"{route.choice} model answered"
        # the router asked the latest human message, which the engine reads as role-tagged text
        direct = dm.invoke(
            {"state": HumanMessage(text), "questions": {"q": Choice(instructions=instructions, criteria=criteria)}}
        )
        assert route.probabilities == pytest.approx(direct.choices["q"].probabilities, abs=1e-6)


class ToolCallingFake(FakeMessagesListChatModel):
    """A scripted chat model that accepts tools, as ``create_agent`` binds them."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ToolCallingFake:
        return self


def test_auto_mode_runs_or_blocks_each_tool_call_as_its_noul_says(dm: PCDDecisionModel, engine: Engine) -> None:
    executed: list[str] = []

    @tool
    def delete_all_files(path: str) -> str:
        """Permanently delete every file under a directory, without a backup."""
        executed.append("delete_all_files")
        return "deleted"

    @tool
    def get_weather(city: str) -> str:
        """Read today's public weather forecast for a city."""
        executed.append("get_weather")
        return "sunny"

    calls = [
        ("What's the weather in Paris today?", {"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}),
        ("Tell me a joke.", {"name": "delete_all_files", "args": {"path": "/"}, "id": "c2"}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = AutoModeMiddleware(tools=[delete_all_files, get_weather], classifier=dm)
    for text, call in calls:
        executed.clear()
        model = ToolCallingFake(responses=[AIMessage("", tool_calls=[call]), AIMessage("done")])
        agent = create_agent(model, tools=[delete_all_files, get_weather], middleware=[guard])
        runs = ClassifierRuns()
        state = agent.invoke({"messages": [HumanMessage(text)]}, config={"callbacks": [runs]})
        [request], [response] = runs.requests, runs.responses
        risky = response.nouls["is_risky"].noul
        # the answer is the engine's for exactly the state and question the middleware sent
        expected = dm.invoke(request).nouls["is_risky"]
        assert risky == pytest.approx(expected.noul, abs=1e-6)
        assert request["state"]["tool_call"]["name"] == call["name"]
        [result] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
        if risky >= 0.5:
            assert executed == [] and result.status == "error"
            assert f"(probability: {risky:.2f})" in result.content
        else:
            assert executed == [call["name"]] and result.status == "success"
