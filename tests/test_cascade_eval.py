"""``pcd calibrate --cascade`` fits where each field escalates, ``pcd eval --cascade`` measures the fitted
point on held-out examples and draws the curve, and ``--then`` applies the fitted thresholds
(pcd_integrations/commands/cascade_eval.py, pcd_integrations/commands/cascading.py).

The engines are the oracle LM (pcd_core/testing.py) with two windows long enough to reach into the
input, so that their answers differ by example; what is checked is the plumbing and the counts,
against answers read again here.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from pcd_core.cascade import EscalationRule
from pcd_core.evaluation import datasets
from pcd_core.evaluation.cascade_curve import cascade_curve
from pcd_core.evaluation.decisions import threshold_split
from pcd_core.evaluation.runner import read_answers, variants
from pcd_core.testing import oracle_engine
from pcd_core.trust.calibration import Calibration
from pcd_integrations.commands import cascading
from pcd_integrations.commands.main import main

SCHEMA = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}
COLOURS, SIZES = SCHEMA["colour"], SCHEMA["size"]
RECORDS = [
    {
        "text": f"item {i}: a {SIZES[i % 2]} {COLOURS[(i // 2) % 3]} thing, number {i * 7 % 11}",
        "labels": {"colour": COLOURS[(i * 5) % 3], "size": SIZES[(i // 3) % 2]},
        "split": "train" if i < 48 else "test",
    }
    for i in range(72)
]


@pytest.fixture()
def files(tmp_path, monkeypatch):
    engines = {"first": oracle_engine(window=40), "second": oracle_engine(window=64)}
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engines[args.model])
    data, schema = tmp_path / "d.jsonl", tmp_path / "s.json"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    schema.write_text(json.dumps(SCHEMA))
    return engines, ["--data", str(data), "--schema", str(schema), "--model", "first", "--constrained-limit", "0"]


def test_calibrate_fits_each_fields_threshold_on_the_part_its_calibration_did_not_see(files, tmp_path, capsys):
    engines, argv = files
    out = tmp_path / "cal.json"
    command = ["calibrate", *argv, "--train-limit", "48", "--limit", "24", "--out", str(out)]
    assert main([*command, "--cascade", "second", "--escalate-share", "0.4"]) == 0
    calibration = Calibration.load(out)
    escalation = calibration.escalation
    assert escalation is not None and escalation.next_model == "second" and escalation.max_escalated == 0.4
    assert set(escalation.below) == set(SCHEMA)
    # the threshold is the best point within the share, counted again on the threshold part of the split
    train = datasets.select(RECORDS, "train", 0, None)  # in the order the command reads them
    order = {r["text"]: k for k, r in enumerate(train)}
    first = read_answers(engines["first"], SCHEMA, train, constrained=0, progress=False)
    part = threshold_split(first).thresholds
    second = read_answers(engines["second"], SCHEMA, train, constrained=0, progress=False)
    for name in SCHEMA:
        rows = variants(part, name, calibration)["calibrated"]
        texts = part.fields[name].texts
        later = second.fields[name].array()[[order[t] for t in texts]]
        gold = np.asarray(part.fields[name].gold)
        point = cascade_curve(rows, later, gold, 0.0, 0.0, thresholds=(escalation.below[name],))[0]
        assert escalation.on_train[name]["n"] == len(texts) < len(train)
        assert escalation.on_train[name]["escalated"] == pytest.approx(point.escalated) and point.escalated <= 0.4
        assert escalation.on_train[name]["accuracy"] == pytest.approx(point.accuracy)
        candidates = cascade_curve(rows, later, gold, 0.0, 0.0, thresholds=tuple(np.unique(rows.max(axis=1))))
        assert point.accuracy == max(p.accuracy for p in candidates if p.escalated <= 0.4)
    err = capsys.readouterr().err
    assert "escalate to second below" in err and "escalation to second" in err


def test_eval_reports_the_fitted_point_on_held_out_examples_and_draws_the_curve(files, tmp_path, capsys):
    _, argv = files
    cal, report, plot = tmp_path / "cal.json", tmp_path / "r.json", tmp_path / "curve.png"
    calibrate = ["calibrate", *argv, "--train-limit", "48", "--limit", "24", "--out", str(cal)]
    assert main([*calibrate, "--cascade", "second", "--escalate-accuracy", "0.5"]) == 0
    command = ["eval", *argv, "--calibration", str(cal), "--cascade", "second", "--cascade-plot", str(plot)]
    assert main([*command, "--json", str(report)]) == 0
    fields = json.loads(report.read_text())["cascade"]["fields"]
    below = Calibration.load(cal).escalation.below
    for name, entry in fields.items():
        fitted = entry["fitted"]
        assert fitted["threshold"] == below[name] and 0 <= fitted["escalated"] <= 1
        assert fitted["on_train"]["n"] > 0
        # a threshold between two grid points escalates between their shares
        grid = {p["threshold"]: p["escalated"] for p in entry["curve"]}
        lower = max(t for t in grid if t <= fitted["threshold"])
        assert grid[lower] <= fitted["escalated"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fitted" in capsys.readouterr().err


def test_the_flags_are_checked_before_any_model_loads(files, tmp_path, capsys):
    _, argv = files
    out = ["--out", str(tmp_path / "c.json")]
    assert main(["calibrate", *argv, *out, "--escalate-share", "0.3"]) == 2
    assert main(["calibrate", *argv, *out, "--cascade", "second"]) == 2
    assert main(["calibrate", *argv, *out, "--cascade", "second", "--escalate-share", "1.5"]) == 2
    both = ["--escalate-share", "0.3", "--escalate-accuracy", "0.8"]
    assert main(["calibrate", *argv, *out, "--cascade", "second", *both]) == 2
    assert main(["eval", *argv, "--cascade-plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("needs --cascade MODEL") == 2 and "not both" in err and "give --escalate-accuracy" in err


def test_then_applies_the_fitted_thresholds_of_the_engine_each_stage_looks_at(tmp_path):
    first = Calibration.from_dict(
        {
            "version": 5,
            "fields": {"size": {"labels": ["small", "large"], "temperature": 1.0, "bias": [0.0, 0.0]}},
            "escalation": {"next_model": "big", "below": {"size": 0.8, "colour": 1.01}, "max_escalated": 0.5},
        }
    )
    path = tmp_path / "first.json"
    first.save(path)
    flags = {"escalate_abstained": True, "escalate_below": None, "escalate_mass": None, "escalate_set": False}
    args = argparse.Namespace(**flags)
    fitted = cascading.rule(args, str(path))
    assert fitted.for_field("size").probability_below == 0.8 and fitted.for_field("size").abstained
    assert fitted.for_field("colour").probability_below == 1.0  # every example: applied as 1
    assert fitted.for_field("other").probability_below is None  # no threshold fitted: the flags' rule
    assert cascading.rule(args) == EscalationRule()
    # --escalate-below is the user's word over the file's
    explicit = cascading.rule(argparse.Namespace(**{**flags, "escalate_below": 0.3}), str(path))
    assert explicit == EscalationRule(probability_below=0.3)


ROOT = Path(__file__).resolve().parents[1]
POLARITY = ROOT / "docs" / "eval" / "cascade" / "smollm2-135m-then-qwen2.5-coder-1.5b.polarity.json"


def _curve_row(label: str, point: dict, second_seconds: float, alone: float) -> str:
    cells = [
        label,
        f"{point['escalated']:.4f}",
        f"{point['accuracy']:.4f}",
        f"{100 * point['accuracy'] / alone:.2f}%",
        f"{point['seconds_per_example']:.2f} s",
        f"{point['seconds_per_example'] / second_seconds:.2f}x",
    ]
    return "| " + " | ".join(cells) + " |"


def test_the_polarity_table_is_the_recorded_run():
    """Every row of docs/cascades.md's polarity table is a point of the recorded ``pcd eval --cascade``
    run, as that run measured it; the fitted row is the calibration file's threshold."""
    text = (ROOT / "docs" / "cascades.md").read_text()
    entry = json.loads(POLARITY.read_text())["cascade"]["fields"]["sentiment"]
    points = {p["threshold"]: p for p in entry["curve"]}
    alone, second = points[1.01]["accuracy"], entry["second_seconds"]
    calibration = Calibration.load(POLARITY.parent / "smollm2-135m.polarity.calibration.json")
    assert entry["fitted"]["threshold"] == calibration.escalation.below["sentiment"]
    rows = [
        _curve_row("never", points[0.0], second, alone),
        _curve_row(f"{entry['fitted']['threshold']:.3f} (fitted)", entry["fitted"], second, alone),
        *(_curve_row(f"{t:.2f}", points[t], second, alone) for t in (0.6, 0.65, 0.7, 0.75, 0.85)),
        _curve_row("always", points[1.01], second, alone),
    ]
    for row in rows:
        assert row in text, row
    # the operating point the page names meets the three bounds
    chosen = points[0.7]
    assert chosen["accuracy"] >= 0.98 * alone and chosen["escalated"] <= 0.5
    assert chosen["seconds_per_example"] <= 0.6 * second


TWENTY_NG = ROOT / "docs" / "eval" / "cascade" / "smollm2-135m-then-qwen2.5-coder-1.5b.20ng-5.json"


def test_the_20ng_table_is_the_recorded_run():
    """docs/cascades.md's 20ng-5 rows are points of the recorded run, under its command; the page's
    claim holds in the record: the first engine alone beats the second, so escalating nothing meets
    the three bounds and every escalation costs accuracy."""
    text = (ROOT / "docs" / "cascades.md").read_text()
    report = json.loads(TWENTY_NG.read_text())
    assert report["meta"]["command"].split(" --answers")[0] in " ".join(text.replace("\\\n", " ").split())
    entry = report["cascade"]["fields"]["topic"]
    points = {p["threshold"]: p for p in entry["curve"]}
    alone, second = points[1.01]["accuracy"], entry["second_seconds"]
    labels = {0.0: "never", 0.5: "0.50", 0.7: "0.70", 0.9: "0.90", 1.01: "always"}
    for threshold, label in labels.items():
        row = _curve_row(label, points[threshold], second, alone)
        assert row in text, row
    never = points[0.0]
    assert never["escalated"] == 0.0 and never["accuracy"] >= 0.98 * alone
    assert never["seconds_per_example"] <= 0.6 * second
    accuracies = [points[t]["accuracy"] for t in sorted(points)]
    assert accuracies[0] == max(accuracies)
