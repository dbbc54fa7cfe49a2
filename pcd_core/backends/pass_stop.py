"""Stopping a pass inside: the cancellation a backend's pass watches between its layers.

A request whose client went away stops at its next pass boundary (``pcd_core/concurrency/model_lock.py``),
but one pass can be long: a decide of 200 questions on a warm head is a single forward pass, and a
short request sent after its client hung up waited for the rest of it (docs/operations.md, "Short
turns after a dropped long pass", has the figures). So the backends that can look inside a pass ask
``watched()`` when it starts and, when it gives a signal, look at it as the pass goes and raise
``Cancelled`` once it is set: torch
before each decoder layer (``TorchPasses._decode``, ``stop_inside``), llama.cpp between its graph's
nodes through ``llama_set_abort_callback`` (``LlamaCppBackend._decode``: prompts, packed passes and
re-reads, whose sequences are dropped on any error; not generation steps, whose rows continue in
place).

The signal is the caller's ``Cancellation``, put here by ``model_lock.cancellable`` (``watching``): this
module sits below the backends so that they can read it without importing the engine's concurrency
layer. The model thread runs every hook in a copy of the caller's context (``model_thread.py``), so a
pass sees the signal of the request it runs for. A pass that carries several callers' work (a join,
``pcd_core/concurrency/pass_join.py``) runs under ``shared_pass``: there ``watched()`` gives nothing,
so one caller leaving never stops the others' answers; such a pass stops at its end, as before.

A torch pass stopped inside leaves nothing shared half-written: its cache layers and outputs are its own,
the prefix it reads is immutable, and the one shared buffer a pass may write into, the room behind a
prefix (``torch_cache.Room``), is claimed before the pass and never offered again, claimed or not
used; a memo of a batch's paths (``torch_cache.StemMemo``) is replaced only after its pass completes.
On llama.cpp the aborted micro-batch's cells are removed by ``llama_decode`` and the rest of the
pass's cells go with the sequences its caller drops; a prefix's own cells are never written by a
pass after it.

``PCD_STOP_INSIDE_PASSES=0`` (or ``set_stopping_inside(False)``) turns the check off, leaving only the
pass boundaries: ``pcd bench --hangup`` measures both in one run. ``tests/test_stop_inside.py`` covers it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from pcd_core.errors import Cancelled

#: the environment variable that turns the in-pass check off ("0") for the whole process
ENV_STOP_INSIDE = "PCD_STOP_INSIDE_PASSES"


class StopSignal(Protocol):
    """What a pass watches: ``model_lock.Cancellation`` is one."""

    reason: str

    @property
    def cancelled(self) -> bool: ...


_WATCHED: ContextVar[StopSignal | None] = ContextVar("pcd_pass_stop", default=None)
_SHARED: ContextVar[bool] = ContextVar("pcd_pass_shared", default=False)
_enabled = [os.environ.get(ENV_STOP_INSIDE, "1").strip() != "0"]


@contextmanager
def watching(signal: StopSignal) -> Iterator[None]:
    """Passes started in the block (on this thread or the model thread it hands them to) watch ``signal``."""
    reset = _WATCHED.set(signal)
    try:
        yield
    finally:
        _WATCHED.reset(reset)


@contextmanager
def shared_pass(shared: bool = True) -> Iterator[None]:
    """Passes started in the block carry other callers' work too (when ``shared``): none stops inside."""
    reset = _SHARED.set(shared)
    try:
        yield
    finally:
        _SHARED.reset(reset)


def set_stopping_inside(enabled: bool) -> bool:
    """Turn the in-pass check on or off for the process; returns the setting it replaces."""
    before, _enabled[0] = _enabled[0], enabled
    return before


def stopping_inside() -> bool:
    """Whether passes check their caller's cancellation between layers."""
    return _enabled[0]


def watched() -> StopSignal | None:
    """The signal a pass starting now stops on: its caller's, when the check is on and the pass serves
    that caller alone; else None (the pass then installs nothing and costs nothing more).
    """
    if not _enabled[0] or _SHARED.get():
        return None
    return _WATCHED.get()


def stop_inside(signal: StopSignal, layer: int, n_layers: int) -> None:
    """Raise ``Cancelled`` when ``signal`` is set; called before layer ``layer`` (0-based) of ``n_layers``."""
    if signal.cancelled:
        raise Cancelled(
            f"{signal.reason}; the request's pass was stopped inside, before decoder layer {layer + 1} of {n_layers}"
        )
