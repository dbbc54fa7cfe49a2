"""Fitted calibration: a temperature (and optionally a per-label bias) per field, fitted on labelled data.

An answer's calibrated probabilities are ``softmax(log p / T + b)`` over the allowed labels, where
``p`` is the (debiased, if the calibration was fitted so) probability the engine read. ``T`` and ``b``
minimise the negative log-likelihood of the gold labels on a train split (``pcd calibrate``); the
loss is convex in ``(1/T, b)``, so a damped Newton iteration finds the optimum with numpy alone.

A ``Calibration`` is saved as a small JSON file (``CALIBRATION_VERSION``) that ``Engine.load(...,
calibration=path)`` applies to every field whose name and labels it knows; the others stay raw and
say so (``FieldResult.calibrated``). ``tests/test_calibration.py`` round-trips the file and recovers
a known temperature from synthetic over-confident answers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .debias import log_probabilities, with_probabilities
from .errors import PcdError
from .readout import Readout

CALIBRATION_VERSION = 1

#: log-probabilities below this are clipped: a zero probability would make the fit infinite
LOG_FLOOR = -30.0


@dataclass(frozen=True)
class FieldCalibration:
    labels: tuple[str, ...]
    temperature: float
    bias: tuple[float, ...]  # per label, the first fixed at 0

    def scores(self, logp: np.ndarray) -> np.ndarray:
        """Calibrated log-scores (unnormalised) of log-probabilities, one row per answer or one answer."""
        return np.maximum(logp, LOG_FLOOR) / self.temperature + np.array(self.bias)

    def apply(self, readout: Readout) -> Readout:
        return with_probabilities(readout, list(self.scores(np.array(log_probabilities(readout)))))


@dataclass(frozen=True)
class Calibration:
    model: str
    debias: bool  # whether it was fitted on debiased probabilities, as it must then be applied
    fields: Mapping[str, FieldCalibration]
    fitted_on: Mapping[str, Any] = field(default_factory=dict)  # data set, split, n, seed: provenance only

    def for_field(self, name: str, labels: Sequence[str]) -> FieldCalibration | None:
        found = self.fields.get(name)
        return found if found is not None and found.labels == tuple(labels) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CALIBRATION_VERSION,
            "model": self.model,
            "debias": self.debias,
            "fields": {
                name: {"labels": list(f.labels), "temperature": f.temperature, "bias": list(f.bias)}
                for name, f in self.fields.items()
            },
            "fitted_on": dict(self.fitted_on),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: Any) -> Calibration:
        if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
            raise PcdError(f"not a version-{CALIBRATION_VERSION} calibration file; refit it with pcd calibrate")
        try:
            fields = {
                name: FieldCalibration(
                    tuple(str(label) for label in spec["labels"]),
                    float(spec["temperature"]),
                    tuple(float(b) for b in spec["bias"]),
                )
                for name, spec in data["fields"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PcdError(f"a calibration file's fields are malformed: {error!r}") from error
        for name, f in fields.items():
            if not f.temperature > 0 or len(f.bias) != len(f.labels):
                raise PcdError(f"calibration of field {name!r}: temperature must be > 0, one bias per label")
        return cls(str(data.get("model", "")), bool(data.get("debias", False)), fields, data.get("fitted_on", {}))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise PcdError(f"cannot read calibration file {str(path)!r}: {error}") from error
        return cls.from_dict(data)


def _nll_grad_hess(
    theta: np.ndarray, logp: np.ndarray, onehot: np.ndarray, use_bias: bool
) -> tuple[float, np.ndarray, np.ndarray]:
    a = theta[0]
    bias = np.concatenate([[0.0], theta[1:]]) if use_bias else np.zeros(logp.shape[1])
    z = a * logp + bias
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(logp)
    loss = float(-np.sum(onehot * np.log(np.maximum(p, 1e-300))) / n)
    # features of each logit: d z_j / d theta = (logp_j, e_j for j >= 1)
    k = logp.shape[1]
    feats = [logp] + ([np.eye(k)[None, :, j].repeat(n, 0) for j in range(1, k)] if use_bias else [])
    x = np.stack(feats, axis=2)  # (n, k, d)
    diff = p - onehot
    grad = np.einsum("nk,nkd->d", diff, x) / n
    mean_x = np.einsum("nk,nkd->nd", p, x)
    centred = x - mean_x[:, None, :]
    hess = np.einsum("nk,nkd,nke->de", p, centred, centred) / n
    return loss, grad, hess


def fit(
    log_probabilities_rows: Sequence[Sequence[float]] | np.ndarray,
    gold: Sequence[int],
    *,
    bias: bool = False,
    iterations: int = 100,
) -> tuple[float, tuple[float, ...]]:
    """The temperature (and per-label bias, the first label's fixed at 0) minimising the gold labels'
    NLL of ``softmax(logp / T + b)``. Damped Newton on ``(1/T, b)``, where the loss is convex.
    """
    logp = np.maximum(np.asarray(log_probabilities_rows, dtype=np.float64), LOG_FLOOR)
    g = np.asarray(gold, dtype=np.int64)
    if logp.ndim != 2 or len(g) != len(logp) or not len(g):
        raise PcdError("calibration needs one row of log-probabilities per gold label, and at least one")
    k = logp.shape[1]
    onehot = np.zeros_like(logp)
    onehot[np.arange(len(g)), g] = 1.0
    theta = np.zeros(1 + (k - 1 if bias else 0))
    theta[0] = 1.0
    loss, grad, hess = _nll_grad_hess(theta, logp, onehot, bias)
    for _ in range(iterations):
        step = np.linalg.solve(hess + 1e-6 * np.eye(len(theta)), grad)
        scale = 1.0
        while scale > 1e-6:
            trial = theta - scale * step
            if trial[0] > 1e-3:
                trial_loss, trial_grad, trial_hess = _nll_grad_hess(trial, logp, onehot, bias)
                if trial_loss <= loss:
                    break
            scale /= 2
        else:
            break
        improvement = loss - trial_loss
        theta, loss, grad, hess = trial, trial_loss, trial_grad, trial_hess
        if improvement < 1e-12 and np.abs(grad).max() < 1e-9:
            break
    temperature = 1.0 / float(theta[0])
    biases = (0.0, *map(float, theta[1:])) if bias else tuple(0.0 for _ in range(k))
    if not math.isfinite(temperature):
        raise PcdError("the calibration fit diverged: the answers carry no signal about the gold labels")
    return temperature, biases
