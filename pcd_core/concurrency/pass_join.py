"""Concurrent callers share forward passes: work that waits while a pass runs joins the next one.

A pass over a little work costs, on a CPU, about what reading the model's weights and setting the
pass up cost, whatever few tokens it carries: a reply's step reads one token per row, a decide
a short state and its questions. So a caller hands its work to a ``PassJoin`` (``submit``) before it
queues for the model, and whichever caller gets the model next (``model_lock.ModelLock``, first come
first served) runs its own work together with every compatible piece waiting then (the same
``key``), oldest first, within the pass's token and row budgets, through the join's ``run_many``.
A caller whose work another's pass read stops waiting for the model as soon as that pass ends
(``ModelLock.turn(served=...)``) and takes its result without it; work left out of a full pass
runs in the next one.

Three joins use it: reply steps and fills' open-row steps (``step_join``: ``Backend.grow_many``,
where each row sees its own prefix and its own row only, so each reply gets the tokens it would get
alone; ``chatting.py``, ``joined_grow``), decides over one head, and fills of one compiled schema
that generate nothing (both in ``engine.py``, through ``batching.BatchRead``, each state's answers
those of its own decide or fill). A caller that stops (its consumer gone, ``Cancelled``) withdraws work nobody took;
work already taken runs and its result is dropped: a pass that carries several callers' work runs
under ``pass_stop.shared_pass``, so no caller's cancellation stops it inside (``backends/pass_stop.py``),
while a caller's work read alone may stop inside its pass. When a joined pass fails, each piece is run
alone, so one caller's error reaches that caller only. ``tests/test_stepping.py`` checks concurrent
replies, decides and fills against the same read one by one, and the passes they cost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pcd_core.backends.base import Backend, GrowStep, Prefix, Rows
from pcd_core.backends.pass_stop import shared_pass
from pcd_core.concurrency.model_lock import no_pause

W = TypeVar("W")
R = TypeVar("R")


@dataclass(eq=False)
class Ticket(Generic[W, R]):
    """One submitted piece of work, and what became of it: its result, or the error its pass raised."""

    work: W
    key: Hashable
    tokens: int
    rows: int
    result: R | None = None
    error: BaseException | None = None
    #: taken into a pass (by its own caller or another)
    taken: bool = False
    #: read by a pass another caller ran (that caller's thread counted the pass)
    shared: bool = False
    #: the tokens of the pass that read it, every piece's together
    pass_tokens: int = 0
    finished: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def served(self) -> bool:
        """Whether a pass has read this work (its caller then waits for the model no more)."""
        return self.done

    def finish(self, result: R | None, error: BaseException | None, pass_tokens: int) -> None:
        self.result, self.error, self.pass_tokens = result, error, pass_tokens
        self.finished.set()


@dataclass
class PassJoin(Generic[W, R]):
    """The work waiting for the model, run together by whichever of its callers holds it.

    ``run_many`` reads pieces of one key in one pass (or as few as it can), holding the model
    throughout; ``run_alone`` reads one piece, handing the model over at the ``pause`` it is given
    (the caller's own work only is in flight then); ``budget`` gives the most tokens and rows one
    pass may take (None: no bound on rows).
    """

    run_many: Callable[[list[W]], list[R]]
    run_alone: Callable[[W, Callable[[], None]], R]
    budget: Callable[[], tuple[int, int | None]]
    _pending: list[Ticket[W, R]] = field(default_factory=list)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, work: W, key: Hashable, tokens: int, rows: int = 1) -> Ticket[W, R]:
        """Queue work before taking the model, so that a pass starting meanwhile can take it."""
        ticket: Ticket[W, R] = Ticket(work, key, tokens, rows)
        with self._guard:
            self._pending.append(ticket)
        return ticket

    def withdraw(self, ticket: Ticket[W, R]) -> None:
        """Take back work that no pass took (its caller stopped); a no-op for work that ran."""
        with self._guard:
            if ticket in self._pending:
                self._pending.remove(ticket)

    def run(self, ticket: Ticket[W, R], pause: Callable[[], None] = no_pause) -> R:
        """The ticket's result: from the pass that took it, or from a pass run now, with the model held,
        over this work and the compatible work waiting behind it (``pause``: the caller's turn's,
        used only when its work runs alone).
        """
        taken = self._take(ticket)
        if taken:
            self._run(taken, pause)
        else:  # another caller's pass took it: without a model lock (vLLM) that pass may still run
            ticket.finished.wait()
            ticket.shared = True
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def _take(self, own: Ticket[W, R]) -> list[Ticket[W, R]]:
        """The caller's own work, then waiting work of its key, oldest first, while the pass has room;
        none when another pass has taken the caller's work.
        """
        max_tokens, max_rows = self.budget()
        with self._guard:
            if own.taken:
                return []
            if own in self._pending:
                self._pending.remove(own)
            own.taken = True
            taken, tokens, rows = [own], own.tokens, own.rows
            for ticket in list(self._pending):
                if ticket.key != own.key:
                    continue
                if tokens + ticket.tokens > max_tokens or (max_rows is not None and rows + ticket.rows > max_rows):
                    break
                self._pending.remove(ticket)
                ticket.taken = True
                taken.append(ticket)
                tokens, rows = tokens + ticket.tokens, rows + ticket.rows
        return taken

    def _run(self, taken: list[Ticket[W, R]], pause: Callable[[], None]) -> None:
        """One pass for every taken piece; when it fails, each piece alone, so an error stays its own.
        Whatever happens, every taken piece ends finished, so no caller waits for it forever.
        """
        try:
            if len(taken) == 1:
                (only,) = taken
                only.finish(self.run_alone(only.work, pause), None, only.tokens)
                return
            try:
                with shared_pass():  # others' work rides in it: one caller leaving must not stop it
                    results = self.run_many([ticket.work for ticket in taken])
            except Exception:
                for ticket in taken:
                    with shared_pass(ticket is not taken[0]):  # the caller's own piece may stop inside
                        self._run_caught(ticket)
                return
            tokens = sum(ticket.tokens for ticket in taken)
            for ticket, result in zip(taken, results, strict=True):
                ticket.finish(result, None, tokens)
        except BaseException as error:  # the caller's own error, or an interrupt: the others get it too
            for ticket in taken:
                if not ticket.done:
                    ticket.finish(None, error, 0)
            raise

    def _run_caught(self, ticket: Ticket[W, R]) -> None:
        try:
            ticket.finish(self.run_alone(ticket.work, no_pause), None, ticket.tokens)
        except Exception as error:  # the caller that owns the work raises it
            ticket.finish(None, error, ticket.tokens)


#: the join of reply steps: a ``GrowStep`` in, its ``Rows`` out
StepJoin = PassJoin[GrowStep, Rows]


def step_join(backend: Backend) -> StepJoin:
    """Reply steps joined through ``Backend.grow_many``, within the backend's pass budgets. Their
    contexts are not bounded: on torch each step attends over its own keys only (``JoinedPass``),
    and on llama.cpp a pass attends over the cache's cells whether it is joined or not, so joining
    adds no attention work.
    """
    return PassJoin(
        run_many=backend.grow_many,
        run_alone=lambda step, _: backend.grow(step.prefix, step.rows, step.new),
        budget=lambda: (backend.max_tokens_per_pass or 0, backend.max_rows_per_pass),
    )


def submit_step(
    steps: StepJoin, prefix: Prefix, rows: Rows | None, new: Sequence[Sequence[int]]
) -> Ticket[GrowStep, Rows]:
    """Queue one reply step: its new tokens are its pass tokens, its rows its rows."""
    step = GrowStep(prefix, rows, tuple(tuple(int(t) for t in n) for n in new))
    return steps.submit(step, None, sum(len(n) for n in step.new), len(step.new))


def joined_grow(
    backend: Backend, steps: StepJoin, pause: Callable[[Callable[[], bool]], None]
) -> Callable[[Prefix, Rows, Sequence[Sequence[int]]], Rows]:
    """A fill's later open-row steps through the join: each step is handed to ``steps``, then the
    fill's turn pauses (``model_lock.Turn.pause``) until it holds the model again or another caller's
    pass has read the step; its rows come from that pass or from one run now with whatever waits.
    """

    def grow(prefix: Prefix, rows: Rows, new: Sequence[Sequence[int]]) -> Rows:
        ticket = submit_step(steps, prefix, rows, new)
        try:
            pause(ticket.served)
            return run_step(backend, steps, ticket)
        finally:
            steps.withdraw(ticket)

    return grow


def run_step(backend: Backend, steps: StepJoin, ticket: Ticket[GrowStep, Rows]) -> Rows:
    """A step's rows; one another reply's pass read is charged to this reply's thread as one pass
    (``PassCounter.charge``), as ``fill_many`` charges each input its batch's passes.
    """
    rows = steps.run(ticket)
    if ticket.shared:
        backend.counter.charge(1, ticket.pass_tokens)
    return rows
