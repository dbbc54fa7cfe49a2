"""``pcd watch`` on the real model: each turn's changes are the session's, as a fresh fill reads them."""

from __future__ import annotations

import io
import json

import pytest

from pcd_integrations.commands.main import main

SCHEMA = {
    "type": "object",
    "properties": {"escalate": {"type": "boolean"}, "mood": {"enum": ["ANGRY", "CALM", "HAPPY"]}},
}
LINES = [
    "customer: My parcel is two weeks late and nobody answers.",
    "",
    "agent: Sorry, let me check the tracking for you.",
    "I want a refund, now!",
]


@pytest.fixture
def use_engine(engine, monkeypatch):
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    return engine


def test_watch_jsonl_prints_each_turns_changes_from_stdin(use_engine, capsys, monkeypatch, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(LINES) + "\n"))
    assert main(["watch", "--schema", str(schema), "--jsonl", "--role", "customer"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["role"] for r in records] == ["customer", "agent", "customer"]
    before: dict = {}
    for record in records:
        assert record["values"].keys() == SCHEMA["properties"].keys()
        assert set(record["changed"]) == {k for k, v in record["values"].items() if before.get(k, object()) != v}
        before = record["values"]
        assert record["tokens_read"] > 0


def test_watch_checks_its_schema_and_input_before_loading(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"x": {"type": "string", "format": "weird"}}}))
    bad = tmp_path / "turns.json"
    bad.write_text(json.dumps({"turns": [{"role": "no role!", "text": "hi"}]}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SCHEMA))
    assert main(["watch", "--schema", str(good), "--input", str(bad)]) == 2
    assert "role" in capsys.readouterr().err
