"""Fair access to one in-process model: a FIFO lock that a long request hands over between passes.

Requests get the model in the order they asked for it (a ticket queue on a condition, not an
``RLock``, whose release lets the same thread take it straight back). A request that holds it
offers it at every pass boundary it reaches (``Turn.pause``: between the chunked passes of one
packed read, between ``depends_on`` waves, between the steps of open generation): when another
request is waiting, the holder goes to the back of the queue, so a small request behind a long one
runs after at most one of the long one's passes, and several long ones take turns pass by pass.

Handing over is safe because nothing a pass leaves behind is shared: a ``Prefix`` is immutable (the
torch and MLX backends concatenate into new tensors; the head cache only drops its reference when it
evicts one), and the rows a generation grows live in an arena of their own (``Arena`` in
``backends/torch_cache.py``), which no other request writes. The result of a request therefore
does not depend on what ran between its passes: the same passes read the same tensors.

A nested hold (the content-free priors measured inside a request) never hands over: the outer
caller expects the model to stay its own until it lets go. ``Turn.queue_ms`` is the time one request
spent waiting, first and after each hand-over; ``Stats.queue_ms`` reports it.
``tests/test_fairness.py`` checks the order with two threads on the real model, and that the answers
equal sequential ones.

Cancellation rides on the same boundaries. A server that sees its client leave sets the request's
``Cancellation``; the engine call runs under it (``cancellable``: a context variable, which
``in_thread`` carries into the worker thread, so no engine signature changes and every entry
point, fill, decide, generate and stream, is covered by the one lock they all take). The request then
raises ``Cancelled`` where it would next take or offer the model: on entering a turn, at every
``pause``, and while it waits in the queue (it leaves the queue). The model is released on the way out
and the rows it grew go with its frames, so the next request starts at once. A pass itself need not
run to its end: ``cancellable`` also hands the flag to the backends (``backends/pass_stop.py``), and
the torch backend checks it between decoder layers, so a long pass (a 200-question decide is one)
stops inside when it serves the cancelled caller alone; a pass joined with other callers' work
(``pass_join.py``) runs to its end. ``tests/test_stop_inside.py`` stops a real pass inside;
``tests/test_fairness.py`` cancels a real reply and fill between passes;
``tests/test_chat_completions.py`` drops a real client in the middle of a long chat and reads the
next request's wait; ``tests/test_mcp_server.py`` abandons an MCP fill mid-generation.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

# the in-pass check's switch is re-exported (``as``) for callers above the backends: ``pcd bench --hangup``
from pcd_core.backends.pass_stop import set_stopping_inside as set_stopping_inside
from pcd_core.backends.pass_stop import stopping_inside as stopping_inside
from pcd_core.backends.pass_stop import watching
from pcd_core.errors import Cancelled

_T = TypeVar("_T")
#: how often a request waiting in the queue looks at its cancellation (a wait needs no faster answer)
CANCEL_POLL_S = 0.05


class Cancellation:
    """One request's cancel flag: set from any thread (the server that saw the client go), read by
    the engine at pass boundaries. Setting it twice keeps the first reason.
    """

    def __init__(self) -> None:
        self._set = threading.Event()
        self.reason = ""

    def cancel(self, reason: str = "the request was cancelled") -> None:
        if not self._set.is_set():
            self.reason = reason
            self._set.set()

    @property
    def cancelled(self) -> bool:
        return self._set.is_set()

    def check(self) -> None:
        """Raise ``Cancelled`` when the flag is set."""
        if self._set.is_set():
            raise Cancelled(f"{self.reason}; the request stopped at a pass boundary")


_CURRENT: ContextVar[Cancellation | None] = ContextVar("pcd_cancellation", default=None)


@contextmanager
def cancellable(token: Cancellation) -> Iterator[Cancellation]:
    """Run the engine calls in the block under ``token``: once it is set they raise ``Cancelled``, at
    a pass boundary or inside a pass that serves them alone (``backends/pass_stop.py``).
    """
    reset = _CURRENT.set(token)
    try:
        with watching(token):
            yield token
    finally:
        _CURRENT.reset(reset)


def run_cancellable(token: Cancellation, call: Callable[[], _T]) -> _T:
    """``call()`` under ``token``; the function a server hands to its worker thread."""
    with cancellable(token):
        return call()


#: worker threads for engine calls made from async code. Such a call mostly waits for the model, and
#: concurrent callers' work shares passes only when each has a thread waiting (``pass_join.py``), so
#: the pool is sized for callers, not for the CPUs that ``asyncio.to_thread``'s default pool follows
#: (six threads on a 2-core machine: eight HTTP clients' replies could not all step together)
ENGINE_THREADS = 64
_pool: list[ThreadPoolExecutor] = []
_pool_guard = threading.Lock()


async def in_thread(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)`` in one of the engine's worker threads, in a copy of the caller's context (its
    cancellation and request listeners ride along), as ``asyncio.to_thread`` runs it in its own.
    """
    with _pool_guard:
        if not _pool:
            _pool.append(ThreadPoolExecutor(max_workers=ENGINE_THREADS, thread_name_prefix="pcd-engine"))
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        _pool[0], functools.partial(context.run, call, *args, **kwargs)
    )


async def in_worker(call: Callable[[], _T], token: Cancellation, reason: str) -> _T:
    """``call()`` in a worker thread under ``token``, which is set with ``reason`` on the way out: a
    no-op once the call is done, and the engine's stop at its next pass boundary when the awaiting
    task was cancelled (a request abandoned). Both servers run their engine calls through it.
    """
    try:
        return await in_thread(run_cancellable, token, call)
    finally:
        token.cancel(reason)


def current_cancellation() -> Cancellation | None:
    """The cancellation the calling context runs under, if any."""
    return _CURRENT.get()


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

    def acquire(self, cancel: Cancellation | None = None, served: Callable[[], bool] | None = None) -> float:
        """Take the model in arrival order (at once when this thread holds it); returns seconds waited.
        With ``cancel``, a wait ends in ``Cancelled`` as soon as it is set, the ticket given up. With
        ``served``, a wait ends without the model once it says true: another request did this one's
        work (``pass_join.py``), so the caller has nothing left to read (``holds`` tells which).
        """
        if not self.serialise:
            return 0.0
        with self._changed:
            if self._owner == threading.get_ident():
                self._depth += 1
                return 0.0
            return self._wait_for_turn(cancel, served)

    def holds(self) -> bool:
        """Whether the calling thread holds the model (always, when the lock is off)."""
        if not self.serialise:
            return True
        with self._changed:
            return self._owner == threading.get_ident()

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

    def offer(self, cancel: Cancellation | None = None, served: Callable[[], bool] | None = None) -> float:
        """Let a waiting request go first: this thread, holding the lock once, queues again behind
        everyone already waiting. Returns seconds waited (0 when nobody waited or the hold is nested).
        A cancelled wait raises ``Cancelled`` without the model; with ``served`` (see ``acquire``)
        the wait ends without it once another request's pass did this one's next work.
        """
        if not self.serialise:
            return 0.0
        with self._changed:
            if self._owner != threading.get_ident() or self._depth != 1 or not self._queue:
                return 0.0
            self._owner, self._depth = None, 0
            self._changed.notify_all()
            return self._wait_for_turn(cancel, served)

    def _wait_for_turn(self, cancel: Cancellation | None = None, served: Callable[[], bool] | None = None) -> float:
        """Take the free model, or queue a ticket and wait until it is first and the model is free
        (``_changed`` is held); returns seconds waited, 0.0 exactly when nobody was in the way. A
        wait that ``served`` ends leaves the queue without the model.
        """
        waited = 0.0
        if self._owner is not None or self._queue:
            ticket = object()
            self._queue.append(ticket)
            started = time.perf_counter()
            while self._owner is not None or self._queue[0] is not ticket:
                if served is not None and served():
                    self._queue.remove(ticket)
                    self._changed.notify_all()  # the next ticket may be first now
                    return time.perf_counter() - started
                self._changed.wait(CANCEL_POLL_S if cancel is not None else None)
                if cancel is not None and cancel.cancelled:
                    self._queue.remove(ticket)
                    self._changed.notify_all()
                    cancel.check()
            self._queue.popleft()
            waited = time.perf_counter() - started
        self._owner, self._depth = threading.get_ident(), 1
        return waited

    @contextmanager
    def turn(self, served: Callable[[], bool] | None = None) -> Iterator[Turn]:
        """Hold the model for one request; the ``Turn`` hands it over at pass boundaries and, under a
        set ``Cancellation``, raises ``Cancelled`` there instead of going on. With ``served`` (see
        ``acquire``) the block may run without the model, once another request did its work.
        """
        held = Turn(self, cancel=current_cancellation())
        held.check()
        held.queue_ms += self.acquire(held.cancel, served) * 1000.0
        try:
            held.check()
            yield held
        finally:
            if self.holds():  # a wait cancelled inside ``pause`` left the queue without the model
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
    """One request's hold on the model: ``pause`` is its pass boundary, ``queue_ms`` its waiting,
    ``cancel`` the flag it stops on.
    """

    lock: ModelLock = field(repr=False)
    queue_ms: float = 0.0
    cancel: Cancellation | None = field(default=None, repr=False)

    def check(self) -> None:
        if self.cancel is not None:
            self.cancel.check()

    def pause(self, served: Callable[[], bool] | None = None) -> None:
        """A pass boundary: let waiting requests go first, then hold the model again, unless ``served``
        says true first (another request's pass read this one's next step: ``pass_join.py``); then the
        model stays with the others, and the next boundary takes it back.
        """
        self.check()
        if self.lock.holds():
            self.queue_ms += self.lock.offer(self.cancel, served) * 1000.0
        else:
            self.queue_ms += self.lock.acquire(self.cancel, served) * 1000.0
        self.check()
