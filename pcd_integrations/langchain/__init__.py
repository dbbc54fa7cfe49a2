"""LangChain on the PCD engine: ``ChatPCD`` (a chat model, ``chat_model.py``), ``PCDDecisionModel``
(LangChain's decision slot, ``decisions.py``) and ``PCDSessionMiddleware`` (an agent middleware that
keeps a session, ``session.py``); ``PCDSessionRunnable`` (a Runnable over a session's ``append``, for
LangGraph, ``session_runnable.py``).

The names users import from ``pcd_integrations.langchain`` are re-exported here; importing them without
the ``langchain`` extra raises ``BackendUnavailableError`` with the install hint (``tests/test_langchain.py``
checks it in a fresh process). The middleware is imported from ``pcd_integrations.langchain.session``
only, because it needs the ``langchain`` package itself and not just ``langchain-core``.
"""

from pcd_integrations.langchain.chat_model import NO_TOOL, ChatPCD, render_chat_messages, render_messages
from pcd_integrations.langchain.decisions import PCDDecisionModel
from pcd_integrations.langchain.session_runnable import PCDSessionRunnable

__all__ = [
    "NO_TOOL",
    "ChatPCD",
    "PCDDecisionModel",
    "PCDSessionRunnable",
    "render_chat_messages",
    "render_messages",
]
