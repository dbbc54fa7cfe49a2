"""One thread runs every in-process model's work, whichever thread asks for it.

torch's CPU kernels and llama.cpp's (the CPU build links GNU OpenMP) run on a team of OpenMP threads
that belongs to the thread that started it: each thread that runs a model's pass gets a team of its
own, kept for as long as it lives. Once these teams hold more threads than the machine has cores,
GNU OpenMP stops letting idle team threads spin and puts them to sleep after almost every parallel
region, and a model's many small regions then each pay a wake-up: on a 2-core machine a reply's
step took half as long again on a second thread as on the first, and three llama.cpp replies twice
as long (docs/benchmarks.md, "One thread runs the model", has the figures and ``pcd bench
--clients``'s before and after). Servers, ``asyncio.to_thread`` and the adapters' ``batch``
call the engine from many threads, so the backends that run in this process (``Backend.serialises``)
hand each hook to this one thread (``run``) and wait for it; their loaders build the model there
too. The call runs in a copy of the caller's context (its pass listener and cancellation, as
``pcd_core/hooks.py`` and ``pcd_core/fairness.py`` keep them), and ``acting_thread`` tells whose
work it is, so that ``counting.PassCounter`` charges the caller. A call made on this thread runs at
once, so a hook may call another. Every in-process model of the process shares the thread, so two
engines' passes take turns (on a CPU they would share the same cores anyway). A child process
forked from one that used it starts a thread of its own on first use. ``tests/test_model_thread.py``
covers it.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["acting_thread", "run"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Job:
    call: Callable[[], Any]
    context: contextvars.Context
    caller: threading.Thread
    result: Future[Any]


_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_started = threading.Lock()
_worker: threading.Thread | None = None
_serving = threading.local()  # on the worker: the thread whose job runs now


def _forget_worker() -> None:
    """In a forked child: the parent's model thread did not come along, nor did its queue's jobs."""
    global _jobs, _started, _worker
    _jobs, _started, _worker = queue.SimpleQueue(), threading.Lock(), None


os.register_at_fork(after_in_child=_forget_worker)


def run(call: Callable[[], _T]) -> _T:
    """``call()`` on the model thread, in a copy of this thread's context; its result or its error."""
    if threading.current_thread() is _worker:
        return call()
    job = _Job(call, contextvars.copy_context(), threading.current_thread(), Future())
    _jobs.put(job)
    _ensure_worker()
    return job.result.result()


def acting_thread() -> threading.Thread:
    """The thread whose work runs now: on the model thread, the caller of the job it runs."""
    caller: threading.Thread | None = getattr(_serving, "caller", None)
    return caller if caller is not None else threading.current_thread()


def _ensure_worker() -> None:
    global _worker
    with _started:
        if _worker is None:
            # a daemon, so that a process whose main thread ends (or is interrupted) does not wait for
            # a pass nobody will read
            _worker = threading.Thread(target=_serve, name="pcd-model", daemon=True)
            _worker.start()


def _serve() -> None:
    while True:
        job = _jobs.get()
        if not job.result.set_running_or_notify_cancel():
            continue
        _serving.caller = job.caller
        try:
            job.result.set_result(job.context.run(job.call))
        except BaseException as error:  # the caller raises it, whatever it is; this thread goes on
            job.result.set_exception(error)
        finally:
            _serving.caller = None
