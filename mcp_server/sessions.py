"""MCP tools that keep a running judgement of a conversation: ``session_open``, ``session_append``,
``session_close`` (``pcd_core/sessions/session.py``).

An agent host opens a session with a question set, appends each turn of its own conversation as it
happens and reads the answers for the whole conversation so far; each append reads only the new
turn. Sessions are kept per server in memory (a restart forgets them) and bounded by the engine's
``max_sessions`` like every session. ``tests/test_mcp_sessions.py`` calls the tools with the ``mcp``
client in-process.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer  # at run time: the SDK reads the tools' signatures
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

from pcd_core import Answer, DecideResponse, Engine, Question, Session, Usage

#: the session tools' names, which are not read-only (they change the session they name)
SESSION_TOOLS = frozenset({"session_open", "session_append", "session_close"})


class SessionOpened(BaseModel):
    session_id: str = Field(description="Pass it to session_append and session_close.")


class SessionAnswers(BaseModel):
    """The answers for the whole conversation so far, and the triggers this turn fired."""

    model: str
    answers: dict[str, Answer]
    triggers: list[dict[str, Any]] = Field(
        description="Each fired trigger: its turn, value and probability before and after."
    )
    usage: Usage


class SessionClosed(BaseModel):
    closed: bool


def add_session_tools(
    server: MCPServer,
    engine_of: Callable[[Context], Awaitable[Engine]],
    run: Callable[[Callable[[], Any]], Awaitable[Any]],
    checked: Callable[[Callable[[], Any]], Any],
) -> dict[str, Session]:
    """The three tools on ``server``; ``engine_of`` waits for the engine, ``run`` runs a blocking call
    in a worker thread turning a caller's mistake into a tool error, ``checked`` does so for a quick one.
    """
    sessions: dict[str, Session] = {}

    def named(session_id: str) -> Session:
        if session_id not in sessions:
            raise ToolError(f"no session {session_id!r}: open one with session_open (a closed one is gone)")
        return sessions[session_id]

    @server.tool(
        title="Open a conversation session",
        description=(
            "Open a session that answers the same questions about a growing conversation. questions maps "
            "your ids to System One questions, as in decide. Append each turn with session_append: it reads "
            "only the new turn and answers for the whole conversation. triggers (optional) watch an id: "
            "{'field': id, 'changed': true} or {'field': id, 'above': 0.7} (or 'below'); fired ones come "
            "back with each append."
        ),
    )
    async def session_open(
        questions: Annotated[dict[str, Question], Field(description="Question id to question; at least one.")],
        ctx: Context,
        triggers: Annotated[list[dict[str, Any]] | None, Field(description="Triggers to watch.")] = None,
    ) -> SessionOpened:
        engine = await engine_of(ctx)

        def open_one() -> Session:
            session = engine.session(dict(questions))
            for trigger in triggers or []:
                session.when(**trigger)
            return session

        session = checked(open_one)
        session_id = "sess_" + secrets.token_hex(12)
        sessions[session_id] = session
        return SessionOpened(session_id=session_id)

    @server.tool(
        title="Append a turn and judge the conversation",
        description="Append one turn (role: a word such as user, assistant, customer) and get the answers.",
    )
    async def session_append(
        session_id: str,
        text: Annotated[str, Field(description="The turn's text.")],
        role: Annotated[str, Field(description="Who said it.")] = "user",
    ) -> SessionAnswers:
        session = named(session_id)
        result: DecideResponse = await run(lambda: session.append(text, role=role))
        return SessionAnswers(
            model=result.model,
            answers=result.answers,
            triggers=[fired.to_dict() for fired in result.triggers],
            usage=result.usage,
        )

    @server.tool(title="Close a session", description="Close the session and free its memory.")
    async def session_close(session_id: str) -> SessionClosed:
        named(session_id).close()
        del sessions[session_id]
        return SessionClosed(closed=True)

    return sessions
