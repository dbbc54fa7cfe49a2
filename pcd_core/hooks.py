"""A per-request listener on forward passes: how a server sees each pass without the engine knowing it.

A server that wants to watch a request's passes (a tracing span per pass, pass and token counters)
sets a listener with ``listening`` around the request; every backend pass counted by
``backends/counting.py:PassCounter.add`` calls it with the number of tokens the pass is about to read,
just before the pass runs. The listener lives in a ``ContextVar``: an asyncio task's context travels
into the worker thread that ``asyncio.to_thread`` starts, so the listener set by a request's
middleware is the one its engine calls see, and never another request's, even when requests hand the
model to each other between passes (``model_lock.py``). No framework is imported here; the
OpenTelemetry side lives in ``pcd_integrations/serving/tracing.py``. A listener observes; stopping a
request is ``model_lock.Cancellation``'s job. ``tests/test_operations.py`` counts a request's passes
through it on the embedded model (one span per pass, as many as the response reports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["PassListener", "listening", "notify_pass"]

PassListener = Callable[[int], None]

_listener: ContextVar[PassListener | None] = ContextVar("pcd_pass_listener", default=None)


def notify_pass(n_tokens: int) -> None:
    """Tell the current request's listener, if any, that a pass over ``n_tokens`` tokens starts."""
    listener = _listener.get()
    if listener is not None:
        listener(n_tokens)


@contextmanager
def listening(listener: PassListener) -> Iterator[None]:
    """Call ``listener`` before every pass run in this context (and threads started from it)."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
