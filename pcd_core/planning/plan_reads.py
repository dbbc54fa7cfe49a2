"""``PlanReads``: how a prepared fill or decide reaches the model, alone, joined or in a batch.

The planner makes a call ready without the model (``planner.py``); this module holds the model for
it. A plan is read in one of three ways, with the same answers and counts each way:
- alone, under the model lock, handing the model over at each pass boundary (``model_lock.py``);
- joined: a decide over a head, or a closed fill of a compiled schema, that other callers wait with
  when a pass starts is read with theirs in one pass (``pass_join.PassJoin``), so that concurrent
  callers of one engine share passes instead of queueing for them;
- batched: ``fill_many`` / ``decide_many`` read every input that can share a pass together
  (``batching.BatchRead``), and the rest alone from the plans already made.
A plan too large for a joined read (``joined_tokens``), one that generates, and any plan on a backend
that batches concurrent calls itself (vLLM, no model lock) is read alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from pcd_core.concurrency.pass_join import PassJoin
from pcd_core.cost import Meter
from pcd_core.planning.batching import BATCH_STEM_TOKENS, BatchRead, Prepared, decide_joins, fill_joins
from pcd_core.planning.deciding import DecidePlan
from pcd_core.planning.filling import Filled, FillPlan, fill_passes
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.read_path import ms_since
from pcd_core.reading.readout import Readout
from pcd_core.request.questions import DecideResponse
from pcd_core.result import Extraction

#: a decide as a joined read takes it, and what each caller gets back: its readouts and warnings
DecideWork = tuple[DecidePlan, Meter]
DecideRead = tuple[list[Readout], list[str]]


class PlanReads:
    """One engine's reads of prepared plans on its model, answered under ``model_name``."""

    def __init__(self, model: LoadedModel, model_name: str) -> None:
        self.model, self.model_name = model, model_name
        # concurrent decides over one head, read in shared passes
        self._decides: PassJoin[DecideWork, DecideRead] = PassJoin(
            run_many=lambda works: BatchRead(model).decide_joined(works),
            run_alone=self._decide_alone,
            budget=lambda: (self.joined_tokens, None),
        )
        # concurrent fills of one compiled schema that generate nothing, read in shared passes
        self._fills: PassJoin[Prepared[FillPlan], Filled] = PassJoin(
            run_many=lambda works: BatchRead(model).fill_joined(works),
            run_alone=self._fill_alone,
            budget=lambda: (self.joined_tokens, None),
        )

    @property
    def joined_tokens(self) -> int:
        """The most tokens a joined read takes: a decide's request and rows, a fill's request (one
        pass per round or wave, so that it keeps a waiting request from the model for little longer
        than a solo read's pass); a decide or fill over it is read alone, handing the model over
        between its passes.
        """
        return min(BATCH_STEM_TOKENS, self.model.backend.max_tokens_per_pass or BATCH_STEM_TOKENS)

    def fill(self, prepared: Prepared[FillPlan], use_head_cache: bool, started: float) -> Extraction:
        """A prepared fill's passes; ``started`` is when its call began. One that can share its
        passes (``batching.fill_joins``, the head cache in use, a request within ``joined_tokens``,
        a backend under the model lock) is read with the fills of the same compiled schema that wait
        when a pass starts, each with its own fill's answers.
        """
        plan, adjust, meter = prepared
        size = len(plan.whole) - len(plan.compiled.head_ids)  # request tokens, as a batch group counts them
        lock = self.model.lock
        # a backend that batches concurrent requests itself (vLLM, no lock) keeps serving fills as it did
        joins = self.model.backend.serialises and use_head_cache and fill_joins(self.model.backend, plan, adjust)
        if joins and size <= self.joined_tokens:
            ticket = self._fills.submit(prepared, id(plan.compiled), size)
            try:
                with lock.turn(served=ticket.served) as turn:
                    filled = self._fills.run(ticket, turn.pause)
            finally:
                self._fills.withdraw(ticket)
        else:
            with lock.turn() as turn:  # the grammar tokenizer is built on first use, under the lock
                later = self.model.joined_steps(turn.pause)  # open rows' steps join other callers'
                filled = fill_passes(self.model, plan, adjust, meter, use_head_cache, turn.pause, later)
        return plan.assemble(filled, replace(meter.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started)))

    def _fill_alone(self, work: Prepared[FillPlan], pause: Callable[[], None]) -> Filled:
        """One fill that shares its passes with none, read as ``fill`` reads it (it generates nothing,
        so no step is handed to the step join).
        """
        plan, adjust, meter = work
        return fill_passes(self.model, plan, adjust, meter, True, pause)

    def decide(self, prepared: Prepared[DecidePlan], started: float) -> DecideResponse:
        """A prepared decide's pass; ``started`` is when its call began. One that can share a pass
        (``batching.decide_joins``) is read with the decides over the same head that wait when a
        pass starts, each with its own decide's answers.
        """
        plan, adjust, meter = prepared
        size = len(plan.whole) - len(plan.head_ids) + plan.row_tokens()  # request and row tokens
        if not decide_joins(plan, adjust) or size > self.joined_tokens:
            reads_hidden = adjust is not None and adjust.reads_hidden
            with self.model.lock.turn() as turn:
                decoded, warnings = plan.read(self.model, meter, turn.pause, reads_hidden)
            read = list(decoded.readouts)
        else:
            ticket = self._decides.submit((plan, meter), plan.head_ids, size)
            try:
                with self.model.lock.turn(served=ticket.served) as turn:
                    read, warnings = self._decides.run(ticket, turn.pause)
            finally:
                self._decides.withdraw(ticket)
        stats = replace(meter.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started))
        readouts, spreads = plan.merged(read)
        return plan.respond(self.model_name, readouts, stats, warnings, adjust, spreads)

    def _decide_alone(self, work: DecideWork, pause: Callable[[], None]) -> DecideRead:
        """One decide that shares its pass with none: read as ``decide`` reads it, on its own."""
        plan, meter = work
        decoded, warnings = plan.read(self.model, meter, pause)
        return list(decoded.readouts), warnings

    def fill_many(self, prepared: Sequence[Prepared[FillPlan]], use_head_cache: bool) -> list[Extraction]:
        """Every fill that a batch can take read together, one pass per wave for all of them; the
        others alone from the plans already made.
        """
        batch = BatchRead(self.model, use_head_cache)
        return batch.fill_many(prepared, lambda k: self.fill(prepared[k], use_head_cache, time.perf_counter()))

    def decide_many(self, prepared: Sequence[Prepared[DecidePlan]]) -> list[DecideResponse]:
        """Every decide that a batch can take read in one pass warm; the others alone."""
        batch = BatchRead(self.model)
        return batch.decide_many(prepared, self.model_name, lambda k: self.decide(prepared[k], time.perf_counter()))
