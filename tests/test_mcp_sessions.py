"""The MCP session tools, called with the ``mcp`` client in-process on the real model."""

from __future__ import annotations

import pytest
from mcp import Client

from mcp_server import build_server

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "mood": {"type": "choice", "instructions": "How does the customer feel?", "criteria": {"angry": "", "calm": ""}},
}


@pytest.mark.asyncio
async def test_an_agent_opens_appends_and_closes_a_session(engine) -> None:
    server = build_server(engine)
    async with Client(server, raise_exceptions=True) as client:
        opened = await client.call_tool(
            "session_open", {"questions": QUESTIONS, "triggers": [{"field": "refund", "above": 0.01}]}
        )
        assert not opened.is_error, opened.content
        sid = opened.structured_content["session_id"]
        first = await client.call_tool("session_append", {"session_id": sid, "text": "Refund me now.", "role": "user"})
        second = await client.call_tool(
            "session_append", {"session_id": sid, "text": "Sure, it is on its way.", "role": "assistant"}
        )
        assert not first.is_error and not second.is_error, (first.content, second.content)
        text = "user: Refund me now.\nassistant: Sure, it is on its way."
        assert [f["turn"] for f in first.structured_content["triggers"]] == [1]
        assert second.structured_content["triggers"] == []  # fired once, not again above its threshold
        noul = second.structured_content["answers"]["refund"]["noul"]
        session = next(iter(server_sessions(server).values()))
        assert session.text == text
        fresh = engine.decide(text, QUESTIONS, fence_nonce=session.nonce)
        assert noul == pytest.approx(fresh.answers["refund"].noul, abs=1e-5)
        closed = await client.call_tool("session_close", {"session_id": sid})
        assert closed.structured_content == {"closed": True}
        gone = await client.call_tool("session_append", {"session_id": sid, "text": "hello"})
        assert gone.is_error and "no session" in gone.content[0].text


def server_sessions(server):
    """The sessions the server's tools keep (the closure ``add_session_tools`` returned)."""
    from mcp_server.http_transport import SERVED

    return SERVED[server].sessions
