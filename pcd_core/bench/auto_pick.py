"""``pcd bench --auto``: the measurement behind ``backend="auto"``'s rule (``pcd_core/loading/auto.py``).

For each model, every backend-and-dtype the rule could pick on this machine is loaded side by side
and timed in the same rounds, in turn (so that a busy machine slows every choice alike): one warm-up
fill, then ``repeat`` timed warm fills of the 28-field closed schema and of the mixed one (the same
28 fields and four open ones). The record keeps each choice's median and every timing, what
``auto`` picks, and whether the picks' answers agree with the default's. docs/models.md's table is
read from the JSON this writes (docs/bench/auto.json).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pcd_core.engine import Engine
from pcd_core.errors import PcdError
from pcd_core.loading.auto import Machine, choose, source_format, this_machine
from pcd_core.loading.load import chosen_options
from pcd_core.loading.model_files import resolve
from pcd_core.loading.options import LoadOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One way to run a model: a backend and, for torch, a dtype."""

    backend: str
    dtype: str | None = None

    @property
    def label(self) -> str:
        return f"{self.backend} {self.dtype}" if self.dtype else self.backend

    def options(self, model: str) -> LoadOptions:
        return LoadOptions(model=model, backend=self.backend, dtype=self.dtype)  # type: ignore[arg-type]


def candidates(machine: Machine, bfloat16: bool) -> list[Candidate]:
    """The choices to time: torch in float32 (the CPU default), llama.cpp where installed, torch in bfloat16 if asked
    (to measure it on a CPU without AMX, where ``auto`` never picks it).
    """
    found = [Candidate("torch", "float32")]
    if machine.llamacpp:
        found.append(Candidate("llamacpp"))
    if bfloat16 or machine.amx or machine.cuda:
        found.append(Candidate("torch", "bfloat16"))
    return found


def bench_auto(
    models: list[str],
    cases: dict[str, tuple[Any, str]],
    *,
    repeat: int = 3,
    bfloat16: bool = False,
    on_record: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """Time every candidate of every model on ``cases`` ({name: (schema, input)}) and say what
    ``auto`` picks; a model that cannot be found is recorded as skipped, with why. ``on_record`` gets
    the report so far after each model (``pcd bench --auto --json`` writes it, so a long run that is
    stopped keeps the models it finished).
    """
    machine = this_machine()
    records: list[dict[str, Any]] = []
    report = {
        "meta": {
            "machine": " ".join(filter(None, (platform.machine(), platform.processor(), f"{os.cpu_count()} CPUs"))),
            "described": machine.describe(),
            "load_average_before": list(os.getloadavg()),
            "repeat": repeat,
            "cases": list(cases),
        },
        "records": records,
    }
    for model in models:
        try:
            source = resolve(model)
        except PcdError as error:
            logger.warning("skipping %s: %s", model, error)
            records.append({"model": model, "skipped": str(error)})
            continue
        model_format, size = source_format(source.gguf, source.pretrained)
        picked = choose(LoadOptions(model=model), model_format, size, machine)
        options, _ = chosen_options(LoadOptions(model=model))
        engines: dict[str, Engine] = {}
        load_s: dict[str, float] = {}
        for candidate in candidates(machine, bfloat16):
            started = time.perf_counter()
            engines[candidate.label] = Engine.load(candidate.options(model))
            load_s[candidate.label] = time.perf_counter() - started
            logger.info("%s on %s loaded in %.1f s", model, candidate.label, load_s[candidate.label])
        times: dict[str, dict[str, list[float]]] = {label: {case: [] for case in cases} for label in engines}
        values: dict[str, dict[str, Any]] = {label: {} for label in engines}
        ran: dict[str, dict[str, str]] = {}
        for label, engine in engines.items():  # warm: the model's first pass, the head in its cache
            for case, (schema, text) in cases.items():
                result = engine.fill(schema, text)
                logger.info("%s on %s, %s: warm-up %.0f ms", model, label, case, result.stats.total_ms)
                values[label][case] = result.values
                ran[label] = {"backend": result.stats.backend, "dtype": result.stats.dtype}
        for _ in range(repeat):
            for label, engine in engines.items():
                for case, (schema, text) in cases.items():
                    started = time.perf_counter()
                    engine.fill(schema, text)
                    times[label][case].append((time.perf_counter() - started) * 1000)
                    logger.info("%s on %s, %s: %.0f ms", model, label, case, times[label][case][-1])
        default_label = "torch float32"
        records.append(
            {
                "model": model,
                "format": model_format,
                "size_bytes": size,
                "auto": {"backend": picked.backend, "dtype": picked.dtype, "reason": picked.reason},
                "auto_loads": options.backend,
                "choices": {
                    label: {
                        "ran": ran[label],
                        "load_s": round(load_s[label], 2),
                        "median_ms": {case: round(statistics.median(ms), 1) for case, ms in times[label].items()},
                        "ms": {case: [round(t, 1) for t in ms] for case, ms in times[label].items()},
                        "fields_agreeing_with_torch_float32": {
                            case: sum(
                                1
                                for name, value in values[label][case].items()
                                if values[default_label][case].get(name) == value
                            )
                            for case in cases
                        },
                    }
                    for label in engines
                },
            }
        )
        del engines
        records[-1]["load_average_after"] = list(os.getloadavg())
        on_record(report)
    return report
