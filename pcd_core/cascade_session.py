"""A cascade's session: every append answered by the first engine's session, the doubtful fields by later stages.

``Cascade.session(schema_or_questions, ...)`` (``pcd_core/cascade.py``) opens a ``CascadedSession``. Each
``append`` goes to the first engine's own session, which reads only the new turn; the fields or
questions a stage's ``EscalationRule`` sends on are answered by that stage on the whole conversation so
far, through the same escalation code as a cascade's ``fill``/``decide`` (``Cascade._escalate_fill`` /
``_escalate_decide``, given an ``Ask`` that answers the names asked). The result is a
``CascadeExtraction`` or ``CascadeDecideResponse``: who answered each field, the escalation records, and
the append's cost per engine (``stages``) and summed (``stats``).

How a later stage reads the conversation:

- a stage whose engine has sessions (an ``Engine``, or a ``Cascade`` whose first engine has) follows it
  in a session of its own, opened at the first append that asks it, on the whole schema or question set
  (its KV holds the prompt head, which depends on the schema, so a smaller schema per turn would read
  everything again; a schema's open fields and multi-label lists, which never escalate, are left out of
  it, ``cascade_asking.stage_schema``). Turns it is not asked about are recorded unread (``Session.add``); the
  append that asks it reads every unread turn in one pass after its kept KV, so it reads each turn's
  tokens once, and an append that asks it nothing costs it nothing. Its session draws its own fence
  nonce: its answers equal a fresh ``fill``/``decide`` of the whole conversation (``text``) by that
  engine, with that session's nonce (``stage_sessions[i].nonce``) and the stage's whole schema. Its cost
  is that read of the whole schema, though only the escalated names are used (``StageCost.asked``).
- a stage without sessions (a remote, ``pcd_integrations/remote_decisions.py``) is asked statelessly,
  as a cascade's ``fill``/``decide`` asks it: the escalated sub-schema or questions on ``text``.
- a stage that raises a ``PcdError`` leaves the earlier answers, marked, as a cascade's ``fill`` does; a
  stage session that failed is closed and opened again, reading every turn, when it is next asked.

Triggers (``when``) watch the cascaded answers, not the first engine's: those are the answers the
session returns, and a first engine that abstains from a field would otherwise hide every change the
later stage reads in it. ``tests/test_cascade_session.py`` checks all of this on the embedded model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pcd_core.cascade_asking import Ask
from pcd_core.concurrency.model_lock import in_thread
from pcd_core.errors import PcdError, SessionClosedError
from pcd_core.request.triggers import Trigger, TriggerState
from pcd_core.sessions.reading import Result
from pcd_core.sessions.session import SessionTurn, fire, watching

logger = logging.getLogger(__name__)


def opens_sessions(engine: Any) -> bool:
    """Whether ``engine`` can follow a conversation in a session of its own: an ``Engine`` can, a remote
    with ``fill``/``decide`` alone cannot, and a ``Cascade`` says (``Cascade.opens_sessions``).
    """
    return bool(getattr(engine, "opens_sessions", callable(getattr(engine, "session", None))))


@dataclass(frozen=True)
class SessionPlan:
    """What a cascaded session needs of its cascade, built by ``Cascade.session``."""

    escalate: Callable[[Any, Ask, float], Result]  # the first's result, an Ask, the start: the cascaded result
    ask_statelessly: Callable[[str], Ask]  # the Ask of a stage without sessions, on the conversation's text
    stage_spec: Any  # the schema or question set a later stage's session is opened on
    stage_keywords: Mapping[str, Any]
    keep_last_tokens: int | None


class CascadedSession:
    """One conversation followed by a cascade; the module docstring says how. It has the interface of
    ``Session`` that the doors use (``SessionInterface``), and ``add`` for a cascade that is itself a stage.
    """

    def __init__(self, first: Any, stages: Sequence[Any], plan: SessionPlan) -> None:
        self._first = first  # the first engine's Session (or CascadedSession)
        self._stages, self._plan = tuple(stages), plan
        self._later: dict[int, Any] = {}  # stage index -> its open session
        self._triggers: list[TriggerState] = []
        self._last: Result | None = None
        self._n_appends = 0
        self._lock = threading.Lock()
        self._closed = False

    # -- what the session holds ----------------------------------------------------------------
    @property
    def nonce(self) -> str:
        """The first engine's session's nonce: its answers equal a fresh fill/decide with ``fence_nonce=`` it."""
        return str(self._first.nonce)

    @property
    def turns(self) -> tuple[SessionTurn, ...]:
        return tuple(self._first.turns)

    @property
    def text(self) -> str:
        return str(self._first.text)

    @property
    def result(self) -> Result | None:
        """The last append's cascaded result (None before the first)."""
        return self._last

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the first engine's session and every open stage session hold now."""
        return int(self._first.kv_tokens) + sum(int(s.kv_tokens) for s in self._later.values())

    @property
    def stage_sessions(self) -> dict[int, Any]:
        """The later stages' open sessions by stage index (1 for the first later stage)."""
        return dict(self._later)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._first.names)

    def watchable(self, field: str) -> str:
        return str(self._first.watchable(field))

    def observe(self, result: Result, trigger: Trigger) -> Any:
        return self._first.observe(result, trigger)

    # -- triggers -------------------------------------------------------------------------------
    def when(self, field: str, **conditions: Any) -> Trigger:
        """Watch ``field`` in the cascaded answers; ``conditions`` are ``Session.when``'s keywords."""
        self._check_open()
        trigger = Trigger(self.watchable(field), **conditions)
        last = self.observe(self._last, trigger) if self._last is not None else None
        self._triggers.append(watching(trigger, last))
        return trigger

    # -- append ---------------------------------------------------------------------------------
    def append(self, text: str, role: str = "user") -> Result:
        """Add a turn; the cascaded result for the whole conversation so far. A turn the first
        engine's session cannot take leaves every session as it was.
        """
        with self._lock:
            self._check_open()
            started = time.perf_counter()
            turn = SessionTurn(role, text)
            first = self._first.append(text, role)
            asked: set[int] = set()
            result = self._plan.escalate(first, self._asker(turn, asked), started)
            self._record(turn, skip=asked)
            states, result.triggers = fire(self._triggers, partial(self.observe, result), self._n_appends + 1)
            self._triggers, self._last = states, result
            self._n_appends += 1
            return result

    async def aappend(self, text: str, role: str = "user") -> Result:
        return await in_thread(self.append, text, role)

    def add(self, text: str, role: str = "user") -> None:
        """Record a turn without reading it, in the first engine's session and every open stage's."""
        with self._lock:
            self._check_open()
            turn = SessionTurn(role, text)
            self._first.add(text, role)
            self._record(turn, skip=set())

    def _asker(self, turn: SessionTurn, asked: set[int]) -> Ask:
        """The ``Ask`` of this append: a stage with sessions reads in its own, the others statelessly."""
        stateless = self._plan.ask_statelessly(self.text)

        def ask(index: int, stage: Any, names: tuple[str, ...]) -> Any:
            if not opens_sessions(stage.engine):
                return stateless(index, stage, names)
            session = self._stage_session(index, stage)
            try:
                answered = session.append(turn.text, turn.role)
            except PcdError:
                self._drop(index)  # it did not keep the turn: it reads every turn when opened again
                raise
            asked.add(index)
            return answered

        return ask

    def _stage_session(self, index: int, stage: Any) -> Any:
        """Stage ``index``'s session, opened now if it is not open, holding every turn before this one unread."""
        session = self._later.get(index)
        if session is not None:
            return session
        plan = self._plan
        session = stage.engine.session(plan.stage_spec, keep_last_tokens=plan.keep_last_tokens, **plan.stage_keywords)
        try:
            for earlier in self._first.turns[:-1]:
                session.add(earlier.text, earlier.role)
        except PcdError:
            session.close()
            raise
        self._later[index] = session
        return session

    def _record(self, turn: SessionTurn, skip: set[int]) -> None:
        """``turn`` recorded unread in every open stage session that did not read it."""
        for index, session in list(self._later.items()):
            if index in skip:
                continue
            try:
                session.add(turn.text, turn.role)
            except PcdError as error:
                logger.warning("cascade stage %d's session could not keep a turn; it reads all again: %s", index, error)
                self._drop(index)

    def _drop(self, index: int) -> None:
        session = self._later.pop(index, None)
        if session is not None:
            session.close()

    # -- fork and close -------------------------------------------------------------------------
    def fork(self) -> CascadedSession:
        """A branch sharing what every session has read so far; its appends never change this one, nor this one's it."""
        with self._lock:
            self._check_open()
            branch = CascadedSession(self._first.fork(), self._stages, self._plan)
            branch._later = {index: session.fork() for index, session in self._later.items()}
            branch._triggers, branch._last, branch._n_appends = list(self._triggers), self._last, self._n_appends
            return branch

    async def afork(self) -> CascadedSession:
        return await in_thread(self.fork)

    def close(self) -> None:
        """Close the first engine's session and every stage's; later calls raise ``SessionClosedError``."""
        with self._lock:
            self._closed = True
            sessions, self._later = [self._first, *self._later.values()], {}
        for session in sessions:
            session.close()

    def __enter__(self) -> CascadedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("the session is closed; open another with cascade.session(...)")
