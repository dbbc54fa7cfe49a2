"""MLX against PyTorch on the real SmolLM2: the same decisions from the same weights.

Two MLX engines are compared with the torch engine, all behind the same tokenizer and compiler:
- ``mlx-fp32`` reads the dequantized float32 folder that torch reads, so every decision must be
  identical and every probability equal to 1e-3;
- ``mlx-q4_1`` keeps the GGUF's Q4_1 tensors quantized; its decisions are counted and printed, every
  field's log-prob of the label torch chose must stay within 1e-2 of torch's, agreeing or not, and
  every field that torch decides by a margin of 0.02 or more must be decided the same.

MLX's Linux CPU wheel runs at about 2.5 GFLOP/s here, so CI runs one short schema. Every bundled
case (about 25 minutes on one core here) runs with ``PCD_CROSS_BACKEND=full``; the docs have the
last result.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from conftest import load_case, schema_cases

from pcd_core import Engine
from pcd_core.backends.mlx_backend import MlxBackend

FULL = os.environ.get("PCD_CROSS_BACKEND") == "full"
needs_full = pytest.mark.skipif(
    not FULL, reason="every bundled case takes ~25 min on MLX's Linux CPU wheel; set PCD_CROSS_BACKEND=full"
)

SHORT_SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["NEGATIVE", "NEUTRAL", "POSITIVE"]},
        "wants_refund": {"type": "boolean"},
        "channel": {"type": "string", "enum": ["EMAIL", "PHONE", "CHAT"]},
    },
    "required": ["sentiment", "wants_refund", "channel"],
}
SHORT_INPUT = "I was charged twice for my plan this month. Please call me back and refund the extra charge."


@pytest.fixture(scope="module")
def mlx_fp32(engine):
    folder = engine.backend.model.config.name_or_path
    return Engine(MlxBackend.from_hf_dir(folder), engine.tokenizer, "smollm2-135m (mlx fp32)")


@pytest.fixture(scope="module")
def mlx_q4(engine):
    return Engine.load("smollm2-135m", backend="mlx")


def compare_fills(torch_engine: Engine, mlx_fp32: Engine, schema, text: str) -> None:
    """Assert fp32 identity field by field, and a warm request of at most 2 forward passes, the same on both."""
    torch_engine.warmup(schema)
    mlx_fp32.warmup(schema)
    expected = torch_engine.fill(schema, text)
    got = mlx_fp32.fill(schema, text)
    assert got.stats.forward_passes == expected.stats.forward_passes <= 2
    for name, want in expected.fields.items():
        have = got.fields[name]
        assert have.value == want.value, name
        assert have.probabilities == pytest.approx(want.probabilities, abs=1e-3), name
        assert have.candidate_mass == pytest.approx(want.candidate_mass, abs=1e-3), name


def report_quantized(torch_engine: Engine, mlx_q4: Engine, schema, text: str, case: str, capsys) -> None:
    expected = torch_engine.fill(schema, text)
    got = mlx_q4.fill(schema, text)
    same = [name for name, want in expected.fields.items() if got.fields[name].value == want.value]
    with capsys.disabled():
        print(f"\n{case}: MLX Q4_1 and torch agree on {len(same)}/{len(expected.fields)} fields")
    for name, want in expected.fields.items():
        have = got.fields[name]
        chosen = next(label for label, p in want.probabilities.items() if p == want.probability)
        assert abs(math.log(have.probabilities[chosen]) - math.log(want.probability)) < 1e-2, name
        runner_up = sorted(want.probabilities.values())[-2]
        if want.probability - runner_up >= 0.02:
            assert have.value == want.value, name


def test_short_schema_decides_the_same_on_mlx_fp32(engine, mlx_fp32):
    compare_fills(engine, mlx_fp32, SHORT_SCHEMA, SHORT_INPUT)


@needs_full
@pytest.mark.parametrize("name", schema_cases())
def test_every_bundled_schema_decides_the_same_on_mlx_fp32(engine, mlx_fp32, name):
    case = load_case(name)
    compare_fills(engine, mlx_fp32, case["json_schema"], case["input"])


@needs_full
@pytest.mark.parametrize("name", schema_cases())
def test_every_bundled_schema_on_mlx_q4_1(engine, mlx_q4, name, capsys):
    case = load_case(name)
    report_quantized(engine, mlx_q4, case["json_schema"], case["input"], name, capsys)


@needs_full
def test_bundled_questions_decide_the_same_on_mlx_fp32(engine, mlx_fp32):
    case = load_case("refund_request_questions")
    expected = engine.decide(case["state"], case["questions"])
    got = mlx_fp32.decide(case["state"], case["questions"])
    for qid, want in expected.answers.items():
        have = got.answers[qid]
        assert have.type == want.type, qid
        if want.type == "noul":
            assert have.noul == pytest.approx(want.noul, abs=1e-3), qid
            continue
        assert getattr(have, want.type) == pytest.approx(getattr(want, want.type), abs=1e-3), qid
        assert have.probabilities == pytest.approx(want.probabilities, abs=1e-3), qid
