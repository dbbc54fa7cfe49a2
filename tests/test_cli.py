"""The ``pcd`` command line on the real model: its tables and JSON say what the engine decided; its
mistakes are one line on stderr and exit status 2, found before a model loads."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pcd_core.result import LOW_MASS
from pcd_integrations.commands.main import main
from pcd_integrations.commands.output import render_value

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCHEMA = EXAMPLES / "ticket_schema.json"
TICKET = EXAMPLES / "ticket.txt"
QUESTIONS = ROOT / "pcd_core" / "benchdata" / "refund_request_questions.json"
COST = re.compile(r"^cost: (\d+) forward passes, (\d+) input tokens \((\d+) from the head cache\), (\d+) ms$")


@pytest.fixture
def use_engine(engine, monkeypatch):
    """The session's engine stands in for the load, so that each command costs no model load."""
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    return engine


def table_rows(out: str, first_column: str) -> dict[str, list[str]]:
    """The table's rows by their first cell; columns are two or more spaces apart, a blank line ends it."""
    lines = out.splitlines()
    assert lines[0].startswith(first_column) and set(lines[1]) <= {"-", " "}
    rows = {}
    for line in lines[2 : lines.index("")]:
        cells = re.split(r" {2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def cost(out: str) -> tuple[int, int]:
    match = COST.match(out.splitlines()[-1])
    assert match, out.splitlines()[-1]
    return int(match[1]), int(match[2])


def load_questions() -> dict:
    return json.loads(QUESTIONS.read_text())


def test_models_lists_the_embedded_aliases(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m (default)" in out and "gemma3-270m" in out


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"pcd {version}"


def test_fill_table_shows_the_engines_decisions(use_engine, capsys):
    assert main(["fill", "--schema", str(SCHEMA), "--input", str(TICKET)]) == 0
    out = capsys.readouterr().out
    expected = use_engine.fill(json.loads(SCHEMA.read_text()), TICKET.read_text())
    rows = table_rows(out, "field")
    assert list(rows) == list(expected.fields)
    for name, field in expected.fields.items():
        value, probability, mass, *mark = rows[name]
        assert value == render_value(field.value)
        assert float(probability) == pytest.approx(field.probability, abs=5e-5)
        assert float(mass) == pytest.approx(field.candidate_mass, abs=5e-5)
        assert mark == (["!"] if field.candidate_mass < LOW_MASS else [])
    for warning in expected.warnings:
        assert f"  - {warning}" in out
    passes, input_tokens = cost(out)
    assert passes >= 1 and input_tokens == expected.stats.input_tokens


def test_fill_table_shows_generated_fields_beside_decided_ones(use_engine, capsys, tmp_path):
    """A schema with an open field once crashed the printer (a generated field has no probability)."""
    schema = {"properties": {"name": {"type": "string", "maxLength": 20}, "urgent": {"type": "boolean"}}}
    text = "Hi, I'm Alice Martin and our server is down. Please help now!"
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "input.txt").write_text(text)
    assert main(["fill", "--schema", str(tmp_path / "schema.json"), "--input", str(tmp_path / "input.txt")]) == 0
    out = capsys.readouterr().out
    expected = use_engine.fill(schema, text)
    rows = table_rows(out, "field")
    assert list(rows) == ["name", "urgent"]
    name = expected.fields["name"]
    assert rows["name"] == [name.text, f"{name.mean_probability:.4f}", "-", str(name.n_tokens)]
    urgent = expected.fields["urgent"]
    value, probability, mass, tokens, *mark = rows["urgent"]
    assert (value, tokens) == (render_value(urgent.value), "-")
    assert float(probability) == pytest.approx(urgent.probability, abs=5e-5)
    assert float(mass) == pytest.approx(urgent.candidate_mass, abs=5e-5)
    assert f"({name.n_forced} of them forced by the grammar)" in out
    assert cost(out)[1] == expected.stats.input_tokens


def test_fill_json_is_the_extraction_record(use_engine, capsys):
    assert main(["fill", "--schema", str(SCHEMA), "--input", str(TICKET), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = use_engine.fill(json.loads(SCHEMA.read_text()), TICKET.read_text()).to_dict()
    assert out["model"] == "smollm2-135m"
    assert out["value"] == expected["value"]
    assert {name: f["probability"] for name, f in out["fields"].items()} == pytest.approx(
        {name: f["probability"] for name, f in expected["fields"].items()}, abs=1e-6
    )
    assert isinstance(out["value"]["wants_refund"], bool)


def test_fill_jsonl_answers_each_line_in_order(use_engine, capsys, tmp_path):
    texts = [
        TICKET.read_text(),
        "Please cancel my subscription, I was charged twice this month.",
        "WIN A FREE CRUISE!!! click here",
    ]
    lines = [json.dumps({"id": "a", "text": texts[0]}), "", json.dumps({"text": texts[1]}), json.dumps(texts[2])]
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    assert main(["fill", "--schema", str(SCHEMA), "--jsonl", str(inputs)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["line"] for r in records] == [1, 3, 4]
    assert [r.get("id") for r in records] == ["a", None, None]
    schema = json.loads(SCHEMA.read_text())
    for record, text in zip(records, texts, strict=True):
        expected = use_engine.fill(schema, text)
        assert record["value"] == expected.values
        # --jsonl reads its lines together (fill_many): each is its solo fill to 1e-5 (tests/test_batching.py)
        assert {n: f["probability"] for n, f in record["fields"].items()} == pytest.approx(
            {n: f.probability for n, f in expected.fields.items()}, abs=1e-5
        )


def test_decide_table_shows_the_engines_answers(use_engine, capsys):
    assert main(["decide", str(QUESTIONS)]) == 0
    out = capsys.readouterr().out
    case = load_questions()
    expected = use_engine.decide(case["state"], case["questions"])
    rows = table_rows(out, "question")
    assert list(rows) == list(case["questions"])
    for qid, answer in expected.answers.items():
        kind, shown, confidence, mass, *mark = rows[qid]
        assert kind == answer.type
        assert float(mass) == pytest.approx(answer.candidate_mass, abs=5e-5)
        assert mark == (["!"] if answer.candidate_mass < LOW_MASS else [])
        if answer.type == "noul":
            assert shown == f"P(yes) {answer.noul:.4f}" and confidence == "-"
        else:
            assert float(confidence) == pytest.approx(answer.confidence, abs=5e-5)
            assert shown.split()[0] == (answer.choice if answer.type == "choice" else f"{answer.score:.2f}")
    assert cost(out)[1] == expected.usage.input_tokens


def test_decide_json_with_another_state_is_the_wire_response(use_engine, capsys, tmp_path):
    state = tmp_path / "state.txt"
    state.write_text("The parcel came two weeks late but the kettle works fine. No refund needed, thanks.")
    assert main(["decide", str(QUESTIONS), "--state", str(state), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = use_engine.decide(state.read_text(), load_questions()["questions"]).to_wire()
    assert_close(out, expected)
    case = load_questions()
    file_state = use_engine.decide(case["state"], case["questions"]).usage.input_tokens
    assert out["usage"]["input_tokens"] < file_state  # the shorter state given, not the file's, was read


def assert_close(got, expected, where="response"):
    """Equal JSON, numbers to 1e-6: a warm head and a cold one sum the same logits in another order."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_close(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-6), where
    else:
        assert got == expected, where


def write(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


ERRORS = {
    "missing input file": (lambda tmp: ["fill", "--schema", str(SCHEMA), "--input", "/nonexistent"], "No such file"),
    "missing schema file": (lambda tmp: ["fill", "--schema", "nope.json", "--input", str(TICKET)], "cannot read"),
    "recursive schema": (
        lambda tmp: [
            "fill",
            "--schema",
            write(
                tmp,
                "s.json",
                '{"properties": {"n": {"$ref": "#/$defs/N"}}, "$defs": {"N": {"type": "object", '
                '"properties": {"next": {"$ref": "#/$defs/N"}}}}}',
            ),
        ],
        "recursive",
    ),
    "bad jsonl line": (
        lambda tmp: ["fill", "--schema", str(SCHEMA), "--jsonl", write(tmp, "in.jsonl", '"ok"\n{"txt": 1}\n')],
        "in.jsonl:2",
    ),
    "no questions": (lambda tmp: ["decide", write(tmp, "q.json", '{"state": "x"}')], "'questions'"),
    "one choice option": (
        lambda tmp: [
            "decide",
            write(tmp, "q.json", '{"state": "x", "questions": {"t": {"type": "choice", "criteria": {"a": null}}}}'),
        ],
        "questions.t",
    ),
    "uncached hf id": (
        lambda tmp: ["fill", "--schema", str(SCHEMA), "--input", str(TICKET), "--model", "pcd-tests/not-cached"],
        "hf download pcd-tests/not-cached",
    ),
    "bad port": (lambda tmp: ["serve", "--port", "70000"], "not a TCP port"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_a_mistake_is_one_line_and_status_2(case, tmp_path, capsys):
    argv, says = ERRORS[case]
    assert main(argv(tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("pcd: error: ")
    assert says in captured.err


def test_a_missing_file_is_one_line_in_a_real_process_too():
    command = [
        sys.executable,
        "-m",
        "pcd_integrations.commands",
        "fill",
        "--schema",
        str(SCHEMA),
        "--input",
        "/nonexistent",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith("pcd: error: ") and "/nonexistent" in line and "No such file or directory" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["fill"],
        ["unknown-command"],
        ["fill", "--schema", "s.json", "--max-tokens-per-pass", "0"],
        ["fill", "--schema", "s.json", "--input", "a.txt", "--jsonl", "b.jsonl"],
    ],
)
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2


def test_fill_in_bfloat16_loads_the_model_so_and_keeps_the_clear_decisions(engine, capsys):
    """A real load (no stand-in): ``--dtype`` reaches the torch backend, and the 16-bit model passes
    the layout self-check; the ticket's fields the float32 model decides at 0.65 or more keep their answer.
    """
    assert main(["fill", "--schema", str(SCHEMA), "--input", str(TICKET), "--dtype", "bfloat16", "--json"]) == 0
    half = json.loads(capsys.readouterr().out)
    full = engine.fill(json.loads(SCHEMA.read_text()), TICKET.read_text())
    clear = [name for name, f in full.fields.items() if f.probability >= 0.65]
    assert clear
    assert {name: half["value"][name] for name in clear} == {name: full.values[name] for name in clear}
    differ = [name for name, f in full.fields.items() if half["fields"][name]["probability"] != f.probability]
    assert differ  # the arithmetic was bfloat16's, not float32's
