"""``pcd serve``'s session routes: a conversation followed turn by turn (``pcd_core/sessions/session.py``).

- ``POST /v1/sessions`` opens one with a schema or a question set and its triggers (201);
- ``POST /v1/sessions/{id}/turns`` appends a turn and answers with the whole conversation's result,
  ``triggers`` listing what fired (a fill's ``Extraction`` record, or the System One body);
- ``GET /v1/sessions/{id}`` reads its turns and last result; ``DELETE`` closes it (204);
- ``GET /v1/sessions/{id}/events`` is a server-sent-events stream of every trigger that fires, one
  ``event: trigger`` a firing, until the session is closed (then ``data: [DONE]``).

A session belongs to the Authorization header that opened it (its SHA-256 is kept, not the key):
any other header, like an unknown or closed id, gets 404, so an id leaks nothing. Sessions live in
memory and expire ``ttl_s`` after their last use; after a restart every old id is 404. Appends to one
session are applied in the order the server accepted them (an ``asyncio.Lock`` is first come, first
served), each in a worker thread under the engine's model lock like any other request, and a client
that goes away stops its append at the next pass boundary, leaving the session as it was. Engine
errors map as on every route (a turn over a bound: 422 naming it). Over a cascade (``pcd serve
--then``) ``engine.session`` is the cascade's (``pcd_core/cascade_session.py``), so each turn is
cascaded and its result carries ``x_cascade`` as ``/v1/systemone`` does.

Opening a session and appending a turn are admitted as every model request is
(``pcd_integrations/serving/operations.py``, through ``SESSION_MODEL_ROUTES``): each takes a place in
the one queue ``--max-queue`` bounds, so with the queue full either gets the 503 with ``Retry-After``
that ``/v1/systemone`` gets, and past ``--timeout`` the 504, the session left as it was. Reading,
closing and the event stream run no pass and are not queued. A body over ``--max-body-bytes`` is a
413 as on every route, and a schema or question set over the engine's ``Limits`` is refused with a
422 naming the limit when the session opens, not at its first turn. ``tests/test_http_sessions.py``
drives the routes with a real ``httpx`` client against a loopback server.
"""

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pcd_core import SessionInterface
from pcd_core.request.triggers import Fired
from pcd_integrations.http.calls import in_engine, served_engine
from pcd_integrations.http.errors import ApiError
from pcd_integrations.serving.engine_loader import EngineLoader
from pcd_integrations.wire.sessions import (
    SessionBody,
    SessionCreate,
    SessionCreated,
    SessionTurnBody,
    TurnRequest,
    append_record,
)

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

#: seconds a session lives after its last use
DEFAULT_SESSION_TTL_S = 3600.0
#: the session routes that run the engine (POST), as (template, pattern): admitted like every model route
SESSION_MODEL_ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("/v1/sessions", re.compile(r"/v1/sessions")),
    ("/v1/sessions/{id}/turns", re.compile(r"/v1/sessions/[^/]+/turns")),
)


@dataclass
class ServedSession:
    owner: str
    session: SessionInterface
    kind: Literal["fill", "decide"]
    expires_at: float
    order: asyncio.Lock = field(default_factory=asyncio.Lock)
    listeners: list["asyncio.Queue[Fired | None]"] = field(default_factory=list)


class SessionTable:
    """The open sessions by id, each with its owner and expiry; expired ones go on the next look-up."""

    def __init__(self, ttl_s: float = DEFAULT_SESSION_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._clock = ttl_s, clock
        self._open: dict[str, ServedSession] = {}

    def add(self, owner: str, session: SessionInterface, kind: Literal["fill", "decide"]) -> str:
        self._sweep()
        sid = "sess_" + secrets.token_hex(12)
        self._open[sid] = ServedSession(owner, session, kind, self._clock() + self.ttl_s)
        return sid

    def get(self, sid: str, owner: str) -> ServedSession:
        self._sweep()
        served = self._open.get(sid)
        if served is None or not secrets.compare_digest(served.owner, owner):
            raise ApiError(404, "session_not_found", f"no session {sid!r}; it may have expired or been closed")
        served.expires_at = self._clock() + self.ttl_s
        return served

    def remove(self, sid: str) -> None:
        served = self._open.pop(sid, None)
        if served is not None:
            _close(served)

    def _sweep(self) -> None:
        now = self._clock()
        for sid in [sid for sid, s in self._open.items() if s.expires_at < now]:
            self.remove(sid)


def _close(served: ServedSession) -> None:
    served.session.close()
    for queue in served.listeners:
        queue.put_nowait(None)


def owner_of(request: "Request") -> str:
    """Who a request speaks for: a hash of its Authorization header (empty when it sends none)."""
    return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()


def add_session_routes(
    app: "FastAPI", loader: EngineLoader, checked: list[Any], guarded: list[Any], errors: dict[int | str, Any]
) -> SessionTable:
    """The routes above on ``app``; ``checked`` are the body checks and key check of every model
    route, ``guarded`` the key check alone (for the routes without a body).
    """
    from fastapi import Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse

    table = SessionTable()
    app.state.sessions = table

    @app.post("/v1/sessions", dependencies=checked, status_code=201, responses=errors)
    async def create_session(body: SessionCreate, http: Request) -> JSONResponse:
        """Open a session over a schema (each turn a fill) or questions (each turn a decide)."""
        engine = served_engine(loader)
        spec = body.json_schema if body.json_schema is not None else body.questions
        keywords = {"task": body.task} if body.task else {}

        def open_one() -> SessionInterface:
            session = engine.session(spec, keep_last_tokens=body.keep_last_tokens, **keywords)
            for t in body.triggers:
                session.when(t.field, **t.model_dump(exclude={"field"}))
            return session

        session = await in_engine(open_one, {}, "schema", http)
        kind: Literal["fill", "decide"] = "fill" if body.json_schema is not None else "decide"
        sid = table.add(owner_of(http), session, kind)
        created = SessionCreated(id=sid, kind=kind, expires_in_s=table.ttl_s)
        return JSONResponse(created.model_dump(), status_code=201)

    @app.post("/v1/sessions/{sid}/turns", dependencies=checked, responses=errors)
    async def append_turn(sid: str, body: TurnRequest, http: Request) -> JSONResponse:
        """Append a turn; the result is the whole conversation's, ``triggers`` what fired."""
        served = table.get(sid, owner_of(http))
        async with served.order:  # first come, first served: appends land in acceptance order
            result = await in_engine(lambda: served.session.append(body.text, role=body.role), {}, "text", http)
        for fired in result.triggers:
            for queue in served.listeners:
                queue.put_nowait(fired)
        return JSONResponse(append_record(result))

    @app.get("/v1/sessions/{sid}", dependencies=guarded, responses=errors)
    async def read_session(sid: str, http: Request) -> SessionBody:
        """The session's turns and its last result."""
        served = table.get(sid, owner_of(http))
        last = served.session.result
        turns = [SessionTurnBody(role=t.role, text=t.text) for t in served.session.turns]
        return SessionBody(
            id=sid, kind=served.kind, turns=turns, result=append_record(last) if last is not None else None
        )

    @app.delete("/v1/sessions/{sid}", dependencies=guarded, status_code=204, responses=errors)
    async def delete_session(sid: str, http: Request) -> Response:
        """Close the session and free its KV; its id is 404 from now on."""
        table.get(sid, owner_of(http))
        table.remove(sid)
        return Response(status_code=204)

    @app.get("/v1/sessions/{sid}/events", dependencies=guarded, responses=errors)
    async def session_events(sid: str, http: Request) -> StreamingResponse:
        """Server-sent events: each trigger that fires from now on, until the session closes."""
        served = table.get(sid, owner_of(http))
        queue: asyncio.Queue[Fired | None] = asyncio.Queue()
        served.listeners.append(queue)

        async def events() -> AsyncIterator[str]:
            try:
                yield ": listening\n\n"
                while (fired := await queue.get()) is not None:
                    yield f"event: trigger\ndata: {json.dumps(fired.to_dict(), ensure_ascii=False)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                served.listeners.remove(queue)

        return StreamingResponse(events(), media_type="text/event-stream")

    return table
