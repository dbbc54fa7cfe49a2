"""The ``pcd`` command line: arguments are checked before a model loads; fill prints JSON."""

import json
from pathlib import Path

import pytest

from pcd_core.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_models_lists_the_embedded_aliases(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m (default)" in out and "gemma3-270m" in out


def test_a_missing_schema_file_fails_fast(capsys):
    assert main(["fill", "--schema", "nope.json", "--input", "x.txt"]) == 2
    assert "cannot read schema" in capsys.readouterr().err


def test_an_open_schema_fails_before_loading_a_model(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"properties": {"note": {"type": "string"}}}))
    assert main(["fill", "--schema", str(schema), "--input", str(schema)]) == 2
    assert "free-text" in capsys.readouterr().err


def test_serve_rejects_a_bad_port_before_loading(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "not a TCP port" in capsys.readouterr().err


def test_fill_prints_the_object_and_its_probabilities(engine, capsys, monkeypatch):
    monkeypatch.setattr("pcd_core.cli._load_engine", lambda args: engine)
    code = main(["fill", "--schema", str(EXAMPLES / "ticket_schema.json"), "--input", str(EXAMPLES / "ticket.txt")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["value"]) == {"sentiment", "topic", "wants_refund", "is_spam", "deadline", "plan", "route_to"}
    assert out["fields"]["topic"]["value"] == out["value"]["topic"]
    assert out["model"] == "smollm2-135m"
    assert isinstance(out["value"]["wants_refund"], bool)


@pytest.mark.parametrize(
    "argv", [["fill"], ["unknown-command"], ["fill", "--schema", "s.json", "--max-tokens-per-pass", "0"]]
)
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
