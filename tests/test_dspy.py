"""DSPy 3.4 on the embedded model through ``PCDLM``: the decision types answered by ``decide`` (the
evidence DSPy records is the engine's probabilities), ``ReAnchor`` fitting a threshold on that evidence,
and an ordinary ``dspy.Predict`` with text and typed outputs answered by a fill.

DSPy's request cache is kept in memory for these tests (``ReAnchor`` needs a caching client, and a test
writes nothing under the home folder).
"""

import math
import statistics
import subprocess
import sys
from typing import Any

import pytest

dspy = pytest.importorskip("dspy", reason="the DSPy tests need the 'dspy' extra")

from dspy.adapters.decision import record_evidence  # noqa: E402
from dspy.experimental import Choice, ReAnchor, Score  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_integrations.dspy import PCDLM  # noqa: E402

TICKET = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."


# the decision types as aliases: their options are values, which an annotation would read as names
Urgency = Score["routine", "soon", "now"]
Team = Choice[("billing", "charges and refunds"), ("shipping", "late or lost parcels")]


class Triage(dspy.Signature):
    """Triage a support ticket."""

    ticket: str = dspy.InputField()
    refund: bool = dspy.OutputField(desc="Does the customer ask for money back?")
    urgency: Urgency = dspy.OutputField(desc="How urgent is it?")
    team: Team = dspy.OutputField(desc="Which team should handle it?")


class Angry(dspy.Signature):
    """Read a customer message."""

    message: str = dspy.InputField()
    angry: bool = dspy.OutputField(desc="Is the customer angry?")


class Answer(dspy.Signature):
    """Answer the question briefly."""

    question: str = dspy.InputField()
    answer: str = dspy.OutputField(desc="the answer, in a few words")
    year: int = dspy.OutputField(desc="the year the answer is about")


MESSAGES = [
    "Thanks, the parcel arrived on time.",
    "Where is my order? It is two weeks late.",
    "This is the third time I write. Fix it now.",
    "Could you send me the invoice again, please?",
    "Your support is useless and I want my money back.",
    "I love the new colour options.",
    "The app crashes every time I open it. Unacceptable.",
    "Can I change the delivery address?",
    "Nobody answers my emails. I am furious.",
    "Happy with the purchase, thank you.",
]


@pytest.fixture(scope="module")
def lm(engine: Engine) -> Any:
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    return PCDLM(engine)


def test_decision_types_carry_decides_probabilities_as_evidence(lm: Any, engine: Engine) -> None:
    with dspy.context(lm=lm), record_evidence() as evidence:
        prediction = dspy.Predict(Triage)(ticket=TICKET)
    sent = lm.history[-1]["request"]
    assert sent["state"]["inputs"] == {"ticket": TICKET} and set(sent["questions"]) == {"refund", "urgency", "team"}
    decided = engine.decide(sent["state"], sent["questions"]).answers  # the engine asked directly
    recorded = {name: answer for _, name, answer in evidence}
    assert math.isclose(recorded["refund"]["noul"], decided["refund"].noul, abs_tol=1e-9)
    for name in ("urgency", "team"):
        expected = {str(k): p for k, p in decided[name].probabilities.items()}
        got = {str(k): p for k, p in recorded[name]["probabilities"].items()}
        assert got.keys() == expected.keys()
        assert all(math.isclose(got[k], expected[k], abs_tol=1e-9) for k in got)
    # DSPy decodes them by its own rules: the 0.5 threshold, the expected level, the argmax
    assert prediction.refund is (decided["refund"].noul >= 0.5)
    levels = decided["urgency"].probabilities
    assert math.isclose(prediction.urgency.value, sum(int(i) * p for i, p in levels.items()), abs_tol=1e-9)
    assert prediction.team.value == max(decided["team"].probabilities, key=decided["team"].probabilities.get)


def test_a_repeated_request_is_answered_from_dspys_cache(lm: Any, engine: Engine) -> None:
    with dspy.context(lm=lm):
        dspy.Predict(Triage)(ticket=TICKET)
        passes = engine.backend.forward_passes
        dspy.Predict(Triage)(ticket=TICKET)
    assert engine.backend.forward_passes == passes and lm.history[-1]["cache_hit"]


def test_reanchor_fits_a_threshold_that_05_cannot_place(lm: Any) -> None:
    """Labels split the examples at the median of the model's own P(angry): a threshold between the two
    groups' evidence separates them, and 0.5 cannot when both groups lie on one side of it."""
    program = dspy.Predict(Angry)
    with dspy.context(lm=lm), record_evidence() as evidence:
        for message in MESSAGES:
            program(message=message)
    noul = [answer["noul"] for _, _, answer in evidence]
    cut = statistics.median(noul)
    labels = [p > cut for p in noul]
    assert all(p > 0.5 for p in noul) or all(p < 0.5 for p in noul), f"0.5 already splits {noul}"
    trainset = [dspy.Example(message=m, angry=y).with_inputs("message") for m, y in zip(MESSAGES, labels)]

    def metric(example: Any, prediction: Any, trace: Any = None) -> float:
        return float(prediction.angry == example.angry)

    optimizer = ReAnchor(metric)
    with dspy.context(lm=lm):
        compiled = optimizer.compile(program, trainset=trainset)
        threshold = compiled.fields["angry"]["threshold"]
        assert threshold != 0.5
        assert max(p for p in noul if p <= cut) < threshold <= min(p for p in noul if p > cut)
        assert all(compiled(message=e.message).angry == e.angry for e in trainset)
    (row,) = optimizer.report["fitted"]
    assert row["parameter"] == "threshold" and row["value"] == threshold and row["train_score"] == 1.0
    assert program.fields.get("angry", {}).get("threshold", 0.5) == 0.5  # the student is left unchanged


def test_a_predict_with_text_and_typed_outputs_is_a_fill(lm: Any, engine: Engine) -> None:
    question = "In which year did the French Revolution begin?"
    with dspy.context(lm=lm):
        prediction = dspy.Predict(Answer)(question=question)
    assert isinstance(prediction.answer, str) and prediction.answer.strip()
    assert isinstance(prediction.year, int)
    response = lm.history[-1]["response"]
    filled = response.provider_data["pcd"]
    assert set(filled["fields"]) == {"answer", "year"} and filled["stats"]["forward_passes"] > 0
    assert filled["value"] == {"answer": prediction.answer, "year": prediction.year}


def test_a_signature_mixing_decisions_and_text_gets_dspys_own_error(lm: Any) -> None:
    class Mixed(dspy.Signature):
        """Triage a support ticket."""

        ticket: str = dspy.InputField()
        refund: bool = dspy.OutputField(desc="Does the customer ask for money back?")
        reply: str = dspy.OutputField(desc="a reply to the customer")

    with dspy.context(lm=lm), pytest.raises(ValueError, match="Unsupported System One output 'reply'"):
        dspy.Predict(Mixed)(ticket=TICKET)


def test_dspys_own_typesafe_client_works_unchanged_against_pcd_serve(engine: Engine) -> None:
    """DSPy's System One client sends its default model, ``jev-latest``, which ``pcd serve`` answers."""
    pytest.importorskip("typesafe_sdk", reason="DSPy's TypeSafe client needs 'typesafe-sdk' (dev extra)")
    pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")
    from dspy.experimental import TypeSafe
    from loopback import serving

    from pcd_integrations.http import create_app

    with serving(create_app(engine)) as url:
        client = TypeSafe(base_url=url, api_key="unused", cache=False, timeout=300)
        assert client.model == "jev-latest"
        with dspy.context(lm=client), record_evidence() as evidence:
            prediction = dspy.Predict(Triage)(ticket=TICKET)
    sent = client.history[-1]["request"]
    decided = engine.decide(sent["state"], sent["questions"]).answers
    recorded = {name: answer for _, name, answer in evidence}
    assert math.isclose(recorded["refund"]["noul"], decided["refund"].noul, abs_tol=1e-6)
    assert prediction.team.value in {"billing", "shipping"}


def test_pcdlm_takes_an_engine() -> None:
    with pytest.raises(TypeError, match="PCDLM needs a pcd_core.Engine"):
        PCDLM("smollm2-135m")


def test_import_without_the_extra_names_the_pip_command() -> None:
    blocked = "import sys; sys.modules['dspy'] = None; import pcd_integrations.dspy"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "BackendUnavailableError" in result.stderr
    assert "pip install 'pcd-engine[dspy]'" in result.stderr
