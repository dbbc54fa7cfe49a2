"""Many inputs, one schema or question set: their passes read together, one forward pass per wave.

A solo fill reads its request as the trunk after the cached head, with the first wave's rows in the
same pass, then hangs each later wave from the prefix that trunk left. A batch cannot keep a prefix
per input (``Backend.score`` extends one prefix), so each input's *stem*, its request and the answer
lines chosen so far, goes in front of its rows instead: every row of input i is ``stem_i + row``.
``pack_tree`` merges rows that start alike, so a stem is read once per pass, and rows never see each
other, so input i's rows see the head, its own stem and their own earlier tokens, exactly what its
solo pass shows them at the same positions. One ``score`` call per wave thus reads every input of
the batch: a warm batch of fills is two passes (wave 0, then every later field), a batch of decides
one, and the base class splits a call over ``max_tokens_per_pass`` into more passes, never into a
different answer. Each later round asks for the request again in front of its rows (a solo fill
reads it once); the torch backend keeps the requests the round before read (``StemMemo`` in
``backends/torch_cache.py``) and reads only what follows them, other backends read them again.
``Stats.prompt_tokens`` counts a request once per round, as asked; the pass counter
(``tokens_read``) counts what was read.

What a batch cannot take runs solo, in order, through the caller's ``fill``: an input that merged with
the head's last token (no stem hangs from the head), a fill that generates open fields (``grow``
extends one prefix's rows), and every fill on a backend whose passes cost their tokens and little
else (``Backend.batches_fills``: llama.cpp, where the re-read requests cost more than the shared
passes save). Running the fills that generate side by side in threads, so that their steps join
as concurrent callers' do (``pass_join.joined_grow``), measured slower than the loop on a 2-core CPU
(docs/benchmarks.md). Concurrent callers' fills of one schema that generate nothing are read as a
batch too (``fill_joined``, through the engine's ``PassJoin``). ``tests/test_batching.py`` checks
every answer and probability against solo calls on the real model, the pass counts, a split batch
and a neighbour swap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pcd_core.backends.base import Backend, Prefix, Query
from pcd_core.backends.packing import pack_tree
from pcd_core.concurrency.model_lock import no_pause
from pcd_core.cost import Meter
from pcd_core.planning.deciding import DecidePlan
from pcd_core.planning.filling import Filled, FillPlan
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.read_path import after_head, count_request, ms_since, read_head
from pcd_core.reading.readout import Readout
from pcd_core.reading.rounds import DecisionTask, RoundStats, plan_rows
from pcd_core.request.questions import DecideResponse
from pcd_core.result import Extraction
from pcd_core.trust.calibration_applying import Adjust

_P = TypeVar("_P")

#: the most request tokens one batch group reads (its inputs' stems summed). A batch asks for each
#: stem in every round after the first, so long requests gained nothing from sharing passes (the
#: 28-field ticket, 388 tokens, batched 16 at a time ran at 0.15x the solo loop, docs/benchmarks.md),
#: and an input too long to share a group with another runs solo. Since the torch backend reads a
#: group's inputs side by side as a batch, not under one dense mask, wider groups no longer cost more
#: per token, but they gained nothing either (sentiment: 1.9x-2.1x the loop from 512 to 8,192 tokens
#: in bfloat16), and a narrow group keeps each pass, and so the wait of a request behind it, short.
BATCH_STEM_TOKENS = 512


@dataclass
class Stem:
    """One input of a batch: the ids after the head it reads before its rows, its pending decisions,
    and its own counts (rounds, rows, distinct row tokens, stem tokens read).
    """

    ids: tuple[int, ...]
    tasks: list[DecisionTask]
    rounds: RoundStats = field(default_factory=RoundStats)
    stem_tokens: int = 0


def decode_batch(backend: Backend, head: Prefix, stems: list[Stem], pause: Callable[[], None]) -> list[list[Readout]]:
    """Run rounds until no stem's task is pending, one ``score`` call per round for every input:
    each input's reads laid out as in ``rounds.plan_rows``, its stem put in front of each row (and
    read as a row of its own when a read falls right after the stem). Readouts per stem, in order.
    """
    n_rounds = 0
    while any(task.pending for stem in stems for task in stem.tasks):
        if n_rounds:
            pause()  # greedy descends one level per round
        n_rounds += 1
        rows: list[tuple[int, ...]] = []
        queries: list[Query] = []
        reads: list[tuple[DecisionTask, tuple[int, ...]]] = []
        for stem in stems:
            requests = [(task, path) for task in stem.tasks for path in task.pending]
            for task in stem.tasks:
                task.pending = []
            if not requests:
                continue
            own, placed = plan_rows([(task.lead + task.trie.row, path) for task, path in requests])
            first = len(rows)
            rows.extend(stem.ids + row for row in own)
            if any(position == -1 for _, position in placed):
                rows.append(stem.ids)  # a read right after the stem: its last token answers it
            for (task, path), (row, position) in zip(requests, placed):
                at = (len(rows) - 1, len(stem.ids) - 1) if position == -1 else (first + row, len(stem.ids) + position)
                queries.append(Query(*at, task.trie.children_ids(path)))
                reads.append((task, path))
            stem.rounds.rounds += 1
            stem.rounds.n_rows += len(own)
            stem.rounds.row_tokens += len(pack_tree(own).tokens) if own else 0
            stem.stem_tokens += len(stem.ids)
        scored = backend.score(head, rows, queries, pause=pause)
        for (task, path), query, logp in zip(reads, queries, scored.values):
            task.absorb(path, dict(zip(query.ids, logp.tolist())))
    return [[task.readout() for task in stem.tasks] for stem in stems]


#: one input made ready before the lock (``Planner.fill`` / ``Planner.decide``, ``planner.py``): its plan, its
#: debias / calibration step, and its ``Meter`` with ``compile_ms`` set
Prepared = tuple[_P, Adjust | None, Meter]


@dataclass(frozen=True)
class BatchRead:
    """A batch's reads of the engine's model (``LoadedModel``). Each ``*_many`` takes the model once
    for its whole batch, handing it over at every pass boundary as a solo request does
    (``model_lock.py``).
    """

    model: LoadedModel
    use_cache: bool = True

    @property
    def backend(self) -> Backend:
        return self.model.backend

    def fill_many(self, prepared: Sequence[Prepared[FillPlan]], solo: Callable[[int], Extraction]) -> list[Extraction]:
        """Every batchable fill read together, the others through ``solo(index)`` after them; results
        in the inputs' order.
        """
        started = time.perf_counter()
        joined = [k for k, (plan, adjust, _) in enumerate(prepared) if fill_joins(self.backend, plan, adjust)]
        results: dict[int, Extraction] = {}
        for group in _groups(joined, [len(plan.whole) - len(plan.compiled.head_ids) for plan, _, _ in prepared]):
            plans = [prepared[k][0] for k in group]
            meters = [prepared[k][2] for k in group]
            with self.model.lock.turn() as turn:
                filled = self._fill(plans, [prepared[k][1] for k in group], meters, turn.pause)
            for k, plan, done, m in zip(group, plans, filled, meters):
                results[k] = plan.assemble(done, replace(m.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started)))
        return [results[k] if k in results else solo(k) for k in range(len(prepared))]

    def decide_many(
        self, prepared: Sequence[Prepared[DecidePlan]], model: str, solo: Callable[[int], DecideResponse]
    ) -> list[DecideResponse]:
        """Every batchable decide read in one ``score`` call (one pass warm, as a solo decide), the
        others through ``solo(index)``; responses in the states' order.
        """
        started = time.perf_counter()
        joined = [k for k, (plan, adjust, _) in enumerate(prepared) if decide_joins(plan, adjust)]
        responses: dict[int, DecideResponse] = {}
        for group in _groups(joined, [len(plan.whole) - len(plan.head_ids) for plan, _, _ in prepared]):
            plans = [prepared[k][0] for k in group]
            meters = [prepared[k][2] for k in group]
            with self.model.lock.turn() as turn:
                readouts = self._decide(plans, meters, turn.pause)
            for k, plan, read, m in zip(group, plans, readouts, meters):
                stats = replace(m.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started))
                merged, spreads = plan.merged(read)
                responses[k] = plan.respond(model, merged, stats, [], prepared[k][1], spreads)
        return [responses[k] if k in responses else solo(k) for k in range(len(prepared))]

    def decide_joined(self, works: list[tuple[DecidePlan, Meter]]) -> list[tuple[list[Readout], list[str]]]:
        """Concurrent callers' decides over one head in one ``score`` call (``pass_join.PassJoin``,
        ``engine.py``), holding the model throughout; each one's readouts, and no warnings (as in
        ``decide_many``: a decide that joins extends the head, so its head read warns of nothing).
        """
        readouts = self._decide([plan for plan, _ in works], [meter for _, meter in works], no_pause)
        return [(read, []) for read in readouts]

    def fill_joined(self, works: list[Prepared[FillPlan]]) -> list[Filled]:
        """Concurrent callers' fills of one compiled schema in one ``score`` call per wave
        (``pass_join.PassJoin``, ``engine.py``), holding the model throughout: a joined read never hands
        the model over between its waves, since the callers whose fills it reads wait in the model's
        queue for it to end. Each fill's own answers, as ``fill_many`` reads them.
        """
        plans = [plan for plan, _, _ in works]
        return self._fill(plans, [adjust for _, adjust, _ in works], [meter for _, _, meter in works], no_pause)

    def _head(self, head_ids: tuple[int, ...], whole: Sequence[tuple[int, ...]], meters: list[Meter]) -> Prefix:
        """The shared head, looked up once; each input's ``meter`` filled as ``read_head`` fills a solo
        request's (the inputs after the first find it read: a hit).
        """
        found: list[tuple[Prefix, bool, bool]] = []

        def once(ids: tuple[int, ...], use_cache: bool) -> tuple[Prefix, bool, bool]:
            if not found:
                found.append(self.model.head(ids, use_cache))
                return found[0]
            return found[0][0], True, found[0][2]

        heads = [read_head(self.model, head_ids, ids, m, self.use_cache, once).head for ids, m in zip(whole, meters)]
        head = heads[0]
        assert head is not None and all(h is head for h in heads)  # inputs that ``_joins`` let in only
        return head

    def _fill(
        self,
        plans: list[FillPlan],
        adjusts: Sequence[Adjust | None],
        meters: list[Meter],
        pause: Callable[[], None],
    ) -> list[Filled]:
        """Every wave of closed fields for every plan (one compiled schema, none generating): one
        ``score`` per wave, each input's stem its request and the answer lines of the waves before;
        each plan's answers adjusted by its own debias / calibration step.
        """
        passes_before = self.backend.counter.mine().forward_passes
        compiled = plans[0].compiled
        head = self._head(compiled.head_ids, [p.whole for p in plans], meters)
        stems = [Stem(p.whole[len(compiled.head_ids) :], []) for p in plans]
        filled = [Filled() for _ in plans]
        speculation = plans[0].speculation(self.backend)  # one compiled schema: the same for every plan
        written = 0  # the waves whose answer lines every stem holds
        clock = time.perf_counter()
        for wave_index in range(len(compiled.waves)):
            if wave_index == 1 and speculation is not None:
                continue  # read in the first wave's pass, behind each answer
            if wave_index:
                pause()
                for stem, plan, done in zip(stems, plans, filled):
                    stem.ids += tuple(plan.waves_lines(compiled.waves[written:wave_index], done.chosen))
                written = wave_index
            for stem, plan in zip(stems, plans):
                stem.tasks = plan.first_tasks(speculation) if not wave_index else plan.tasks(wave_index)
            readouts = decode_batch(self.backend, head, stems, pause)
            for plan, done, stem_readouts, adjust in zip(plans, filled, readouts, adjusts):
                if wave_index:
                    done.record(plan, wave_index, stem_readouts, adjust)
                else:
                    done.record_first(plan, stem_readouts, adjust, speculation)
            if not wave_index:
                for m in meters:
                    m.stats = replace(m.stats, prefill_ms=ms_since(clock))
                clock = time.perf_counter()
        for m, stem in zip(meters, stems):
            later = len(compiled.waves) > (2 if speculation is not None else 1)
            m.stats = replace(m.stats, decode_ms=ms_since(clock) if later else 0.0)
            self._count(m, stem, passes_before, len(compiled.head_ids))
        return filled

    def _decide(self, plans: list[DecidePlan], meters: list[Meter], pause: Callable[[], None]) -> list[list[Readout]]:
        """One ``score`` call for every state's questions."""
        passes_before = self.backend.counter.mine().forward_passes
        head_ids = plans[0].head_ids
        head = self._head(head_ids, [p.whole for p in plans], meters)
        stems = [Stem(p.whole[len(head_ids) :], p.tasks()) for p in plans]
        clock = time.perf_counter()
        readouts = decode_batch(self.backend, head, stems, pause)
        for m, stem in zip(meters, stems):
            m.stats = replace(m.stats, prefill_ms=ms_since(clock))
            self._count(m, stem, passes_before, len(head_ids))
        return readouts

    def _count(self, meter: Meter, stem: Stem, passes_before: int, n_head: int) -> None:
        """An input's totals: the batch's passes (shared by its inputs), and its own rows and stems;
        ``prompt_tokens`` is every stem token its rows were asked after, its request once per round
        (a backend may take a repeat from its memo: the pass counter says what was read).
        """
        count_request(self.backend, meter, stem.rounds, passes_before, n_head)
        tokens = n_head + stem.stem_tokens + meter.stats.row_tokens
        meter.stats = replace(meter.stats, prompt_tokens=stem.stem_tokens, input_tokens=tokens)


def _groups(joined: Sequence[int], stems: Sequence[int], budget: int | None = None) -> list[list[int]]:
    """The batchable inputs (``joined``, indices into ``stems``, each input's tokens after the head),
    shortest stem first, in groups whose stems sum to at most ``budget`` (``BATCH_STEM_TOKENS``),
    each group read in its own passes; a group of one is left out, to run solo. Taken by length, a
    group's requests are alike in length, and a pass that reads them side by side as a batch (the
    torch backend's ``torch_batched.batched_hidden``) pads each to the longest.
    """
    budget = BATCH_STEM_TOKENS if budget is None else budget
    groups: list[list[int]] = [[]]
    used = 0
    for k in sorted(joined, key=lambda k: stems[k]):
        if groups[-1] and used + stems[k] > budget:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += stems[k]
    return [group for group in groups if len(group) > 1]


def fill_joins(backend: Backend, plan: FillPlan, adjust: Adjust | None) -> bool:
    """Whether a fill can share passes with others (``fill_many``, concurrent fills): the backend's
    batches pay (``Backend.batches_fills``), the fill generates no open field (``grow`` extends one
    prefix's rows), reads no hidden state (a batch's rows keep none), and its prompt extends its
    schema's head.
    """
    return (
        backend.batches_fills
        and not plan.generates
        and not plan.reads_hidden(adjust)
        and _joins(plan.whole, plan.compiled.head_ids)
    )


def decide_joins(plan: DecidePlan, adjust: Adjust | None) -> bool:
    """Whether a decide can share passes with others (``decide_many``, concurrent decides): it extends
    its head, and no trained head reads its hidden states, which a batch's rows do not keep.
    """
    return (adjust is None or not adjust.reads_hidden) and _joins(plan.whole, plan.head_ids)


def _joins(whole: Sequence[int], head_ids: Sequence[int]) -> bool:
    """Whether an input can join a batch: its prompt extends the head by at least one token."""
    rest = after_head(whole, head_ids)
    return rest is not None and len(rest) > 0
