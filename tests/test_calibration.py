"""Fitted calibration: the file round-trips (and version 1 still reads), a known temperature and known
per-label biases are recovered, the bias prior holds an unseen label, the top-label step fits the
confidence where the NLL fit does not, the engine applies it in fill and in decide and says so.
"""

import json
import math

import numpy as np
import pytest

from pcd_core.errors import PcdError
from pcd_core.evaluation import metrics
from pcd_core.reading.readout import make_readout
from pcd_core.testing import oracle_engine
from pcd_core.trust.calibration import CALIBRATION_VERSION, Calibration, FieldCalibration
from pcd_core.trust.calibration_fitting import fit


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
    # the offset undone, up to the common shift softmax ignores: the fitted biases sum to zero
    assert bias == pytest.approx((1 / 6, -5 / 6, 4 / 6), abs=0.1)
    assert sum(bias) == pytest.approx(0.0, abs=1e-6)


def test_temperature_and_biases_are_fitted_jointly():
    """Answers both over-confident (x3) and leaning (labels 0 and 2): one fit recovers both."""
    logp, gold = _overconfident(3.0, n=20000, k=3, seed=2)
    lean = np.array([0.8, 0.0, -0.8])
    leaning = _log_softmax(logp + lean * 3.0)
    temperature, bias = fit(leaning, gold, bias=True)
    # softmax(logp / T + b) undoes it when T = 3 and b = -lean
    assert temperature == pytest.approx(3.0, rel=0.05)
    assert bias == pytest.approx(tuple(-lean), abs=0.1)
    alone, _ = fit(leaning, gold)  # a temperature alone cannot undo a lean
    joint = np.exp(_log_softmax(leaning / temperature + np.array(bias)))
    assert metrics.nll(joint, gold) < metrics.nll(np.exp(_log_softmax(leaning / alone)), gold) - 0.01


def test_the_bias_prior_keeps_a_label_never_seen_in_training_finite_and_narrower_shrinks_more():
    logp, gold = _overconfident(1.0, n=300, k=3, seed=3)
    gold = np.where(gold == 2, 0, gold)  # label 2 never the answer: without a prior its bias runs off
    _, wide = fit(logp, gold, bias=True, bias_sd=2.0)
    _, narrow = fit(logp, gold, bias=True, bias_sd=0.2)
    assert all(map(math.isfinite, wide)) and wide[2] < -1.0
    assert abs(narrow[2]) < abs(wide[2]) and sum(narrow) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(PcdError, match="standard deviation"):
        fit(logp, gold, bias=True, bias_sd=0.0)


def test_a_calibration_file_round_trips(tmp_path):
    original = Calibration(
        model="smollm2-135m",
        debias=True,
        fields={"sentiment": FieldCalibration(("positive", "negative"), 1.7, (0.25, -0.25))},
        fitted_on={"data": "polarity", "split": "train", "n": 300, "seed": 0},
        bias_sd=2.0,
    )
    path = tmp_path / "cal.json"
    original.save(path)
    assert Calibration.load(path) == original
    assert json.loads(path.read_text())["version"] == CALIBRATION_VERSION == 5


def test_a_version_3_file_keeps_each_fields_choice_and_thresholds(tmp_path):
    original = Calibration(
        model="smollm2-135m",
        debias=False,
        fields={
            "sentiment": FieldCalibration(("positive", "negative"), 1.2, (0.3, -0.3), True, "debiased", 0.8, 0.15),
            "topic": FieldCalibration(("a", "b", "c"), 1.0, (0.0, 0.0, 0.0), False, "raw"),
        },
        abstain_risk=0.05,
        coverage=0.9,
    )
    path = tmp_path / "cal.json"
    original.save(path)
    loaded = Calibration.load(path)
    assert loaded == original
    assert loaded.debiases(loaded.fields["sentiment"]) and not loaded.debiases(loaded.fields["topic"])


#: a file as the second release's ``pcd calibrate --debias --bias`` wrote it: no per-field choice or thresholds
VERSION_2_FILE = {
    "version": 2,
    "model": "smollm2-135m",
    "debias": True,
    "bias_sd": 2.0,
    "fields": {"sentiment": {"labels": ["positive", "negative"], "temperature": 0.9998, "bias": [0.29, -0.29]}},
    "fitted_on": {"data": "polarity", "split": "train", "seed": 0, "n": 1000, "top_label": True},
}


def test_a_version_2_file_debiases_every_field_as_it_says_and_never_abstains(tmp_path):
    path = tmp_path / "v2.calibration.json"
    path.write_text(json.dumps(VERSION_2_FILE))
    loaded = Calibration.load(path)
    found = loaded.fields["sentiment"]
    assert loaded.debiases(found) and found.abstain_below is None and found.set_threshold is None
    assert loaded.abstain_risk is None and loaded.coverage is None


#: a file as the first release's ``pcd calibrate --debias`` wrote it (temperature only, no bias prior)
VERSION_1_FILE = {
    "version": 1,
    "model": "smollm2-135m",
    "debias": True,
    "fields": {"sentiment": {"labels": ["positive", "negative"], "temperature": 1.796536697327704, "bias": [0.0, 0.0]}},
    "fitted_on": {"data": "polarity", "split": "train", "seed": 0, "n": 150},
}


def test_a_version_1_file_still_loads_and_applies_as_it_did(tmp_path):
    path = tmp_path / "v1.calibration.json"
    path.write_text(json.dumps(VERSION_1_FILE, indent=2))
    loaded = Calibration.load(path)
    assert loaded.debias and loaded.bias_sd is None
    found = loaded.for_field("sentiment", ["positive", "negative"])
    assert found is not None and found.bias == (0.0, 0.0)
    readout = make_readout([math.log(0.9), math.log(0.1)], {})
    power = 1 / found.temperature
    assert found.apply(readout).probabilities[0] == pytest.approx(0.9**power / (0.9**power + 0.1**power))


@pytest.mark.parametrize(
    "content",
    [
        '{"version": 99, "fields": {}}',
        '{"version": 1, "fields": {"a": {"labels": ["x"], "temperature": 0, "bias": [0]}}}',
        '{"version": 2, "fields": {"a": {"labels": ["x", "y"], "temperature": 1, "bias": [0, NaN]}}}',
        '{"version": 2, "bias_sd": -1, "fields": {}}',
        '{"version": 3, "abstain_risk": 1.5, "fields": {}}',
        '{"version": 3, "fields": {"a": {"labels": ["x", "y"], "temperature": 1, "bias": [0, 0], "abstain_below": -1}}}',
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
    engine.planner.calibration = Calibration(
        "oracle", False, {"colour": FieldCalibration(("red", "green", "blue"), 1e6, (0.0, 0.0, 0.0))}
    )
    result = engine.fill(schema, "a small red ball")
    assert result.fields["colour"].calibrated and not result.fields["size"].calibrated
    # an enormous temperature flattens the field to uniform; the other field is untouched
    assert list(result.fields["colour"].probabilities.values()) == pytest.approx([1 / 3] * 3, abs=1e-5)
    assert result.fields["size"].probabilities == raw.fields["size"].probabilities
    assert engine.fill(schema, "a small red ball", calibrate=False).fields["colour"] == raw.fields["colour"]


def test_decide_applies_a_calibration_to_the_questions_it_covers_and_flags_each_answer():
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
        "team": {"type": "choice", "instructions": "Who owns it?", "criteria": {"billing": None, "shipping": None}},
    }
    engine = oracle_engine()
    raw = engine.decide("Refund me.", questions)
    engine.planner.calibration = Calibration(
        "oracle", False, {"refund": FieldCalibration(("true", "false"), 4.0, (0.0, 0.0))}
    )
    tempered = engine.decide("Refund me.", questions)
    p = raw.answers["refund"].noul
    assert tempered.answers["refund"].noul == pytest.approx(p**0.25 / (p**0.25 + (1 - p) ** 0.25))
    assert tempered.answers["refund"].calibrated and not tempered.answers["refund"].debiased
    assert not tempered.answers["team"].calibrated and tempered.answers["team"] == raw.answers["team"]
    assert tempered.answers["refund"].candidate_mass == raw.answers["refund"].candidate_mass
    assert engine.decide("Refund me.", questions, calibrate=False).answers == raw.answers
    wire = tempered.to_wire()["answers"]
    assert wire["refund"]["x_calibrated"] is True and wire["team"]["x_calibrated"] is False
    assert wire["refund"]["x_debiased"] is False


def test_fill_and_decide_abstain_below_the_fields_threshold_and_still_report_the_reading():
    schema = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}
    engine = oracle_engine()
    raw = engine.fill(schema, "a small red ball").fields
    top = {name: max(raw[name].probabilities.values()) for name in schema}
    engine.planner.calibration = Calibration(
        "oracle",
        False,
        {  # a temperature of 1 leaves the reading as it was: the thresholds sit either side of it
            "colour": FieldCalibration(
                ("red", "green", "blue"), 1.0, (0.0, 0.0, 0.0), abstain_below=top["colour"] + 1e-6
            ),
            "size": FieldCalibration(
                ("small", "large"), 1.0, (0.0, 0.0), abstain_below=top["size"] - 1e-6, set_threshold=0.0
            ),
        },
        abstain_risk=0.1,
        coverage=0.9,
    )
    fields = engine.fill(schema, "a small red ball").fields
    assert fields["colour"].abstained and not fields["size"].abstained
    assert fields["colour"].value == raw["colour"].value
    assert fields["colour"].probabilities == pytest.approx(raw["colour"].probabilities)
    assert fields["colour"].answer_set is None  # no set fitted for it
    assert fields["size"].answer_set == sorted(schema["size"], key=lambda v: -raw["size"].probabilities[v])
    assert fields["size"].to_dict()["abstained"] is False

    questions = {
        "team": {"type": "choice", "instructions": "Who owns it?", "criteria": {"billing": None, "shipping": None}}
    }
    reading = engine.decide("Refund me.", questions).answers["team"]
    engine.planner.calibration = Calibration(
        "oracle",
        False,
        {"team": FieldCalibration(("billing", "shipping"), 1.0, (0.0, 0.0), abstain_below=1.5, set_threshold=0.0)},
    )
    answer = engine.decide("Refund me.", questions).answers["team"]
    assert answer.abstained and answer.choice == reading.choice
    wire = engine.decide("Refund me.", questions).to_wire()["answers"]["team"]
    assert wire["x_abstained"] is True and wire["x_answer_set"][0] == reading.choice
    assert sorted(wire["x_answer_set"]) == ["billing", "shipping"]


def test_an_engine_that_debiases_by_default_flags_every_answer_and_a_call_can_turn_it_off():
    schema = {"colour": ["red", "green", "blue"]}
    engine = oracle_engine()
    engine.planner.debias = True
    assert engine.fill(schema, "a red ball").fields["colour"].debiased
    assert not engine.fill(schema, "a red ball", debias=False).fields["colour"].debiased
    question = {"q": {"type": "noul", "instructions": "Is it red?"}}
    assert engine.decide("a red ball", question).answers["q"].debiased
    assert not engine.decide("a red ball", question, debias=False).answers["q"].debiased


def test_the_fill_table_says_what_its_probabilities_are():
    from pcd_integrations.commands.output import MEANING, fill_table

    schema = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}
    engine = oracle_engine()
    assert f"probabilities: {MEANING['raw']}" in fill_table(engine.fill(schema, "a small red ball")).splitlines()
    engine.planner.calibration = Calibration(
        "oracle", False, {"size": FieldCalibration(("small", "large"), 2.0, (0.0, 0.0))}
    )
    line = next(x for x in fill_table(engine.fill(schema, "a small red ball")).splitlines() if x.startswith("prob"))
    assert line == f"probabilities: colour: {MEANING['raw']}; size: {MEANING['calibrated']}"


def test_the_top_label_step_makes_the_confidence_match_accuracy_where_the_nll_fit_does_not():
    """A model that exaggerates only its top label (not a temperature): the NLL fit compromises between
    the top label and the rest, the top-label step then fits the confidence to how often it is right.
    """
    rng = np.random.default_rng(4)
    z = rng.normal(0.0, 1.0, (6000, 10))
    gold = np.array([rng.choice(10, p=row) for row in np.exp(_log_softmax(z))])
    logp = _log_softmax(z + 2.5 * (z == z.max(axis=1, keepdims=True)))

    def gap(temperature, bias):
        p = np.exp(_log_softmax(logp / temperature + np.array(bias)))
        return p.max(axis=1).mean() - np.mean(p.argmax(axis=1) == gold)

    nll_only = fit(logp, gold, top_label=False)
    with_step = fit(logp, gold)
    assert abs(gap(*nll_only)) > 0.03
    assert abs(gap(*with_step)) < 0.01
    assert with_step[0] != nll_only[0]


def test_the_top_label_step_leaves_a_binary_fit_where_the_nll_put_it():
    logp, gold = _overconfident(2.0, n=3000, k=2, seed=5)
    assert fit(logp, gold)[0] == pytest.approx(fit(logp, gold, top_label=False)[0], rel=1e-3)


def test_saving_replaces_the_file_whole_and_a_failed_save_leaves_the_previous_one(tmp_path):
    path = tmp_path / "c.json"
    first = Calibration("m", False, {"f": FieldCalibration(("a", "b"), 1.5, (0.0, 0.0))})
    first.save(path)
    inode = path.stat().st_ino
    second = Calibration("m", False, {"f": FieldCalibration(("a", "b"), 2.5, (0.0, 0.0))})
    second.save(path)
    # a new file renamed over the old one (a reader holding the old one open keeps reading it whole)
    assert path.stat().st_ino != inode
    assert Calibration.load(path).fields["f"].temperature == 2.5
    broken = Calibration("m", False, second.fields, fitted_on={"data": object()})  # not JSON
    with pytest.raises(TypeError):
        broken.save(path)
    assert Calibration.load(path).fields["f"].temperature == 2.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # no partial file left behind
