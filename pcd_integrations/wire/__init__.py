"""Wire protocols over ``engine.decide``: one set of pydantic models per protocol, shared by every server.

- System One (``POST /v1/systemone``, MCP ``decide``): the question and answer models of
  ``pcd_core/request/questions.py`` are that wire themselves.
- OpenAI Decisions (``POST /v1/decisions``): ``decisions.py`` declares its request and response and
  translates them to and from the System One models, so both routes make the same engine call;
  ``decision_input.py`` declares its input items and splits them into state, turns and instructions.
- OpenAI Chat Completions (``POST /v1/chat/completions``): ``chat.py`` declares its request,
  ``chat_reply.py`` its reply and stream chunks; ``errors.py`` the error body every OpenAI route
  answers with.
- ``served.py``: the served model as ``GET /v1/models`` lists it in both protocols, and ``/healthz``;
  `accepts_model` below, the names a request may give it (on the decision routes, the Jev aliases too).
- ``body.py`` reads a raw JSON body strictly (duplicate keys and non-finite numbers are errors, not
  silently resolved), for every HTTP route.

Nothing here needs FastAPI or a model; ``tests/test_questions.py`` covers the System One and
Decisions models, ``tests/test_chat_completions.py`` the chat ones.
"""

from __future__ import annotations

from pcd_core.loading.model_files import EMBEDDED

#: The model aliases of the Jev specification. A decision server answers a request that names one with
#: the model it serves: clients written for the hosted API send ``jev-latest`` unless told otherwise
#: (DSPy's ``dspy.experimental.TypeSafe`` defaults to it; pydantic-ai's ``TypeSafeModel`` lists both
#: names as the moving aliases). A versioned id such as ``jev-1.13.0`` pins one hosted release, which
#: this server is not, so it still gets 404.
JEV_ALIASES: frozenset[str] = frozenset({"jev-latest", "jev-preview"})


def served_names(model_name: str, aliases: frozenset[str] = frozenset()) -> frozenset[str]:
    """The names a client may ask for to reach ``model_name``: itself, for an embedded model its
    alias and its package's name, and ``aliases`` (a protocol's own, such as `JEV_ALIASES`);
    compared case-insensitively.
    """
    names = {model_name, *aliases}
    spec = EMBEDDED.get(model_name)
    if spec is not None:
        names |= {spec.alias, spec.package}
    return frozenset(name.casefold() for name in names)


def accepts_model(requested: str | None, model_name: str, aliases: frozenset[str] = frozenset()) -> bool:
    """Whether a request that names ``requested`` (None: no name) may be answered by ``model_name``;
    the decision routes pass `JEV_ALIASES` as ``aliases``.
    """
    return requested is None or requested.casefold() in served_names(model_name, aliases)
