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
``pcd_core/hooks.py`` and ``pcd_core/concurrency/model_lock.py`` keep them), and ``acting_thread`` tells whose
work it is, so that ``counting.PassCounter`` charges the caller. A call made on this thread runs at
once, so a hook may call another. Every in-process model of the process shares the thread, so two
engines' passes take turns (on a CPU they would share the same cores anyway). A process that ends,
an interrupted command included, lets the pass in flight finish first; a child process forked from
one that used the thread starts a thread of its own on first use. ``tests/test_model_thread.py``
covers it.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["acting_thread", "run"]

_T = TypeVar("_T")

_serving = threading.local()  # on the model thread: the thread whose call runs now
_worker: threading.Thread | None = None  # the model thread, once it has started


def _mark_worker() -> None:
    global _worker
    _worker = threading.current_thread()
    _worker.name = "pcd-model"  # not the pool's "pcd-model_0": there is only ever one


def _new_executor() -> ThreadPoolExecutor:
    # concurrent.futures' own worker, not a daemon: a process that ends (an interrupted command
    # included) lets the pass in flight finish, where a daemon thread killed inside the model's
    # kernels aborted the process ("terminate called without an active exception")
    return ThreadPoolExecutor(max_workers=1, initializer=_mark_worker)


_executor = _new_executor()


def _forget_worker() -> None:
    """In a forked child: the parent's model thread did not come along; the first call starts one."""
    global _executor, _worker
    _executor, _worker = _new_executor(), None


os.register_at_fork(after_in_child=_forget_worker)


def run(call: Callable[[], _T]) -> _T:
    """``call()`` on the model thread, in a copy of this thread's context; its result or its error."""
    if threading.current_thread() is _worker:
        return call()
    return _executor.submit(_act_for, threading.current_thread(), contextvars.copy_context(), call).result()


def acting_thread() -> threading.Thread:
    """The thread whose work runs now: on the model thread, the caller of the call it runs."""
    caller: threading.Thread | None = getattr(_serving, "caller", None)
    return caller if caller is not None else threading.current_thread()


def _act_for(caller: threading.Thread, context: contextvars.Context, call: Callable[[], _T]) -> _T:
    _serving.caller = caller
    try:
        return context.run(call)
    finally:
        _serving.caller = None
