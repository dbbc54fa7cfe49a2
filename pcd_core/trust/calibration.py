"""The calibration file: its records (``Calibration``, ``FieldCalibration``) and their JSON format.

A ``Calibration`` holds, per field, a temperature and optionally a bias per label, fitted on labelled
data (``calibration_fitting.py``): an answer's calibrated probabilities are ``softmax(log p / T + b)``
over the allowed labels, where ``p`` is the (debiased, if the calibration was fitted so) probability
the engine read. It is saved as a small JSON file (``CALIBRATION_VERSION``) that ``Engine.load(...,
calibration=path)`` applies to every decision whose name and labels it knows, in ``fill`` and in
``decide`` (a question id is the name there; ``calibration_applying.py``); the others stay raw and
say so (``FieldResult.calibrated``, ``x_calibrated`` on the wire). ``tests/test_calibration.py``
round-trips the file and reads a version-1 file.

Version 4 adds trained heads (pcd_core/trust/heads.py, ``pcd calibrate --head probe``): a field with a head
is answered from the model's hidden state at its first decision point, read in the same pass
(``method: "head"``), with the zero-shot reading kept beside it (``zero_shot``); a field without one
is read zero-shot as before. A head names its model; ``check_heads`` refuses another one at load. A
head's answer abstains and reports its answer set by the head's own thresholds (``Head.abstain_below``,
``Head.set_threshold``), which live in the head's entry: the version-4 layout had room for them, and
a head saved without them never abstains. ``tests/test_heads_engine.py`` checks both on the real model.

Version 5 adds ``escalation`` (``Escalation``): per field, the top probability below which a cascade
sends the field to the next engine, fitted for a target by ``pcd calibrate --cascade MODEL``
(pcd_core/evaluation/cascade_curve.py). It lives here because it is fitted on the probabilities this
calibration gives: applied to other ones it would escalate another share of the fields.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import HiddenStatesUnavailableError, OptionError, PcdError
from pcd_core.reading.readout import Readout
from pcd_core.trust.debias import log_probabilities, with_probabilities
from pcd_core.trust.heads import Head

#: the version written. Version 1 (temperatures, biases with the first label's fixed at 0, no
#: ``bias_sd``) and version 2 read the same way: both apply ``softmax(log p / T + b)``. Version 3 adds,
#: per field, whether it is debiased (the cross-validated choice, pcd_core/trust/calibration_choice.py), the
#: abstention threshold and the answer-set threshold (pcd_core/trust/selective.py); a file without them
#: debiases every field or none, as its top-level ``debias`` says, and never abstains.
#: Version 4 adds ``heads``: per field, a trained head (``Head.to_dict``); none in a version-3 file. A
#: head's ``abstain_below`` and ``set_threshold`` came later in the same version; a head without them
#: never abstains and has no answer set. Version 5 adds ``escalation``; none in a version-4 file.
CALIBRATION_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)

#: the confidence level of the abstention bound before it was a choice: a file without
#: ``abstain_confidence`` had its thresholds fitted at it
OLD_CONFIDENCE = 0.9

#: log-probabilities below this are clipped: a zero probability would make the fit infinite
LOG_FLOOR = -30.0


@dataclass(frozen=True)
class FieldCalibration:
    labels: tuple[str, ...]
    temperature: float
    bias: tuple[float, ...]  # per label; summing to 0 when fitted (version 1: the first fixed at 0)
    debias: bool | None = None  # fitted on debiased answers; None: as the whole calibration says
    fit: str = ""  # which candidate fit this is (pcd_core/trust/calibration_choice.py); provenance only
    # answer only at a top probability >= this (pcd_core/trust/selective.py); None: never abstain
    abstain_below: float | None = None
    # the answer set holds every label of probability >= this, and the top one; None: no set
    set_threshold: float | None = None

    def scores(self, logp: np.ndarray) -> np.ndarray:
        """Calibrated log-scores (unnormalised) of log-probabilities, one row per answer or one answer."""
        return np.maximum(logp, LOG_FLOOR) / self.temperature + np.array(self.bias)

    def apply(self, readout: Readout) -> Readout:
        return with_probabilities(readout, list(self.scores(np.array(log_probabilities(readout)))))


@dataclass(frozen=True)
class Escalation:
    """Where a cascade sends each field on: below ``below[name]``, the field's top probability (as this
    calibration gives it) is too low to keep. Fitted on the train split for one target, an accuracy to
    reach or a share of examples to escalate at most, against ``next_model``'s answers there;
    ``on_train`` keeps, per field, what the fitted point did there (share escalated, accuracy, examples).
    """

    next_model: str
    below: Mapping[str, float]
    accuracy: float | None = None
    max_escalated: float | None = None
    on_train: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "next_model": self.next_model,
            "below": dict(self.below),
            "accuracy": self.accuracy,
            "max_escalated": self.max_escalated,
            "on_train": {name: dict(point) for name, point in self.on_train.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Escalation:
        below = {str(name): float(value) for name, value in data["below"].items()}
        for name, value in below.items():
            if not 0 <= value <= 1.01:
                raise PcdError(f"escalation of field {name!r}: a threshold lies in [0, 1.01], not {value!r}")
        return cls(
            str(data["next_model"]),
            below,
            _optional_float(data.get("accuracy")),
            _optional_float(data.get("max_escalated")),
            {
                str(name): {str(k): float(v) for k, v in point.items()}
                for name, point in data.get("on_train", {}).items()
            },
        )


@dataclass(frozen=True)
class Calibration:
    model: str
    debias: bool  # whether it was fitted on debiased probabilities, as it must then be applied
    fields: Mapping[str, FieldCalibration]
    fitted_on: Mapping[str, Any] = field(default_factory=dict)  # data set, split, n, seed: provenance only
    bias_sd: float | None = None  # the biases' prior, when they were fitted; None: temperatures only
    abstain_risk: float | None = None  # the target error among answered examples (--abstain-risk)
    # how sure the fit is that a threshold's risk is at most the target (--abstain-confidence,
    # pcd_core/trust/selective.py); a file without it, fitted before the choice existed, used 0.9
    abstain_confidence: float | None = None
    coverage: float | None = None  # the answer sets' target coverage (--coverage)
    heads: Mapping[str, Head] = field(default_factory=dict)  # per field, a trained head (version 4)
    escalation: Escalation | None = None  # per field, where a cascade escalates (version 5)

    def for_field(self, name: str, labels: Sequence[str]) -> FieldCalibration | None:
        found = self.fields.get(name)
        return found if found is not None and found.labels == tuple(labels) else None

    def head_for(self, name: str, labels: Sequence[str]) -> Head | None:
        """The field's head when it was fitted on these labels, in this order; None: read zero-shot."""
        found = self.heads.get(name)
        return found if found is not None and found.labels == tuple(labels) else None

    def check_heads(self, model: str, backend: str, reads_hidden: bool, parts: tuple[str, ...] = FINAL_STATE) -> None:
        """Refuse, when an engine loads, heads of another model or a backend that cannot read hidden
        states (vLLM): a head applied to another model's states would answer confidently and wrongly.
        """
        if not self.heads:
            return
        if not reads_hidden:
            raise HiddenStatesUnavailableError(
                f"the calibration holds heads for {sorted(self.heads)}, but the {backend} backend cannot read "
                "hidden states; load the model with the torch, llamacpp or mlx backend"
            )
        for name, head in self.heads.items():
            if parts[: len(head.parts)] != head.parts:
                raise HiddenStatesUnavailableError(
                    f"the head of field {name!r} reads the {'+'.join(head.parts)} hidden state, and the {backend} "
                    f"backend gives {'+'.join(parts)}; load the model with the torch or mlx backend"
                )
            if head.model != model:
                raise OptionError(
                    f"the head of field {name!r} was fitted on {head.model!r}, not {model!r}; refit it with "
                    f"pcd calibrate --head probe --model {model}"
                )

    def debiases(self, found: FieldCalibration) -> bool:
        """Whether ``found`` (one of this calibration's fields) applies to debiased answers."""
        return self.debias if found.debias is None else found.debias

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CALIBRATION_VERSION,
            "model": self.model,
            "debias": self.debias,
            "bias_sd": self.bias_sd,
            "abstain_risk": self.abstain_risk,
            "abstain_confidence": self.abstain_confidence,
            "coverage": self.coverage,
            "fields": {
                name: {
                    "labels": list(f.labels),
                    "temperature": f.temperature,
                    "bias": list(f.bias),
                    "debias": f.debias,
                    "fit": f.fit,
                    "abstain_below": f.abstain_below,
                    "set_threshold": f.set_threshold,
                }
                for name, f in self.fields.items()
            },
            "fitted_on": dict(self.fitted_on),
            "heads": {name: head.to_dict() for name, head in self.heads.items()},
            "escalation": self.escalation.to_dict() if self.escalation is not None else None,
        }

    def save(self, path: str | Path) -> None:
        """Write the file whole or not at all: beside the target, then renamed over it (as the model
        caches do, pcd_core/loading/model_files.py), so a crash mid-write leaves the previous calibration readable.
        """
        target = Path(path)
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        try:
            with open(partial, "w", encoding="utf-8") as out:
                out.write(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, target)  # atomic on one file system, over an existing file too
        finally:
            partial.unlink(missing_ok=True)

    @classmethod
    def from_dict(cls, data: Any) -> Calibration:
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            found = data.get("version") if isinstance(data, dict) else None
            raise PcdError(
                f"not a calibration file of version {' or '.join(map(str, READABLE_VERSIONS))} (version "
                f"{found!r}); refit it with pcd calibrate"
            )
        try:
            fields = {
                name: FieldCalibration(
                    tuple(str(label) for label in spec["labels"]),
                    float(spec["temperature"]),
                    tuple(float(b) for b in spec["bias"]),
                    None if spec.get("debias") is None else bool(spec["debias"]),
                    str(spec.get("fit", "")),
                    _optional_float(spec.get("abstain_below")),
                    _optional_float(spec.get("set_threshold")),
                )
                for name, spec in data["fields"].items()
            }
            bias_sd = _optional_float(data.get("bias_sd"))
            abstain_risk, coverage = _optional_float(data.get("abstain_risk")), _optional_float(data.get("coverage"))
            confidence = _optional_float(data.get("abstain_confidence", OLD_CONFIDENCE if abstain_risk else None))
            heads = {str(name): Head.from_dict(spec) for name, spec in (data.get("heads") or {}).items()}
            escalation = Escalation.from_dict(data["escalation"]) if data.get("escalation") else None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PcdError(f"a calibration file's fields are malformed: {error!r}") from error
        for name, f in fields.items():
            if not f.temperature > 0 or len(f.bias) != len(f.labels) or not all(map(math.isfinite, f.bias)):
                raise PcdError(f"calibration of field {name!r}: temperature must be > 0, one finite bias per label")
            for threshold in (f.abstain_below, f.set_threshold):
                if threshold is not None and not 0 <= threshold <= 2:
                    raise PcdError(f"calibration of field {name!r}: a threshold must lie in [0, 2], not {threshold!r}")
        if bias_sd is not None and not bias_sd > 0:
            raise PcdError(f"a calibration file's bias_sd must be > 0, not {bias_sd!r}")
        for target in (abstain_risk, coverage, confidence):
            if target is not None and not 0 < target < 1:
                raise PcdError(
                    f"a calibration file's abstain_risk, abstain_confidence and coverage lie in (0, 1), not {target!r}"
                )
        return cls(
            str(data.get("model", "")),
            bool(data.get("debias", False)),
            fields,
            data.get("fitted_on", {}),
            bias_sd,
            abstain_risk,
            confidence,
            coverage,
            heads,
            escalation,
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise PcdError(f"cannot read calibration file {str(path)!r}: {error}") from error
        return cls.from_dict(data)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
