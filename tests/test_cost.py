"""The one cost record (``pcd_core/cost.py``): what fill, decide and generate return, and every
wire's usage rendered from it. The expected numbers are read off the record's fields here, not
from the rendering code; the read path's counts themselves are checked on the real model by
``tests/test_engine.py`` (fill, decide) and ``tests/test_chatting.py`` (replies).
"""

import dataclasses
from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from pcd_core import DecideResponse, Stats, Usage
from pcd_core.result import FieldResult
from pcd_integrations.langchain.decisions import usage_metadata
from pcd_integrations.wire.chat_reply import CompletionUsage, PcdExtension
from pcd_integrations.wire.decisions import DecisionUsage

# every count a different number, so that a rendering that reads the wrong field shows it
SPENT = Stats(
    forward_passes=3,
    input_tokens=410,
    prompt_tokens=52,
    cached_tokens=301,
    cache_write_tokens=7,
    row_tokens=57,
    n_rows=11,
    rounds=2,
    output_tokens=13,
    open_steps=5,
    queue_ms=17.5,
    total_ms=90.0,
    head_cache="hit",
)
CHOICE = Stats(forward_passes=1, input_tokens=120, cached_tokens=100, queue_ms=2.25)


def test_the_record_is_frozen_and_its_states_are_literals():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPENT.forward_passes = 0  # type: ignore[misc]
    hints = get_type_hints(Stats)
    literals = {
        "head_cache": (hints["head_cache"], {"hit", "miss", "bypassed"}),
        "row_layout": (hints["row_layout"], {"packed", "copies"}),
        "method": (get_type_hints(FieldResult)["method"], {"trie", "greedy", "exact", "head"}),
    }
    for name, (hint, values) in literals.items():
        assert get_origin(hint) is Literal and set(get_args(hint)) == values, name


def test_every_wire_renders_the_same_record():
    assert Usage.of(SPENT).model_dump() == {
        "input_tokens": 410,
        "output_tokens": 13,
        "cached_tokens": 301,
        "forward_passes": 3,
        "queue_ms": 17.5,
    }
    assert DecisionUsage.of(SPENT).model_dump(mode="json") == {
        "input_tokens": 410,
        "input_tokens_details": {"cached_tokens": 301, "cache_write_tokens": 7},
        "output_tokens": 13,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 423,
    }
    chat = CompletionUsage.of([SPENT]).model_dump(mode="json")
    assert (chat["prompt_tokens"], chat["completion_tokens"], chat["total_tokens"]) == (410, 13, 423)
    assert chat["prompt_tokens_details"] == {"cached_tokens": 301}
    pcd = PcdExtension.of([SPENT], method="filled")
    assert (pcd.forward_passes, pcd.queue_ms) == (3, 17.5)
    assert usage_metadata(SPENT) == {
        "input_tokens": 410,
        "output_tokens": 13,
        "total_tokens": 423,
        "input_token_details": {"cache_read": 301},
    }


def test_a_chat_reply_adds_up_the_calls_behind_it():
    """A tool choice (a decide) and the fill of its arguments answer one chat request."""
    usage = CompletionUsage.of([CHOICE, SPENT])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (530, 13, 543)
    assert usage.prompt_tokens_details.cached_tokens == 401
    pcd = PcdExtension.of([CHOICE, SPENT], method="tool_call")
    assert (pcd.forward_passes, pcd.queue_ms) == (4, 19.75)
    nothing = CompletionUsage.of([Stats()])  # a tool named by the caller: nothing was asked
    assert (nothing.prompt_tokens, nothing.total_tokens) == (0, 0)


def test_a_decide_response_carries_the_record_and_renders_its_usage():
    response = DecideResponse(model="m", answers={}, stats=SPENT)
    assert response.usage == Usage.of(SPENT)
    dumped = response.model_dump(mode="json")
    assert "stats" not in dumped and dumped["usage"] == {"input_tokens": 410, "output_tokens": 0}
    wire = response.to_wire()
    assert (wire["x_forward_passes"], wire["x_queue_ms"]) == (3, 17.5)


def test_fill_decide_and_generate_return_one_kind_of_record(engine):
    filled = engine.fill({"type": "object", "properties": {"ok": {"type": "boolean"}}}, "All good.")
    decided = engine.decide("All good.", {"ok": {"type": "noul", "instructions": "Is it fine?"}})
    replied = engine.generate("Say hi.", max_new_tokens=2)
    for stats in (filled.stats, decided.stats, replied.stats):
        assert type(stats) is Stats and stats.forward_passes >= 1 and stats.input_tokens > 0
    assert decided.usage.input_tokens == decided.stats.input_tokens
    assert replied.stats.output_tokens == 2 and filled.stats.output_tokens == decided.stats.output_tokens == 0
