"""A LangChain 1.x agent middleware that keeps a session over the agent's messages.

``PCDSessionMiddleware(engine, questions, triggers=...)`` goes into ``create_agent(...,
middleware=[...])``. Before each model call and after the agent's last step it appends the messages
the agent state holds that its session has not read yet (``pcd_core/sessions/session.py``: only those are
read) and puts the answers for the whole conversation into the state: ``pcd_decisions`` (question id
to the System One answer) and ``pcd_triggers`` (what the last append fired), for a graph to route,
stop or hand over on. A message's role is its type (human: ``user``, ai: ``assistant``, tool:
``tool``); a message with no text (an AI message that only calls tools) is read as its tool calls'
names and arguments.

The session is keyed by the conversation's first message id. One the middleware does not hold (a
new conversation, or a restarted process whose sessions are gone) is opened and fed every message,
so it answers as if it had been there all along; a conversation whose messages are no longer a
continuation of what the session read (a summarised history) is read again the same way.
``tests/test_langchain_session.py`` runs it in a real ``create_agent`` loop.
"""

from __future__ import annotations

import json
import threading
from typing import Any, NotRequired

from langchain.agents.middleware import AgentMiddleware, AgentState
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from pcd_core import DecideResponse, Engine, Session, SessionTurn


class SessionState(AgentState):
    """The agent state with the session's answers after the latest message."""

    pcd_decisions: NotRequired[dict[str, Any]]
    pcd_triggers: NotRequired[list[dict[str, Any]]]


def message_turn(message: BaseMessage) -> SessionTurn | None:
    """A message as a session turn (None for one with nothing to read, such as a system message)."""
    role = {HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool"}.get(type(message))
    if role is None:
        return None
    text = str(message.text)
    if not text.strip() and isinstance(message, AIMessage) and message.tool_calls:
        text = "; ".join(f"{c['name']}({json.dumps(c['args'], ensure_ascii=False)})" for c in message.tool_calls)
    return SessionTurn(role, text) if text.strip() else None


class PCDSessionMiddleware(AgentMiddleware[SessionState, Any, Any]):
    """Keeps a ``decide`` session over the agent's messages; see the module docstring."""

    state_schema = SessionState

    def __init__(self, engine: Engine, questions: dict[str, Any], triggers: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.engine, self.questions, self.triggers = engine, questions, list(triggers or [])
        self._sessions: dict[str, tuple[Session, list[SessionTurn]]] = {}
        self._lock = threading.Lock()

    def before_model(self, state: SessionState, runtime: Any) -> dict[str, Any] | None:
        return self._follow(state)

    def after_agent(self, state: SessionState, runtime: Any) -> dict[str, Any] | None:
        return self._follow(state)

    def _follow(self, state: SessionState) -> dict[str, Any] | None:
        messages = state["messages"]
        turns = [turn for turn in map(message_turn, messages) if turn is not None]
        if not turns:
            return None
        key = str(messages[0].id or id(messages[0]))
        with self._lock:
            session, read = self._sessions.get(key, (None, []))
            if session is None or turns[: len(read)] != read:  # new, forgotten, or rewritten history
                if session is not None:
                    session.close()
                session, read = self._open(), []
            result: DecideResponse | None = None
            fired: list[dict[str, Any]] = []
            for turn in turns[len(read) :]:
                answer = session.append(turn.text, role=turn.role)
                assert isinstance(answer, DecideResponse)  # a question set's session decides
                result = answer
                fired += [f.to_dict() for f in answer.triggers]
            self._sessions[key] = (session, turns)
        if result is None:
            return None
        return {
            "pcd_decisions": {qid: a.model_dump(mode="json") for qid, a in result.answers.items()},
            "pcd_triggers": fired,
        }

    def _open(self) -> Session:
        session = self.engine.session(self.questions)
        for trigger in self.triggers:
            session.when(**trigger)
        return session
