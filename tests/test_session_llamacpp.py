"""Sessions on llama.cpp: a session is a sequence whose KV an append extends, a fork a ``seq_cp``.

Each append equals a fresh ``decide``/``fill`` of the whole conversation on the same engine within
``LAYOUT_TOLERANCE`` (1e-3), the bound llama.cpp's load-time self-check holds packed rows to: the
quantized kernels read a different batch shape (the new turn after the kept KV, against the whole
conversation after the cached head), so float rounding differs more than torch's float32.
"""

from __future__ import annotations

import pytest

from pcd_core import Engine
from pcd_core.backends.llamacpp_backend import LAYOUT_TOLERANCE

pytest.importorskip("llama_cpp", reason="the llama.cpp tests need the llamacpp extra")

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


def _gap(mine, fresh) -> float:
    gaps = []
    for qid, answer in fresh.answers.items():
        if answer.type == "noul":
            gaps.append(abs(mine.answers[qid].noul - answer.noul))
        else:
            gaps += [abs(mine.answers[qid].probabilities[k] - p) for k, p in answer.probabilities.items()]
    return max(gaps)


def test_every_append_and_a_fork_equal_a_fresh_decide_within_the_layout_bound(llama_engine):
    session = llama_engine.session(QUESTIONS)
    for role, text in TURNS[:2]:
        result = session.append(text, role=role)
        assert _gap(result, llama_engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce)) < LAYOUT_TOLERANCE
    branch = session.fork()
    mine = branch.append("Actually a new delivery is fine.", role="customer")
    theirs = session.append(TURNS[2][1], role="customer")
    assert mine.stats.cached_tokens == theirs.stats.cached_tokens > 0  # both after the shared sequence
    assert _gap(mine, llama_engine.decide(branch.text, QUESTIONS, fence_nonce=branch.nonce)) < LAYOUT_TOLERANCE
    assert _gap(theirs, llama_engine.decide(session.text, QUESTIONS, fence_nonce=session.nonce)) < LAYOUT_TOLERANCE


def test_a_fill_session_matches_a_fresh_fill(llama_engine):
    session = llama_engine.session(SCHEMA)
    for role, text in TURNS:
        result = session.append(text, role=role)
        fresh = llama_engine.fill(SCHEMA, session.text, fence_nonce=session.nonce)
        assert result.values == fresh.values
        for name, field in fresh.fields.items():
            for label, p in field.probabilities.items():
                assert abs(result.fields[name].probabilities[label] - p) < LAYOUT_TOLERANCE
