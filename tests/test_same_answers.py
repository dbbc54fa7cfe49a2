"""``examples/same_answers.py compare``: what counts as a changed answer between two recorded runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
spec = importlib.util.spec_from_file_location("same_answers", EXAMPLES / "same_answers.py")
assert spec is not None and spec.loader is not None
same_answers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(same_answers)

READ = {
    "decide_warm": {
        "answers": {"refund": {"noul": 0.8123456, "abstained": False}},
        "stats": {"forward_passes": 1, "row_tokens": 363, "prefill_ms": 41.0},
    }
}


def _runs(tmp_path: Path, second: dict) -> tuple[Path, Path]:
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    for folder, reads in ((first_dir, READ), (second_dir, second)):
        folder.mkdir()
        (folder / "reads_torch.json").write_text(json.dumps(reads))
        line = {"key": "k1", "probabilities": {"sentiment": [0.9, 0.1]}}
        (folder / "answers_batched_torch.jsonl").write_text(json.dumps(line) + "\n")
    return first_dir, second_dir


def _changed(**stats: object) -> dict:
    read = json.loads(json.dumps(READ))
    read["decide_warm"]["stats"].update(stats)
    return read


def test_times_vary_and_new_fields_are_listed_apart(tmp_path, capsys):
    first, second = _runs(tmp_path, _changed(prefill_ms=97.5, backend="torch"))
    assert same_answers.compare(first, second) == 0
    shown = capsys.readouterr().out
    assert "0 differ" in shown and "backend: only in the second" in shown


def test_a_probability_off_by_more_than_1e_6_or_a_count_off_by_one_differs(tmp_path, capsys):
    moved = json.loads(json.dumps(READ))
    moved["decide_warm"]["answers"]["refund"]["noul"] += 2e-6
    first, second = _runs(tmp_path, moved)
    assert same_answers.compare(first, second) == 1
    assert "noul" in capsys.readouterr().out
    passes = tmp_path / "passes"
    passes.mkdir()
    assert same_answers.compare(*_runs(passes, _changed(forward_passes=2))) == 1
    assert "forward_passes: 1 against 2" in capsys.readouterr().out
    steps = tmp_path / "steps"  # a count whose name holds "_s" is a count, not seconds
    steps.mkdir()
    first, second = _runs(steps, _changed(open_steps=3))
    (first / "reads_torch.json").write_text(json.dumps(_changed(open_steps=2)))
    assert same_answers.compare(first, second) == 1
    assert "open_steps: 2 against 3" in capsys.readouterr().out


def test_rounding_below_1e_6_is_the_same_answer(tmp_path):
    moved = json.loads(json.dumps(READ))
    moved["decide_warm"]["answers"]["refund"]["noul"] += 4e-7
    assert same_answers.compare(*_runs(tmp_path, moved)) == 0
