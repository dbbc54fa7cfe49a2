"""Contextual calibration removes a known bias exactly (model-free: the oracle LM and pure readouts)."""

import math

import pytest

from pcd_core.reading.readout import make_readout
from pcd_core.testing import oracle_engine
from pcd_core.trust.debias import CONTENT_FREE, content_free_prior, debiased

SCHEMA = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}


def _readout(probabilities):
    return make_readout([math.log(p) for p in probabilities], {0: 0.0})


def test_a_multiplicative_bias_measured_on_content_free_inputs_is_divided_out_exactly():
    bias = [0.7, 0.2, 0.1]  # what the model says when the input says nothing
    evidence = [0.1, 0.3, 0.6]  # what the input alone supports
    biased = [b * e for b, e in zip(bias, evidence)]
    biased = [p / sum(biased) for p in biased]
    assert max(range(3), key=biased.__getitem__) == 0  # the bias wins before debiasing
    prior = content_free_prior([bias, bias])
    fixed = debiased(_readout(biased), prior)
    assert fixed.probabilities == pytest.approx(evidence, abs=1e-12)
    assert fixed.best == 2


def test_debiasing_keeps_candidate_mass_and_the_measured_log_masses():
    raw = make_readout([math.log(0.3), math.log(0.1)], {5: math.log(0.4)})
    fixed = debiased(raw, (0.75, 0.25))
    assert fixed.candidate_mass == raw.candidate_mass
    assert fixed.logmass == raw.logmass
    assert fixed.probabilities == pytest.approx((0.5, 0.5))


def test_the_prior_is_the_mean_of_the_content_free_distributions_and_is_floored():
    assert content_free_prior([[0.6, 0.4, 0.0], [0.8, 0.2, 0.0]])[:2] == pytest.approx((0.7, 0.3))
    assert content_free_prior([[1.0, 0.0]])[1] > 0


def test_a_model_that_ignores_its_input_is_pure_bias_and_debiases_to_uniform():
    # the oracle's logits depend only on the last three tokens, which are the prompt's tail and the
    # label's own bytes: every input reads like the content-free ones, so all of it is bias
    engine = oracle_engine(window=3)
    raw = engine.fill(SCHEMA, "the sky is clear today")
    fixed = engine.fill(SCHEMA, "the sky is clear today", debias=True)
    for name, result in fixed.fields.items():
        n = len(result.probabilities)
        assert list(result.probabilities.values()) == pytest.approx([1 / n] * n, abs=1e-12)
        assert result.debiased and not raw.fields[name].debiased
        assert result.candidate_mass == raw.fields[name].candidate_mass
        assert max(raw.fields[name].probabilities.values()) > 1 / n + 0.05  # there was a bias to remove


def test_the_prior_is_measured_once_per_schema_on_the_content_free_inputs():
    engine = oracle_engine(window=3)
    first = engine.content_free_priors(SCHEMA)
    passes = engine.backend.forward_passes
    assert engine.content_free_priors(SCHEMA) is first
    engine.fill(SCHEMA, "another input", debias=True)
    # the second debiased fill costs what a raw fill costs: the prior came from the cache
    cost = engine.backend.forward_passes - passes
    before = engine.backend.forward_passes
    engine.fill(SCHEMA, "another input")
    assert cost == engine.backend.forward_passes - before
    readings = [engine.fill(SCHEMA, text) for text in CONTENT_FREE]
    want = [sum(r.fields["colour"].probabilities[c] for r in readings) / 3 for c in ("red", "green", "blue")]
    assert first["colour"] == pytest.approx(want)


def test_decide_debiases_each_question_by_its_own_content_free_prior():
    engine = oracle_engine(window=3)
    questions = {
        "mood": {
            "type": "choice",
            "instructions": "The mood?",
            "criteria": {"calm": "calm", "angry": "angry", "sad": "sad"},
        },
        "spam": {"type": "noul", "instructions": "Is it spam?", "criteria": {"true": "spam", "false": "not spam"}},
    }
    raw = engine.decide("the sky is clear today", questions)
    fixed = engine.decide("the sky is clear today", questions, debias=True)
    assert list(fixed.answers["mood"].probabilities.values()) == pytest.approx([1 / 3] * 3, abs=1e-12)
    assert fixed.answers["spam"].noul == pytest.approx(0.5, abs=1e-12)
    assert fixed.answers["mood"].candidate_mass == raw.answers["mood"].candidate_mass
    assert max(raw.answers["mood"].probabilities.values()) > 1 / 3 + 0.05
