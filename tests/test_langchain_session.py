"""``PCDSessionMiddleware`` in a real ``create_agent`` loop on the embedded model."""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent

from pcd_core import Engine
from pcd_integrations.langchain import ChatPCD
from pcd_integrations.langchain.session import PCDSessionMiddleware

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the user ask for a refund?"},
    "mood": {"type": "choice", "instructions": "How does the user feel?", "criteria": {"angry": "", "calm": ""}},
}


def test_the_agents_state_carries_the_sessions_decisions_after_each_turn(engine: Engine) -> None:
    middleware = PCDSessionMiddleware(engine, QUESTIONS, triggers=[{"field": "refund", "above": 0.01}])
    agent: Any = create_agent(ChatPCD(engine=engine, max_tokens=8), tools=[], middleware=[middleware])
    state = agent.invoke({"messages": [("user", "My order never came. I want a refund.")]})
    decisions = state["pcd_decisions"]
    session, read = next(iter(middleware._sessions.values()))
    assert [t.role for t in read] == ["user", "assistant"]  # the reply was read after the agent's step
    fresh = engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce)
    assert decisions["refund"]["noul"] == pytest.approx(fresh.answers["refund"].noul, abs=1e-5)
    # a second turn: the session reads only what is new, and a middleware that lost its sessions
    # (a restart) opens one from the messages and answers the same
    state = agent.invoke({"messages": [*state["messages"], ("user", "Please hurry.")]})
    again = PCDSessionMiddleware(engine, QUESTIONS)
    update = again._follow(state)
    assert update is not None
    reopened, reread = next(iter(again._sessions.values()))
    assert reread == next(iter(middleware._sessions.values()))[1]  # every message, as the first one read them
    fresh = engine.decide(reopened.text, QUESTIONS, fence_nonce=reopened.nonce)
    assert update["pcd_decisions"]["refund"]["noul"] == pytest.approx(fresh.answers["refund"].noul, abs=1e-5)
