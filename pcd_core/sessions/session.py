"""Sessions: the decisions of a growing conversation, each append reading only what it added.

``Engine.session(schema_or_questions, ...)`` opens a ``Session``; ``append(text, role=...)`` adds a
turn and returns the result for the whole conversation so far, the same type ``fill`` (an
``Extraction``) or ``decide`` (a ``DecideResponse``) returns, with the append's own cost in ``stats``.

How an append reads only its turn. The conversation is the request's input, one line per turn
(``role: text``, a turn's own line breaks shown as `` ¶ ``), fenced with a nonce the session draws once
(``prompt.new_fence_nonce``): a hashed nonce would change the prompt from the fence's first line at
every turn, a secret one leaves the prompt up to the conversation's end as it was. The session keeps
the KV of the prompt up to the end of the conversation (the head, the fence's opening line, every
turn); an append reads the new turn's tokens after it, with the fence's closing line, the tail and
the rows behind them, in one pass (``read_path.read_request``, the read path ``fill`` and ``decide``
take: the new turn and the closing lines are that pass's trunk), then keeps the KV up to the new
turn's end (``Backend.cut``, over the pass's own KV). Neither changes the prefix read after, so a
``fork()`` shares it. A backend that reads a trunk in a pass of its own (torch's ``copies`` layout)
reads the turn first, as a ``prefill`` after the kept KV. The
ids are those of the whole prompt tokenized in one piece, exactly as a fresh ``fill``/``decide`` with
``fence_nonce=session.nonce`` tokenizes it; where the new turn merged with the token before it, the
session reads from the last token the two agree on, and says so in the result's warnings.

Memory is bounded by ``SessionMemory`` (``session_memory.py``): an evicted session keeps its turns and
reads them again on its next append. A conversation over the model's context or
``max_session_tokens`` is a ``SessionOverflowError`` naming the bound, unless the session was opened
with ``keep_last_tokens=N``, which drops whole early turns to keep at most N tokens of conversation
and says so in the result's warnings. ``tests/test_session.py`` checks that every append, fork and
evicted session equals a fresh fill/decide of the whole conversation on the real model.

``add`` records a turn without reading it: the next ``append`` reads every unread turn in its one pass,
since it extends the kept KV up to the whole prompt's end however many turns that is. A cascade's later
stage (``pcd_core/cascade_session.py``) follows the conversation so, reading only when it is asked.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol, runtime_checkable

from pcd_core.backends.base import Prefix
from pcd_core.concurrency.model_lock import in_thread
from pcd_core.errors import OptionError, PromptError, SessionClosedError, SessionOverflowError
from pcd_core.planning.batching import Prepared
from pcd_core.planning.deciding import DecideKeywords
from pcd_core.planning.filling import FillKeywords
from pcd_core.prompting.prompt import new_fence_nonce, normalise_input
from pcd_core.reading.read_path import count_request, ms_since
from pcd_core.request.questions import ChoiceQuestion, NoulQuestion, ScoreQuestion
from pcd_core.request.triggers import Fired, Observation, Trigger, TriggerState
from pcd_core.sessions.reading import DecideReader, FillReader, Result, SessionHost

logger = logging.getLogger(__name__)

_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
#: what a turn's line breaks are shown as, so that every line of the conversation starts with a role
TURN_LINE_BREAK = " \u00b6 "
QUESTION_TYPES = ("noul", "choice", "score")


@dataclass(frozen=True)
class SessionTurn:
    """One turn: who said it (a word: ``user``, ``agent``, ``customer``) and what."""

    role: str
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not _ROLE.fullmatch(self.role):
            raise OptionError(f"a turn's role is a word of letters, digits, - or _ (at most 32), not {self.role!r}")
        normalise_input(self.text)  # a string, not blank

    @property
    def line(self) -> str:
        """The turn as the conversation shows it: ``role: text`` on one line."""
        lines = (" ".join(line.split()) for line in self.text.splitlines())
        return f"{self.role}: {TURN_LINE_BREAK.join(line for line in lines if line)}"


def conversation_text(turns: tuple[SessionTurn, ...]) -> str:
    """The input a session's turns make: one line per turn, in order."""
    return "\n".join(turn.line for turn in turns)


def is_question_set(value: Any) -> bool:
    """Whether ``Engine.session``'s first argument is a question set (``decide``'s), not a schema: a
    non-empty dict whose every value is a question model or a dict with a question ``type``.
    """
    kinds = (NoulQuestion, ChoiceQuestion, ScoreQuestion)
    return (
        isinstance(value, dict)
        and bool(value)
        and all(
            isinstance(q, kinds) or (isinstance(q, dict) and q.get("type") in QUESTION_TYPES) for q in value.values()
        )
    )


def common_start(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def watching(trigger: Trigger, last: Observation | None) -> TriggerState:
    """A new trigger's state, started from the reading so far (``last``), so that a later change is a change."""
    state = TriggerState(trigger, last)
    if last is None or last.probability is None:
        return state
    if trigger.above is not None:
        return replace(state, armed=last.probability < trigger.above)
    if trigger.below is not None:
        return replace(state, armed=last.probability > trigger.below)
    return state


def fire(
    states: list[TriggerState], observe: Callable[[Trigger], Observation], turn: int
) -> tuple[list[TriggerState], list[Fired]]:
    """Every trigger stepped with this append's reading (``observe``), and the ones that fired."""
    fired: list[Fired] = []
    stepped = []
    for state in states:
        state, one = state.step(observe(state.trigger), turn)
        stepped.append(state)
        if one is not None:
            fired.append(one)
    return stepped, fired


@runtime_checkable
class SessionInterface(Protocol):
    """What the doors (HTTP, MCP, LangChain) use of a session once it is open: a ``Session``, or a
    cascade's ``CascadedSession`` (``pcd_core/cascade_session.py``). Both also take triggers with
    ``when(field, ...)``, whose keywords are ``Trigger``'s.
    """

    @property
    def nonce(self) -> str: ...

    @property
    def turns(self) -> tuple[SessionTurn, ...]: ...

    @property
    def text(self) -> str: ...

    @property
    def result(self) -> Result | None: ...

    @property
    def kv_tokens(self) -> int: ...

    def append(self, text: str, role: str = "user") -> Result: ...

    async def aappend(self, text: str, role: str = "user") -> Result: ...

    def fork(self) -> SessionInterface: ...

    def close(self) -> None: ...


class Session:
    """One conversation and the decisions read over it; ``Engine.session`` opens one.

    Appends to one session are applied one at a time, in the order their calls took the session's
    lock; different sessions share the engine's model lock like any other request.
    """

    def __init__(
        self,
        host: SessionHost,
        reader: FillReader | DecideReader,
        *,
        keep_last_tokens: int | None = None,
        nonce: str | None = None,
    ) -> None:
        if keep_last_tokens is not None and (
            isinstance(keep_last_tokens, bool) or not isinstance(keep_last_tokens, int) or keep_last_tokens < 1
        ):
            raise OptionError(f"keep_last_tokens must be a positive whole number, got {keep_last_tokens!r}")
        self._host, self._reader = host, reader
        self.keep_last_tokens = keep_last_tokens
        self._nonce = nonce if nonce is not None else new_fence_nonce()
        self._turns: tuple[SessionTurn, ...] = ()
        self._turn_tokens: tuple[int, ...] = ()  # each kept turn's line, tokenized alone (keep_last_tokens)
        self._dropped = 0  # early turns dropped by keep_last_tokens
        self._unread_dropped = 0  # of those, the ones dropped by ``add`` since the last read
        self._n_appends = 0
        self._prefix: Prefix | None = None  # the KV of the prompt up to the conversation's end
        self._triggers: list[TriggerState] = []
        self._last: Result | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- what the session holds ----------------------------------------------------------------
    @property
    def nonce(self) -> str:
        """The fence's secret nonce: a fresh ``fill``/``decide`` with ``fence_nonce=`` it reads the
        same prompt. Never show it to whoever writes the turns.
        """
        return self._nonce

    @property
    def turns(self) -> tuple[SessionTurn, ...]:
        """The turns the conversation holds now (early ones dropped by ``keep_last_tokens`` are gone)."""
        return self._turns

    @property
    def text(self) -> str:
        """The conversation as the model reads it: the input of the equivalent ``fill``/``decide``."""
        return conversation_text(self._turns)

    @property
    def result(self) -> Result | None:
        """The last append's result (None before the first)."""
        return self._last

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the session holds now (0 after eviction or close)."""
        prefix = self._prefix
        return prefix.n_tokens if prefix is not None else 0

    @property
    def prefix(self) -> Prefix | None:
        """The kept KV (None after eviction or close), for what measures the memory a session holds
        (``pcd_core/bench/session_memory.py``); reading from it never changes it.
        """
        return self._prefix

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def names(self) -> tuple[str, ...]:
        """The schema's keys or the question ids: what a trigger can watch."""
        return self._reader.names(self._host)

    def observe(self, result: Result, trigger: Trigger) -> Observation:
        """What ``trigger`` sees of ``result`` (this session's or a cascade's over it)."""
        return self._reader.observe(result, trigger)

    def release_kv(self) -> None:
        """Drop the KV (``SessionMemory`` evicts with it); the turns stay, and the next append reads
        them again. A plain reference swap, so it never waits for an append in progress.
        """
        self._prefix = None

    # -- triggers -------------------------------------------------------------------------------
    def when(
        self,
        field: str,
        *,
        changed: bool = False,
        above: float | None = None,
        below: float | None = None,
        abstained: bool | None = None,
        label: str | None = None,
        hysteresis: float = 0.05,
        name: str = "",
    ) -> Trigger:
        """Watch ``field`` (a schema key or a question id): each later append's result lists in
        ``triggers`` the ones that fired (``triggers.py`` says each condition).
        """
        self._check_open()
        trigger = Trigger(self.watchable(field), changed, above, below, abstained, label, hysteresis, name)
        last = self._reader.observe(self._last, trigger) if self._last is not None else None
        self._triggers.append(watching(trigger, last))
        return trigger

    def watchable(self, field: str) -> str:
        """``field``, where a trigger can watch it; else an ``OptionError`` naming what can be watched."""
        if field not in self.names:
            raise OptionError(f"no key or question {field!r} to watch; there are {', '.join(self.names)}")
        return field

    # -- append -----------------------------------------------------------------------------------
    def append(self, text: str, role: str = "user") -> Result:
        """Add a turn and return the result for the whole conversation so far (``stats``: this
        append's own cost; ``triggers``: what fired). A turn the session cannot take (over a bound)
        leaves the session as it was.
        """
        with self._lock:
            turns, counts, dropped = self._with(SessionTurn(role, text))
            result = self._read(turns, self._unread_dropped + dropped)
            observe = partial(self._reader.observe, result)
            states, result.triggers = fire(self._triggers, observe, self._n_appends + 1)  # a bad label raises here
            self._turns, self._turn_tokens = turns, counts
            self._dropped += dropped
            self._unread_dropped = 0
            self._n_appends += 1
            self._triggers, self._last = states, result
            return result

    def add(self, text: str, role: str = "user") -> None:
        """Record a turn without reading it: no pass, and ``result`` stays the last append's. The next
        ``append`` reads it with its own turn, in one pass after the kept KV.
        """
        with self._lock:
            turns, counts, dropped = self._with(SessionTurn(role, text))
            self._turns, self._turn_tokens = turns, counts
            self._dropped += dropped
            self._unread_dropped += dropped

    def _with(self, turn: SessionTurn) -> tuple[tuple[SessionTurn, ...], tuple[int, ...], int]:
        """The turns with ``turn`` added, kept under ``keep_last_tokens``; called under the lock."""
        self._check_open()
        n_line = len(self._host.model.tokenizer.encode_head(turn.line))
        return self._kept(self._turns + (turn,), self._turn_tokens + (n_line,))

    async def aappend(self, text: str, role: str = "user") -> Result:
        """``append`` in a worker thread, so that the event loop runs while the model reads."""
        return await in_thread(self.append, text, role)

    def fork(self) -> Session:
        """A branch with the same turns, triggers and nonce that shares the KV read so far: its
        appends never change this session, nor this session's appends it ("what if the agent said X?").
        """
        with self._lock:
            self._check_open()
            branch = Session(self._host, self._reader, keep_last_tokens=self.keep_last_tokens, nonce=self._nonce)
            branch._turns, branch._turn_tokens = self._turns, self._turn_tokens
            branch._dropped, branch._n_appends = self._dropped, self._n_appends
            branch._unread_dropped = self._unread_dropped
            branch._prefix, branch._last = self._prefix, self._last
            branch._triggers = list(self._triggers)
        if branch._prefix is not None:
            self._host.sessions.hold(branch)
        return branch

    async def afork(self) -> Session:
        return await in_thread(self.fork)

    def close(self) -> None:
        """Free the KV; later calls raise ``SessionClosedError``. Closing twice is harmless."""
        with self._lock:
            self._closed = True
            self._prefix = None
        self._host.sessions.forget(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("the session is closed; open another with engine.session(...)")

    def _kept(
        self, turns: tuple[SessionTurn, ...], counts: tuple[int, ...]
    ) -> tuple[tuple[SessionTurn, ...], tuple[int, ...], int]:
        """The turns kept under ``keep_last_tokens`` (whole turns, the newest always), their token
        counts, and how many early ones were dropped.
        """
        limit = self.keep_last_tokens
        if limit is None:
            return turns, counts, 0
        if counts[-1] > limit:
            raise SessionOverflowError(
                f"the new turn alone is {counts[-1]} tokens, over keep_last_tokens={limit}; "
                "split it or raise keep_last_tokens",
                setting="keep_last_tokens",
                limit=limit,
                needed=counts[-1],
            )
        drop = 0
        while sum(counts[drop:]) > limit:
            drop += 1
        return turns[drop:], counts[drop:], drop

    def _read(self, turns: tuple[SessionTurn, ...], dropped: int) -> Result:
        host, started = self._host, time.perf_counter()
        text = conversation_text(turns)
        prepared = self._prepare(text)
        plan, adjust, meter = prepared
        whole: tuple[int, ...] = plan.whole
        # the conversation's KV is kept up to the last token it shares with the whole prompt, so that
        # a closing line that merges with the last turn's end is read with the tail, never kept
        kept_ids = host.model.tokenizer.encode_head(self._reader.kept_text(host, text, self._nonce))
        n_keep = common_start(kept_ids, whole)
        notes: list[str] = []
        if dropped:
            notes.append(
                f"{dropped} early turn(s) dropped to keep the conversation within keep_last_tokens="
                f"{self.keep_last_tokens} ({len(turns)} turns kept); the conversation was read again"
            )
        with host.model.lock.turn() as turn:
            passes_before = host.model.backend.counter.mine().forward_passes
            clock = time.perf_counter()
            base, reused, note = self._base(whole[:n_keep], self._reader.head_ids(plan))
            if note and not dropped:
                notes.append(note)
            backend = host.model.backend
            if base is None or (base.n_tokens < n_keep and not backend.packs_trunk):
                # no head to read after, or a backend that would read the trunk in a pass of its own
                start = 0 if base is None else base.n_tokens
                base = backend.prefill(whole[start:n_keep], parent=base)
                turn.pause()
            extend_ms = ms_since(clock)
            rounds, finish, extended = self._reader.read(host, prepared, whole[: base.n_tokens], base, turn.pause)
            # the new turns were read in the trunk of the first pass, with the closing lines and rows:
            # the conversation's KV is kept over that pass's, without its closing lines
            kept = backend.cut(extended, n_keep) if base.n_tokens < n_keep else base
            n_new = base.n_tokens - reused  # what was read before the pass: a head on a miss, a prefill
            meter.stats = replace(
                meter.stats,
                prompt_tokens=meter.stats.prompt_tokens + n_new,
                cached_tokens=reused,
                head_cache="hit" if reused else "miss",
                head_ms=meter.stats.head_ms + extend_ms,
            )
            count_request(backend, meter, rounds, passes_before, reused)
        self._prefix = kept
        host.sessions.hold(self)
        stats = replace(meter.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started))
        result = finish(stats)
        result.warnings[:0] = notes
        return result

    def _prepare(self, text: str) -> Prepared[Any]:
        """The plan of a fresh ``fill``/``decide`` of ``text``; a prompt over a bound is a
        ``SessionOverflowError`` naming it.
        """
        host = self._host
        try:
            prepared = self._reader.prepare(host, text, self._nonce)
        except PromptError as error:
            if "context" not in str(error) or isinstance(error, SessionOverflowError):
                raise
            raise SessionOverflowError(
                f"the conversation is over the model's context of {host.model.backend.context_length} tokens "
                f"({error}); open the session with keep_last_tokens=N to drop early turns",
                setting="context_length",
                limit=host.model.backend.context_length,
                needed=0,
            ) from error
        limit = host.sessions.max_session_tokens
        n_prompt = len(prepared[0].whole)
        if limit is not None and n_prompt > limit:
            raise SessionOverflowError(
                f"the conversation's prompt needs {n_prompt} tokens, over max_session_tokens={limit}; "
                "open the session with keep_last_tokens=N to drop early turns",
                setting="max_session_tokens",
                limit=limit,
                needed=n_prompt,
            )
        return prepared

    def _base(self, kept_ids: tuple[int, ...], head_ids: tuple[int, ...]) -> tuple[Prefix | None, int, str]:
        """The prefix this append reads after: the session's own KV when it is a start of
        ``kept_ids``, else the engine's cached head, else nothing; the tokens it reuses, and a note
        when the session's KV could not be used.
        """
        prefix = self._prefix
        if prefix is not None and common_start(prefix.ids, kept_ids) == prefix.n_tokens:
            return prefix, prefix.n_tokens, ""
        note = ""
        if prefix is not None:
            note = "the new turn merged with the text before it; the conversation was read again"
        elif self._n_appends:
            note = "the session's KV had been evicted (max_sessions); its conversation was read again"
        if kept_ids[: len(head_ids)] == head_ids:
            head, hit, _ = self._host.model.head(head_ids, True)
            return head, len(head_ids) if hit else 0, note
        return None, 0, note


def open_session(
    host: SessionHost,
    schema_or_questions: Any,
    keywords: Mapping[str, Any],
    keep_last_tokens: int | None = None,
) -> Session:
    """``Engine.session``: a fill session for a schema, a decide session for a question set, each
    taking only its own call's keywords (``FillKeywords`` / ``DecideKeywords``).
    """
    if is_question_set(schema_or_questions):
        allowed = set(DecideKeywords.__annotations__) - {"fence_nonce", "cache_key"}
        reader: FillReader | DecideReader = DecideReader(schema_or_questions, DecideKeywords(**keywords))  # type: ignore[typeddict-item]
        what = "a question set's session"
    else:
        allowed = set(FillKeywords.__annotations__) - {"fence_nonce", "use_head_cache"}
        reader = FillReader(schema_or_questions, FillKeywords(**keywords))  # type: ignore[typeddict-item]
        what = "a schema's session"
    unknown = sorted(set(keywords) - allowed)
    if unknown:
        raise OptionError(f"{what} takes {', '.join(sorted(allowed))}; not {', '.join(unknown)}")
    reader.check(host)  # over the engine's limits: refused now, not at the first turn
    return Session(host, reader, keep_last_tokens=keep_last_tokens)
