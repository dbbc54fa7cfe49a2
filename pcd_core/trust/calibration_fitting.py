"""Fitting a calibration: a temperature, and optionally a bias per label, per field, on labelled data.

``fit`` finds the temperature ``T`` and biases ``b`` of ``softmax(log p / T + b)`` (the file's form,
``calibration.py``) jointly on a train split (``pcd calibrate``, ``--bias`` for ``b``) by the negative
log-likelihood of the gold labels, ``b`` under a Gaussian prior (a ridge); the loss is convex in
``(1/T, b)``, so a damped Newton iteration finds the optimum with numpy alone.

The NLL weighs every label's probability, but what a caller acts on is the answer's confidence, its
top probability. With many labels the two part: on 20 Newsgroups' five coarse topics, fitted on 500
examples, the NLL fit left SmolLM2-135M's ECE at 0.066 on the very answers it was fitted on. So a second,
one-parameter step scales the fitted scores, ``(log p / T + b) * c``, with ``c`` fitted by the log
loss of "the top label is right" against the confidence (``confidence_scale``). ``c`` never changes
which label wins. With two labels the two losses are the same, so ``c`` only undoes what the bias
prior pulled the NLL fit in. ``tests/test_calibration.py`` recovers a known temperature and known
per-label biases from synthetic answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pcd_core.errors import PcdError
from pcd_core.trust.calibration import LOG_FLOOR

#: the prior standard deviation of each per-label bias, in nats. Wide enough not to shrink a real
#: lean (SmolLM2-135M's raw polarity prior is 0.96 : 0.04, 3.2 nats, pcd_core/trust/debias.py), narrow
#: enough to hold a label the train split barely shows near 0.
BIAS_SD = 2.0

#: the top-label step's scale is searched within [1 / SCALE_RANGE, SCALE_RANGE]
SCALE_RANGE = 20.0


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
