"""Forward passes and tokens read: the count every backend keeps, shared by threads, tallied per thread.

Every backend counts each pass before it runs (``Backend.counter``); ``Stats`` and the bench report
these counts, so they are the cost a request is charged. ``tests/test_fairness.py`` checks that a
request run behind another is charged its own passes only.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from pcd_core.backends.model_thread import acting_thread
from pcd_core.hooks import notify_pass


@dataclass
class PassCounter:
    """Forward passes and tokens read, counted under a lock so that threads may share a backend.

    Each thread also keeps its own tally (``mine``): a request runs in one thread, and when it hands
    the model over between passes (``pcd_core/concurrency/model_lock.py``) other requests' passes fall between its
    own, so the difference of two totals would count them as its cost. A pass the model thread runs
    for a thread is that thread's (``model_thread.acting_thread``).
    """

    forward_passes: int = 0
    tokens_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tallies: weakref.WeakKeyDictionary[threading.Thread, Tally] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    def add(self, n_tokens: int) -> None:
        """Count one forward pass over ``n_tokens`` distinct tokens, before it runs; the request's pass
        listener (``pcd_core/hooks.py``: a tracing span per pass) hears of it first.
        """
        notify_pass(n_tokens)
        with self._lock:
            self.forward_passes += 1
            self.tokens_read += n_tokens
            self._tally(1, n_tokens)

    def charge(self, n_passes: int, n_tokens: int) -> None:
        """Count, in this thread's tally only, passes another thread ran for this thread's request as
        well as its own (``pcd_core/concurrency/pass_join.py``: replies' steps joined in one pass); the totals
        counted that pass once already.
        """
        with self._lock:
            self._tally(n_passes, n_tokens)

    def _tally(self, n_passes: int, n_tokens: int) -> None:
        thread = acting_thread()
        mine = self._tallies.get(thread, Tally(0, 0))
        self._tallies[thread] = Tally(mine.forward_passes + n_passes, mine.tokens_read + n_tokens)

    def mine(self) -> Tally:
        """The passes and tokens this thread has counted so far."""
        with self._lock:
            return self._tallies.get(acting_thread(), Tally(0, 0))


@dataclass(frozen=True)
class Tally:
    """One thread's running count of forward passes and tokens read."""

    forward_passes: int
    tokens_read: int
