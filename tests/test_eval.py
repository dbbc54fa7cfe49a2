"""``pcd eval`` / ``pcd calibrate``: the report agrees with the engine's own answers, calibration never
worsens the NLL it was fitted on, splits are disjoint, and the CLI writes JSON and a plot.
"""

import json

import numpy as np
import pytest

from pcd_core.evaluation import datasets
from pcd_core.evaluation.cache import AnswerCache
from pcd_core.evaluation.runner import build_report, fit_calibration, read_answers, read_question_answers, variants
from pcd_core.testing import oracle_engine
from pcd_core.trust.calibration import Calibration
from pcd_core.trust.calibration_fitting import fit
from pcd_core.trust.selective import NEVER
from pcd_integrations.commands.main import main

SCHEMA = {"colour": ["red", "green", "blue"], "size": ["small", "large"]}
RECORDS = [
    {"text": f"item {i}: a {size} {colour} thing", "labels": {"colour": colour, "size": size}}
    for i, (colour, size) in enumerate(
        [
            ("red", "small"),
            ("green", "large"),
            ("blue", "small"),
            ("red", "large"),
            ("blue", "large"),
            ("green", "small"),
        ]
    )
]


@pytest.fixture(scope="module")
def oracle_answers():
    engine = oracle_engine(window=6)  # a window that reaches into the input, so answers vary by example
    return engine, read_answers(engine, SCHEMA, RECORDS, progress=False)


def test_the_reported_accuracy_is_the_share_of_fills_that_match_gold(oracle_answers):
    engine, answers = oracle_answers
    report = build_report(answers)
    for name in SCHEMA:
        right = [engine.fill(SCHEMA, r["text"]).values[name] == r["labels"][name] for r in RECORDS]
        assert report["fields"][name]["raw"]["accuracy"] == pytest.approx(np.mean(right))
    pooled = [report["fields"][n]["raw"]["accuracy"] for n in SCHEMA]
    assert report["overall"]["raw"]["accuracy"] == pytest.approx(np.mean(pooled))  # equal counts per field


def test_the_constrained_baseline_is_reported_beside_pcd_on_the_same_examples(oracle_answers):
    _, answers = oracle_answers
    ar = build_report(answers)["overall"]["constrained_ar"]
    assert ar["n"] == 2 * len(RECORDS)
    assert 0.0 <= ar["accuracy"] <= 1.0


def test_a_fitted_calibration_never_raises_the_nll_it_was_fitted_on(oracle_answers):
    _, answers = oracle_answers
    calibration = fit_calibration(answers, debias=False, bias=False, model="oracle", fitted_on={})
    report = build_report(answers, calibration)
    for name in SCHEMA:
        entry = report["fields"][name]
        assert entry["calibrated"]["nll"] <= entry["raw"]["nll"] + 1e-9
        # a temperature never changes which label wins
        assert entry["calibrated"]["accuracy"] == entry["raw"]["accuracy"]


def test_splits_are_disjoint_seeded_and_keep_a_records_own_split():
    records = [{"text": str(i), "labels": {}} for i in range(10)] + [{"text": "x", "labels": {}, "split": "test"}]
    train = datasets.select(records, "train", 0, None)
    test = datasets.select(records, "test", 0, None)
    assert {r["text"] for r in train}.isdisjoint(r["text"] for r in test)
    assert len(train) + len(test) == 11 and any(r["text"] == "x" for r in test)
    assert datasets.select(records, "test", 0, 3) == test[:3]
    assert datasets.select(records, "test", 1, None) != test


def test_a_gold_value_outside_the_schema_fails_before_the_model_reads(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hi", "labels": {"colour": "purple"}}) + "\n")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    engine = oracle_engine()
    with pytest.raises(Exception, match="purple"):
        read_answers(engine, SCHEMA, datasets.read_jsonl(data), progress=False)
    assert main(["eval", "--data", str(data)]) == 2
    assert "needs --schema" in capsys.readouterr().err


def test_the_eval_command_writes_a_report_and_a_reliability_plot(engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data = tmp_path / "reviews.jsonl"
    texts = [("a wonderful, moving film", "positive"), ("dull and far too long", "negative")] * 2
    data.write_text("".join(json.dumps({"text": t, "labels": {"sentiment": s}}) + "\n" for t, s in texts))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(datasets.SCHEMAS["polarity"]))
    report_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["eval", "--data", str(data), "--schema", str(schema), "--json", str(report_path), "--plot", str(plot_path)]
    assert main([*argv, "--split", "test", "--limit", "2"]) == 0
    report = json.loads(report_path.read_text())
    assert report["meta"]["n"] == 2 and report["meta"]["model"] == "smollm2-135m"
    assert set(report["fields"]["sentiment"]) >= {"raw", "debiased", "constrained_ar", "prior"}
    assert plot_path.read_bytes()[:4] == b"\x89PNG"
    assert "| raw |" in capsys.readouterr().out


def test_calibrate_with_bias_saves_a_fixed_fit_and_reports_the_fits_it_did_not_save(tmp_path, monkeypatch, capsys):
    engine = oracle_engine(window=6)
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data, schema = tmp_path / "d.jsonl", tmp_path / "s.json"
    data.write_text("".join(json.dumps({**r, "split": split}) + "\n" for r in RECORDS for split in ("train", "test")))
    schema.write_text(json.dumps(SCHEMA))
    out, report_path = tmp_path / "cal.json", tmp_path / "r.json"
    argv = ["calibrate", "--data", str(data), "--schema", str(schema), "--out", str(out), "--json", str(report_path)]
    assert (
        main([*argv, "--bias", "--bias-sd", "0.5", "--train-limit", "4", "--limit", "500", "--constrained-limit", "0"])
        == 0
    )
    saved = json.loads(out.read_text())
    assert saved["version"] == 5 and saved["heads"] == {} and saved["escalation"] is None and saved["bias_sd"] == 0.5
    assert all(spec["fit"] == "" and spec["debias"] is None for spec in saved["fields"].values())
    assert all(sum(spec["bias"]) == pytest.approx(0.0, abs=1e-6) for spec in saved["fields"].values())
    report = json.loads(report_path.read_text())
    assert report["meta"]["n"] == len(RECORDS)  # --limit 500 reads the whole test split, and says how many
    assert {"calibrated", "calibrated_debiased", "calibrated_temperature_only"} <= set(report["overall"])
    err = capsys.readouterr().err
    assert "train: 4 of the 6 examples" in err and f"test: {len(RECORDS)} of the {len(RECORDS)} examples" in err


def test_calibrate_by_default_chooses_per_field_and_fits_thresholds_that_eval_then_reports(
    tmp_path, monkeypatch, capsys
):
    engine = oracle_engine(window=6)
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data, schema = tmp_path / "d.jsonl", tmp_path / "s.json"
    data.write_text("".join(json.dumps({**r, "split": split}) + "\n" for r in RECORDS for split in ("train", "test")))
    schema.write_text(json.dumps(SCHEMA))
    out, report_path, risk_plot = tmp_path / "cal.json", tmp_path / "r.json", tmp_path / "risk.png"
    argv = ["calibrate", "--data", str(data), "--schema", str(schema), "--out", str(out), "--json", str(report_path)]
    trust = ["--abstain-risk", "0.2", "--abstain-confidence", "0.9", "--coverage", "0.8", "--risk-plot", str(risk_plot)]
    trust += ["--constrained-limit", "0"]
    assert main([*argv, *trust]) == 0
    calibration = Calibration.load(out)
    assert calibration.abstain_risk == 0.2 and calibration.coverage == 0.8
    assert calibration.abstain_confidence == 0.9
    assert calibration.fitted_on["choice"] == "cross-validated"
    for name, found in calibration.fields.items():
        assert found.fit == calibration.fitted_on["chosen"][name]["fit"]
        # six train examples are too few to promise 0.2 (the scan starts at 18 answered): always abstain
        assert found.abstain_below == NEVER
        assert found.set_threshold is not None
    report = json.loads(report_path.read_text())
    pooled = report["decisions"]["overall"]
    assert pooled["coverage"] == 0.0 and pooled["n"] == 2 * len(RECORDS)
    assert 0 < pooled["set_coverage"] <= 1 and pooled["mean_set_size"] >= 1
    assert risk_plot.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert "cannot promise risk 0.2" in captured.err and "yardstick" in captured.err
    # the split and the labels each part used are said, and the calibration keeps them
    assert "train split: 3 examples fit the calibration, the other 3 the thresholds" in captured.err
    assert "thresholds fitted on the other 3 labels" in captured.err
    assert (calibration.fitted_on["n_fit"], calibration.fitted_on["n_thresholds"]) == (3, 3)
    assert "| pooled |" in captured.out
    # pcd eval with the file reports the same held-out decisions
    eval_path = tmp_path / "e.json"
    argv = ["eval", "--data", str(data), "--schema", str(schema), "--calibration", str(out), "--json", str(eval_path)]
    assert main([*argv, "--constrained-limit", "0"]) == 0
    assert json.loads(eval_path.read_text())["decisions"] == report["decisions"]
    assert "calibration: 3 train examples fit it, 3 others its thresholds" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--abstain-risk", "--coverage"])
def test_a_target_outside_zero_one_fails_before_the_model_loads(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        "pcd_integrations.commands.common.load_engine", lambda args: pytest.fail("the model was loaded")
    )
    argv = ["calibrate", "--data", "polarity", "--out", str(tmp_path / "c.json"), flag, "1.5"]
    assert main(argv) != 0
    assert "strictly between 0 and 1" in capsys.readouterr().err


QUESTIONS = {
    "red": {"type": "noul", "instructions": "Is it red?"},
    "size": {"type": "choice", "instructions": "How big is it?", "criteria": {"small": None, "large": "big"}},
}
QUESTION_RECORDS = [
    {"text": r["text"], "labels": {"red": r["labels"]["colour"] == "red", "size": r["labels"]["size"]}} for r in RECORDS
]


def test_a_calibration_fitted_on_question_answers_is_what_decide_then_serves(tmp_path, monkeypatch):
    """pcd calibrate --questions fits on engine.decide's own answers, keyed by question id, so the
    probabilities /v1/systemone serves with the file are the calibrated ones the report scored.
    """
    engine = oracle_engine(window=6)
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data, questions, out = tmp_path / "q.jsonl", tmp_path / "q.json", tmp_path / "cal.json"
    data.write_text("".join(json.dumps({**r, "split": s}) + "\n" for r in QUESTION_RECORDS for s in ("train", "test")))
    questions.write_text(json.dumps({"questions": QUESTIONS}))
    argv = ["calibrate", "--data", str(data), "--questions", str(questions), "--out", str(out), "--debias", "--bias"]
    assert main(argv) == 0
    calibration = Calibration.load(out)
    assert {name: f.labels for name, f in calibration.fields.items()} == {
        "red": ("true", "false"),
        "size": ("small", "large"),
    }
    expected = variants(read_question_answers(engine, QUESTIONS, QUESTION_RECORDS, progress=False), "size", calibration)
    engine.planner.calibration = calibration
    for row, record in zip(expected["calibrated"], QUESTION_RECORDS):
        served = engine.decide(record["text"], QUESTIONS).answers["size"]
        assert served.calibrated and served.debiased
        assert list(served.probabilities.values()) == pytest.approx(list(row), abs=1e-9)


def test_eval_reads_questions_in_k_rotations_and_keeps_them_apart_from_one_order(tmp_path, monkeypatch):
    engine = oracle_engine(window=400)  # sees the option list, so a rotation reads differently
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data, questions, answers = tmp_path / "d.jsonl", tmp_path / "q.json", tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({**r, "split": "test"}) + "\n" for r in QUESTION_RECORDS))
    questions.write_text(json.dumps({"questions": QUESTIONS}))
    reports = {}
    for k in (1, 2):
        path = tmp_path / f"r{k}.json"
        argv = ["eval", "--data", str(data), "--questions", str(questions), "--answers", str(answers)]
        assert main([*argv, "--order-samples", str(k), "--json", str(path)]) == 0
        reports[k] = json.loads(path.read_text())
    assert reports[2]["meta"]["order_samples"] == 2 and reports[2]["reused_answers"] == 0  # not the K = 1 answers
    expected = read_question_answers(engine, QUESTIONS, QUESTION_RECORDS, progress=False, order_samples=2)
    assert reports[2]["fields"]["size"]["raw"]["nll"] == pytest.approx(
        build_report(expected)["fields"]["size"]["raw"]["nll"]
    )
    assert reports[2]["fields"]["size"]["raw"]["nll"] != pytest.approx(reports[1]["fields"]["size"]["raw"]["nll"])
    # the rotations are rows of the same passes: K = 2 costs K = 1's passes, over more row tokens
    assert reports[2]["forward_passes"] == reports[1]["forward_passes"] > 0
    assert reports[2]["tokens_read"] > reports[1]["tokens_read"]
    again = tmp_path / "again.json"
    assert main([*argv, "--order-samples", "2", "--json", str(again)]) == 0
    assert json.loads(again.read_text())["forward_passes"] == 0  # every answer came from the file


def test_order_samples_without_questions_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        "pcd_integrations.commands.common.load_engine", lambda args: pytest.fail("the model was loaded")
    )
    assert main(["eval", "--data", "polarity", "--order-samples", "3"]) != 0
    assert "--order-samples needs --questions" in capsys.readouterr().err


def test_questions_take_a_jsonl_file_and_no_schema(tmp_path, capsys):
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": QUESTIONS}))
    assert main(["eval", "--data", "polarity", "--questions", str(questions)]) == 2
    assert "--questions takes a JSONL --data" in capsys.readouterr().err
    questions.write_text(json.dumps({"questions": {"q": {"type": "choice", "instructions": "x", "criteria": {}}}}))
    assert main(["eval", "--data", str(tmp_path / "any.jsonl"), "--questions", str(questions)]) == 2
    assert "question file" in capsys.readouterr().err


def _page_and_reports(page: str, folder: str, skipped: tuple[str, ...]) -> tuple[str, list[dict]]:
    """A docs page's text and the JSON reports recorded in a docs folder (those ending in ``skipped`` left out)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    paths = sorted((root / folder).glob("*.json"))
    reports = [json.loads(p.read_text()) for p in paths if not p.name.endswith(skipped)]
    assert reports
    return (root / page).read_text(), reports


def test_the_readme_quality_table_is_the_recorded_runs():
    """Every docs/eval report is a row of the README's decision-quality table, as quality_row renders it."""
    from pcd_integrations.commands.eval_output import QUALITY_HEAD, quality_row

    readme, reports = _page_and_reports("docs/quality.md", "docs/eval", (".calibration.json", ".ticket.json"))
    assert QUALITY_HEAD in readme
    for report in reports:
        assert quality_row(report) in readme, quality_row(report)


def test_the_heads_table_is_the_recorded_runs():
    """Every docs/eval/heads report is a row of docs/heads.md's table, as head_row renders it."""
    from pcd_integrations.commands.eval_output import HEADS_HEAD, head_row

    page, reports = _page_and_reports("docs/heads.md", "docs/eval/heads", (".calibration.json",))
    assert HEADS_HEAD in page
    for report in reports:
        assert head_row(report) in page, head_row(report)
        assert report["meta"]["command"].startswith("pcd calibrate") and "--head probe" in report["meta"]["command"]


class _Unreadable:
    """An engine whose model must not be asked: every answer has to come from the answers file."""

    def __init__(self, engine):
        self._engine = engine
        self.model_name = engine.model_name

    def __getattr__(self, name):
        if name in ("fill", "decide", "fill_many", "decide_many"):
            raise AssertionError(f"engine.{name} was called for an answer the file holds")
        return getattr(self._engine, name)


def test_an_answers_file_gives_the_report_fresh_answers_give_without_asking_the_model(tmp_path):
    engine = oracle_engine(window=6)
    path = tmp_path / "answers.jsonl"
    fresh = read_answers(engine, SCHEMA, RECORDS, progress=False, cache=AnswerCache(path))
    assert len(path.read_text().splitlines()) == len(RECORDS)
    cached = read_answers(_Unreadable(engine), SCHEMA, RECORDS, progress=False, cache=AnswerCache(path))
    assert build_report(cached)["fields"] == build_report(fresh)["fields"]
    assert (fresh.reused, cached.reused) == (0, len(RECORDS))
    assert cached.fields["colour"].constrained_ar == fresh.fields["colour"].constrained_ar
    # another schema is another key: those answers are read, not mixed in
    other = {"colour": ["red", "green", "blue", "black"], "size": ["small", "large"]}
    read_answers(engine, other, RECORDS[:2], progress=False, cache=AnswerCache(path))
    assert len(path.read_text().splitlines()) == len(RECORDS) + 2


def test_an_answer_kept_without_the_baseline_is_read_again_when_the_baseline_is_wanted(tmp_path):
    engine = oracle_engine(window=6)
    path = tmp_path / "answers.jsonl"
    without = read_answers(engine, SCHEMA, RECORDS, constrained=0, progress=False, cache=AnswerCache(path))
    assert without.fields["size"].constrained_ar == []
    again = read_answers(engine, SCHEMA, RECORDS, constrained=2, progress=False, cache=AnswerCache(path))
    assert len(again.fields["size"].constrained_ar) == 2
    assert len(path.read_text().splitlines()) == len(RECORDS) + 2  # the two now read with it, appended
    reread = read_answers(_Unreadable(engine), SCHEMA, RECORDS, constrained=2, progress=False, cache=AnswerCache(path))
    assert reread.fields["size"].constrained_ar == again.fields["size"].constrained_ar


def test_question_answers_are_kept_too(tmp_path):
    engine = oracle_engine(window=6)
    path = tmp_path / "answers.jsonl"
    fresh = read_question_answers(engine, QUESTIONS, QUESTION_RECORDS, progress=False, cache=AnswerCache(path))
    cached = read_question_answers(
        _Unreadable(engine), QUESTIONS, QUESTION_RECORDS, progress=False, cache=AnswerCache(path)
    )
    assert build_report(cached)["fields"] == build_report(fresh)["fields"]


def test_a_malformed_answers_file_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def no_model(args):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", no_model)
    data, schema, answers = tmp_path / "d.jsonl", tmp_path / "s.json", tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({**r, "split": "test"}) + "\n" for r in RECORDS))
    schema.write_text(json.dumps(SCHEMA))
    argv = ["eval", "--data", str(data), "--schema", str(schema), "--answers", str(answers)]
    keyless = {"version": 1, "probabilities": {}, "candidate_mass": {}, "constrained_ar": None}
    for line in ({"version": 1, "key": "k"}, keyless):
        answers.write_text(json.dumps(line) + "\n")
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{answers}:1 is not a line of a pcd answers file" in err and "delete the file" in err


def test_calibrate_with_an_answers_file_reads_each_example_once_and_reports_the_same(tmp_path, monkeypatch, capsys):
    engine = oracle_engine(window=6)
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engine)
    data, schema, answers = tmp_path / "d.jsonl", tmp_path / "s.json", tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({**r, "split": split}) + "\n" for r in RECORDS for split in ("train", "test")))
    schema.write_text(json.dumps(SCHEMA))
    reports = []
    for run in range(2):
        out, report_path = tmp_path / f"cal{run}.json", tmp_path / f"r{run}.json"
        argv = ["calibrate", "--data", str(data), "--schema", str(schema), "--answers", str(answers)]
        assert main([*argv, "--out", str(out), "--json", str(report_path), "--train-limit", "4"]) == 0
        reports.append(json.loads(report_path.read_text()))
    err = capsys.readouterr().err
    assert "0 of 4 answers were in" in err and "4 of 4 answers were in" in err and "6 of 6 answers were in" in err
    assert reports[0]["overall"] == reports[1]["overall"] and reports[1]["reused_answers"] == len(RECORDS)
    assert reports[1]["meta"]["train_reused_answers"] == 4
    # the fitting's own time is reported beside the reading's (a head's fit can take minutes)
    assert all(isinstance(report["meta"]["fit_seconds"], float) for report in reports)
    assert err.count("fitted in ") == 2
    # the fit without the top-label step, from the same answers: the NLL fit's temperature, as saved
    out = tmp_path / "plain.json"
    argv = ["calibrate", "--data", str(data), "--schema", str(schema), "--answers", str(answers), "--out", str(out)]
    assert main([*argv, "--train-limit", "4", "--no-top-label"]) == 0
    plain = Calibration.load(out)
    train = datasets.select(datasets.read_jsonl(data), "train", 0, None)[:4]
    rows = read_answers(engine, SCHEMA, train, constrained=0, progress=False).fields["colour"]
    expected, _ = fit(np.log(rows.array()), rows.gold, top_label=False)
    assert plain.fitted_on["top_label"] is False and plain.fields["colour"].temperature == pytest.approx(expected)
    assert expected != pytest.approx(fit(np.log(rows.array()), rows.gold)[0])  # the step did move this one


def test_batched_reading_gives_the_answers_of_one_at_a_time_on_the_real_model(engine):
    """``--batch-size``: the same report, probabilities to 1e-5 (torch fp32), fills and decides."""
    one = read_answers(engine, SCHEMA, RECORDS, constrained=0, progress=False)
    four = read_answers(engine, SCHEMA, RECORDS, constrained=0, progress=False, batch_size=4)
    for name in SCHEMA:
        assert four.fields[name].gold == one.fields[name].gold
        assert np.abs(four.fields[name].array() - one.fields[name].array()).max() <= 1e-5
    assert build_report(four)["fields"].keys() == build_report(one)["fields"].keys()
    asked = read_question_answers(engine, QUESTIONS, QUESTION_RECORDS, progress=False)
    batched = read_question_answers(engine, QUESTIONS, QUESTION_RECORDS, progress=False, batch_size=3)
    for qid in QUESTIONS:
        assert np.abs(batched.fields[qid].array() - asked.fields[qid].array()).max() <= 1e-5


def test_an_example_refused_for_its_input_is_named_and_left_out_and_the_rest_read_as_without_it(engine):
    """One empty or over-long text no longer stops a run: its batch is read again one by one, the
    refused example is named in the report, and every other answer is the one a run without it gives.
    """
    empty, too_long = "   ", "word " * 9000  # SmolLM2's context is 8,192 tokens
    mixed = RECORDS[:2] + [{"text": empty, "labels": RECORDS[0]["labels"]}] + RECORDS[2:4]
    mixed.append({"text": too_long, "labels": RECORDS[1]["labels"]})
    fills = read_answers(engine, SCHEMA, mixed, constrained=0, progress=False, batch_size=3)
    alone = read_answers(engine, SCHEMA, RECORDS[:4], constrained=0, progress=False, batch_size=3)
    labels = {q["text"]: q["labels"] for q in QUESTION_RECORDS}
    mixed_questions = [{"text": r["text"], "labels": labels.get(r["text"], {"red": True})} for r in mixed]
    asked = read_question_answers(engine, QUESTIONS, mixed_questions, progress=False, batch_size=3)
    asked_alone = read_question_answers(engine, QUESTIONS, QUESTION_RECORDS[:4], progress=False, batch_size=3)
    for read, clean in ((fills, alone), (asked, asked_alone)):
        assert [(r["example"], r["text"][:5]) for r in read.refused] == [(2, empty), (5, "word ")]
        assert "empty" in read.refused[0]["error"] and read.refused[1]["error"]
        for name, out in read.fields.items():
            assert out.gold == clean.fields[name].gold
            assert np.abs(out.array() - clean.fields[name].array()).max() <= 1e-5
        report = build_report(read)
        assert report["refused"] == read.refused
        assert all(entry["raw"]["n"] == 4 for entry in report["fields"].values())


def test_eval_cascade_reports_the_curve_from_the_first_engine_to_the_second(tmp_path, monkeypatch, capsys):
    engines = {"first": oracle_engine(window=6), "second": oracle_engine(window=4)}
    monkeypatch.setattr("pcd_integrations.commands.common.load_engine", lambda args: engines[args.model])
    data, schema, out = tmp_path / "d.jsonl", tmp_path / "s.json", tmp_path / "r.json"
    data.write_text("".join(json.dumps({**r, "split": "test"}) + "\n" for r in RECORDS))
    schema.write_text(json.dumps(SCHEMA))
    argv = ["eval", "--data", str(data), "--schema", str(schema), "--model", "first", "--cascade", "second"]
    assert main([*argv, "--constrained-limit", "0", "--json", str(out)]) == 0
    cascade = json.loads(out.read_text())["cascade"]
    assert cascade["model"] == "second" and set(cascade["fields"]) == set(SCHEMA)
    second = read_answers(engines["second"], SCHEMA, RECORDS, progress=False, constrained=0)
    for name, field in cascade["fields"].items():
        never, always = field["curve"][0], field["curve"][-1]
        assert never["escalated"] == 0 and always["escalated"] == 1
        right = second.fields[name].array().argmax(axis=1) == np.asarray(second.fields[name].gold)
        assert always["accuracy"] == pytest.approx(right.mean())
    assert "cascade to second" in capsys.readouterr().err
