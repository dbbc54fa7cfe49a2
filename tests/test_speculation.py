"""The second wave read in the first wave's pass, behind each answer of the first field
(``pcd_core/planning/speculation.py``): the same answers as two passes, one pass fewer, on the real
embedded model and on Gemma 3's tokenizer; and the rule that says when it pays.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from pcd_core.planning import speculation
from pcd_core.planning.speculation import SPECULATIVE_TOKENS, speculate

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = json.loads((ROOT / "examples" / "support_conversation.json").read_text(encoding="utf-8"))
CONVERSATION = "\n".join(f"{turn['role']}: {turn['text']}" for turn in SUPPORT["turns"][:8])

TICKET = {
    "sentiment": ["POSITIVE", "NEUTRAL", "NEGATIVE"],
    "wants_refund": "boolean",
    "urgent": "boolean",
    "summary": {"type": "string", "maxLength": 40},
}
TEXT = "Charged twice for March! Refund within 12 hours or I cancel."


def both(engine, monkeypatch, schema, text, **keywords):
    """A fill read ahead (the default) and the same fill in two passes, with each one's pass count."""
    ahead = engine.fill(schema, text, **keywords)
    with monkeypatch.context() as patch:
        patch.setattr(speculation, "SPECULATIVE_TOKENS", 0)
        apart = engine.fill(schema, text, **keywords)
    return ahead, apart


def same_fields(ahead, apart, atol=1e-5):
    assert list(ahead.fields) == list(apart.fields)
    for name, field in apart.fields.items():
        mine = ahead.fields[name]
        assert mine.value == field.value, name
        if hasattr(field, "probabilities"):
            assert mine.probabilities.keys() == field.probabilities.keys()
            for label, p in field.probabilities.items():
                assert mine.probabilities[label] == pytest.approx(p, abs=atol), (name, label)
            assert mine.candidate_mass == pytest.approx(field.candidate_mass, abs=atol), name


@pytest.mark.parametrize("model", ["engine", "gemma_engine"])
def test_a_fill_read_ahead_gives_the_two_pass_answers_in_one_pass_fewer(model, request, monkeypatch):
    engine = request.getfixturevalue(model)
    engine.warmup(SUPPORT["schema"])
    ahead, apart = both(engine, monkeypatch, SUPPORT["schema"], CONVERSATION, generate=False)
    same_fields(ahead, apart)
    assert (ahead.stats.forward_passes, apart.stats.forward_passes) == (1, 2)
    # the answer line is read as a row behind each answer, not as the next pass's trunk
    assert ahead.stats.prompt_tokens < apart.stats.prompt_tokens
    assert ahead.stats.row_tokens > apart.stats.row_tokens


def test_open_fields_are_written_after_both_waves_lines(engine, monkeypatch):
    """The open field's first step writes in the answer lines of both waves read ahead: the same
    text as after two passes, with the same steps.
    """
    engine.warmup(TICKET)
    ahead, apart = both(engine, monkeypatch, TICKET, TEXT)
    same_fields(ahead, apart)
    assert ahead.value == apart.value and ahead.fields["summary"].text == apart.fields["summary"].text
    assert ahead.stats.open_steps == apart.stats.open_steps
    assert ahead.stats.forward_passes == apart.stats.forward_passes - 1


def test_the_branch_taken_is_the_debiased_choice_and_hidden_states_match(engine, monkeypatch):
    """Debiasing may change the first field's answer: the second wave read is the one behind the
    answer it chose; the hidden states a head would read are those of the two-pass read.
    """
    schema = {key: TICKET[key] for key in ("sentiment", "wants_refund", "urgent")}
    ahead, apart = both(engine, monkeypatch, schema, TEXT, debias=True, hidden=True)
    same_fields(ahead, apart)
    for name in schema:
        assert ahead.fields[name].debiased and apart.fields[name].debiased
        np.testing.assert_allclose(ahead.fields[name].hidden, apart.fields[name].hidden, atol=1e-4)


def test_a_later_depends_on_wave_reads_the_lines_of_both_waves_before_it(engine, monkeypatch):
    schema = {
        "topic": ["BILLING", "TECHNICAL"],
        "urgent": "boolean",
        "escalate": {"type": "boolean", "depends_on": ["urgent"]},
    }
    engine.warmup(schema)
    ahead, apart = both(engine, monkeypatch, schema, TEXT)
    same_fields(ahead, apart)
    assert (ahead.stats.forward_passes, apart.stats.forward_passes) == (2, 3)


def test_it_is_read_ahead_only_when_the_branches_not_taken_are_short_and_the_rows_packed():
    yes_no = ((1, 2, 3), (1, 4, 3))
    short = [((5, 6), (5, 7, 8))]
    made = speculate(yes_no, short, 1, packed=True)
    assert made is not None and made.leads == yes_no and made.n_wave == 1
    assert speculate(yes_no, short, 1, packed=False) is None  # a backend of copies reads each row whole
    assert speculate(yes_no, [], 1, packed=True) is None  # one wave: nothing to read ahead
    # each branch not taken adds its lead and every later field's longest line
    per_branch = 3 + 3
    many = tuple((9, k) + (3,) for k in range(SPECULATIVE_TOKENS // per_branch + 2))
    assert speculate(many, short, 1, packed=True) is None
    fits = tuple((9, k, 3) for k in range(SPECULATIVE_TOKENS // per_branch + 1))
    assert speculate(fits, short, 1, packed=True) is not None


def test_a_big_schema_keeps_its_two_passes(engine):
    """Twenty boolean fields after a boolean: the branch not taken would add far more than the
    budget, so the fill reads them after the real answer line, in a second pass.
    """
    schema = {"first": "boolean", **{f"flag_{k}": "boolean" for k in range(20)}}
    engine.warmup(schema)
    result = engine.fill(schema, TEXT)
    assert result.stats.forward_passes == 2
