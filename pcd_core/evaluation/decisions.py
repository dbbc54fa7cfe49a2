"""From answers on labelled examples to a calibration an agent can act on, and the report of how it acts.

``choose_calibration`` is ``pcd calibrate``'s default: per field, the fit cross-validation picks on the
train split (pcd_core/trust/calibration_choice.py). ``with_decisions`` adds, per field, the abstention
threshold for a target risk and the answer-set threshold for a target coverage, both fitted on
calibrated answers the calibration was not fitted on (pcd_core/trust/selective.py says why):
``threshold_split`` parts the train split in two, the calibration is fitted on one and the thresholds
on the other. ``decision_report`` scores those on the
held-out split: coverage (share answered) and risk (error among answered), and the sets' coverage and
mean size, per field and pooled; for the fields answered by a trained head, the same for the head's
own thresholds (fitted on its out-of-fold probabilities, pcd_core/evaluation/probing.py) under
``head``. ``tests/test_eval_decisions.py`` runs them on synthetic answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pcd_core.errors import PcdError
from pcd_core.evaluation import metrics
from pcd_core.evaluation.runner import Answers, FieldAnswers, variants
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.calibration_choice import TEMPERATURE_SD, choose_fit
from pcd_core.trust.heads import Head
from pcd_core.trust.selective import (
    DEFAULT_CONFIDENCE,
    abstention_threshold,
    answer_set,
    conformal_threshold,
    first_tested,
    risk_coverage,
    supported_risk,
)

#: the share of the train split that fits the thresholds (the rest fits the calibration), by default
THRESHOLD_SHARE = 0.5


@dataclass(frozen=True)
class ThresholdSplit:
    """The train split in two disjoint parts: ``fit`` for the calibration, ``thresholds`` for the
    abstention and answer-set thresholds; each holds the examples of its part, every field's.
    """

    fit: Answers
    thresholds: Answers

    def sizes(self) -> tuple[int, int]:
        """The examples (distinct texts) in each part."""
        return _examples(self.fit), _examples(self.thresholds)


def _examples(answers: Answers) -> int:
    return len({text for out in answers.fields.values() for text in out.texts})


def _subset(out: FieldAnswers, keep: set[str]) -> FieldAnswers:
    chosen = [i for i, text in enumerate(out.texts) if text in keep]
    part = FieldAnswers(out.labels)
    part.texts = [out.texts[i] for i in chosen]
    part.probabilities = [out.probabilities[i] for i in chosen]
    part.candidate_mass = [out.candidate_mass[i] for i in chosen]
    part.gold = [out.gold[i] for i in chosen]
    part.hidden = [out.hidden[i] for i in chosen] if len(out.hidden) == len(out.texts) else []
    # the baseline's picks are kept for the first examples read only: they do not follow a subset
    return part


def threshold_split(answers: Answers, share: float = THRESHOLD_SHARE) -> ThresholdSplit:
    """The train answers parted by example: the last ``share`` of the examples, in the (seeded,
    shuffled) order they were read, fit the thresholds; the first the calibration. An example with the
    same text twice falls in one part, so no threshold sees an answer the calibration was fitted on.
    """
    if not 0 < share < 1:
        raise PcdError(f"the thresholds' share of the train split must lie in (0, 1), not {share!r}")
    order = list(dict.fromkeys(text for out in answers.fields.values() for text in out.texts))
    cut = len(order) - round(len(order) * share)
    if cut < 1 or cut >= len(order):
        raise PcdError(
            f"{len(order)} train examples cannot be parted into a calibration fit and a threshold fit; "
            "give at least 2 (--train-limit)"
        )
    first, last = set(order[:cut]), set(order[cut:])

    def part(keep: set[str]) -> Answers:
        return replace(answers, fields={name: _subset(out, keep) for name, out in answers.fields.items()})

    return ThresholdSplit(part(first), part(last))


def choose_calibration(answers: Answers, model: str, fitted_on: Mapping[str, Any], seed: int = 0) -> Calibration:
    """Per field, the cross-validated choice of fit, saved with what it chose and why (``fitted_on``)."""
    fields, chosen = {}, {}
    for name, out in answers.fields.items():
        if not out.gold:
            continue
        rows = variants(answers, name, None)
        raw, debiased = (np.log(np.maximum(rows[v], 1e-300)) for v in ("raw", "debiased"))
        choice = choose_fit(raw, debiased, np.asarray(out.gold), seed)
        fields[name] = FieldCalibration(
            out.labels, choice.temperature, choice.bias, choice.candidate.debias, choice.candidate.name
        )
        chosen[name] = {"fit": choice.candidate.name, "cv_nll": choice.cv_nll}
    provenance = {**fitted_on, "choice": "cross-validated", "temperature_sd": TEMPERATURE_SD, "chosen": chosen}
    return Calibration(model, False, fields, provenance, None)


def _calibrated(answers: Answers, name: str, calibration: Calibration) -> np.ndarray:
    rows = variants(answers, name, calibration)
    return rows.get("calibrated", rows["raw"])


def fitted_thresholds(
    rows: np.ndarray,
    gold: np.ndarray,
    abstain_risk: float | None,
    coverage: float | None,
    level: float = DEFAULT_CONFIDENCE,
) -> tuple[float | None, float | None]:
    """The abstention threshold for ``abstain_risk`` (bounded at confidence ``level``) and the
    answer-set threshold for ``coverage`` (each None when its target is) fitted on probability rows and
    their gold label indices.
    """
    correct = metrics.predictions(rows) == gold
    below = None if abstain_risk is None else abstention_threshold(rows.max(axis=1), correct, abstain_risk, level)
    floor = None if coverage is None else conformal_threshold(rows[np.arange(len(gold)), gold], coverage)
    return below, floor


def with_decisions(
    calibration: Calibration,
    answers: Answers,
    abstain_risk: float | None,
    coverage: float | None,
    level: float = DEFAULT_CONFIDENCE,
) -> Calibration:
    """``calibration`` with each field's abstention and answer-set thresholds fitted on ``answers``,
    which must be answers the calibration was not fitted on (``threshold_split``) for the targets to
    hold on new ones.
    """
    fields = dict(calibration.fields)
    for name, found in calibration.fields.items():
        out = answers.fields.get(name)
        if out is None or not out.gold:
            continue
        below, floor = fitted_thresholds(
            _calibrated(answers, name, calibration), np.asarray(out.gold), abstain_risk, coverage, level
        )
        fields[name] = replace(found, abstain_below=below, set_threshold=floor)
    confidence = None if abstain_risk is None else level
    return replace(
        calibration, fields=fields, abstain_risk=abstain_risk, coverage=coverage, abstain_confidence=confidence
    )


def _scores(rows: np.ndarray, gold: np.ndarray, found: FieldCalibration | Head) -> dict[str, float | None]:
    """What one field's thresholds do on these answers."""
    scores: dict[str, float | None] = {"n": float(len(gold))}
    if found.abstain_below is not None:
        answered = rows.max(axis=1) >= found.abstain_below
        wrong = metrics.predictions(rows) != gold
        scores.update(
            abstain_below=found.abstain_below,
            answered=float(answered.sum()),
            coverage=float(answered.mean()),
            risk=float(wrong[answered].mean()) if answered.any() else None,  # None, not NaN: JSON stays JSON
        )
    if found.set_threshold is not None:
        sets = [answer_set(list(row), found.set_threshold) for row in rows]
        scores.update(
            set_threshold=found.set_threshold,
            set_coverage=float(np.mean([g in s for s, g in zip(sets, gold)])),
            mean_set_size=float(np.mean([len(s) for s in sets])),
        )
    return scores


def _fitted(
    answers: Answers, calibration: Calibration, head: bool
) -> dict[str, tuple[np.ndarray, FieldCalibration | Head]]:
    """Per field with gold labels: the rows its thresholds apply to and what holds them, the zero-shot
    calibration's or (``head``) the trained head's, where the answers kept the states it reads.
    """
    fitted: dict[str, tuple[np.ndarray, FieldCalibration | Head]] = {}
    for name, out in answers.fields.items():
        if not out.gold:
            continue
        if head:
            found_head = calibration.head_for(name, out.labels)
            if found_head is not None and len(out.hidden) == len(out.gold):
                fitted[name] = (found_head.probabilities(out.states()), found_head)
        elif (found := calibration.for_field(name, out.labels)) is not None:
            fitted[name] = (_calibrated(answers, name, calibration), found)
    return fitted


def _tally(answers: Answers, fitted: Mapping[str, tuple[np.ndarray, FieldCalibration | Head]]) -> dict[str, Any]:
    """Per field and pooled: coverage and risk, set coverage and mean set size, where thresholds are fitted."""
    fields: dict[str, Any] = {}
    pooled: dict[str, list[float]] = {"answered": [], "wrong_answered": [], "n": [], "in_set": [], "set_size": []}
    for name, (rows, found) in fitted.items():
        gold = np.asarray(answers.fields[name].gold)
        entry = _scores(rows, gold, found)
        if len(entry) == 1:  # neither a threshold nor a set fitted
            continue
        fields[name] = entry
        pooled["n"].append(len(gold))
        if "answered" in entry:
            answered = entry["answered"] or 0.0
            pooled["answered"].append(answered)
            pooled["wrong_answered"].append(answered * (entry["risk"] or 0.0))
        if "set_coverage" in entry:
            pooled["in_set"].append((entry["set_coverage"] or 0.0) * len(gold))
            pooled["set_size"].append((entry["mean_set_size"] or 0.0) * len(gold))
    total = sum(pooled["n"])
    overall: dict[str, float | None] = {"n": float(total)}
    if pooled["answered"]:
        answered = sum(pooled["answered"])
        overall.update(coverage=answered / total, risk=sum(pooled["wrong_answered"]) / answered if answered else None)
    if pooled["in_set"]:
        overall.update(set_coverage=sum(pooled["in_set"]) / total, mean_set_size=sum(pooled["set_size"]) / total)
    return {"fields": fields, "overall": overall}


def decision_report(answers: Answers, calibration: Calibration) -> dict[str, Any]:
    """Per field and pooled, the thresholds' held-out coverage and risk, set coverage and set size: those
    of the zero-shot calibration at the top level, and under ``head`` those of the trained heads, when
    some head has thresholds (a field with a head is answered by it, so its row is what a caller gets).
    """
    report: dict[str, Any] = {"target_risk": calibration.abstain_risk, "confidence": calibration.abstain_confidence}
    report["target_coverage"] = calibration.coverage
    report.update(_tally(answers, _fitted(answers, calibration, head=False)))
    heads = _tally(answers, _fitted(answers, calibration, head=True))
    if heads["fields"]:
        report["head"] = heads
    return report


def unsupported(
    calibration: Calibration, answers: Answers, risk: float | None, level: float = DEFAULT_CONFIDENCE
) -> list[str]:
    """One sentence per field whose threshold labels cannot support ``risk`` (it always abstains),
    naming the lowest risk they do support at ``level`` (``selective.supported_risk``).
    """
    if risk is None:
        return []
    found = []
    for name, fitted in calibration.fields.items():
        out = answers.fields.get(name)
        if out is None or not out.gold or fitted.abstain_below is None or fitted.abstain_below <= 1.0:
            continue
        rows = _calibrated(answers, name, calibration)
        correct = metrics.predictions(rows) == np.asarray(out.gold)
        lowest = supported_risk(rows.max(axis=1), correct, level)
        can = (
            f"the lowest they support is {lowest:.2f}"
            if lowest is not None
            else "they support no risk below 1, too many of the most confident answers are wrong"
        )
        found.append(
            f"{name}: the {len(out.gold)} threshold labels cannot support risk {risk} at confidence {level:.2f}, "
            f"so it always abstains; {can} (ask --abstain-risk {lowest if lowest is not None else 'higher'}, or "
            "give more labels)"
        )
    return found


def too_few(n: int, risk: float | None, level: float = DEFAULT_CONFIDENCE) -> str | None:
    """A sentence when ``n`` train examples per field cannot promise the target risk, whatever the model does."""
    if risk is None or n >= first_tested(risk, level):
        return None
    return (
        f"{n} train examples cannot promise risk {risk}: the bound (Clopper-Pearson at confidence "
        f"{level:.2f}, pcd_core/trust/selective.py) is first tested at {first_tested(risk, level)} answered examples, "
        "so every field will abstain; fit on more examples (--train-limit)"
    )


def write_risk_plot(answers: Answers, calibration: Calibration | None, path: str, title: str) -> None:
    """Risk against coverage when answering the most confident first, pooled over fields, one line per
    variant; the fitted abstention point (held-out coverage, risk) and the target risk marked.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 4))
    pooled: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for name, out in answers.fields.items():
        if not out.gold:
            continue
        for variant, rows in variants(answers, name, calibration).items():
            confidence, correct = pooled.setdefault(variant, ([], []))
            confidence.append(rows.max(axis=1))
            correct.append(metrics.predictions(rows) == np.asarray(out.gold))
    for variant, (confidence, correct) in pooled.items():
        coverage, risk = risk_coverage(np.concatenate(confidence), np.concatenate(correct))
        axes.plot(coverage, risk, label=variant)
    if calibration is not None and calibration.abstain_risk is not None:
        decisions = decision_report(answers, calibration)
        axes.axhline(calibration.abstain_risk, color="grey", linestyle=":", label="target risk")
        points = [("ko", "fitted threshold, held-out", decisions["overall"])]
        if "head" in decisions:
            points.append(("k^", "head's fitted threshold, held-out", decisions["head"]["overall"]))
        for marker, label, overall in points:
            if overall.get("risk") is not None:
                axes.plot([overall["coverage"]], [overall["risk"]], marker, label=label)
    axes.set(xlabel="coverage (share answered)", ylabel="risk (error among answered)", title=title, xlim=(0, 1))
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
