"""What ``pcd`` prints: aligned tables for people, the JSON records for programs.

A table shows every decision with 4 decimals, marks a low candidate mass with ``!`` (the model wanted to
write something that is not an allowed value, so its probability says little) and every generated
field's text, token count and mean token probability, then what the probabilities are (calibrated,
debiased or raw: :func:`trust_line`), the warnings and one line of cost. ``--json`` prints the records of :func:`fill_record` and :func:`decide_record` instead, unrounded. ``tests/test_cli.py`` reads the tables back and compares them with the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pcd_core import (
    ChoiceAnswer,
    DecideResponse,
    Extraction,
    FieldResult,
    GeneratedField,
    MembershipResult,
    NoulAnswer,
    ScoreAnswer,
    Stats,
)
from pcd_core.result import LOW_MASS

LOW_MASS_MARK = "!"

#: what a probability means, by what was done to it (FieldResult and the answers carry the flags)
MEANING = {
    "head": "read by a trained head (pcd calibrate --head probe) from the hidden state of the same pass, "
    "fitted on labelled data; the zero-shot reading is kept as zero_shot",
    "calibrated": "calibrated by a pcd calibrate fit (on data like its train split, a 0.8 is right about 80% "
    "of the time)",
    "debiased": "debiased (the model's lean on content-free inputs divided out), not calibrated: beliefs, "
    "not measured frequencies",
    "raw": "the model's raw beliefs under this prompt, not measured frequencies (pcd calibrate fits them)",
}


def fill_record(extraction: Extraction, model: str) -> dict[str, Any]:
    """The JSON that ``pcd fill --json`` prints, one per line with ``--jsonl``."""
    return {**extraction.to_dict(), "model": model}


def decide_record(response: DecideResponse) -> dict[str, Any]:
    """The JSON that ``pcd decide --json`` prints: the ``/v1/systemone`` response."""
    return response.to_wire()


def render_value(value: Any) -> str:
    """A value as JSON, so that the string ``"true"`` and the boolean ``true`` stay apart."""
    return json.dumps(value, ensure_ascii=False)


def fill_table(extraction: Extraction) -> str:
    """Decided, multi-label and generated fields in one table, in the schema's order. A schema with
    generated fields gets a ``tokens`` column and a line that says what their probability is.
    """
    written = [f for f in extraction.fields.values() if isinstance(f, GeneratedField)]
    rows = [_fill_cells(name, f, bool(written)) for name, f in extraction.fields.items()]
    masses = [f.candidate_mass for f in extraction.fields.values() if not isinstance(f, GeneratedField)]
    header = ["field", "value", "probability", "candidate mass", *(["tokens"] if written else []), ""]
    table = _table(header, rows, numeric={2, 3, 4} if written else {2, 3})
    trust = trust_line(extraction.fields)
    if written:
        forced = sum(f.n_forced for f in written)
        note = (
            f"generated: probability is the mean probability of the tokens the model chose, tokens counts "
            f"every token written ({forced} of them forced by the grammar)"
        )
        trust = note if trust is None else f"{trust}\n{note}"
    return _with_footer(table, masses, extraction.warnings, extraction.stats, trust)


def _fill_cells(name: str, field: FieldResult | MembershipResult | GeneratedField, generated: bool) -> list[str]:
    """One row: a decided field's probability, a list's lowest candidate mass, a generated field's text."""
    if isinstance(field, GeneratedField):
        return [name, field.text, f"{field.mean_probability:.4f}", "-", str(field.n_tokens), ""]
    probability = f"{field.probability:.4f}" if isinstance(field, FieldResult) else "-"
    mass = field.candidate_mass
    return [name, render_value(field.value), probability, f"{mass:.4f}", *(["-"] if generated else []), _mark(mass)]


def decide_table(response: DecideResponse) -> str:
    rows = [[qid, answer.type, *_answer_cells(answer)] for qid, answer in response.answers.items()]
    masses = [answer.candidate_mass for answer in response.answers.values()]
    table = _table(["question", "type", "answer", "confidence", "candidate mass", ""], rows, numeric={3, 4})
    return _with_footer(table, masses, [], response.stats, trust_line(response.answers))


def _answer_cells(answer: NoulAnswer | ChoiceAnswer | ScoreAnswer) -> list[str]:
    """answer, confidence, candidate mass and mark; a noul answer is P(yes), which has no confidence."""
    if isinstance(answer, NoulAnswer):
        shown, confidence = f"P(yes) {answer.noul:.4f}", "-"
    elif isinstance(answer, ChoiceAnswer):
        shown, confidence = answer.choice, f"{answer.confidence:.4f}"
    else:  # the expected level, and the name of the level nearest to it
        level = answer.legend.get(str(round(answer.score)), "")
        shown, confidence = f"{answer.score:.2f} {level}".rstrip(), f"{answer.confidence:.4f}"
    return [shown, confidence, f"{answer.candidate_mass:.4f}", _mark(answer.candidate_mass)]


def cost_line(stats: Stats) -> str:
    """The table's last line, from the call's cost record (``pcd_core/cost.py``)."""
    return (
        f"cost: {stats.forward_passes} forward passes, {stats.input_tokens} input tokens "
        f"({stats.cached_tokens} from the head cache), {stats.total_ms:.0f} ms"
    )


def trust_line(decisions: Mapping[str, Any]) -> str | None:
    """One line on what the probabilities are: every decision's kind (``MEANING``) when they share it,
    else each kind with the decisions it holds. None when nothing was decided (open fields only).
    """
    groups: dict[str, list[str]] = {}
    for name, decision in decisions.items():
        if hasattr(decision, "calibrated"):  # generated fields and multi-label lists carry no probability
            kind = "calibrated" if decision.calibrated else "debiased" if decision.debiased else "raw"
            kind = "head" if getattr(decision, "method", None) == "head" else kind
            groups.setdefault(kind, []).append(name)
    if not groups:
        return None
    if len(groups) == 1:
        return f"probabilities: {MEANING[next(iter(groups))]}"
    return "probabilities: " + "; ".join(f"{', '.join(names)}: {MEANING[kind]}" for kind, names in groups.items())


def _mark(candidate_mass: float) -> str:
    return LOW_MASS_MARK if candidate_mass < LOW_MASS else ""


def _with_footer(table: str, masses: Sequence[float], warnings: Sequence[str], stats: Stats, trust: str | None) -> str:
    lines = [table, ""]
    if any(mass < LOW_MASS for mass in masses):
        lines.append(f"{LOW_MASS_MARK} candidate mass below {LOW_MASS}: the model wanted to write something else")
    if trust is not None:
        lines.append(trust)
    if warnings:
        lines += ["warnings:", *(f"  - {warning}" for warning in warnings)]
    lines.append(cost_line(stats))
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    """Columns padded to their widest cell; numbers right-aligned so that the decimals line up."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]).rstrip(), *map(line, rows)])
