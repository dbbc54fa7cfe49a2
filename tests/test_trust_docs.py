"""Every figure of docs/trust.md is the recorded run under docs/eval/trust/ it names."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "eval" / "trust"
PAGE = (ROOT / "docs" / "trust.md").read_text()
#: the page with its line breaks as spaces, so that reflowing the prose does not move a figure
PROSE = " ".join(PAGE.split())


def _load(name):
    return json.loads((RUNS / name).read_text())


def test_the_default_fit_table_is_the_recorded_run():
    overall = _load("smollm2-135m.polarity.default-100.json")["overall"]
    for variant, label in (("raw", "raw"), ("debiased", "debiased"), ("calibrated", "default (chose `debiased`)")):
        v = overall[variant]
        assert f"| {label} | {v['accuracy']:.3f} | {v['ece']:.3f} | {v['ece_if_calibrated']:.3f} |" in PAGE
    chosen = _load("smollm2-135m.polarity.default-100.calibration.json")["fitted_on"]["chosen"]["sentiment"]
    assert chosen["fit"] == "debiased"
    assert f"raw {chosen['cv_nll']['raw']:.3f}, debiased {chosen['cv_nll']['debiased']:.3f}" in PAGE


def test_the_answer_set_and_abstention_figures_are_the_recorded_runs():
    for risk in ("0.05", "0.10"):
        decisions = _load(f"smollm2-135m.polarity.risk-{risk}.json")["decisions"]["overall"]
        assert decisions["coverage"] == 0.0 and decisions["risk"] is None  # always abstains, as the page says
        assert f"held-out coverage **{decisions['set_coverage']:.3f}**" in PAGE
        assert f"mean set size **{decisions['mean_set_size']:.2f}**" in PROSE


def test_the_order_samples_table_is_the_recorded_run():
    runs = _load("smollm2-135m.ticket.order-samples.json")["runs"]
    for run in runs:
        row = f"| K = {run['order_samples']} | {run['right']} | {run['forward_passes']} | {run['n_rows']} |"
        assert row in PAGE
    assert runs[0]["forward_passes"] == runs[1]["forward_passes"]


def test_the_heads_trust_table_is_the_recorded_runs():
    """Every recorded run whose trained heads carry thresholds is a row of the heads' table, as
    head_trust_row renders it from the run's JSON.
    """
    from pcd_integrations.commands.eval_output import HEAD_TRUST_HEAD, head_trust_row

    assert HEAD_TRUST_HEAD in PAGE
    reports = [
        json.loads(path.read_text())
        for folder in (RUNS, ROOT / "docs" / "eval" / "heads")
        for path in sorted(folder.glob("*.json"))
        if not path.name.endswith(".calibration.json")
    ]
    headed = [report for report in reports if "head" in report.get("decisions", {})]
    assert len(headed) >= 3  # polarity at risk 0.05 and 0.10, and 20ng-5
    for report in headed:
        assert head_trust_row(report) in PAGE, head_trust_row(report)
        assert "--head probe" in report["meta"]["command"] and "--abstain-risk" in report["meta"]["command"]


def test_the_labelled_order_samples_table_is_the_recorded_runs():
    """Every K = 1 / K = 3 run on labelled data (docs/eval/order/) is a row of the page's table, and
    K = 3 read its examples in the passes K = 1 did.
    """
    from pcd_integrations.commands.eval_output import ORDER_HEAD, order_row

    assert ORDER_HEAD in PAGE
    runs = {
        path.name: json.loads(path.read_text()) for path in sorted((ROOT / "docs" / "eval" / "order").glob("*.json"))
    }
    reports = {name: run for name, run in runs.items() if "meta" in run}  # not the question files
    assert len(reports) >= 4
    for name, report in reports.items():
        assert order_row(report) in PAGE, order_row(report)
        assert report["meta"]["command"].startswith("pcd eval") and "--questions" in report["meta"]["command"]
        if name.endswith(".k3.json"):
            alone = reports[name.replace(".k3.json", ".k1.json")]
            assert (
                report["meta"]["n"] == alone["meta"]["n"] and report["reused_answers"] == alone["reused_answers"] == 0
            )
            assert report["forward_passes"] == alone["forward_passes"] > 0
            assert report["tokens_read"] > alone["tokens_read"]
