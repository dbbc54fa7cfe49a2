"""Trained heads on the oracle backend's hidden states: fitted, applied and served with no model.

The oracle's state is a bag of its context's tokens (``pcd_core/testing.py``), so a head fitted on it
answers from the words of the input. What these tests check is the plumbing, which does not depend on
the model: a head answers its field from the state read in the same passes, keeps the zero-shot reading
beside it, and every wire (HTTP, the OpenAI SDK's routes, MCP, LangChain) says that a head answered.
``tests/test_heads_engine.py`` checks on the embedded model that a head fitted on real states is right.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="fitting a head needs the 'heads' extra")

from test_heads_engine import LABELS, NEGATIVE, POSITIVE, SCHEMA

from pcd_core import Engine
from pcd_core.testing import oracle_engine
from pcd_core.trust.calibration import Calibration
from pcd_core.trust.heads import Head, fit_head

STATE = "The blender arrived cracked. I want my money back."
REFUND = {"type": "noul", "instructions": "Does the customer ask for money back?"}
FIXED_TRUE = float(np.exp(1.0) / (np.exp(1.0) + np.exp(-1.0)))


@pytest.fixture(scope="module")
def oracle_states() -> Engine:
    return oracle_engine(hidden_size=16)


@pytest.fixture(scope="module")
def head(oracle_states: Engine) -> Head:
    texts = POSITIVE[:8] + NEGATIVE[:8]
    gold = [0] * 8 + [1] * 8
    states = [
        oracle_states.fill(SCHEMA, text, calibrate=False, hidden=True).fields["sentiment"].hidden for text in texts
    ]
    parts = oracle_states.backend.hidden_parts
    return fit_head(np.stack(states), gold, LABELS, oracle_states.model_name, parts=parts)


def _with_heads(engine: Engine, heads: dict[str, Head]) -> Engine:
    calibration = Calibration(engine.model_name, False, {}, {"data": "hand-written"}, heads=heads)
    return Engine(engine.backend, engine.tokenizer, engine.model_name, calibration=calibration)


def test_the_oracle_reads_a_state_per_query_at_no_extra_pass(oracle_states: Engine) -> None:
    oracle_states.warmup(SCHEMA)  # both fills below find the head cached
    plain = oracle_states.fill(SCHEMA, POSITIVE[0])
    kept = oracle_states.fill(SCHEMA, POSITIVE[0], hidden=True)
    assert kept.stats.forward_passes == plain.stats.forward_passes
    first, other = kept.fields["sentiment"].hidden, kept.fields["mentions_price"].hidden
    assert first.shape == (16,) and first.dtype == np.float32 and not np.allclose(first, other)
    # another input moves the state: the head has something to read
    again = oracle_states.fill(SCHEMA, NEGATIVE[0], hidden=True).fields["sentiment"].hidden
    assert not np.allclose(first, again)


def test_a_head_answers_from_the_state_of_the_same_passes(oracle_states: Engine, head: Head) -> None:
    headed = _with_heads(oracle_states, {"sentiment": head})
    oracle_states.warmup(SCHEMA)
    headed.warmup(SCHEMA)  # each engine keeps its own head cache: both read warm
    for text in (POSITIVE[9], NEGATIVE[9]):
        plain = oracle_states.fill(SCHEMA, text, hidden=True)
        answered = headed.fill(SCHEMA, text)
        field = answered.fields["sentiment"]
        assert answered.stats.forward_passes == plain.stats.forward_passes
        assert field.method == "head" and field.calibrated is True
        assert field.zero_shot == pytest.approx(plain.fields["sentiment"].probabilities, abs=1e-9)
        expected = head.probabilities(plain.fields["sentiment"].hidden)
        assert list(field.probabilities.values()) == pytest.approx(list(expected), abs=1e-9)
        assert field.value == LABELS[int(np.argmax(expected))]
        assert answered.fields["mentions_price"].method == "trie"


@pytest.fixture(scope="module")
def served(oracle_states: Engine, head: Head) -> Engine:
    """The fitted head for the field, and for the questions ``refund`` and ``questions[0]`` a head whose
    weights are zero: it answers softmax(bias) = (0.881, 0.119) whatever the state, so the served numbers
    show that the head was applied. Those two abstain below 0.9 and their sets hold labels of 0.1 or more;
    the field's head answers from 0.0 with a set threshold of 0 (so it answers, its set every label).
    """
    width = head.width
    fixed = Head(
        ("true", "false"),
        oracle_states.model_name,
        np.zeros(width),
        np.ones(width),
        np.zeros((2, width)),
        np.array([1.0, -1.0]),
        1.0,
        0,
    )
    heads = {
        "sentiment": replace(head, abstain_below=0.0, set_threshold=0.0),
        "refund": replace(fixed, abstain_below=0.9, set_threshold=0.1),
        "questions[0]": replace(fixed, abstain_below=0.9, set_threshold=0.1),
    }
    return _with_heads(oracle_states, heads)


def test_served_answers_say_a_head_answered(oracle_states: Engine, served: Engine) -> None:
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from loopback import serving

    from pcd_integrations.http import create_app

    raw = oracle_states.decide(STATE, {"refund": REFUND}).answers["refund"]
    with serving(create_app(served)) as url:
        body = httpx.post(f"{url}/v1/systemone", json={"state": STATE, "questions": {"refund": REFUND}}, timeout=600)
        refund = body.json()["answers"]["refund"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        predicate = {"type": "predicate", "instructions": REFUND["instructions"]}
        decision = client.decisions.create(model=served.model_name, input=STATE, questions=[predicate])
        response_format = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}
        reply = client.chat.completions.create(
            model=served.model_name,
            messages=[{"role": "user", "content": POSITIVE[1]}],
            response_format=response_format,
        )
    assert refund["x_method"] == "head" and refund["noul"] == pytest.approx(FIXED_TRUE, abs=1e-9)
    assert refund["x_zero_shot"]["true"] == pytest.approx(raw.noul, abs=1e-9)
    assert refund["x_abstained"] is True and refund["x_answer_set"] == ["true", "false"]
    refused = decision.answers[0]  # /v1/decisions has no answer sets; an abstained head answer is a refusal
    assert refused.type == "refusal" and refused.x_abstained is True
    assert refused.x_answer["x_method"] == "head" and refused.x_answer["probability"] == pytest.approx(FIXED_TRUE)
    fields = reply.x_pcd["fields"]
    assert fields["sentiment"]["method"] == "head" and set(fields["sentiment"]["zero_shot"]) == set(LABELS)
    assert fields["sentiment"]["abstained"] is False and sorted(fields["sentiment"]["answer_set"]) == sorted(LABELS)
    assert fields["mentions_price"]["method"] == "trie" and fields["mentions_price"]["zero_shot"] is None


@pytest.mark.asyncio
async def test_mcp_and_langchain_answers_say_a_head_answered(served: Engine) -> None:
    from langchain_core.decisions import Noul
    from mcp import Client

    from mcp_server import build_server
    from pcd_integrations.langchain.decisions import PCDDecisionModel

    async with Client(build_server(served), raise_exceptions=True) as client:
        decided = (
            await client.call_tool("decide", {"state": STATE, "questions": {"refund": REFUND}})
        ).structured_content
        filled = (await client.call_tool("fill", {"state": POSITIVE[1], "schema": SCHEMA})).structured_content
    assert decided["answers"]["refund"]["x_method"] == "head" and decided["answers"]["refund"]["x_abstained"] is True
    assert decided["answers"]["refund"]["noul"] == pytest.approx(FIXED_TRUE, abs=1e-9)
    assert filled["fields"]["sentiment"]["method"] == "head" and filled["fields"]["mentions_price"]["method"] == "trie"
    assert filled["fields"]["sentiment"]["abstained"] is False and len(filled["fields"]["sentiment"]["answer_set"]) == 2
    answers = PCDDecisionModel(engine=served).invoke(
        {"state": STATE, "questions": {"refund": Noul(instructions=REFUND["instructions"])}}
    )
    assert answers.answers["refund"].method == "head" and answers.answers["refund"].zero_shot is not None
    assert answers.answers["refund"].abstained is True and answers.answers["refund"].answer_set == ["true", "false"]
