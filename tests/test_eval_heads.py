"""Heads in the evaluation (pcd_core/evaluation/probing.py, cache.py, runner.py) on states of known structure.

The states are built so that a probe can separate the labels and the zero-shot rows cannot: the
report's ``head`` variant must beat the raw one, the learning curve must cover the sizes the train
split holds (a size too small for every label says so), and an answers file must give back the states
it was given, to float16's precision.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.evaluation.cache import AnswerCache, CachedAnswer
from pcd_core.evaluation.probing import fit_heads, learning_curve
from pcd_core.evaluation.runner import Answers, FieldAnswers, build_report
from pcd_core.trust.calibration import Calibration

pytest.importorskip("sklearn", reason="fitting a head needs the 'heads' extra")

LABELS = ("north", "south", "east")
WIDTH = 16


def _answers(n: int, seed: int) -> Answers:
    """``n`` examples: uniform zero-shot rows, and states whose first coordinates point at the gold label."""
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, len(LABELS), n)
    out = FieldAnswers(LABELS)
    for label in gold:
        state = rng.standard_normal(WIDTH)
        state[label] += 4.0
        out.probabilities.append([1 / 3] * 3)
        out.candidate_mass.append(0.9)
        out.gold.append(int(label))
        out.hidden.append(state)
    return Answers(None, {"wind": out}, {"wind": (1 / 3, 1 / 3, 1 / 3)})


def test_a_fitted_head_is_a_variant_of_the_report_and_beats_the_flat_rows():
    train, test = _answers(300, 0), _answers(200, 1)
    heads = fit_heads(train, "model-a")
    assert set(heads) == {"wind"} and heads["wind"].n_train == 300 and heads["wind"].model == "model-a"
    report = build_report(test, Calibration("model-a", False, {}, {}, heads=heads))
    head, raw = report["overall"]["head"], report["overall"]["raw"]
    assert head["accuracy"] >= 0.9 > raw["accuracy"] + 0.4
    assert report["fields"]["wind"]["head"]["n"] == 200


def test_the_learning_curve_covers_the_sizes_the_split_holds():
    train, test = _answers(100, 2), _answers(100, 3)
    curve = learning_curve(train, test, "model-a", sizes=(4, 16, 64, 256))
    assert [point["n_train"] for point in curve] == [4, 16, 64, 100]  # 256 is over the split: all 100 instead
    too_few = curve[0]  # four examples cannot hold two of each of three labels
    assert "error" in too_few and "two or more" in too_few["error"]
    fitted = [point for point in curve if "accuracy" in point]
    assert len(fitted) == 3 and fitted[-1]["accuracy"] >= 0.85 and 0 <= fitted[-1]["ece"] <= 1


def test_a_head_needs_answers_read_with_states():
    train = _answers(30, 4)
    train.fields["wind"].hidden.clear()
    with pytest.raises(Exception, match="hidden states"):
        fit_heads(train, "model-a")


def test_an_answers_file_keeps_the_states_to_float16(tmp_path):
    path = tmp_path / "answers.jsonl"
    state = np.random.default_rng(5).standard_normal(WIDTH).astype(np.float32) * 30
    AnswerCache(path).put("k", CachedAnswer({"wind": [0.2, 0.3, 0.5]}, {"wind": 0.9}, None, {"wind": state}))
    AnswerCache(path).put("plain", CachedAnswer({"wind": [0.2, 0.3, 0.5]}, {"wind": 0.9}, None))
    again = AnswerCache(path)
    read = again.get("k", needs_constrained=False, needs_hidden=("final",))
    assert read is not None and read.hidden is not None
    np.testing.assert_allclose(read.hidden["wind"], state, rtol=1e-3)
    # an answer read without states serves a run without heads, and a run with them reads it again
    assert again.get("plain", needs_constrained=False) is not None
    assert again.get("plain", needs_constrained=False, needs_hidden=("final",)) is None
    # states of other parts (a line written before the middle layers were read) are read again
    assert again.get("k", needs_constrained=False, needs_hidden=("final", "middle")) is None
    both = CachedAnswer({"wind": [0.2, 0.3, 0.5]}, {"wind": 0.9}, None, {"wind": state}, ("final", "middle"))
    AnswerCache(path).put("k", both)
    assert AnswerCache(path).get("k", needs_constrained=False, needs_hidden=("final", "middle")) is not None
