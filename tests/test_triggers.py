"""Triggers: each condition on scripted readings (model-free), then on a real session's appends."""

from __future__ import annotations

import pytest

from pcd_core.errors import OptionError
from pcd_core.request.triggers import Observation, Trigger, TriggerState, observe


def _turns_fired(trigger: Trigger, observations: list[Observation]) -> list[int]:
    state, fired = TriggerState(trigger), []
    for turn, now in enumerate(observations, start=1):
        state, one = state.step(now, turn)
        if one is not None:
            fired.append(one.turn)
    return fired


def _probabilities(*ps: float) -> list[Observation]:
    return [Observation(p >= 0.5, p) for p in ps]


def test_above_fires_on_reaching_the_threshold_then_waits_out_the_hysteresis_band():
    # 0.72 reaches 0.7; 0.69 and 0.71 stay inside the band (over 0.65), so no second firing; 0.64 leaves
    # the band and re-arms it, and 0.75 fires again
    readings = _probabilities(0.5, 0.72, 0.69, 0.71, 0.64, 0.75)
    assert _turns_fired(Trigger("x", above=0.7, hysteresis=0.05), readings) == [2, 6]
    # with no band, a probability wobbling round the threshold fires each time it comes back
    assert _turns_fired(Trigger("x", above=0.7, hysteresis=0.0), readings) == [2, 4, 6]


def test_below_is_above_mirrored():
    readings = _probabilities(0.5, 0.28, 0.31, 0.29, 0.36, 0.2)
    assert _turns_fired(Trigger("x", below=0.3, hysteresis=0.05), readings) == [2, 6]


def test_changed_fires_on_each_new_value_with_the_value_before_and_after():
    readings = [Observation(v, 0.9) for v in ("A", "A", "B", "B", "A")]
    state, fired = TriggerState(Trigger("x", changed=True)), []
    for turn, now in enumerate(readings, start=1):
        state, one = state.step(now, turn)
        fired += [one] if one else []
    assert [(f.turn, f.before_value, f.after_value) for f in fired] == [(3, "A", "B"), (5, "B", "A")]


def test_abstained_fires_when_the_answer_starts_or_stops_abstaining():
    flags = [False, True, True, False, True]
    readings = [Observation("A", 0.6, abstained=flag) for flag in flags]
    assert _turns_fired(Trigger("x", abstained=True), readings) == [2, 5]
    assert _turns_fired(Trigger("x", abstained=False), readings) == [4]


def test_a_trigger_takes_exactly_one_condition_and_real_probabilities():
    with pytest.raises(OptionError, match="exactly one"):
        Trigger("x")
    with pytest.raises(OptionError, match="exactly one"):
        Trigger("x", changed=True, above=0.5)
    with pytest.raises(OptionError, match="strictly between"):
        Trigger("x", above=1.0)
    with pytest.raises(OptionError, match="hysteresis"):
        Trigger("x", below=0.4, hysteresis=0.6)
    assert Trigger("mood", above=0.7).name == "mood above 0.7"


def test_observe_compares_a_labels_probability_p_true_or_the_top_answer():
    assert observe(True, {"true": 0.8, "false": 0.2}, None).probability == 0.8
    assert observe(False, {"true": 0.3, "false": 0.7}, None).probability == 0.3  # P(true), not the top
    assert observe("B", {"A": 0.1, "B": 0.6, "C": 0.3}, None).probability == 0.6
    assert observe("B", {"A": 0.1, "B": 0.6, "C": 0.3}, "C").probability == 0.3
    assert observe("a summary", None, None).probability is None
    with pytest.raises(OptionError, match="no answer 'D'"):
        observe("B", {"A": 0.5, "B": 0.5}, "D")


QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "mood": {
        "type": "choice",
        "instructions": "How does the customer feel?",
        "criteria": {"angry": "", "calm": "", "happy": ""},
    },
}
TURNS = [
    ("customer", "Hello, I have a question about my invoice."),
    ("customer", "You charged me twice. I am furious and I want my money back, a full refund!"),
    ("agent", "I am sorry. The refund of the double charge is on its way."),
]


def test_a_sessions_results_list_the_triggers_that_fired(engine):
    session = engine.session(QUESTIONS)
    changed = session.when("mood", changed=True)
    wants = session.when("refund", above=0.6, hysteresis=0.05)
    with pytest.raises(OptionError, match="no key or question 'nope'"):
        session.when("nope", changed=True)
    previous = None
    armed = True
    for role, text in TURNS:
        result = session.append(text, role=role)
        mood, p_refund = result.answers["mood"].choice, result.answers["refund"].noul
        expected = []
        if previous is not None and previous.answers["mood"].choice != mood:
            expected.append((changed.name, previous.answers["mood"].choice, mood))
        if armed and p_refund >= 0.6:
            expected.append((wants.name, previous.answers["refund"].noul >= 0.5 if previous else None, p_refund >= 0.5))
            armed = False
        elif not armed and p_refund < 0.55:
            armed = True
        assert [(f.trigger, f.before_value, f.after_value) for f in result.triggers] == expected
        for fired in result.triggers:
            assert fired.turn == len(session.turns)
        previous = result
