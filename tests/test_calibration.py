"""Fitted calibration: the file round-trips, a known temperature is recovered, the engine applies it."""

import json
import math

import numpy as np
import pytest

from pcd_core.calibration import Calibration, FieldCalibration, fit
from pcd_core.errors import PcdError
from pcd_core.evaluation import metrics
from pcd_core.readout import make_readout
from pcd_core.testing import oracle_engine


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _overconfident(temperature, n=4000, k=4, seed=0):
    """Gold labels drawn from softmax(z); the 'model' reports softmax(z * temperature)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 1.5, (n, k))
    true = np.exp(_log_softmax(z))
    gold = np.array([rng.choice(k, p=row) for row in true])
    return _log_softmax(z * temperature), gold


def test_the_fitted_temperature_recovers_a_known_overconfidence():
    logp, gold = _overconfident(3.0)
    temperature, bias = fit(logp, gold)
    assert temperature == pytest.approx(3.0, rel=0.05)
    assert bias == (0.0, 0.0, 0.0, 0.0)
    calibrated = np.exp(_log_softmax(logp / temperature))
    assert metrics.ece(calibrated, gold) < metrics.ece(np.exp(logp), gold) / 3


def test_the_per_label_bias_recovers_a_known_offset():
    logp, gold = _overconfident(1.0, n=6000, k=3, seed=1)
    shifted = _log_softmax(logp + np.array([0.0, 1.0, -0.5]))  # the model leans to label 1
    temperature, bias = fit(shifted, gold, bias=True)
    assert temperature == pytest.approx(1.0, rel=0.05)
    assert bias == pytest.approx((0.0, -1.0, 0.5), abs=0.1)


def test_a_calibration_file_round_trips(tmp_path):
    original = Calibration(
        model="smollm2-135m",
        debias=True,
        fields={"sentiment": FieldCalibration(("positive", "negative"), 1.7, (0.0, -0.25))},
        fitted_on={"data": "polarity", "split": "train", "n": 300, "seed": 0},
    )
    path = tmp_path / "cal.json"
    original.save(path)
    assert Calibration.load(path) == original
    assert json.loads(path.read_text())["version"] == 1


@pytest.mark.parametrize(
    "content",
    [
        '{"version": 99, "fields": {}}',
        '{"version": 1, "fields": {"a": {"labels": ["x"], "temperature": 0, "bias": [0]}}}',
        "not json",
    ],
)
def test_a_bad_calibration_file_is_a_pcd_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PcdError):
        Calibration.load(path)


def test_applying_a_calibration_tempers_probabilities_and_keeps_candidate_mass():
    readout = make_readout([math.log(0.8), math.log(0.2)], {3: math.log(0.6)})
    tempered = FieldCalibration(("a", "b"), 2.0, (0.0, 0.0)).apply(readout)
    assert tempered.probabilities == pytest.approx((2 / 3, 1 / 3))  # sqrt(0.8) : sqrt(0.2) = 2 : 1
    assert tempered.candidate_mass == readout.candidate_mass


def test_the_engine_applies_a_calibration_only_to_the_fields_it_was_fitted_on():
    schema = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}
    engine = oracle_engine()
    raw = engine.fill(schema, "a small red ball")
    engine.calibration = Calibration(
        "oracle", False, {"colour": FieldCalibration(("red", "green", "blue"), 1e6, (0.0, 0.0, 0.0))}
    )
    result = engine.fill(schema, "a small red ball")
    assert result.fields["colour"].calibrated and not result.fields["size"].calibrated
    # an enormous temperature flattens the field to uniform; the other field is untouched
    assert list(result.fields["colour"].probabilities.values()) == pytest.approx([1 / 3] * 3, abs=1e-5)
    assert result.fields["size"].probabilities == raw.fields["size"].probabilities
    assert engine.fill(schema, "a small red ball", calibrate=False).fields["colour"] == raw.fields["colour"]
