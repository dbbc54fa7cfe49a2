"""Heads fitted on answers read with hidden states, and how their accuracy grows with the train split.

``fit_heads`` fits one head per field (pcd_core/trust/heads.py) on the train answers' states, which
``read_answers(..., hidden=True)`` kept from the fills it ran anyway: fitting reads nothing. With a
target risk or coverage it also fits the head's own abstention and answer-set thresholds
(pcd_core/evaluation/decisions.py), on its out-of-fold probabilities (``heads.out_of_fold``): the same
rules as the zero-shot fields', on probabilities no head saw its example in.
``learning_curve`` refits on the first n train examples for each n and scores every fit on the same
held-out answers, beside the zero-shot readings of those answers, so that the curve says how many
labels a head needs to beat them. ``tests/test_eval_heads.py`` runs both on states of known structure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import OptionError
from pcd_core.evaluation import metrics
from pcd_core.evaluation.decisions import fitted_thresholds
from pcd_core.evaluation.runner import Answers, FieldAnswers, variants
from pcd_core.trust.calibration import Calibration
from pcd_core.trust.heads import Head, fit_head, out_of_fold
from pcd_core.trust.near_duplicates import near_duplicate_groups
from pcd_core.trust.selective import DEFAULT_CONFIDENCE

#: the train sizes of the learning curve; sizes over the train split are left out
CURVE_SIZES = (16, 64, 256, 1000)


def _groups(out: FieldAnswers, end: int) -> np.ndarray | None:
    """The near-duplicate groups of the first ``end`` examples (pcd_core/trust/near_duplicates.py), which
    the heads' folds keep whole; None for answers that came without their texts.
    """
    return near_duplicate_groups(out.texts[:end]) if len(out.texts) == len(out.gold) else None


def _fit(
    out: FieldAnswers,
    model: str,
    n: int,
    groups: np.ndarray | None,
    seed: int = 0,
    parts: tuple[str, ...] = FINAL_STATE,
) -> Head:
    """A head on the first ``n`` examples; ``groups`` are theirs (``_groups(out, n)``), passed in so
    that ``fit_heads`` computes them once for the fit and its out-of-fold probabilities.
    """
    if len(out.hidden) != len(out.gold):
        raise OptionError("heads need answers read with hidden states (pcd calibrate --head probe)")
    return fit_head(out.states()[:n], out.gold[:n], out.labels, model, seed=seed, parts=parts, groups=groups)


def fit_heads(
    answers: Answers,
    model: str,
    seed: int = 0,
    abstain_risk: float | None = None,
    coverage: float | None = None,
    level: float = DEFAULT_CONFIDENCE,
    parts: tuple[str, ...] = FINAL_STATE,
) -> dict[str, Head]:
    """One head per field with gold labels, fitted on every train answer's state; with ``abstain_risk``
    or ``coverage``, carrying the thresholds for them, fitted on its out-of-fold probabilities.
    """
    heads = {}
    for name, out in answers.fields.items():
        if not out.gold:
            continue
        groups = _groups(out, len(out.gold))
        head = _fit(out, model, len(out.gold), groups, seed=seed, parts=parts)
        if abstain_risk is not None or coverage is not None:
            rows = out_of_fold(out.states(), out.gold, head, seed=seed, groups=groups)
            below, floor = fitted_thresholds(rows, np.asarray(out.gold), abstain_risk, coverage, level)
            head = replace(head, abstain_below=below, set_threshold=floor)
        heads[name] = head
    return heads


def learning_curve(
    train: Answers,
    test: Answers,
    model: str,
    sizes: Sequence[int] = CURVE_SIZES,
    seed: int = 0,
    fitted: Mapping[str, Head] | None = None,
    parts: tuple[str, ...] = FINAL_STATE,
) -> list[dict[str, Any]]:
    """Per train size n (those the train split holds, and the whole split): the held-out accuracy and
    ECE of heads fitted on the first n train examples, pooled over fields. A size too small to hold two
    examples of every label gets ``error`` instead of numbers (a head cannot learn a label it has not seen).
    ``fitted`` (``fit_heads``'s heads of the same split and seed) stand for the fits on a whole field's
    examples, which would be the same fits: on 1,000 polarity states that refit is half of the time
    ``pcd calibrate --head probe`` spends fitting. ``parts`` are what the states hold, as for ``fit_heads``.
    """
    available = min(len(out.gold) for out in train.fields.values() if out.gold)
    known = fitted or {}

    def fit_on(name: str, out: FieldAnswers, n: int) -> Head:
        whole = known.get(name)
        return (
            whole
            if whole is not None and n == len(out.gold) == whole.n_train
            else _fit(out, model, n, _groups(out, n), seed, parts)
        )

    points = []
    for n in sorted({size for size in sizes if size <= available} | {available}):
        try:
            heads = {name: fit_on(name, out, n) for name, out in train.fields.items() if out.gold}
        except OptionError as error:
            points.append({"n_train": n, "error": str(error)})
            continue
        rows, gold = [], []
        for name, head in heads.items():
            out = test.fields[name]
            rows.append(head.probabilities(out.states()))
            gold.append(np.asarray(out.gold))
        width = max(r.shape[1] for r in rows)
        pooled = np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows])
        truth = np.concatenate(gold)
        points.append(
            {
                "n_train": n,
                "accuracy": metrics.accuracy(metrics.predictions(pooled), truth),
                "ece": metrics.ece(pooled, truth),
            }
        )
    return points


def write_curve_plot(
    curve: list[dict[str, Any]], test: Answers, calibration: Calibration | None, path: str, title: str
) -> None:
    """Held-out accuracy of the head against train examples (log scale), with the zero-shot variants'
    held-out accuracy as flat lines: what n labels buy over reading the model's next-token beliefs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 4))
    fitted = [point for point in curve if "accuracy" in point]
    axes.plot([p["n_train"] for p in fitted], [p["accuracy"] for p in fitted], marker="o", label="head", color="C0")
    for variant, colour in (("raw", "C1"), ("debiased", "C2"), ("calibrated", "C3")):
        hits = [
            metrics.predictions(rows[variant]) == np.asarray(test.fields[name].gold)
            for name in test.fields
            if test.fields[name].gold and variant in (rows := variants(test, name, calibration))
        ]
        if hits:
            accuracy = float(np.mean(np.concatenate(hits)))
            axes.axhline(accuracy, linestyle=":", color=colour, label=f"zero-shot {variant}")
    axes.set(
        xscale="log" if fitted else "linear",
        xlabel="train examples",
        ylabel="held-out accuracy",
        title=title,
        ylim=(0, 1),
    )
    if fitted:  # the sizes themselves as ticks, not powers of ten
        axes.set_xticks([p["n_train"] for p in fitted], [str(p["n_train"]) for p in fitted])
        axes.minorticks_off()
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def heads_out_of_fold(answers: Answers, heads: Mapping[str, Head], seed: int = 0) -> dict[str, np.ndarray]:
    """Per field with a head, each train answer's probabilities from the head's fold that left it out:
    what the head says of an example it never saw, the probabilities a threshold fitted on the train
    split must be fitted on (a cascade's escalation, pcd_core/evaluation/cascade_curve.py).
    """
    return {
        name: out_of_fold(out.states(), out.gold, heads[name], seed=seed, groups=_groups(out, len(out.gold)))
        for name, out in answers.fields.items()
        if name in heads and out.gold
    }
