"""Wire protocols over ``engine.decide``: one set of pydantic models per protocol, shared by every server.

- System One (``POST /v1/systemone``, MCP ``decide``): the question and answer models of
  ``pcd_core/request/questions.py`` are that wire themselves.
- OpenAI Decisions (``POST /v1/decisions``): ``decisions.py`` declares its request and response and
  translates them to and from the System One models, so both routes make the same engine call;
  ``decision_input.py`` declares its input items and splits them into state, turns and instructions.
- OpenAI Chat Completions (``POST /v1/chat/completions``): ``chat.py`` declares its request,
  ``chat_reply.py`` its reply and stream chunks; ``errors.py`` the error body every OpenAI route
  answers with.
- ``served.py``: the served model as ``GET /v1/models`` lists it in both protocols, and ``/healthz``.
- ``body.py`` reads a raw JSON body strictly (duplicate keys and non-finite numbers are errors, not
  silently resolved), for every HTTP route.

Nothing here needs FastAPI or a model; ``tests/test_questions.py`` covers the System One and
Decisions models, ``tests/test_chat_completions.py`` the chat ones.
"""

from __future__ import annotations

from pcd_core.loading.model_files import EMBEDDED


def served_names(model_name: str) -> frozenset[str]:
    """The names a client may ask for to reach ``model_name``: itself, and for an embedded model its
    alias and its package's name; compared case-insensitively.
    """
    names = {model_name}
    spec = EMBEDDED.get(model_name)
    if spec is not None:
        names |= {spec.alias, spec.package}
    return frozenset(name.casefold() for name in names)


def accepts_model(requested: str | None, model_name: str) -> bool:
    """Whether a request that names ``requested`` (None: no name) may be answered by ``model_name``."""
    return requested is None or requested.casefold() in served_names(model_name)
