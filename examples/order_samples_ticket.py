"""The double-billing ticket asked as questions, each choice read in one order and in K rotations.

Each enum field of ``examples/ticket_schema.json`` becomes a choice question (its description the
question, its values the options) and each boolean a noul; ``Engine.decide`` answers them with
``order_samples=1`` and with ``order_samples=K``, warm, and the script writes, per question, the answer,
the probability of the right one (examples/ticket_answers.json), ``x_order_spread``, and
per setting the forward passes and the milliseconds (median of ``--repeats``).

    python examples/order_samples_ticket.py --k 3 --json docs/eval/trust/smollm2-135m.ticket.order-samples.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pcd_core import Engine

EXAMPLES = Path(__file__).resolve().parent
RIGHT = json.loads((EXAMPLES / "ticket_answers.json").read_text())  # as tests/test_double_billing.py's


def ticket_questions(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One question per field: a choice over an enum's values, a noul for a boolean."""
    questions: dict[str, dict[str, Any]] = {}
    for name, spec in schema["properties"].items():
        if "enum" in spec:
            criteria = {value: None for value in spec["enum"]}
            questions[name] = {"type": "choice", "instructions": spec["description"], "criteria": criteria}
        else:
            questions[name] = {"type": "noul", "instructions": spec["description"] + "?"}
    return questions


def run(engine: Engine, text: str, questions: dict[str, Any], k: int, repeats: int) -> dict[str, Any]:
    engine.decide(text, questions, order_samples=k)  # warm: the head is cached after this
    times, response = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        response = engine.decide(text, questions, order_samples=k)
        times.append((time.perf_counter() - started) * 1000)
    assert response is not None
    answers = {}
    for name, answer in response.answers.items():
        right = RIGHT[name]
        if answer.type == "noul":
            p_right = answer.noul if right else 1 - answer.noul
            answers[name] = {"answer": answer.noul >= 0.5, "p_right": p_right}
        else:
            answers[name] = {
                "answer": answer.choice,
                "p_right": answer.probabilities[right],
                "order_spread": answer.order_spread,
            }
        answers[name]["right"] = answers[name]["answer"] == right
    return {
        "order_samples": k,
        "right": sum(a["right"] for a in answers.values()),
        "forward_passes": response.stats.forward_passes,
        "n_rows": response.stats.n_rows,
        "median_ms": statistics.median(times),
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    engine = Engine.load(args.model)
    questions = ticket_questions(json.loads((EXAMPLES / "ticket_schema.json").read_text()))
    text = (EXAMPLES / "ticket.txt").read_text()
    report = {
        "model": args.model,
        "command": "python examples/order_samples_ticket.py " + " ".join(sys.argv[1:]),
        "runs": [run(engine, text, questions, k, args.repeats) for k in (1, args.k)],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
