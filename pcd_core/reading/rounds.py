"""One batched backend call per round; every decision advances by its own small state machine.

A round gathers, from every pending decision, the trie nodes it must read, lays them out as rows
(a node on the path of a longer row is read from that row instead of getting its own), and scores
all rows after the shared prefix in one ``backend.score`` call. The first round may carry a *trunk*,
text to read after the prefix before the rows (the request, or the answer lines of the wave before):
it is read in that same pass, and ``decode`` hands back the prefix extended by it. ``trie`` and
``exact`` finish in one round; ``greedy`` takes one round per trie level it descends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcd_core.backends.base import Backend, Prefix, Query
from pcd_core.concurrency.model_lock import no_pause
from pcd_core.errors import OptionError
from pcd_core.prompting.trie import STRATEGIES, LabelTrie, Path, Strategy, greedy_next
from pcd_core.reading.readout import Readout, exact_logmass, make_readout, settled_logmass


@dataclass(frozen=True)
class DecodeOptions:
    """How every decision of one call is read; checked once, here, before any pass runs.

    ``strategy``: ``trie`` (every decision node in one pass), ``greedy`` (the likeliest branch, one
    pass per level) or ``exact`` (every label's whole line); see ``pcd_core/prompting/trie.py``.
    """

    strategy: Strategy = "trie"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise OptionError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")

    def replace(self, **changes: Any) -> DecodeOptions:
        """These options with some of them overridden for one call (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass
class DecisionTask:
    """One decision after the prefix: its trie, the strategy, and what has been read so far."""

    trie: LabelTrie
    strategy: Strategy = "trie"
    branch_norm: bool = False
    reads: dict[Path, dict[int, float]] = field(default_factory=dict)
    pending: list[Path] = field(default_factory=list)
    hidden: Any = None  # the final hidden state at the first decision point, when the pass read it
    lead: tuple[int, ...] = ()  # tokens read before the trie's row, in the row (planning/speculation.py)

    def __post_init__(self) -> None:
        if self.strategy == "trie":
            self.pending = self.trie.decision_paths()
        elif self.strategy == "exact":
            self.pending = self.trie.all_paths()
        elif self.strategy == "greedy":
            self.pending = [()]
        else:  # DecodeOptions rejects it first; a task built by hand gets the same error
            DecodeOptions(self.strategy)

    def absorb(self, path: Path, read: dict[int, float]) -> None:
        self.reads[path] = read
        if self.strategy == "greedy":
            following = greedy_next(self.trie, path, read)
            if following is not None:
                self.pending.append(following)

    def readout(self) -> Readout:
        n = self.trie.n_labels()
        if self.strategy == "exact":
            logmass = exact_logmass(self.trie, self.reads, n)
        else:
            logmass = settled_logmass(self.trie, self.reads, n, self.branch_norm)
        return dataclasses.replace(make_readout(logmass, self.reads[()]), hidden=self.hidden)


@dataclass
class RoundStats:
    rounds: int = 0
    n_rows: int = 0
    row_tokens: int = 0  # distinct row tokens read, the trunks not included


@dataclass(frozen=True, eq=False)
class Decoded:
    """The readouts, one per task in order, and the prefix extended by the trunk that was read."""

    readouts: list[Readout]
    prefix: Prefix


def plan_rows(paths: list[tuple[tuple[int, ...], Path]]) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """Lay out (row prefix, path) reads as rows: ``(row index, position)`` per read, in input order.

    A read whose tokens are a prefix of a longer row's tokens is read from that row, so a chain of
    nested decision nodes (``"`` then ``true``) costs one row with several queries.
    """
    full = [row + path for row, path in paths]
    order = sorted(range(len(full)), key=lambda k: -len(full[k]))
    rows: list[tuple[int, ...]] = []
    placed: list[tuple[int, int]] = [(0, -1)] * len(full)
    for k in order:
        tokens = full[k]
        if not tokens:
            placed[k] = (0, -1)  # read straight after the prefix
            continue
        index = next((r for r, row in enumerate(rows) if row[: len(tokens)] == tokens), None)
        if index is None:
            rows.append(tokens)
            index = len(rows) - 1
        placed[k] = (index, len(tokens) - 1)
    return rows, placed


def decode(
    backend: Backend,
    prefix: Prefix | None,
    tasks: list[DecisionTask],
    stats: RoundStats,
    trunk: Sequence[int] = (),
    pause: Callable[[], None] = no_pause,
    hidden: bool = False,
) -> Decoded:
    """Run rounds until no task has pending reads; one ``score`` call per round for all tasks, the
    first carrying ``trunk``. ``prefix`` may be None when the trunk is the whole prompt. ``pause`` is
    called at every pass boundary, between rounds and between the chunks of one (``model_lock.py``).
    With ``hidden``, the round that reads a task's first decision point (its root, path ``()``) also
    keeps the final hidden state there (``Readout.hidden``): the same passes, no more.
    """
    trunk = tuple(trunk)
    n_rounds = 0
    while trunk or any(task.pending for task in tasks):
        if n_rounds:
            pause()  # greedy descends one level per round
        n_rounds += 1
        requests = [(task, path) for task in tasks for path in task.pending]
        for task in tasks:
            task.pending = []
        rows, placed = plan_rows([(task.lead + task.trie.row, path) for task, path in requests])
        queries = [
            Query(row, position, task.trie.children_ids(path))
            for (task, path), (row, position) in zip(requests, placed)
        ]
        tokens_before = backend.counter.mine().tokens_read  # this thread's: others read between chunks
        roots = hidden and any(not path for _, path in requests)
        scored = backend.score(prefix, rows, queries, trunk=trunk, pause=pause, hidden=roots)
        stats.rounds += 1 if requests else 0
        stats.n_rows += len(rows)
        stats.row_tokens += backend.counter.mine().tokens_read - tokens_before - len(trunk)  # distinct row tokens
        prefix, trunk = scored.prefix, ()
        for k, ((task, path), query, logp) in enumerate(zip(requests, queries, scored.values)):
            task.absorb(path, dict(zip(query.ids, logp.tolist())))
            if roots and not path and scored.hidden is not None:
                task.hidden = scored.hidden[k]
    assert prefix is not None  # score refuses a call with neither a prefix nor a trunk
    return Decoded([task.readout() for task in tasks], prefix)
