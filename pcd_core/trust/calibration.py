"""Fitted calibration: a temperature, and optionally a bias per label, per field, fitted on labelled data.

An answer's calibrated probabilities are ``softmax(log p / T + b)`` over the allowed labels, where
``p`` is the (debiased, if the calibration was fitted so) probability the engine read. ``T`` and ``b``
are fitted jointly on a train split (``pcd calibrate``, ``--bias`` for ``b``) by the negative
log-likelihood of the gold labels, ``b`` under a Gaussian prior (a ridge); the loss is convex in
``(1/T, b)``, so a damped Newton iteration finds the optimum with numpy alone.

The NLL weighs every label's probability, but what a caller acts on is the answer's confidence, its
top probability. With many labels the two part: on 20 Newsgroups' five coarse topics, fitted on 500
examples, the NLL fit left SmolLM2-135M's ECE at 0.066 on the very answers it was fitted on. So a second,
one-parameter step scales the fitted scores, ``(log p / T + b) * c``, with ``c`` fitted by the log
loss of "the top label is right" against the confidence. ``c`` never changes which label wins. With
two labels the two losses are the same, so ``c`` only undoes what the bias prior pulled the NLL fit in.

A ``Calibration`` is saved as a small JSON file (``CALIBRATION_VERSION``) that ``Engine.load(...,
calibration=path)`` applies to every decision whose name and labels it knows, in ``fill`` and in
``decide`` (a question id is the name there); the others stay raw and say so (``FieldResult.calibrated``,
``x_calibrated`` on the wire). ``tests/test_calibration.py`` round-trips the file, reads a version-1
file, and recovers a known temperature and known per-label biases from synthetic answers.

Version 4 adds trained heads (pcd_core/trust/heads.py, ``pcd calibrate --head probe``): a field with a head
is answered from the model's hidden state at its first decision point, read in the same pass
(``method: "head"``), with the zero-shot reading kept beside it (``zero_shot``); a field without one
is read zero-shot as before. A head names its model; ``check_heads`` refuses another one at load. A
head's answer abstains and reports its answer set by the head's own thresholds (``Head.abstain_below``,
``Head.set_threshold``), which live in the head's entry: the version-4 layout had room for them, and
a head saved without them never abstains. ``tests/test_heads_engine.py`` checks both on the real model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import HiddenStatesUnavailableError, OptionError, PcdError
from pcd_core.reading.readout import Readout
from pcd_core.trust.debias import debiased, log_probabilities, with_probabilities
from pcd_core.trust.heads import Head
from pcd_core.trust.selective import answer_set

#: the version written. Version 1 (temperatures, biases with the first label's fixed at 0, no
#: ``bias_sd``) and version 2 read the same way: both apply ``softmax(log p / T + b)``. Version 3 adds,
#: per field, whether it is debiased (the cross-validated choice, pcd_core/trust/calibration_choice.py), the
#: abstention threshold and the answer-set threshold (pcd_core/trust/selective.py); a file without them
#: debiases every field or none, as its top-level ``debias`` says, and never abstains.
#: Version 4 adds ``heads``: per field, a trained head (``Head.to_dict``); none in a version-3 file. A
#: head's ``abstain_below`` and ``set_threshold`` came later in the same version; a head without them
#: never abstains and has no answer set.
CALIBRATION_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)

#: the confidence level of the abstention bound before it was a choice: a file without
#: ``abstain_confidence`` had its thresholds fitted at it
OLD_CONFIDENCE = 0.9

#: log-probabilities below this are clipped: a zero probability would make the fit infinite
LOG_FLOOR = -30.0

#: the prior standard deviation of each per-label bias, in nats. Wide enough not to shrink a real
#: lean (SmolLM2-135M's raw polarity prior is 0.96 : 0.04, 3.2 nats, pcd_core/trust/debias.py), narrow
#: enough to hold a label the train split barely shows near 0.
BIAS_SD = 2.0

#: the top-label step's scale is searched within [1 / SCALE_RANGE, SCALE_RANGE]
SCALE_RANGE = 20.0


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


def _loss_grad_hess(
    theta: np.ndarray, logp: np.ndarray, onehot: np.ndarray, ridge: float, anchor: float = 0.0
) -> tuple[float, np.ndarray, np.ndarray]:
    """The mean NLL of ``softmax(a * logp + b)`` with ``theta = (a, b...)`` (no ``b`` when ``theta``
    has one entry), plus ``ridge / 2 * sum(b**2)`` and ``anchor / 2 * (a - 1)**2``; its gradient and
    Hessian in ``theta``.
    """
    n, k = logp.shape
    use_bias = len(theta) > 1
    z = theta[0] * logp + (theta[1:] if use_bias else 0.0)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.sum(onehot * np.log(np.maximum(p, 1e-300))) / n)
    # d z_j / d theta: logp_j for a, the unit vector e_j for the biases
    x = logp[:, :, None]
    if use_bias:
        x = np.concatenate([x, np.broadcast_to(np.eye(k), (n, k, k))], axis=2)  # (n, k, 1 + k)
    grad = np.einsum("nk,nkd->d", p - onehot, x) / n
    centred = x - np.einsum("nk,nkd->nd", p, x)[:, None, :]
    hess = np.einsum("nk,nkd,nke->de", p, centred, centred) / n
    if use_bias:
        loss += 0.5 * ridge * float(theta[1:] @ theta[1:])
        grad[1:] += ridge * theta[1:]
        hess[1:, 1:] += ridge * np.eye(k)
    loss += 0.5 * anchor * float(theta[0] - 1.0) ** 2
    grad[0] += anchor * (theta[0] - 1.0)
    hess[0, 0] += anchor
    return loss, grad, hess


def _top_label_loss(scores: np.ndarray, gold: np.ndarray, scale: float) -> float:
    """The mean log loss of "the top label is right" against the confidence of ``softmax(scores * scale)``."""
    z = scores * scale
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    top = np.argmax(z, axis=1)
    log_confidence = -log_norm  # the top score is 0 after the shift
    right = top == gold
    log_doubt = np.log(np.maximum(-np.expm1(log_confidence), 1e-300))  # log(1 - confidence)
    return float(-np.mean(np.where(right, log_confidence, log_doubt)))


def confidence_scale(scores: np.ndarray, gold: np.ndarray) -> float:
    """The factor ``c`` on calibrated scores whose confidences best predict whether the top label is
    right: a grid over ``[1 / SCALE_RANGE, SCALE_RANGE]`` in log steps, then golden-section search
    between the best point's neighbours (the loss need not be convex in ``c``, so the grid comes first).
    """
    grid = np.exp(np.linspace(math.log(1 / SCALE_RANGE), math.log(SCALE_RANGE), 49))
    losses = [_top_label_loss(scores, gold, float(c)) for c in grid]
    best = int(np.argmin(losses))
    low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, len(grid) - 1)])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if _top_label_loss(scores, gold, math.exp(left)) <= _top_label_loss(scores, gold, math.exp(right)):
            high = right
        else:
            low = left
    return math.exp((low + high) / 2)


def fit(
    log_probabilities_rows: Sequence[Sequence[float]] | np.ndarray,
    gold: Sequence[int] | np.ndarray,
    *,
    bias: bool = False,
    bias_sd: float = BIAS_SD,
    top_label: bool = True,
    temperature_sd: float | None = None,
    iterations: int = 100,
) -> tuple[float, tuple[float, ...]]:
    """The temperature (and with ``bias``, a bias per label) that fit the gold labels by the NLL of
    ``softmax(logp / T + b)``, jointly: damped Newton on ``(1/T, b)``, where the loss is convex. Then,
    with ``top_label``, both are scaled by ``confidence_scale`` (the module docstring says why).

    The biases are a MAP fit under a ``N(0, bias_sd**2)`` prior on each, i.e. a ridge of
    ``sum(b**2) / (2 * bias_sd**2)`` on the summed NLL: a label seen rarely, or never, in the train
    split keeps a finite bias instead of one that runs off to minus infinity. Softmax ignores a common
    shift, so the ridge also makes the biases sum to zero. Without ``bias`` they are all 0.
    ``temperature_sd`` puts a ``N(1, temperature_sd**2)`` prior on ``1/T`` the same way, so that a
    few examples leave the reading near the raw one (the default choice, pcd_core/trust/calibration_choice.py).
    """
    logp = np.maximum(np.asarray(log_probabilities_rows, dtype=np.float64), LOG_FLOOR)
    g = np.asarray(gold, dtype=np.int64)
    if logp.ndim != 2 or len(g) != len(logp) or not len(g):
        raise PcdError("calibration needs one row of log-probabilities per gold label, and at least one")
    if not bias_sd > 0:
        raise PcdError(f"the bias prior's standard deviation must be > 0, not {bias_sd!r}")
    n, k = logp.shape
    onehot = np.zeros_like(logp)
    onehot[np.arange(n), g] = 1.0
    ridge = 1.0 / (n * bias_sd**2)  # the prior's weight per example, as the loss is a mean
    anchor = 0.0 if temperature_sd is None else 1.0 / (n * temperature_sd**2)
    theta = np.zeros(1 + k if bias else 1)
    theta[0] = 1.0
    loss, grad, hess = _loss_grad_hess(theta, logp, onehot, ridge, anchor)
    for _ in range(iterations):
        step = np.linalg.solve(hess + 1e-9 * np.eye(len(theta)), grad)
        scale = 1.0
        while scale > 1e-6:  # halve the step until the loss does not rise and the temperature stays positive
            trial = theta - scale * step
            if trial[0] > 1e-3:
                trial_loss, trial_grad, trial_hess = _loss_grad_hess(trial, logp, onehot, ridge, anchor)
                if trial_loss <= loss:
                    break
            scale /= 2
        else:
            break
        improvement = loss - trial_loss
        theta, loss, grad, hess = trial, trial_loss, trial_grad, trial_hess
        if improvement < 1e-12 and np.abs(grad).max() < 1e-9:
            break
    if top_label:
        theta = theta * confidence_scale(theta[0] * logp + (theta[1:] if bias else 0.0), g)
    temperature = 1.0 / float(theta[0])
    if not math.isfinite(temperature):
        raise PcdError("the calibration fit diverged: the answers carry no signal about the gold labels")
    return temperature, tuple(map(float, theta[1:])) if bias else tuple(0.0 for _ in range(k))


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
