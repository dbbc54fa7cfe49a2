"""Bounded session memory: which sessions keep their KV, evicting the least recently used.

A session (``session.py``) holds the KV of everything it has read, so an engine with many open
sessions would hold many prompts' worth of KV. ``SessionMemory`` bounds that by count
(``max_sessions``): the session that appended last is the most recent; when one more would be over
the bound, the least recently used drops its KV (``release_kv``). It keeps its text, so its next
append reads the conversation again, with the same answers (``tests/test_session.py`` checks them).
Each session's prompt is bounded by ``max_session_tokens`` (checked by the session itself), so the
KV held is at most ``max_sessions * max_session_tokens`` tokens' worth.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger(__name__)


class HoldsKV(Protocol):
    """What the memory needs of a session: the tokens its KV holds, and a way to drop it."""

    @property
    def kv_tokens(self) -> int: ...

    def release_kv(self) -> None: ...


class SessionMemory:
    """The sessions that hold KV now, least recently used first."""

    def __init__(self, max_sessions: int = 64, max_session_tokens: int | None = None) -> None:
        self.max_sessions, self.max_session_tokens = max_sessions, max_session_tokens
        self._held: OrderedDict[int, HoldsKV] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def hold(self, session: HoldsKV) -> None:
        """``session`` has just read (it is the most recent now); evict beyond ``max_sessions``."""
        with self._lock:
            self._held[id(session)] = session
            self._held.move_to_end(id(session))
            evicted = []
            while len(self._held) > self.max_sessions:
                _, oldest = self._held.popitem(last=False)
                evicted.append(oldest)
            self.evictions += len(evicted)
        for oldest in evicted:  # outside the lock: a session's own lock is taken in release_kv
            logger.debug("session evicted: %d tokens of KV dropped, its text kept", oldest.kv_tokens)
            oldest.release_kv()

    def forget(self, session: HoldsKV) -> None:
        """A closed or evicted session holds nothing any more."""
        with self._lock:
            self._held.pop(id(session), None)

    @property
    def n_sessions(self) -> int:
        """Sessions that hold KV now."""
        return len(self._held)

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the held sessions have read (a fork's shared start counted in each)."""
        with self._lock:
            return sum(session.kv_tokens for session in self._held.values())
