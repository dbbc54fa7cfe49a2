"""Fair access to one in-process model: a FIFO lock that a long request hands over between passes.

Requests get the model in the order they asked for it (a ticket queue on a condition, not an
``RLock``, whose release lets the same thread take it straight back). A request that holds it
offers it at every pass boundary it reaches (``Turn.pause``: between the chunked passes of one
packed read, between ``depends_on`` waves, between the steps of open generation): when another
request is waiting, the holder goes to the back of the queue, so a small request behind a long one
runs after at most one of the long one's passes, and several long ones take turns pass by pass.

Handing over is safe because nothing a pass leaves behind is shared: a ``Prefix`` is immutable (the
torch and MLX backends concatenate into new tensors; the head cache only drops its reference when it
evicts one), and the rows a generation grows live in an arena of their own (``_Arena`` in
``backends/torch_backend.py``), which no other request writes. The result of a request therefore
does not depend on what ran between its passes: the same passes read the same tensors.

A nested hold (the content-free priors measured inside a request) never hands over: the outer
caller expects the model to stay its own until it lets go. ``Turn.queue_ms`` is the time one request
spent waiting, first and after each hand-over; ``Stats.queue_ms`` reports it.
``tests/test_fairness.py`` checks the order with two threads on the real model, and that the answers
equal sequential ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType


def no_pause() -> None:
    """The pause of code that runs without a turn (a backend used directly, a test)."""


class ModelLock:
    """A reentrant FIFO lock over a model; ``serialise=False`` makes every call a no-op (a server
    that batches concurrent requests itself, such as vLLM, needs no lock).
    """

    def __init__(self, serialise: bool = True) -> None:
        self.serialise = serialise
        self._changed = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()  # one ticket per waiting thread, oldest first
        self._owner: int | None = None
        self._depth = 0

    @property
    def waiting(self) -> int:
        """Threads queued for the model now."""
        with self._changed:
            return len(self._queue)

    def acquire(self) -> float:
        """Take the model in arrival order (at once when this thread holds it); returns seconds waited."""
        if not self.serialise:
            return 0.0
        with self._changed:
            if self._owner == threading.get_ident():
                self._depth += 1
                return 0.0
            return self._wait_for_turn()

    def release(self) -> None:
        if not self.serialise:
            return
        with self._changed:
            if self._owner != threading.get_ident():
                raise RuntimeError("the model lock is released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._changed.notify_all()

    def offer(self) -> float:
        """Let a waiting request go first: this thread, holding the lock once, queues again behind
        everyone already waiting. Returns seconds waited (0 when nobody waited or the hold is nested).
        """
        if not self.serialise:
            return 0.0
        with self._changed:
            if self._owner != threading.get_ident() or self._depth != 1 or not self._queue:
                return 0.0
            self._owner, self._depth = None, 0
            self._changed.notify_all()
            return self._wait_for_turn()

    def _wait_for_turn(self) -> float:
        """Take the free model, or queue a ticket and wait until it is first and the model is free
        (``_changed`` is held); returns seconds waited, 0.0 exactly when nobody was in the way.
        """
        waited = 0.0
        if self._owner is not None or self._queue:
            ticket = object()
            self._queue.append(ticket)
            started = time.perf_counter()
            while self._owner is not None or self._queue[0] is not ticket:
                self._changed.wait()
            self._queue.popleft()
            waited = time.perf_counter() - started
        self._owner, self._depth = threading.get_ident(), 1
        return waited

    @contextmanager
    def turn(self) -> Iterator[Turn]:
        """Hold the model for one request; the ``Turn`` hands it over at pass boundaries."""
        held = Turn(self)
        held.queue_ms += self.acquire() * 1000.0
        try:
            yield held
        finally:
            self.release()

    def __enter__(self) -> ModelLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


@dataclass
class Turn:
    """One request's hold on the model: ``pause`` is its pass boundary, ``queue_ms`` its waiting."""

    lock: ModelLock = field(repr=False)
    queue_ms: float = 0.0

    def pause(self) -> None:
        self.queue_ms += self.lock.offer() * 1000.0
