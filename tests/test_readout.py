"""The readout's arithmetic against hand-computed values."""

import math

import pytest

from pcd_core.planning.filling import field_result
from pcd_core.reading.readout import make_readout, normalised_peak, renormalise
from pcd_core.request.schema import make_field
from pcd_core.result import mass_warnings


def test_renormalise_is_a_stable_softmax():
    # a worked example: logits 2.1, 0.9, -0.1
    p = renormalise([2.1, 0.9, -0.1])
    assert p == pytest.approx((0.7082, 0.2133, 0.0785), abs=1e-4)
    assert renormalise([1000.0, 1000.0]) == pytest.approx((0.5, 0.5))


def test_unreached_labels_get_zero():
    assert renormalise([0.0, -math.inf]) == (1.0, 0.0)


@pytest.mark.parametrize("p, expected", [((0.5, 0.5), 0.0), ((1.0, 0.0, 0.0), 1.0), ((0.7, 0.2, 0.1), 0.55)])
def test_confidence_is_the_normalised_peak(p, expected):
    assert normalised_peak(p) == pytest.approx(expected)


def test_candidate_mass_sums_the_root_reads_unrenormalised():
    readout = make_readout([math.log(0.2), math.log(0.1)], {5: math.log(0.2), 7: math.log(0.1), 9: math.log(0.05)})
    assert readout.candidate_mass == pytest.approx(0.35)
    assert readout.probabilities == pytest.approx((2 / 3, 1 / 3))
    assert readout.best == 0


def test_low_candidate_mass_becomes_a_warning_not_an_error():
    field = make_field("topic", ["A", "B"])
    low = field_result(field, make_readout([-3.0, -4.0], {1: -3.0, 2: -4.0}), "trie", 1)
    high = field_result(field, make_readout([-0.1, -3.0], {1: -0.1, 2: -3.0}), "trie", 1)
    warnings = mass_warnings({"topic": low, "other": high})
    assert len(warnings) == 1 and "'topic'" in warnings[0]
