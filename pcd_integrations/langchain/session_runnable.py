"""A LangChain ``Runnable`` over a session's ``append``, for LangGraph nodes and LCEL pipes.

``PCDSessionRunnable.open(engine, schema_or_questions, triggers=..., **keywords)`` opens one session
(``Engine.session``, ``pcd_core/sessions/session.py``), and each ``invoke(turn)`` appends a turn to it:
``turn`` is the turn's text (role ``user``) or a mapping ``{"text": ..., "role": ...}``. The output is
what the append returns, an ``Extraction`` (a schema) or a ``DecideResponse`` (a question set), with
the append's own cost in ``stats`` and the fired triggers in ``triggers``; with ``output="json"`` it is
that result's JSON record (``Extraction.to_dict()`` or the System One body, with ``triggers``), for a
graph state that is checkpointed or sent over a wire. One runnable is one conversation: a later
``invoke`` reads only its turn, the tail and the rows, on the session's kept KV.

Order. A session's appends are applied one at a time, and the answer after a turn depends on every
turn before it, so running them in parallel (``Runnable.batch``'s default, in a thread pool) would
apply them in whatever order the threads took the session's lock. ``batch`` and ``abatch`` therefore
apply the turns one after another in the order given, and ``batch_as_completed`` and
``abatch_as_completed`` yield them in that order too. A turn that fails (over a bound, a bad role)
leaves the session as it was: with ``return_exceptions=False`` the batch raises there and the turns
after it are not applied; with ``return_exceptions=True`` its slot holds the exception and the turns
after it are applied. ``ainvoke`` runs the append in a worker thread, so the event loop keeps running.
Concurrent ``invoke`` calls from several threads are applied in the order they take the session's
lock, which a caller that cares about order must not rely on.

It needs only ``langchain-core``. ``tests/test_langchain_session_runnable.py`` runs it as a LangGraph
node and in a ``RunnableSequence`` on the embedded model, and checks each answer against the
session's own ``append``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal

from pcd_core import BackendUnavailableError, DecideResponse, Engine, Extraction, OptionError, SessionInterface
from pcd_integrations.wire.sessions import append_record

try:
    from langchain_core.runnables import RunnableConfig, RunnableSerializable
    from langchain_core.runnables.config import get_config_list
    from pydantic import ConfigDict
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("langchain", "langchain-core") from error

__all__ = ["PCDSessionRunnable", "SessionInput", "SessionOutput"]

#: a turn: its text (role ``user``), or ``{"text": ..., "role": ...}``
SessionInput = str | Mapping[str, Any]
#: what an append returns, or its JSON record (``output="json"``)
SessionOutput = Extraction | DecideResponse | dict[str, Any]


def turn_of(turn: Any) -> tuple[str, str]:
    """``(text, role)`` of an input turn; anything else is an ``OptionError`` that shows it."""
    if isinstance(turn, str):
        return turn, "user"
    if isinstance(turn, Mapping) and isinstance(turn.get("text"), str):
        unknown = sorted(set(turn) - {"text", "role"})
        if unknown:
            raise OptionError(f"a turn has 'text' and 'role'; not {', '.join(map(repr, unknown))}")
        role = turn.get("role", "user")
        if not isinstance(role, str):
            raise OptionError(f"a turn's role is a string, not {role!r}")
        return turn["text"], role
    raise OptionError(f"a turn is its text or {{'text': ..., 'role': ...}}, not {turn!r}")


class PCDSessionRunnable(RunnableSerializable[SessionInput, SessionOutput]):
    """Appends each input turn to one session and returns the whole conversation's result."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    session: SessionInterface
    """The session every ``invoke`` appends to (an engine's or a cascade's); ``session.text`` and
    ``session.nonce`` reproduce it."""
    output: Literal["result", "json"] = "result"
    """``result``: the ``Extraction`` or ``DecideResponse``; ``json``: its JSON record."""

    @classmethod
    def open(
        cls,
        engine: Engine,
        schema_or_questions: Any,
        *,
        triggers: Sequence[Mapping[str, Any]] = (),
        output: Literal["result", "json"] = "result",
        keep_last_tokens: int | None = None,
        **keywords: Any,
    ) -> PCDSessionRunnable:
        """A runnable over a new ``engine.session(schema_or_questions, **keywords)``; ``triggers`` are
        ``Session.when``'s arguments, one mapping each.
        """
        session = engine.session(schema_or_questions, keep_last_tokens=keep_last_tokens, **keywords)
        try:
            for trigger in triggers:
                session.when(**trigger)
        except Exception:
            session.close()
            raise
        return cls(session=session, output=output)

    def close(self) -> None:
        """Free the session's KV; later turns raise ``SessionClosedError``."""
        self.session.close()

    # -- one turn ---------------------------------------------------------------------------------
    def invoke(self, input: SessionInput, config: RunnableConfig | None = None, **kwargs: Any) -> SessionOutput:
        return self._call_with_config(self._append, input, config, run_type="chain")

    async def ainvoke(self, input: SessionInput, config: RunnableConfig | None = None, **kwargs: Any) -> SessionOutput:
        return await self._acall_with_config(self._aappend, input, config, run_type="chain")

    def _append(self, turn: SessionInput) -> SessionOutput:
        text, role = turn_of(turn)
        return self._shaped(self.session.append(text, role=role))

    async def _aappend(self, turn: SessionInput) -> SessionOutput:
        text, role = turn_of(turn)
        return self._shaped(await self.session.aappend(text, role=role))

    def _shaped(self, result: Extraction | DecideResponse) -> SessionOutput:
        return append_record(result) if self.output == "json" else result

    # -- many turns of the one conversation: in order, never in parallel ---------------------------
    def batch(
        self,
        inputs: list[SessionInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any | None,
    ) -> list[SessionOutput]:
        return [out for _, out in self.batch_as_completed(inputs, config, return_exceptions=return_exceptions)]  # type: ignore[misc]

    async def abatch(
        self,
        inputs: list[SessionInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any | None,
    ) -> list[SessionOutput]:
        iterator = self.abatch_as_completed(inputs, config, return_exceptions=return_exceptions)
        return [out async for _, out in iterator]  # type: ignore[misc]

    # the base class types these as overloads on ``return_exceptions``'s literal; one signature serves both
    def batch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[SessionInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any | None,
    ) -> Iterator[tuple[int, SessionOutput | Exception]]:
        configs = get_config_list(config, len(inputs))
        for index, (turn, one) in enumerate(zip(inputs, configs, strict=True)):
            try:
                yield index, self.invoke(turn, one)
            except Exception as error:
                if not return_exceptions:
                    raise
                yield index, error

    async def abatch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[SessionInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any | None,
    ) -> AsyncIterator[tuple[int, SessionOutput | Exception]]:
        configs = get_config_list(config, len(inputs))
        for index, (turn, one) in enumerate(zip(inputs, configs, strict=True)):
            try:
                yield index, await self.ainvoke(turn, one)
            except Exception as error:
                if not return_exceptions:
                    raise
                yield index, error
