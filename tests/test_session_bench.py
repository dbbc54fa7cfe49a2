"""``pcd bench --session``: the bundled conversation, the file checks, and the docs' table is the run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pcd_core.bench.report import write_table
from pcd_core.bench.sessions import load_conversation
from pcd_core.errors import PcdError
from pcd_core.request.schema import parse_schema

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "support_conversation.json"
QUESTIONS = ROOT / "examples" / "support_questions.json"


def test_the_bundled_conversation_has_forty_turns_and_a_support_leads_questions():
    schema, turns = load_conversation(EXAMPLE)
    assert len(turns) >= 40 and {role for role, _ in turns} == {"customer", "agent"}
    keys = set(parse_schema(schema).keys)
    assert keys == {"escalate", "refund", "churn_risk", "mood", "topic", "summary"}


def test_a_bad_conversation_file_is_refused_before_any_load(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": {}, "turns": [{"role": "two words", "text": "hi"}]}))
    with pytest.raises(PcdError, match="role"):
        load_conversation(bad)
    with pytest.raises(PcdError, match="'schema' and 'turns'"):
        load_conversation(tmp_path / "missing.json")


#: the recorded runs docs/sessions.md shows, each under its command
RUNS = (
    "session_torch.json",
    "session_torch_again.json",
    "session_torch_quiet.json",
    "session_torch_merged.json",
    "session_torch_threads.json",
    "session_llamacpp.json",
    "session_torch_ahead.json",
    "session_torch_ahead_threads.json",
    "session_llamacpp_ahead.json",
    "session_torch_questions.json",
)


@pytest.mark.parametrize("name", RUNS)
def test_the_sessions_page_table_is_the_recorded_run(name):
    path = ROOT / "docs" / "bench" / name
    if not path.exists():
        pytest.skip(f"{name} was not recorded")
    page = (ROOT / "docs" / "sessions.md").read_text()
    assert f"--json docs/bench/{name}" in page
    rendered = io.StringIO()
    write_table(json.loads(path.read_text())["records"], rendered)
    rows = [line for line in rendered.getvalue().splitlines() if line.startswith(("| torch", "| llamacpp"))]
    assert rows and all(row in page for row in rows), rows


def test_bench_session_counts_each_appends_tokens_and_matches_the_re_read(engine, tmp_path, monkeypatch, capsys):
    from pcd_core.engine import Engine
    from pcd_integrations.commands.main import main

    schema, turns = load_conversation(EXAMPLE)
    short = tmp_path / "short.json"
    closed = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k != "summary"}}
    closed["required"] = list(closed["properties"])
    short.write_text(json.dumps({"schema": closed, "turns": [{"role": r, "text": t} for r, t in turns[:3]]}))
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    out = tmp_path / "session.json"
    assert main(["bench", "--session", str(short), "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["mode"] == "session" and record["turns"] == 3 and record["same_values"]
    assert record["max_probability_gap"] < 1e-5
    for turn in record["per_turn"]:
        # the pass counter's tokens: the turn, its rows, and the closing line, tail and answer lines
        assert turn["append_tokens"] > turn["turn_tokens"] + turn["append_row_tokens"]
        if turn["turn"] > 1:
            assert turn["append_tokens"] < turn["reread_tokens"]
    assert "| torch | float32 | 3 |" in capsys.readouterr().out


def test_session_runs_alone_and_its_file_is_checked_before_a_model_loads(tmp_path, capsys):
    from pcd_integrations.commands.main import main

    assert main(["bench", "--session", str(EXAMPLE), "--widths", "1,2"]) == 2
    assert main(["bench", "--session", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.count("--session") == 2


def test_bench_session_asks_a_question_set_and_its_rows_carry_the_questions(engine, tmp_path, monkeypatch):
    """``--session-questions``: the same turns asked as ``decide`` questions; each append's rows carry
    every question's text after the conversation, where the schema's rows are its short keys.
    """
    from pcd_core.engine import Engine
    from pcd_integrations.commands.main import main

    schema, turns = load_conversation(EXAMPLE)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"schema": schema, "turns": [{"role": r, "text": t} for r, t in turns[:2]]}))
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    records = {}
    for asks, extra in (("schema", []), ("questions", ["--session-questions", str(QUESTIONS)])):
        out = tmp_path / f"{asks}.json"
        assert main(["bench", "--session", str(short), *extra, "--json", str(out)]) == 0
        (records[asks],) = json.loads(out.read_text())["records"]
        assert records[asks]["asks"] == asks and records[asks]["same_values"], asks
        assert records[asks]["max_probability_gap"] < 1e-5
    assert records["questions"]["median_row_tokens"] > 3 * records["schema"]["median_row_tokens"]


def test_session_questions_are_checked_before_any_load(tmp_path, capsys):
    from pcd_integrations.commands.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"questions": {"q": {"type": "choice", "criteria": {"a": None}}}}))
    assert main(["bench", "--session", str(EXAMPLE), "--session-questions", str(bad)]) != 0
    assert main(["bench", "--session-questions", str(QUESTIONS)]) != 0
    assert "--session-questions" in capsys.readouterr().err


#: the two layouts docs/sessions.md compares on labelled sets, by the key in each record's file name
LAYOUTS = {"questions": "questions after the text (`decide`)", "head": "the question in the head (`fill`)"}


@pytest.mark.parametrize("name", ["polarity", "20ng-5"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_layout_table_is_the_recorded_eval(name, layout):
    path = ROOT / "docs" / "eval" / "layout" / f"smollm2-135m.{name}.{layout}.json"
    if not path.exists():
        pytest.skip(f"{path.name} was not recorded")
    record = json.loads(path.read_text())
    raw, debiased = record["overall"]["raw"], record["overall"]["debiased"]
    row = (
        f"| {name} | {int(raw['n'])} | {LAYOUTS[layout]} | {raw['accuracy']:.3f} | {raw['ece']:.3f} "
        f"| {debiased['accuracy']:.3f} | {debiased['ece']:.3f} | {record['tokens_read']:,} |"
    )
    page = (ROOT / "docs" / "sessions.md").read_text()
    assert row in page
    assert record["meta"]["command"].removeprefix("pcd ") in page
