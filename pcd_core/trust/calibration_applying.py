"""Applying a calibration to one request: each decision's readout debiased, calibrated or read by its head.

``adjuster`` turns a ``Calibration`` (``calibration.py``), the request's decisions and its ``debias``
choice into an ``Adjust``, which every planner calls on each decision's raw readout: a decision the
calibration covers (by name and labels) gets its fitted temperature and biases, a decision with a
head is answered by the head where its readout carries the hidden state, and every answer reports
what was done (``debiased``, ``calibrated``) and, where fitted, ``decision_flags``: whether it
abstains and its answer set (``selective.py``). A decision the calibration does not cover stays raw.
``tests/test_calibration.py`` checks that an engine calibrates only the decisions a calibration
covers and flags each answer; ``tests/test_heads_oracle.py`` that a head answers from the same passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcd_core.reading.readout import Readout
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.debias import debiased, with_probabilities
from pcd_core.trust.heads import Head
from pcd_core.trust.selective import answer_set


def decision_flags(found: FieldCalibration | Head | None, readout: Readout) -> dict[str, Any]:
    """What a fitted field (or its head) adds to its answer: ``abstained`` (its top probability is below
    the threshold) and ``answer_set`` (the label indices of its conformal set), each only where fitted.
    """
    flags: dict[str, Any] = {}
    if found is not None and found.abstain_below is not None:
        flags["abstained"] = readout.probabilities[readout.best] < found.abstain_below
    if found is not None and found.set_threshold is not None:
        flags["answer_set"] = answer_set(readout.probabilities, found.set_threshold)
    return flags


@dataclass(frozen=True)
class Adjust:
    """The per-decision readout transform of one request (``adjuster`` builds it): called with a
    decision's name and raw readout, it returns the readout to answer with and the flags every answer
    reports (``debiased``, ``calibrated``, and ``decision_flags`` where fitted). A decision with a head
    is answered from it (``method: "head"``, its zero-shot probabilities as ``zero_shot``) when its
    readout carries the hidden state, which the request reads exactly when ``reads_hidden``.
    """

    covered: Mapping[str, FieldCalibration | None]
    use_prior: Mapping[str, bool]
    measured: Mapping[str, Sequence[float]]
    heads: Mapping[str, Head]

    @property
    def reads_hidden(self) -> bool:
        return bool(self.heads)

    def __call__(self, name: str, readout: Readout) -> tuple[Readout, dict[str, Any]]:
        if self.use_prior[name]:
            readout = debiased(readout, self.measured[name])
        found = self.covered[name]
        if found is not None:
            readout = found.apply(readout)
        flags = {"debiased": self.use_prior[name], "calibrated": found is not None}
        head = self.heads.get(name)
        if head is None or readout.hidden is None:
            return readout, {**flags, **decision_flags(found, readout)}
        # the head's probabilities are fitted on the user's labels (cross-validated log loss): calibrated;
        # its thresholds are its own, fitted on its out-of-fold probabilities (pcd_core/trust/heads.py), not the
        # zero-shot field's
        answered = with_probabilities(readout, list(np.log(np.maximum(head.probabilities(readout.hidden), 1e-300))))
        zero_shot = {"method": "head", "zero_shot": list(readout.probabilities)}
        return answered, {**flags, "calibrated": True, **zero_shot, **decision_flags(head, answered)}


def adjuster(
    calibration: Calibration | None,
    labels: Mapping[str, Sequence[str]],
    debias: bool,
    priors: Callable[[], Mapping[str, Sequence[float]]],
) -> Adjust | None:
    """The per-decision readout transform of one request, or None when it leaves every decision raw.

    ``labels`` names each decision (a field, a question id) with its labels in readout order. A
    decision the calibration covers is debiased exactly when the calibration was fitted on debiased
    answers of it, whatever ``debias`` says; the others are debiased when ``debias`` is set. ``priors``
    (the content-free priors, pcd_core/trust/debias.py) is called only when some decision needs them. A
    decision whose head (``Calibration.head_for``) was fitted on its labels is answered by the head.
    """
    covered = {
        name: calibration.for_field(name, names) if calibration is not None else None for name, names in labels.items()
    }
    heads = {
        name: head
        for name, names in labels.items()
        if calibration is not None and (head := calibration.head_for(name, names)) is not None
    }
    use_prior = {
        name: calibration.debiases(found) if calibration is not None and found is not None else debias
        for name, found in covered.items()
    }
    if not any(use_prior.values()) and all(found is None for found in covered.values()) and not heads:
        return None
    measured = priors() if any(use_prior.values()) else {}
    return Adjust(covered, use_prior, measured, heads)
