"""What ``pcd eval`` and ``pcd calibrate`` print and draw: the per-variant tables, the decisions
table, the one-line held-out summary, the reliability plot, and the rows of the quality, heads and
heads' trust tables in the docs.

Pure rendering of a report that ``pcd_core/evaluation/runner.py`` built; ``commands/evaluate.py``
calls it. ``tests/test_eval.py`` checks that every row of docs/quality.md and docs/heads.md is
``quality_row`` / ``head_row`` of a record under docs/eval/.
"""

from __future__ import annotations

import math
from typing import Any, TextIO

from pcd_core import Calibration
from pcd_core.evaluation.metrics import reliability
from pcd_core.evaluation.runner import variants

COLUMNS = (
    "n",
    "accuracy",
    "macro_f1",
    "nll",
    "brier",
    "ece",
    "ece_if_calibrated",
    "auroc_probability",
    "auroc_candidate_mass",
    "pcd_accuracy_same_examples",
)


def write_decisions(decisions: dict[str, Any], out: TextIO) -> None:
    """The held-out abstention and answer-set table: a row per field and pooled."""
    columns = ("n", "abstain_below", "coverage", "risk", "set_threshold", "set_coverage", "mean_set_size")
    out.write(
        f"\ndecisions (target risk {decisions['target_risk']} at confidence {decisions.get('confidence')}, "
        f"target coverage {decisions['target_coverage']})\n"
        f"| field | {' | '.join(columns)} |\n|{'---|' * (len(columns) + 1)}\n"
    )
    rows = [*decisions["fields"].items(), ("pooled", decisions["overall"])]
    if "head" in decisions:  # the trained heads' own thresholds: what a field with a head answers by
        heads = decisions["head"]
        rows += [(f"{name} (head)", entry) for name, entry in heads["fields"].items()]
        rows.append(("pooled (head)", heads["overall"]))
    for title, entry in rows:
        out.write(f"| {title} | {' | '.join(_cell(entry.get(c)) for c in columns)} |\n")


def held_out_summary(overall: dict[str, Any]) -> str:
    """One line: the saved calibration's held-out ECE beside the ECE its confidences would show by
    chance alone if they were exact (``metrics.ece_if_calibrated``, the yardstick), and the accuracy
    beside the raw and debiased readings'.
    """
    calibrated, raw, debiased = overall["calibrated"], overall["raw"], overall["debiased"]
    head = overall.get("head")
    with_head = f"; head: accuracy {head['accuracy']:.3f}, ECE {head['ece']:.3f}" if head else ""
    return (
        f"held-out (n {calibrated['n']:.0f}): ECE {calibrated['ece']:.3f} (yardstick: "
        f"{calibrated['ece_if_calibrated']:.3f} if every confidence were exact), accuracy {calibrated['accuracy']:.3f} "
        f"(raw {raw['accuracy']:.3f}, debiased {debiased['accuracy']:.3f}){with_head}"
    )


#: the report's rows, in the printed order: ``pcd calibrate`` adds the fits it did not save as
#: ``calibrated_*``, each fitted on the same train answers
VARIANTS = (
    "raw",
    "debiased",
    "calibrated",
    "calibrated_raw",
    "calibrated_debiased",
    "calibrated_temperature_only",
    "calibrated_with_bias",
    "head",
    "constrained_ar",
)


def write_table(report: dict[str, Any], out: TextIO) -> None:
    """One Markdown table per field and overall: a row per variant, a column per metric."""
    sections = [("overall", report["overall"])] + list(report["fields"].items())
    for title, entry in sections:
        out.write(f"\n{title}\n| variant | {' | '.join(COLUMNS)} |\n|{'---|' * (len(COLUMNS) + 1)}\n")
        for variant in VARIANTS:
            if variant in entry:
                values = entry[variant]
                cells = [_cell(values.get(c)) for c in COLUMNS]
                out.write(f"| {variant} | {' | '.join(cells)} |\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and value > 1:
        return str(int(value))
    return f"{value:.3f}"


def write_plot(answers: Any, calibration: Calibration | None, path: str, title: str) -> None:
    """Accuracy against confidence per bin, one line per variant, pooled over fields, with the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(figsize=(5, 5))
    axes.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    pooled: dict[str, list[Any]] = {}
    for name, out in answers.fields.items():
        for variant, rows in variants(answers, name, calibration).items():
            pooled.setdefault(variant, []).append((rows, out.gold))
    for variant, parts in pooled.items():
        width = max(rows.shape[1] for rows, _ in parts)
        rows = np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r, _ in parts])
        gold = np.concatenate([g for _, g in parts])
        bins = [b for b in reliability(rows, gold) if b["count"]]
        axes.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label=variant)
    axes.set(xlabel="confidence (top probability)", ylabel="accuracy", title=title, xlim=(0, 1), ylim=(0, 1))
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


#: the decision-quality table head of docs/quality.md; ``quality_row`` renders its rows
QUALITY_HEAD = (
    "| model | data | n held-out / train | accuracy raw | debiased | calibrated | AR-constrained (n; PCD on those) "
    "| ECE raw | ECE T | ECE T + bias | ECE T + bias, raw | ECE if calibrated | Brier raw | Brier calibrated "
    "| AUROC of candidate mass |\n|" + "---|" * 15
)


def quality_row(report: dict[str, Any]) -> str:
    """The decision-quality row (docs/quality.md) of one ``pcd calibrate --debias --bias --json`` report
    (tests/test_eval.py checks that every row there is one of docs/eval/*.json). The fitted columns:
    temperature alone on the debiased answers, temperature and per-label bias on the debiased answers
    (the saved file), and the same on the raw answers (what ``--bias`` without ``--debias`` saves);
    then the ECE the saved fit's confidences would show if they were exactly right
    (``metrics.ece_if_calibrated``), the yardstick for the three before it.
    """
    meta, overall = report["meta"], report["overall"]
    raw, debiased = overall["raw"], overall["debiased"]
    calibrated, nan = overall.get("calibrated", {}), math.nan
    temperature_only, on_raw = overall.get("calibrated_temperature_only", {}), overall.get("calibrated_raw", {})
    ar = overall.get("constrained_ar")
    ar_cell = f"{ar['accuracy']:.3f} ({ar['n']:.0f}; {ar['pcd_accuracy_same_examples']:.3f})" if ar else "–"
    trained = _train_size(meta)
    return (
        f"| {meta['model']} | {meta['data']} | {meta['n']} / {trained} | {raw['accuracy']:.3f} "
        f"| {debiased['accuracy']:.3f} | {calibrated.get('accuracy', nan):.3f} | {ar_cell} | {raw['ece']:.3f} "
        f"| {temperature_only.get('ece', nan):.3f} | {calibrated.get('ece', nan):.3f} | {on_raw.get('ece', nan):.3f} "
        f"| {calibrated.get('ece_if_calibrated', nan):.3f} | {raw['brier']:.3f} | {calibrated.get('brier', nan):.3f} | {raw['auroc_candidate_mass']:.3f} |"
    )


#: the trained-heads table head of docs/heads.md; ``head_row`` renders its rows
HEADS_HEAD = (
    "| model | data | head reads | n held-out / train | accuracy raw | debiased | calibrated | head | ECE calibrated "
    "| ECE head | head accuracy at n train |\n|" + "---|" * 11
)


def head_row(report: dict[str, Any]) -> str:
    """The trained-heads row (docs/heads.md) of one ``pcd calibrate --head probe --json`` report
    (tests/test_eval.py checks that every row there is one of docs/eval/heads/*.json): held-out accuracy
    of each variant, the ECE of the zero-shot calibration and of the head, and the learning curve.
    """
    meta, overall = report["meta"], report["overall"]
    curve = ", ".join(
        f"{point['n_train']}: {point['accuracy']:.3f}" if "accuracy" in point else f"{point['n_train']}: –"
        for point in report.get("learning_curve", [])
    )
    trained = _train_size(meta)
    calibrated, head, nan = overall.get("calibrated", {}), overall.get("head", {}), math.nan
    return (
        f"| {meta['model']} | {meta['data']} | {_head_parts(meta)} | {meta['n']} / {trained} "
        f"| {overall['raw']['accuracy']:.3f} "
        f"| {overall['debiased']['accuracy']:.3f} | {calibrated.get('accuracy', nan):.3f} "
        f"| {head.get('accuracy', nan):.3f} | {calibrated.get('ece', nan):.3f} | {head.get('ece', nan):.3f} | {curve} |"
    )


#: the trained heads' abstention and answer-set table head of docs/trust.md; ``head_trust_row`` renders its rows
HEAD_TRUST_HEAD = (
    "| model | data | head reads | n train / held-out | target risk (confidence) | head accuracy | threshold "
    "| coverage | risk | set coverage (target) | mean set size |\n|" + "---|" * 11
)


def head_trust_row(report: dict[str, Any]) -> str:
    """The row of docs/trust.md's heads table (tests/test_trust_docs.py checks each against its run) of
    one ``pcd calibrate --head probe --abstain-risk R --coverage C --json`` report: the heads' held-out
    accuracy, the threshold (``never`` where no threshold held the target on the train split), and the
    pooled held-out coverage, risk, set coverage and mean set size of the heads' own thresholds.
    """
    meta, decisions = report["meta"], report["decisions"]
    heads, held_out = decisions["head"]["fields"], decisions["head"]["overall"]
    thresholds = [entry["abstain_below"] for entry in heads.values()]
    shown = ", ".join("never" if t > 1 else f"{t:.3f}" for t in thresholds)
    risk = "–" if held_out.get("risk") is None else f"{held_out['risk']:.3f}"
    trained = _train_size(meta)
    confidence = decisions.get("confidence") or 1 - decisions["delta"]  # older reports: a bound at 1 - delta
    return (
        f"| {meta['model']} | {meta['data']} | {_head_parts(meta)} | {trained} / {meta['n']} "
        f"| {decisions['target_risk']:.2f} ({confidence:.1f}) "
        f"| {report['overall']['head']['accuracy']:.3f} | {shown} | {held_out['coverage']:.3f} | {risk} "
        f"| {held_out['set_coverage']:.3f} ({decisions['target_coverage']}) | {held_out['mean_set_size']:.2f} |"
    )


#: the order-samples table head of docs/trust.md; ``order_row`` renders its rows
ORDER_HEAD = (
    "| model | data | n held-out | K | accuracy raw | ECE raw | accuracy debiased | ECE debiased "
    "| passes per example | tokens per example | seconds per example |\n|" + "---|" * 11
)


def order_row(report: dict[str, Any]) -> str:
    """The order-samples row (docs/trust.md; tests/test_trust_docs.py checks each against its run) of one
    ``pcd eval --questions FILE --order-samples K --json`` report: accuracy and ECE raw and debiased, and
    what the examples read by that run cost each (``–`` where every answer came from an answers file);
    refused examples cost no pass and are not counted.
    """
    meta, overall = report["meta"], report["overall"]
    read = meta["n"] - report["reused_answers"] - len(report.get("refused", ()))

    def each(total: float, digits: int) -> str:
        return f"{total / read:.{digits}f}" if read else "–"

    data = meta["data"]
    name = data.split("/")[-2] if data.endswith("/data.jsonl") else data  # a bundled set's file: its folder
    return (
        f"| {meta['model']} | {name} | {meta['n']} | {meta['order_samples']} "
        f"| {overall['raw']['accuracy']:.3f} | {overall['raw']['ece']:.3f} "
        f"| {overall['debiased']['accuracy']:.3f} | {overall['debiased']['ece']:.3f} "
        f"| {each(report['forward_passes'], 2)} | {each(report['tokens_read'], 0)} | {each(report['seconds'], 2)} |"
    )


def _head_parts(meta: dict[str, Any]) -> str:
    """What a report's heads read (``Head.parts``); a report from before the parts were kept: the final state."""
    heads = meta.get("calibration", {}).get("heads", {}).values()
    return ", ".join(sorted({"+".join(h.get("parts", ["final"])) for h in heads})) or "–"


def _train_size(meta: dict[str, Any]) -> Any:
    """How many train examples a report's calibration was fitted on, ``–`` for a report without one."""
    return meta.get("calibration", {}).get("fitted_on", {}).get("n", "–")
