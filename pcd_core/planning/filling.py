"""The fill planner: what ``Engine.fill`` does around the pass that reads the request.

``deciding.py`` plans ``decide``; this module plans ``fill``. ``FillPlan`` is built before the model
lock (no model needed, so a bad input costs no pass): the compiled schema, the request's ids, the
read options. Under the lock, ``fill_passes`` reads the head and the request with the first wave's
rows (``read_path.read_request``); ``read_waves`` then reads every later ``depends_on`` wave, each
hanging from the answer lines the wave before chose, and generates the open fields
(``generation.py``) from the closed answers not yet written in. ``FillPlan.assemble`` orders the results as the schema does and
rebuilds the value. The pass counts this keeps are checked by ``tests/test_engine.py`` and
``tests/test_generation.py`` on the real model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import numpy as np

from pcd_core.backends.base import Backend, Prefix
from pcd_core.cost import Meter, Stats
from pcd_core.errors import OptionError, PromptError
from pcd_core.planning.speculation import Speculation, speculate
from pcd_core.prompting.compiler import CompiledSchema
from pcd_core.reading.generation import GeneratedField, generate_open_fields
from pcd_core.reading.loaded_model import LaterStep, LoadedModel
from pcd_core.reading.read_path import count_request, ms_since, read_request
from pcd_core.reading.readout import Readout
from pcd_core.reading.rounds import DecisionTask, Decoded, DecodeOptions, RoundStats, decode
from pcd_core.request.schema import Field, open_waves
from pcd_core.result import Extraction, FieldResult, Method, gather_memberships, mass_warnings
from pcd_core.tokenizer import TextTokenizer
from pcd_core.trust.calibration_applying import Adjust


class FillKeywords(TypedDict, total=False):
    """The keywords of ``Engine.fill`` after ``schema`` and ``text``, spelt out (and documented) once
    so that ``fill_many``, ``afill`` and ``afill_many`` take exactly them (``Unpack[FillKeywords]``):
    a misspelt one is a type error, and a ``TypeError`` at the call, not a silent default.
    """

    options: DecodeOptions | None  # how closed fields are read (decoding.py)
    strategy: str | None  # short for options=DecodeOptions(strategy=...); both is an OptionError
    task: str  # an instruction after the generic ones ("Triage the ticket."); each gets its own head
    use_head_cache: bool  # False prefills the head again instead of taking it from the cache
    max_new_tokens: dict[str, int] | None  # per open field, its cap (generation.py)
    debias: bool | None  # divide out the content-free prior (debias.py); None: the engine's default
    calibrate: bool  # apply the engine's fitted calibration (and heads) where it covers a field
    generate: bool  # False decides the closed fields only, on the same prompt (the value is a dict)
    hidden: bool  # keep each field's hidden state at its first decision point (FieldResult.hidden)
    fence_nonce: str | None  # the input fence's nonce (prompt.fence): a session's secret; None hashes the text


def fill_options(options: DecodeOptions | None, strategy: str | None) -> DecodeOptions:
    """The call's read options: ``options``, or ``strategy`` as its short form, never both (which of
    the two would win is a guess the caller should not have to make).
    """
    if options is not None and strategy is not None:
        raise OptionError(
            f"give options ({options!r}) or strategy ({strategy!r}), not both; "
            f"options=DecodeOptions(strategy={strategy!r}) says the same"
        )
    if options is not None:
        return options
    return DecodeOptions() if strategy is None else DecodeOptions(strategy=strategy)  # type: ignore[arg-type]


def request_ids(
    tokenizer: TextTokenizer, compiled: CompiledSchema, text: str, context_length: int, nonce: str | None = None
) -> tuple[int, ...]:
    """The whole prompt's ids, tokenized in one piece, after checking that the prompt, the longest
    answer lines and the open rows fit the context; ``nonce`` is a session's fence nonce (``prompt.fence``).
    """
    whole = tokenizer.encode_head(compiled.prompt.head + compiled.prompt.request_text(text, nonce))
    answers = sum(max(map(len, f.answer_ids)) for f in compiled.fields)
    budget = len(whole) + answers + max(compiled.max_variant_tokens, open_row_budget(compiled))
    if budget > context_length:
        raise PromptError(
            f"the input needs {budget} tokens with the schema, over the model's context of "
            f"{context_length}; shorten the input"
        )
    return whole


def open_row_budget(compiled: CompiledSchema) -> int:
    """Tokens the open rows may need past the closed answers: every wave but the last is written in
    whole, and the longest row of the last wave grows to its cap.
    """
    if not compiled.open_rows:
        return 0
    size = {row.field.name: len(row.opening) + row.field.max_new_tokens for row in compiled.open_rows}
    waves = open_waves(compiled.schema)
    return sum(size[n] for wave in waves[:-1] for n in wave) + max(size[n] for n in waves[-1])


@dataclass(frozen=True)
class FillPlan:
    """One checked fill request: the compiled schema, the prompt's ids, and how it is read."""

    compiled: CompiledSchema
    whole: tuple[int, ...]
    options: DecodeOptions
    generate: bool = True
    max_new_tokens: Mapping[str, int] | None = None
    hidden: bool = False  # keep each field's hidden state at its first decision point (FieldResult.hidden)

    def reads_hidden(self, adjust: Adjust | None) -> bool:
        """Whether the passes read hidden states: asked for, or a head answers some field."""
        return self.hidden or (adjust is not None and adjust.reads_hidden)

    @property
    def generates(self) -> bool:
        """Whether open fields are generated (a schema with some, and ``generate=True``)."""
        return bool(self.compiled.open_rows) and self.generate

    def tasks(self, wave_index: int) -> list[DecisionTask]:
        """The decisions of one wave; none when the schema has only open fields (the request is
        then read with no rows).
        """
        if not self.compiled.waves:
            return []
        compiled = self.compiled
        return [DecisionTask(compiled.field(name).trie, self.options.strategy) for name in compiled.waves[wave_index]]

    def speculation(self, backend: Backend) -> Speculation | None:
        """How the first pass also reads the second wave (``speculation.py``), or None when it would not pay."""
        waves = self.compiled.waves
        if len(waves) < 2:
            return None
        (first,) = waves[0]  # the first independent field is decided alone (``Schema.waves``)
        wave = [self.compiled.field(name).answer_ids for name in waves[1]]
        return speculate(self.compiled.field(first).answer_ids, wave, 1, backend.row_layout == "packed")

    def first_tasks(self, speculation: Speculation | None) -> list[DecisionTask]:
        """The decisions of the first pass: the first wave's, and with ``speculation`` the second's behind it."""
        first = self.tasks(0)
        return first if speculation is None else speculation.tasks(first, self.tasks(1))

    def waves_lines(self, waves: Sequence[tuple[str, ...]], chosen: Mapping[str, int]) -> list[int]:
        """The chosen answer lines of ``waves``, wave after wave: what a prefix lacks when those
        waves were decided but not yet written in (one wave, or two read in one pass).
        """
        return [t for wave in waves for t in self.answer_lines(set(wave), chosen)]

    def answer_lines(self, names: set[str], chosen: Mapping[str, int]) -> list[int]:
        """The chosen answer lines of the fields in ``names``, in schema order: the trunk that the
        next wave's rows (or the open rows) hang from.
        """
        return [t for f in self.compiled.fields if f.name in names for t in f.answer_ids[chosen[f.name]]]

    def assemble(self, filled: Filled, stats: Stats) -> Extraction:
        """The result in the schema's key order; with ``generate=False`` the value is a dict of the
        closed fields (no model object can be built without the open ones).
        """
        schema = self.compiled.schema
        decided = {f.name: filled.results[f.name] for f in schema.fields}
        everything: dict[str, Any] = {**decided, **gather_memberships(schema, decided), **filled.generated}
        if self.compiled.open_rows and not self.generate:
            ordered = {name: everything[name] for name in schema.keys if name in everything}
            value: Any = {name: r.value for name, r in ordered.items()}
        else:
            ordered = {name: everything[name] for name in schema.keys}
            value = schema.rebuild({name: r.value for name, r in ordered.items()})
        return Extraction(value, ordered, stats, filled.warnings + mass_warnings(decided))


@dataclass
class Filled:
    """What the passes of one fill produced: the decided and generated fields, the choices that fed
    later waves, and the open rows' warnings.
    """

    results: dict[str, FieldResult] = field(default_factory=dict)
    chosen: dict[str, int] = field(default_factory=dict)
    generated: dict[str, GeneratedField] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def record(self, plan: FillPlan, wave_index: int, readouts: list[Readout], adjust: Adjust | None) -> None:
        """One wave's readouts as field results; debiased / calibrated before the choice feeds a later wave."""
        compiled = plan.compiled
        names = compiled.waves[wave_index] if compiled.waves else ()  # no closed fields: no readouts
        for name, readout in zip(names, readouts):
            flags: dict[str, Any] = {}
            if adjust is not None:
                readout, flags = adjust(name, readout)
            self.chosen[name] = readout.best
            spec = compiled.schema.field(name)
            kept = readout.hidden if plan.hidden else None
            method = flags.pop("method", plan.options.strategy)  # "head" where a trained head answered
            self.results[name] = field_result(spec, readout, method, wave_index, hidden=kept, **flags)

    def record_first(
        self, plan: FillPlan, readouts: list[Readout], adjust: Adjust | None, speculation: Speculation | None
    ) -> list[Readout]:
        """The first pass's readouts: the first wave's, and under ``speculation`` the second wave's
        behind the answer the first chose (the branches not taken are dropped). Returns the last
        wave recorded's readouts.
        """
        if speculation is None:
            self.record(plan, 0, readouts, adjust)
            return readouts
        self.record(plan, 0, speculation.first(readouts), adjust)
        taken = speculation.branch(readouts, self.chosen[plan.compiled.waves[0][0]])
        self.record(plan, 1, taken, adjust)
        return taken


def fill_passes(
    model: LoadedModel,
    plan: FillPlan,
    adjust: Adjust | None,
    meter: Meter,
    use_cache: bool,
    pause: Callable[[], None],
    later: LaterStep | None = None,
) -> Filled:
    """Every pass of a fill: the request with the first wave's rows (``read_path.read_request``), one
    pass per later wave, then the open rows' steps; ``meter`` is counted when the last is read. The
    caller holds the lock, whose ``pause`` hands the model over at each pass boundary; ``later``
    runs the open rows' steps after each wave's first (``generation.generate_open_fields``).
    """
    passes_before = model.backend.counter.mine().forward_passes
    rounds = RoundStats()
    speculation = plan.speculation(model.backend)
    decoded, warnings = read_request(
        model,
        plan.compiled.head_ids,
        plan.whole,
        plan.first_tasks(speculation),
        meter,
        rounds,
        use_cache,
        pause,
        plan.reads_hidden(adjust),
    )
    filled = read_waves(model, plan, decoded, adjust, meter, rounds, pause, later, speculation)
    filled.warnings[:0] = warnings  # the request's warnings come before the open rows'
    count_request(model.backend, meter, rounds, passes_before, len(plan.compiled.head_ids))
    return filled


def read_waves(
    model: LoadedModel,
    plan: FillPlan,
    first: Decoded,
    adjust: Adjust | None,
    meter: Meter,
    rounds: RoundStats,
    pause: Callable[[], None],
    later: LaterStep | None = None,
    speculation: Speculation | None = None,
) -> Filled:
    """Every pass of a fill after the first (whose readouts are ``first``, with the second wave's
    behind each answer under ``speculation``): one per later wave, then the open rows' steps. Fills
    ``decode_ms``, ``generate_ms``, ``open_steps``, ``output_tokens`` and the answer lines'
    ``prompt_tokens``.
    """
    compiled = plan.compiled
    filled = Filled()
    taken = filled.record_first(plan, first.readouts, adjust, speculation)
    decoded = replace(first, readouts=taken)
    unwritten = list(compiled.waves[: 1 if speculation is None else 2])  # decided, their lines not in the prefix
    clock = time.perf_counter()
    later_waves = range(len(unwritten), len(compiled.waves))
    for wave_index in later_waves:
        pause()
        lines = plan.waves_lines(unwritten, filled.chosen)
        tasks = plan.tasks(wave_index)
        decoded = decode(
            model.backend, decoded.prefix, tasks, rounds, trunk=lines, pause=pause, hidden=plan.reads_hidden(adjust)
        )
        meter.stats = replace(meter.stats, prompt_tokens=meter.stats.prompt_tokens + len(lines))
        filled.record(plan, wave_index, decoded.readouts, adjust)
        unwritten = [compiled.waves[wave_index]]
    if later_waves:
        meter.stats = replace(meter.stats, decode_ms=ms_since(clock))
    if plan.generates:
        clock = time.perf_counter()
        pause()
        _generate_open(model, plan, decoded.prefix, filled, meter, pause, later, unwritten)
        meter.stats = replace(meter.stats, generate_ms=ms_since(clock))
    return filled


def _generate_open(
    model: LoadedModel,
    plan: FillPlan,
    prefix: Prefix,
    filled: Filled,
    meter: Meter,
    pause: Callable[[], None],
    later: LaterStep | None,
    unwritten: list[tuple[str, ...]],
) -> None:
    """Generate every open field; the first step also writes in the closed answers not yet in the
    prompt (the ``unwritten`` waves', in order).
    """
    compiled = plan.compiled
    lines = plan.waves_lines(unwritten, filled.chosen)
    meter.stats = replace(meter.stats, prompt_tokens=meter.stats.prompt_tokens + len(lines))
    max_new_tokens = dict(plan.max_new_tokens) if plan.max_new_tokens is not None else None
    filled.generated, filled.warnings = generate_open_fields(
        model.backend,
        model.grammar,  # built on first use, under the lock
        prefix,
        compiled.open_rows,
        compiled.schema,
        meter,
        max_new_tokens,
        pause,
        written_in=tuple(lines),
        later=later,
    )


def field_result(
    spec: Field,
    readout: Readout,
    method: Method,
    wave: int,
    debiased: bool = False,
    calibrated: bool = False,
    abstained: bool = False,
    answer_set: list[int] | None = None,
    zero_shot: list[float] | None = None,
    hidden: np.ndarray | None = None,
) -> FieldResult:
    """A closed field's result from its readout. ``answer_set`` holds label indices (``calibration_applying.decision_flags``); the result holds their
    values. ``zero_shot`` is in label order, as the readout's probabilities.
    """
    ranked = readout.ranked()
    return FieldResult(
        name=spec.name,
        value=spec.labels[readout.best].value,
        probability=readout.probabilities[readout.best],
        probabilities={label.text: p for label, p in zip(spec.labels, readout.probabilities)},
        candidate_mass=readout.candidate_mass,
        confidence=readout.confidence,
        top=[(spec.labels[i].value, readout.probabilities[i]) for i in ranked[:5]],
        method=method,
        wave=wave,
        debiased=debiased,
        calibrated=calibrated,
        abstained=abstained,
        answer_set=None if answer_set is None else [spec.labels[i].value for i in answer_set],
        zero_shot=None if zero_shot is None else {label.text: p for label, p in zip(spec.labels, zero_shot)},
        hidden=hidden,
    )
