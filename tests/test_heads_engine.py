"""Trained heads on the embedded model: fitted on real hidden states, applied by fill and decide.

A head is fitted on the states ``Engine.fill(..., hidden=True)`` keeps for a small hand-written
labelled set; an engine whose calibration holds it answers that field from it (``method: "head"``),
keeps the zero-shot reading beside it and reads the same passes. A field without a head is read
zero-shot; a head of another model, or on a backend without hidden states, is refused when the engine
is built; a version-3 file still loads. ``tests/test_heads_oracle.py`` serves a head on every wire, on
the oracle backend's states. A head's own thresholds (fitted
by ``pcd calibrate --head probe --abstain-risk --coverage``) make its answer abstain and carry its answer
set on every wire, whatever the zero-shot field's thresholds say.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="fitting a head needs the 'heads' extra")

from pcd_core import Engine
from pcd_core.errors import HiddenStatesUnavailableError, OptionError
from pcd_core.testing import ByteTokenizer, OracleBackend
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.heads import Head, fit_head
from pcd_core.trust.selective import NEVER

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative"]},
        "mentions_price": {"type": "boolean"},
    },
    "required": ["sentiment", "mentions_price"],
}
LABELS = ("positive", "negative")
POSITIVE = [
    "I love this kettle, it boils fast and looks great.",
    "Wonderful film, the actors were superb.",
    "The best pizza I have had in years.",
    "Great service, friendly staff, will come back.",
    "These headphones sound amazing and feel comfortable.",
    "A delightful book that I could not put down.",
    "Excellent quality, arrived early, very happy.",
    "The hotel room was spotless and the view was stunning.",
    "Fantastic app, simple and fast.",
    "My kids adore this game, hours of fun.",
    "Beautiful shoes and they fit perfectly.",
    "The concert was brilliant from start to finish.",
    "Superb coffee, rich and smooth.",
    "This vacuum works better than I hoped.",
    "A lovely restaurant with delicious food.",
    "The course was clear, useful and well taught.",
]
NEGATIVE = [
    "The kettle broke after two days, awful.",
    "A boring film with terrible acting.",
    "The worst pizza I have ever eaten.",
    "Rude staff and slow service, never again.",
    "These headphones crackle and hurt my ears.",
    "A dull book, I gave up after one chapter.",
    "Poor quality, arrived late and damaged.",
    "The hotel room was dirty and smelled bad.",
    "Useless app, it crashes all the time.",
    "My kids hated this game, a waste of money.",
    "Ugly shoes and they gave me blisters.",
    "The concert was a disappointing mess.",
    "Bitter, burnt coffee, undrinkable.",
    "This vacuum stopped working in a week.",
    "A grim restaurant with tasteless food.",
    "The course was confusing and a waste of time.",
]
N_TRAIN = 12  # per label; the rest is held out


def _split() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    labelled = [(text, 0) for text in POSITIVE] + [(text, 1) for text in NEGATIVE]
    train = [pair for pair in labelled if (POSITIVE + NEGATIVE).index(pair[0]) % 16 < N_TRAIN]
    return train, [pair for pair in labelled if pair not in train]


@pytest.fixture(scope="module")
def head(engine: Engine) -> Head:
    train, _ = _split()
    states = [engine.fill(SCHEMA, text, calibrate=False, hidden=True).fields["sentiment"].hidden for text, _ in train]
    gold = [gold for _, gold in train]
    return fit_head(np.stack(states), gold, LABELS, engine.model_name, parts=engine.backend.hidden_parts)


@pytest.fixture(scope="module")
def headed(engine: Engine, head: Head) -> Engine:
    calibration = Calibration(engine.model_name, False, {}, {"data": "hand-written"}, heads={"sentiment": head})
    return Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=calibration)


def test_hidden_states_cost_no_pass_and_change_no_reading(engine: Engine) -> None:
    engine.warmup(SCHEMA)  # both fills below find the head cached
    plain = engine.fill(SCHEMA, POSITIVE[0])
    kept = engine.fill(SCHEMA, POSITIVE[0], hidden=True)
    assert kept.stats.forward_passes == plain.stats.forward_passes
    assert kept.stats.row_tokens == plain.stats.row_tokens
    for name in ("sentiment", "mentions_price"):
        assert kept.fields[name].probabilities == pytest.approx(plain.fields[name].probabilities, abs=1e-9)
        assert kept.fields[name].hidden is not None and kept.fields[name].hidden.ndim == 1
        assert plain.fields[name].hidden is None and "hidden" not in kept.fields[name].to_dict()
    assert not np.allclose(kept.fields["sentiment"].hidden, kept.fields["mentions_price"].hidden)


def test_a_fitted_head_answers_its_field_in_the_same_passes(engine: Engine, head: Head, headed: Engine) -> None:
    _, held_out = _split()
    engine.warmup(SCHEMA)
    headed.warmup(SCHEMA)  # each engine keeps its own head cache: both read warm
    right_head = right_zero_shot = 0
    for text, gold in held_out:
        plain = engine.fill(SCHEMA, text, hidden=True)
        answered = headed.fill(SCHEMA, text)
        field, zero_shot = answered.fields["sentiment"], plain.fields["sentiment"]
        assert answered.stats.forward_passes == plain.stats.forward_passes
        assert answered.stats.input_tokens == plain.stats.input_tokens
        assert field.method == "head" and field.calibrated is True
        assert field.zero_shot == pytest.approx(zero_shot.probabilities, abs=1e-9)
        expected = head.probabilities(zero_shot.hidden)
        assert list(field.probabilities.values()) == pytest.approx(list(expected), abs=1e-9)
        assert field.value == LABELS[int(np.argmax(expected))]
        # the field without a head is read zero-shot; it is read after the first field's answer line
        # (the first field is decided alone), so it reads as without the head where both chose alike
        other = answered.fields["mentions_price"]
        assert other.method == "trie" and other.zero_shot is None and other.calibrated is False
        if field.value == zero_shot.value:
            assert other.probabilities == pytest.approx(plain.fields["mentions_price"].probabilities, abs=1e-9)
        right_head += LABELS.index(str(field.value)) == gold
        right_zero_shot += LABELS.index(str(zero_shot.value)) == gold
    assert right_head >= right_zero_shot and right_head >= 0.75 * len(held_out)


def test_a_head_answer_abstains_below_its_own_threshold_and_reports_its_set(engine: Engine, head: Head) -> None:
    """The head's thresholds, not the zero-shot field's, decide: one just above and one just below the
    head's top probability for the same text, and a zero-shot threshold that would always abstain.
    """
    _, held_out = _split()
    text = held_out[0][0]
    top = float(head.probabilities(engine.fill(SCHEMA, text, hidden=True).fields["sentiment"].hidden).max())
    never = FieldCalibration(LABELS, 1.0, (0.0, 0.0), abstain_below=NEVER)  # the zero-shot field: always abstain
    answers = {}
    for name, below in (("above", top + 1e-6), ("below", top - 1e-6)):
        fitted = replace(head, abstain_below=below, set_threshold=0.0)
        calibration = Calibration(engine.model_name, False, {"sentiment": never}, {}, heads={"sentiment": fitted})
        answers[name] = Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=calibration).fill(
            SCHEMA, text
        )
    above, below = answers["above"].fields["sentiment"], answers["below"].fields["sentiment"]
    assert above.method == "head" and above.abstained is True and below.abstained is False
    assert above.value == below.value and above.probabilities == pytest.approx(below.probabilities, abs=1e-9)
    assert sorted(above.answer_set or []) == sorted(LABELS) and above.answer_set[0] == above.value
    assert above.to_dict()["abstained"] is True and below.to_dict()["answer_set"][0] == below.value
    # a head saved without thresholds (the fixture's) never abstains and has no set
    plain = Calibration(engine.model_name, False, {"sentiment": never}, {}, heads={"sentiment": head})
    unfitted = Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=plain).fill(SCHEMA, text)
    assert unfitted.fields["sentiment"].abstained is False and unfitted.fields["sentiment"].answer_set is None


def test_a_head_of_another_model_is_refused_at_load(engine: Engine, head: Head, tmp_path: Any) -> None:
    path = tmp_path / "other.calibration.json"
    other = replace(head, model="qwen2.5-coder-0.5b")
    Calibration("qwen2.5-coder-0.5b", False, {}, {}, heads={"sentiment": other}).save(path)
    with pytest.raises(OptionError, match="fitted on 'qwen2.5-coder-0.5b', not 'smollm2-135m'"):
        Engine.load("smollm2-135m", calibration=path)
    with pytest.raises(OptionError, match="qwen2.5-coder-0.5b"):
        Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=Calibration.load(path))


def test_a_head_reading_the_middle_layers_is_refused_where_only_the_final_state_is_read(head: Head) -> None:
    assert head.parts == ("final", "middle")  # fitted on the torch backend's states
    calibration = Calibration(head.model, False, {}, {}, heads={"sentiment": head})
    backend = OracleBackend()
    backend.reads_hidden = True  # a backend that gives the final state alone, as llama.cpp does
    with pytest.raises(HiddenStatesUnavailableError, match="reads the final\\+middle hidden state"):
        Engine(backend, ByteTokenizer(), head.model, calibration=calibration)


def test_a_head_fitted_on_the_final_state_alone_reads_that_part_of_wider_states(engine: Engine, head: Head) -> None:
    text = POSITIVE[0]
    state = engine.fill(SCHEMA, text, hidden=True).fields["sentiment"].hidden
    final = state[: len(state) // 2]
    narrow = fit_head(np.stack([final + k for k in range(4)]), [0, 1, 0, 1], head.labels, head.model, parts=("final",))
    np.testing.assert_allclose(narrow.probabilities(state), narrow.probabilities(final))
    with pytest.raises(OptionError, match="final\\+middle state of hidden size"):
        head.probabilities(final)


def test_a_backend_without_hidden_states_refuses_a_head(head: Head) -> None:
    calibration = Calibration(head.model, False, {}, {}, heads={"sentiment": head})
    with pytest.raises(HiddenStatesUnavailableError, match="cannot read hidden states"):
        Engine(OracleBackend(), ByteTokenizer(), head.model, calibration=calibration)


def test_version_4_round_trips_its_heads_and_version_3_still_loads(head: Head, tmp_path: Any) -> None:
    fields = {"mentions_price": FieldCalibration(("true", "false"), 2.0, (0.1, -0.1))}
    calibration = Calibration(head.model, False, fields, {"n": 24}, heads={"sentiment": head})
    path = tmp_path / "v4.json"
    calibration.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 5 and set(data["heads"]) == {"sentiment"}
    again = Calibration.load(path)
    states = np.stack([head.mean, head.mean + head.scale])
    np.testing.assert_allclose(again.heads["sentiment"].probabilities(states), head.probabilities(states))
    assert again.fields == calibration.fields
    del data["heads"]
    data["version"] = 3
    older = Calibration.from_dict(data)
    assert older.heads == {} and older.fields == calibration.fields
