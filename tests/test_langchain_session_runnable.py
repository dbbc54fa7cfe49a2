"""``PCDSessionRunnable`` as a LangGraph node and in a ``RunnableSequence``, on the embedded model.

The reference for each answer is the same session's own ``append``: a fork opened before the first
turn shares the runnable's session nonce (and nothing read after it), and is fed the same turns
directly, so the runnable must give the same values and probabilities; a fresh ``decide`` with that
nonce checks the pair independently (``tests/test_session.py`` holds sessions to it).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import pytest
from langchain_core.runnables import RunnableLambda, RunnableSequence
from langgraph.graph import END, START, StateGraph

from pcd_core import DecideResponse, Engine, Extraction, OptionError, Session
from pcd_integrations.langchain import PCDSessionRunnable

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "mood": {"type": "choice", "instructions": "How does the customer feel?", "criteria": {"angry": "", "calm": ""}},
}
SCHEMA = {
    "type": "object",
    "properties": {"escalate": {"type": "boolean", "description": "hand the chat to a human now"}},
}
FIRST = (
    "Hello. I ordered a standing desk, order 55120, on the third of March and paid for express delivery. "
    "The tracking page has said 'label created' for eleven days, nobody answers the phone line, and the "
    "two emails I sent to the shipping team came back with an automatic reply and nothing else since."
)
TURNS = [
    {"role": "customer", "text": FIRST},
    {"role": "agent", "text": "Sorry! Let me check the tracking."},
    {"role": "customer", "text": "Just refund me."},
]


def assert_same_decisions(got: DecideResponse, want: DecideResponse) -> None:
    assert got.answers.keys() == want.answers.keys()
    assert_same_json(got.to_wire()["answers"], want.to_wire()["answers"])


def assert_same_probabilities(got: DecideResponse, want: DecideResponse) -> None:
    """The equality a session promises against a fresh decide (``tests/test_session.py``): every
    probability within 1e-5; log-probabilities and mass, unbounded numbers, are not held to it.
    """
    assert got.answers.keys() == want.answers.keys()
    for qid, answer in want.answers.items():
        mine = got.answers[qid]
        if answer.type == "noul":
            assert mine.noul == pytest.approx(answer.noul, abs=1e-5), qid
        else:
            assert mine.probabilities.keys() == answer.probabilities.keys()
            for name, p in answer.probabilities.items():
                assert mine.probabilities[name] == pytest.approx(p, abs=1e-5), (qid, name)


def assert_same_json(got: Any, want: Any, tolerance: float = 1e-6) -> None:
    """Equal JSON, numbers within ``tolerance``, everything else exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            assert_same_json(got[key], want[key], tolerance)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for mine, theirs in zip(got, want, strict=True):
            assert_same_json(mine, theirs, tolerance)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=tolerance)
    else:
        assert got == want


class Conversation(TypedDict, total=False):
    turn: dict[str, str]
    decisions: dict[str, Any]
    passes: int


def test_a_langgraph_node_answers_each_turn_as_the_sessions_own_append(engine: Engine) -> None:
    runnable = PCDSessionRunnable.open(engine, QUESTIONS, output="json")
    reference: Session = runnable.session.fork()  # the same nonce, nothing read yet
    node = (
        RunnableLambda(lambda state: state["turn"])
        | runnable
        | RunnableLambda(lambda body: {"decisions": body["answers"], "passes": body["x_forward_passes"]})
    )
    builder = StateGraph(Conversation)
    builder.add_node("judge", node)
    builder.add_edge(START, "judge")
    builder.add_edge("judge", END)
    graph = builder.compile()
    n_earlier = 0
    for index, turn in enumerate(TURNS):
        state = graph.invoke({"turn": turn})
        want = reference.append(turn["text"], role=turn["role"])
        assert isinstance(want, DecideResponse)
        assert_same_json(state["decisions"], want.to_wire()["answers"])
        fresh = engine.decide(runnable.session.text, QUESTIONS, fence_nonce=runnable.session.nonce)
        assert_same_probabilities(want, fresh)
        # what this append read: its own turn, the tail and the rows, never the turns before it
        # (the first append may read the cached head the reference then finds: compared from the second)
        mine = runnable.session.result
        assert mine is not None and state["passes"] == mine.stats.forward_passes
        if index:
            assert (mine.stats.forward_passes, mine.stats.prompt_tokens) == (
                want.stats.forward_passes,
                want.stats.prompt_tokens,
            )
            assert mine.stats.cached_tokens >= n_earlier
            assert mine.stats.prompt_tokens < n_earlier, (mine.stats.prompt_tokens, n_earlier)
        n_earlier = len(engine.tokenizer.encode_head(runnable.session.text))
    runnable.close()
    reference.close()


def test_batch_applies_the_turns_of_one_conversation_in_order(engine: Engine) -> None:
    runnable = PCDSessionRunnable.open(engine, QUESTIONS, triggers=[{"field": "refund", "changed": True}])
    reference = runnable.session.fork()
    chain = RunnableSequence(RunnableLambda(lambda turn: turn), runnable)
    got = chain.batch(TURNS, {"max_concurrency": 8})
    assert [t.text for t in runnable.session.turns] == [t["text"] for t in TURNS]
    for turn, mine in zip(TURNS, got, strict=True):
        want = reference.append(turn["text"], role=turn["role"])
        assert isinstance(mine, DecideResponse) and isinstance(want, DecideResponse)
        assert_same_decisions(mine, want)
        assert [f.to_dict() for f in mine.triggers] == [f.to_dict() for f in want.triggers]
    # a bad turn in a batch: its slot holds the typed error, the session stays as it was, the next lands
    more = runnable.batch([{"text": "ok", "role": "not a role"}, "Thanks."], return_exceptions=True)
    assert isinstance(more[0], OptionError) and isinstance(more[1], DecideResponse)
    assert [t.text for t in runnable.session.turns][-1] == "Thanks." and len(runnable.session.turns) == 4
    with pytest.raises(OptionError, match="'speaker'"):
        runnable.invoke({"text": "hi", "speaker": "user"})
    runnable.close()
    reference.close()


def test_ainvoke_and_abatch_append_in_order_on_a_schema(engine: Engine) -> None:
    runnable = PCDSessionRunnable.open(engine, SCHEMA)
    reference = runnable.session.fork()

    async def run() -> list[Any]:
        first = await runnable.ainvoke("My parcel is two weeks late.")
        rest = await runnable.abatch(["Sorry, checking now.", {"text": "I want a human.", "role": "customer"}])
        return [first, *rest]

    got = asyncio.run(run())
    sent = [("My parcel is two weeks late.", "user"), ("Sorry, checking now.", "user"), ("I want a human.", "customer")]
    for (text, role), mine in zip(sent, got, strict=True):
        want = reference.append(text, role=role)
        assert isinstance(mine, Extraction) and isinstance(want, Extraction)
        assert mine.value == want.value
        assert mine.fields["escalate"].probabilities == pytest.approx(want.fields["escalate"].probabilities, abs=1e-6)
    runnable.close()
    reference.close()
