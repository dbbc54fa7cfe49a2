"""Sessions on llama.cpp: a session is a sequence whose KV an append extends, a fork a ``seq_cp``.

Each append equals a fresh ``decide``/``fill`` of the whole conversation on the same engine within
llama.cpp's measured bound. The session reads the prompt in other batches than a fresh call does
(the new turn with the tail and rows after the kept KV; a fresh call reads the whole conversation
after the cached head), and llama.cpp's quantized kernels give log-probs that move with the batch shape:
``tests/test_llamacpp_backend.py`` holds them to ``SELF_ATOL`` = 0.3 nats against plain prefills. So
each answer's log-ratio to another answer (what renormalising keeps) may move by twice that; on
SmolLM2's GGUF the probabilities measured here moved by 0.021 to 0.039.
"""

from __future__ import annotations

import math

import pytest

from pcd_core import Engine

pytest.importorskip("llama_cpp", reason="the llama.cpp tests need the llamacpp extra")

#: tests/test_llamacpp_backend.py's SELF_ATOL: how far a log-prob moves with the batch shape alone
SELF_ATOL = 0.3


def _same_within_batch_shapes(mine: dict[str, float], fresh: dict[str, float]) -> None:
    """Every answer's log-ratio to the first answer agrees within 2 * SELF_ATOL."""
    first = next(iter(fresh))
    for name in fresh:
        ours = math.log(mine[name]) - math.log(mine[first])
        theirs = math.log(fresh[name]) - math.log(fresh[first])
        assert abs(ours - theirs) <= 2 * SELF_ATOL, (name, mine, fresh)


QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "mood": {
        "type": "choice",
        "instructions": "How does the customer feel?",
        "criteria": {"angry": "", "calm": "", "happy": ""},
    },
}
SCHEMA = {"type": "object", "properties": {"escalate": {"type": "boolean"}, "mood": {"enum": ["ANGRY", "CALM"]}}}
TURNS = [
    ("customer", "My parcel is two weeks late and nobody answers my emails."),
    ("agent", "I am sorry. Let me look at the tracking."),
    ("customer", "I want my money back, today."),
]


@pytest.fixture(scope="module")
def llama_engine():
    return Engine.load("smollm2-135m", backend="llamacpp")


def _same_answers(mine, fresh) -> None:
    for qid, answer in fresh.answers.items():
        if answer.type == "noul":
            ours = mine.answers[qid].noul
            _same_within_batch_shapes({"t": ours, "f": 1 - ours}, {"t": answer.noul, "f": 1 - answer.noul})
        else:
            _same_within_batch_shapes(mine.answers[qid].probabilities, answer.probabilities)


def test_every_append_and_a_fork_equal_a_fresh_decide_within_the_batch_shape_bound(llama_engine):
    session = llama_engine.session(QUESTIONS)
    for role, text in TURNS[:2]:
        result = session.append(text, role=role)
        _same_answers(result, llama_engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce))
    branch = session.fork()
    mine = branch.append("Actually a new delivery is fine.", role="customer")
    theirs = session.append(TURNS[2][1], role="customer")
    assert mine.stats.cached_tokens == theirs.stats.cached_tokens > 0  # both after the shared sequence
    _same_answers(mine, llama_engine.decide(branch.text, QUESTIONS, fence_nonce=branch.nonce))
    _same_answers(theirs, llama_engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce))


def test_a_fill_session_matches_a_fresh_fill(llama_engine):
    session = llama_engine.session(SCHEMA)
    for role, text in TURNS:
        result = session.append(text, role=role)
        fresh = llama_engine.fill(SCHEMA, session.text, fence_nonce=session.nonce)
        for name, field in fresh.fields.items():
            _same_within_batch_shapes(result.fields[name].probabilities, field.probabilities)
