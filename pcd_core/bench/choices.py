"""``pcd bench --choices 64,128,255``: what one choice question costs as its options grow.

A choice past the tokenizer's single-token letters is read through two-letter codes: one row per
first letter, every row carrying the question's whole option list. The rows are packed as a tree,
so the list is read once and the second letters hang from it; the record shows it as row tokens that
grow like the options, in one pass. Counting each row whole once split a 255-option question into 15
passes that read the list 15 times. Each record is one warm request (the head cached by a
two-option question first), timed ``repeat`` times; ``ms`` is the median.
"""

from __future__ import annotations

import statistics
from typing import Any

from pcd_core.bench.measure import timed

STATE = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."


def choice_question(n_options: int) -> dict[str, Any]:
    """One choice with ``n_options`` short, distinct options, one of which fits ``STATE``."""
    names = [f"queue {k}" for k in range(n_options - 1)] + ["billing refunds"]
    return {
        "type": "choice",
        "instructions": "Which queue should handle this message?",
        "criteria": dict.fromkeys(names),
    }


def bench_choices(engine: Any, n_options: int, repeat: int) -> dict[str, Any]:
    """One record: the median warm time of a decide with one ``n_options`` choice, its passes and rows."""
    engine.decide(STATE, {"q": choice_question(2)}, debias=False)  # the shared head, cached
    question = {"q": choice_question(n_options)}
    runs = [timed(engine.backend, lambda: engine.decide(STATE, question, debias=False)) for _ in range(repeat)]
    last = runs[-1].result
    return {
        "mode": "choices",
        "backend": engine.backend.name,
        "model": engine.model_name,
        "options": n_options,
        "ms": statistics.median(run.ms for run in runs),
        "forward_passes": last.stats.forward_passes,
        "row_tokens": last.stats.row_tokens,
        "n_rows": last.stats.n_rows,
        "input_tokens": last.stats.input_tokens,
        "choice": last.answers["q"].choice,
    }
