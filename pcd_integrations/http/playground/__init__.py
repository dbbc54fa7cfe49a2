"""The playground: one page on ``pcd serve`` (``GET /`` and ``GET /playground``) where a person types a
text and a schema or a question set, presses Decide, and sees each decision as bars; or, in its
conversation mode, follows a conversation turn by turn through the session routes.

The page is a client of the server's public routes and of nothing else: a question set goes to
``POST /v1/systemone``, a schema to ``POST /v1/chat/completions`` with ``response_format``
``json_schema`` (its per-field probabilities are read from ``x_pcd.fields``), so it shows exactly
what an API client gets, errors included (the 4xx body as the API returns it). A conversation opens a
session (``POST /v1/sessions``), appends each turn (``POST /v1/sessions/{id}/turns``) and closes it
(``DELETE``), drawing each turn's answer with the same code (``conversation.js``). Everything it loads
ships in this package, because users run offline: its Content-Security-Policy allows ``'self'``
only, so a page that reached for a CDN would break in the test rather than on a user's machine.

The page itself needs no key (a browser cannot send a bearer header when it navigates); with
``pcd serve --api-key-env``, the page asks for the key once and sends it on every ``/v1`` call.
``tests/test_playground.py`` drives it in a real headless Chromium against a loopback server on the
embedded model and checks the bars against the API's JSON for the same request.
"""

import json
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["PAGE_PATHS", "add_playground", "bundled_conversation", "bundled_examples"]

#: where the page answers; ``pcd serve --no-playground`` leaves both to the 404 handler
PAGE_PATHS = ("/", "/playground")
#: the page's own files, served by name from this package; nothing else under /playground/static
_STATIC = {"playground.js": "text/javascript", "conversation.js": "text/javascript", "playground.css": "text/css"}
# 'self' only: no CDN, no inline script or style, and the page may call no other origin
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


@cache
def bundled_examples() -> tuple[dict[str, Any], ...]:
    """The examples the page can load: the README's ticket schema and text (copies of
    ``examples/ticket_schema.json`` and ``examples/ticket.txt``, since ``examples/`` is not in the
    wheel; a test keeps them equal), the longer support ticket and the refund question set that
    ``pcd bench`` uses.
    """
    benchdata = resources.files("pcd_core").joinpath("benchdata")
    triage = json.loads(benchdata.joinpath("support_ticket.json").read_text(encoding="utf-8"))
    refund = json.loads(benchdata.joinpath("refund_request_questions.json").read_text(encoding="utf-8"))
    return (
        {
            "name": "Support ticket: a schema (examples/ticket_schema.json)",
            "kind": "schema",
            "spec": json.loads(_read("ticket_schema.json")),
            "text": _read("ticket.txt"),
        },
        {
            "name": "Refund request: a question set (noul, choice, score)",
            "kind": "questions",
            "spec": {"questions": refund["questions"]},
            "text": refund["state"],
        },
        {
            "name": "Enterprise outage ticket: a longer schema",
            "kind": "schema",
            "spec": triage["json_schema"],
            "text": triage["input"],
        },
    )


@cache
def bundled_conversation() -> dict[str, Any]:
    """The conversation the page's conversation mode can load: the schema and first turns of
    ``examples/support_conversation.json`` (a copy, as for the ticket; a test keeps it equal), few
    enough that stepping through them stays quick on a laptop.
    """
    conversation = json.loads(_read("support_conversation.json"))
    n_turns = len(conversation["turns"])
    name = f"a support chat, the first {n_turns} turns of examples/support_conversation.json"
    return {"name": name, **conversation}


def add_playground(app: "FastAPI", *, api_key_required: bool) -> None:
    """Add the page, its static files and ``/playground/examples`` to ``app``.

    None of these routes needs the API key: they serve only this package's files and the bundled
    examples, never a model answer. ``api_key_required`` tells the page to ask for the key up front.
    """
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException

    page = _read("index.html")

    async def playground_page() -> HTMLResponse:
        return HTMLResponse(page, headers=_SECURITY_HEADERS)

    async def static_file(name: str) -> Response:
        if name not in _STATIC:  # a fixed set: no path from the URL ever reaches the file system
            raise HTTPException(404, f"no playground file {name!r}")
        return Response(_read(name), media_type=_STATIC[name], headers=_SECURITY_HEADERS)

    async def examples() -> JSONResponse:
        body = {
            "api_key_required": api_key_required,
            "examples": list(bundled_examples()),
            "conversation": bundled_conversation(),
        }
        return JSONResponse(body, headers=_SECURITY_HEADERS)

    for path in PAGE_PATHS:
        app.add_api_route(path, playground_page, methods=["GET"], include_in_schema=False, response_model=None)
    app.add_api_route(
        "/playground/static/{name}", static_file, methods=["GET"], include_in_schema=False, response_model=None
    )
    app.add_api_route("/playground/examples", examples, methods=["GET"], include_in_schema=False, response_model=None)
