"""One benchmark record per (schema, number of fields, backend): PCD and its competitors, pair by pair.

Every repeat runs PCD, the request prefill alone, then each baseline, back to back on the same
engine and cached head, so that a noisy machine slows a pair together; ratios are medians of the
per-repeat ratios, times are medians of the repeats. One warm-up before the repeats fills the head
and compiled-schema caches and touches each loop once (a short one for the generators).

``scripted`` is for dummy weights: the generators write PCD's answer as their document
(``baselines.py``), and the record keeps times, pass counts, token counts and memory, and none of
the answers, their validity or their agreement (``ANSWER_KEYS``), which a random model makes
meaningless.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pcd_core.bench.baselines import (
    BaselineRun,
    ar_cap,
    fill_sequential,
    generate_free,
    generate_grammar,
    read_request,
    request_ids,
    scripted_document,
)
from pcd_core.bench.checks import agreement, json_object_end, parse_lenient, valid_output
from pcd_core.bench.measure import Timed, peak_rss_mb, timed, weights_dtype

BASELINES = ("ar", "arc", "seq")
#: how AR-constrained is implemented, written into every record
ARC_ENGINE = "llguidance"
#: a record's keys about answers, left out (None) with dummy weights
ANSWER_KEYS = (
    "pcd_output",
    "pcd_valid",
    "agreement",
    "ar_valid",
    "ar_output",
    "arc_valid",
    "arc_agreement",
    "arc_output",
    "seq_valid",
    "seq_agreement",
)


@dataclass(frozen=True)
class BenchCase:
    name: str
    schema: dict[str, Any]  # a JSON Schema
    text: str
    task: str = ""  # a case file's "task", put into the prompt by every method alike

    @property
    def n_fields(self) -> int:
        return len(self.schema["properties"])

    def truncated(self, n_fields: int) -> BenchCase:
        """The same case on the schema's first ``n_fields`` properties (``--fields``)."""
        keep = list(self.schema["properties"])[:n_fields]
        schema = dict(self.schema, properties={k: self.schema["properties"][k] for k in keep})
        if "required" in schema:
            schema["required"] = [k for k in schema["required"] if k in keep]
        return BenchCase(self.name, schema, self.text, self.task)


def strict_json(text: str) -> Any:
    """The object up to its closing brace as ``json.loads`` reads it, or None: what a validator sees."""
    end, start = json_object_end(text), text.find("{")
    if end is None or start < 0:
        return None
    try:
        return json.loads(text[start:end])
    except json.JSONDecodeError:
        return None


def bench_case(
    engine: Any,
    case: BenchCase,
    *,
    repeat: int = 3,
    baselines: tuple[str, ...] = BASELINES,
    cap: int | None = None,
    tick: Callable[[], None] = lambda: None,
    scripted: bool = False,
    rival: Any = None,
) -> dict[str, Any]:
    """One record. ``rival`` is a second engine (another backend, same model): its PCD fill is timed
    in the same repeats, right after this engine's, for a cross-backend ratio (``--versus``).
    """
    backend = engine.backend
    compiled = engine.compile(case.schema, case.task)
    schema = compiled.schema
    head = engine.warmup(case.schema, case.task)
    open_caps = sum(row.field.max_new_tokens for row in compiled.open_rows)
    cap = cap or ar_cap(case.n_fields) + open_caps
    # the grammar closes the object by itself; this cap only stops a model that pads with whitespace
    arc_cap = 4 * ar_cap(case.n_fields) + open_caps
    # warm-up; sequential runs on PCD's primitives
    warm = engine.fill(case.schema, case.text, task=case.task)
    script = scripted_document(engine, compiled, warm.value) if scripted else ()
    methods: dict[str, Callable[[], Any]] = {
        "pcd": lambda: engine.fill(case.schema, case.text, task=case.task),
        "prefill": lambda: read_request(engine, compiled, head, case.text),
        "ar": lambda: generate_free(engine, compiled, head, case.text, cap, script),
        "arc": lambda: generate_grammar(engine, compiled, head, case.text, arc_cap, script),
        "seq": lambda: fill_sequential(engine, compiled, head, case.text),
    }
    order = ["pcd", "prefill"] + [b for b in BASELINES if b in baselines]
    if rival is not None:
        rival.fill(case.schema, case.text, task=case.task)  # its warm-up
        methods["rival"] = lambda: rival.fill(case.schema, case.text, task=case.task)
        order.insert(1, "rival")
    if "ar" in order:
        generate_free(engine, compiled, head, case.text, 4)
    if "arc" in order:
        generate_grammar(engine, compiled, head, case.text, 4)
    tick()
    runs: dict[str, list[Timed]] = {name: [] for name in order}
    for _ in range(repeat):
        for name in order:
            runs[name].append(timed(backend, methods[name]))
            tick()
    # memory from one more run each, untimed, on pages handed back first (``measure.py``)
    memory_runs = {name: timed(backend, methods[name], fresh_memory=True) for name in order if name != "rival"}
    memory = {name: run.peak_mem_mb for name, run in memory_runs.items()}
    tick()

    pcd_values = runs["pcd"][-1].result.values
    record: dict[str, Any] = {
        "schema": case.name,
        "backend": backend.name,
        "model": engine.model_name,
        "fields": case.n_fields,
        "input_tokens": len(request_ids(engine, compiled, case.text)[0]),
        "repeat": repeat,
        "pcd_ms": _median_ms(runs["pcd"]),
        "pcd_forward_passes": runs["pcd"][-1].forward_passes,
        "pcd_row_tokens": runs["pcd"][-1].result.stats.row_tokens,
        # the JSON document PCD returns, read back and checked against the JSON Schema itself
        "pcd_valid": all(
            valid_output(case.schema, schema, json.loads(json.dumps(r.result.value))) for r in runs["pcd"]
        ),
        "prefill_ms": _median_ms(runs["prefill"]),
        "pcd_over_prefill": _median_ratio(runs["pcd"], runs["prefill"]),
        "peak_mem_mb": memory["pcd"],
        # the request's prefill alone: what the rows and the answers add shows beside it
        "prefill_peak_mem_mb": memory["prefill"],
        "pcd_output": pcd_values,
        "pcd_stats": runs["pcd"][-1].result.stats.to_dict(),  # where PCD's time went, by phase
    }
    for name in BASELINES:
        record.update(_baseline_fields(name, runs.get(name), runs["pcd"], case, schema, pcd_values, memory.get(name)))
    record["arc_engine"] = ARC_ENGINE if "arc" in runs else None
    if rival is not None:
        record["rival_backend"] = rival.backend.name
        record["rival_pcd_ms"] = _median_ms(runs["rival"])
        record["rival_ratio"] = _median_ratio(runs["rival"], runs["pcd"])  # rival's time over this one's
    if memory_runs["pcd"].device_peak_mb is not None:  # CUDA: the RSS rise misses what the GPU holds
        record["device_peak_mem_mb"] = {name: run.device_peak_mb for name, run in memory_runs.items()}
    if scripted:
        record.update(dict.fromkeys(ANSWER_KEYS))
        record["dummy_weights"] = True
    return record


def _baseline_fields(
    name: str,
    runs: list[Timed] | None,
    pcd: list[Timed],
    case: BenchCase,
    schema: Any,
    pcd_values: dict[str, Any],
    peak_mem_mb: float | None,
) -> dict[str, Any]:
    """The ``<name>_*`` keys of a record; all None when the baseline was skipped."""
    ratio_key = "ratio" if name == "ar" else f"{name}_ratio"
    agree_key = "agreement" if name == "ar" else f"{name}_agreement"
    keys = [
        f"{name}_ms",
        ratio_key,
        f"{name}_forward_passes",
        f"{name}_tokens",
        f"{name}_valid",
        agree_key,
        f"{name}_peak_mem_mb",
    ]
    if name != "seq":
        keys += [f"{name}_stop", f"{name}_output"]
    if not runs:
        return dict.fromkeys(keys)
    last: BaselineRun = runs[-1].result
    if name == "seq":
        written, valid = last.values, all(valid_output(case.schema, schema, r.result.values) for r in runs)
    else:
        written = parse_lenient(schema, last.text)
        valid = all(valid_output(case.schema, schema, strict_json(r.result.text)) for r in runs)
    fields: dict[str, Any] = {
        f"{name}_ms": _median_ms(runs),
        ratio_key: _median_ratio(runs, pcd),
        f"{name}_forward_passes": runs[-1].forward_passes,
        f"{name}_tokens": last.tokens,
        f"{name}_valid": valid,
        agree_key: agreement(schema, pcd_values, written),
        f"{name}_peak_mem_mb": peak_mem_mb,
    }
    if name != "seq":
        fields[f"{name}_stop"] = last.stop
        fields[f"{name}_output"] = last.text
    return fields


def bench_throughput(engine: Any, case: BenchCase, n_docs: int, texts: Sequence[str] = ()) -> dict[str, Any]:
    """``n_docs`` inputs on one warm schema, one at a time (``fill`` in a loop) and then read together
    (``fill_many``, ``pcd_core/planning/batching.py``), on the same engine: documents per second of each, the
    ratio, the passes, and the peak RSS of each (the rise over the run and the process's peak after
    it). ``texts`` are the inputs, taken in turn up to ``n_docs``; none: numbered copies of the case's.
    """
    given = list(texts) or [f"(document {k + 1} of {n_docs})\n{case.text}" for k in range(n_docs)]
    inputs = [given[k % len(given)] for k in range(n_docs)]
    engine.fill(case.schema, inputs[0], task=case.task)  # compiled, head cached, priors measured
    solo = timed(engine.backend, lambda: [engine.fill(case.schema, text, task=case.task) for text in inputs])
    solo_peak = peak_rss_mb()
    batch = timed(engine.backend, lambda: engine.fill_many(case.schema, inputs, task=case.task))
    return {
        "mode": "throughput",
        "schema": case.name,
        "backend": engine.backend.name,
        "dtype": weights_dtype(engine.backend),
        "model": engine.model_name,
        "fields": case.n_fields,
        "documents": n_docs,
        "max_tokens_per_pass": engine.backend.max_tokens_per_pass,
        "solo_ms": solo.ms,
        "total_ms": batch.ms,
        "ms_per_doc": batch.ms / n_docs,
        "solo_docs_per_s": n_docs / (solo.ms / 1000.0),
        "docs_per_s": n_docs / (batch.ms / 1000.0),
        "speedup": solo.ms / batch.ms,
        "same_answers": [r.values for r in solo.result] == [r.values for r in batch.result],
        "solo_forward_passes": solo.forward_passes,
        "forward_passes": batch.forward_passes,
        "solo_peak_mem_mb": solo.peak_mem_mb,
        "peak_mem_mb": batch.peak_mem_mb,
        "solo_peak_rss_mb": solo_peak,
        "peak_rss_mb": peak_rss_mb(),
    }


def _median_ms(runs: list[Timed]) -> float:
    return statistics.median(run.ms for run in runs)


def _median_ratio(slow: list[Timed], fast: list[Timed]) -> float:
    return statistics.median(s.ms / f.ms for s, f in zip(slow, fast))
