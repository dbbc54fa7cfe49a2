"""``pcd eval`` and ``pcd calibrate``: arguments, data selection, the printed table, JSON and plot.

Arguments, the data file and the schema are checked before the model loads. ``pcd calibrate`` reads
the train split, fits per field (by default the cross-validated choice of pcd_core/calibration_choice.py;
``--debias`` / ``--bias`` / ``--no-top-label`` a fixed fit), adds the ``--abstain-risk`` and
``--coverage`` thresholds (pcd_core/evaluation/decisions.py), saves the file, then reports on the test
split with it applied, so one command gives raw, debiased and calibrated numbers on held-out data
(with ``--head probe`` also a trained head per field, with its own thresholds, and its learning curve,
pcd_core/evaluation/probing.py),
ending with the held-out ECE beside its yardstick; beside them it reports the fixed fits it did not
save, from the same train answers (debiased or not, with per-label biases or not).
Both commands say on stderr how many examples each split gave, of how many it has.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from pcd_core.calibration import BIAS_SD, Calibration
from pcd_core.errors import PcdError
from pcd_core.evaluation import datasets
from pcd_core.evaluation.cache import AnswerCache
from pcd_core.evaluation.decisions import choose_calibration, decision_report, too_few, with_decisions, write_risk_plot
from pcd_core.evaluation.metrics import reliability
from pcd_core.evaluation.probing import CURVE_SIZES, fit_heads, learning_curve, write_curve_plot
from pcd_core.evaluation.runner import (
    Answers,
    build_report,
    fit_calibration,
    read_answers,
    read_question_answers,
    variants,
)
from pcd_core.limits import MAX_ORDER_SAMPLES
from pcd_core.schema import parse_schema

from . import common

COLUMNS = (
    "n",
    "accuracy",
    "macro_f1",
    "nll",
    "brier",
    "ece",
    "ece_if_calibrated",
    "auroc_probability",
    "auroc_candidate_mass",
    "pcd_accuracy_same_examples",
)


def _add_data_options(parser: argparse.ArgumentParser, split: str) -> None:
    parser.add_argument(
        "--data",
        required=True,
        help=f"a bundled set ({', '.join(datasets.NAMES)}; built on first use) or a JSONL file of "
        '{"text", "labels": {field: value}}',
    )
    parser.add_argument("--schema", help="JSON Schema or case file (needed with a JSONL --data)")
    parser.add_argument(
        "--questions",
        metavar="FILE",
        help="instead of --schema: a question file as pcd decide takes; a JSONL --data's labels are then "
        "keyed by question id, and the answers are read as /v1/systemone reads them",
    )
    parser.add_argument("--split", default=split, choices=("train", "test"))
    parser.add_argument(
        "--order-samples",
        type=int,
        default=1,
        metavar="K",
        help="with --questions: read each choice and score in K rotations of its options, in the same pass, "
        "and average them (default 1)",
    )
    parser.add_argument(
        "--batch-size",
        type=common.positive,
        default=32,
        metavar="N",
        help="examples read together, one forward pass per wave for all of them (Engine.fill_many / "
        "decide_many); the answers are those of one at a time (default 32; 1 reads them one by one)",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffles the examples and splits sets without one")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a reliability diagram")
    parser.add_argument(
        "--constrained-limit",
        type=int,
        default=None,
        metavar="N",
        help="run the AR-constrained baseline on the first N examples only (default all; 0 skips it)",
    )
    parser.add_argument(
        "--answers",
        metavar="JSONL",
        help="keep the model's raw answers in this file, one line per example read; an example already in it "
        "(same model, schema or questions, and text) is not read again, so a refit or a larger limit reads "
        "only new examples. Delete it when the model or pcd-engine changes",
    )
    common.add_model_options(parser)


def add_trust_options(parser: argparse.ArgumentParser, what: str = "the answers") -> None:
    """``--debias`` and ``--calibration`` for commands that answer (``pcd fill``, ``pcd serve``)."""
    parser.add_argument(
        "--debias",
        action="store_true",
        help=f"divide out the model's content-free label prior from {what} (contextual calibration)",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help=f"a calibration file written by pcd calibrate, applied to {what} it was fitted on",
    )


def add_eval_parsers(subparsers: Any) -> None:
    """Register ``eval`` and ``calibrate`` on the ``pcd`` subparsers."""
    evaluate = subparsers.add_parser("eval", help="measure accuracy and calibration on labelled data")
    _add_data_options(evaluate, "test")
    evaluate.add_argument("--limit", type=int, default=500, help="examples to read (default 500)")
    evaluate.add_argument("--calibration", metavar="FILE", help="also report with this calibration applied")
    evaluate.add_argument("--risk-plot", metavar="PNG", help="write the risk-coverage curve")
    evaluate.add_argument("--fetch", action="store_true", help="only build the bundled --data set and exit")
    evaluate.set_defaults(run=run_eval)

    calibrate = subparsers.add_parser(
        "calibrate", help="fit a temperature (and with --bias, per-label biases) per field on a train split"
    )
    _add_data_options(calibrate, "train")
    calibrate.add_argument("--out", required=True, metavar="FILE", help="where the calibration JSON goes")
    calibrate.add_argument("--train-limit", type=int, default=300, help="train examples to fit on (default 300)")
    calibrate.add_argument("--limit", type=int, default=500, help="held-out test examples to report on")
    calibrate.add_argument(
        "--debias",
        action="store_true",
        help="fit on debiased probabilities (with --bias or alone: a fixed fit instead of the default, "
        "which chooses per field by cross-validation on the train split)",
    )
    calibrate.add_argument(
        "--bias",
        action="store_true",
        help="also fit a bias per label, jointly with the temperature (a fixed fit, as --debias)",
    )
    calibrate.add_argument(
        "--abstain-risk",
        type=float,
        metavar="R",
        help="per field, fit the probability below which an answer is abstained from, so that the answered "
        "train examples' error stays at or below R (a Clopper-Pearson bound at 90%% confidence)",
    )
    calibrate.add_argument(
        "--coverage",
        type=float,
        metavar="C",
        help="per field, fit split-conformal answer sets that hold the right label at rate C",
    )
    calibrate.add_argument(
        "--bias-sd",
        type=float,
        default=BIAS_SD,
        metavar="NATS",
        help=f"the biases' Gaussian prior, its standard deviation (default {BIAS_SD}); smaller shrinks them more",
    )
    calibrate.add_argument(
        "--no-top-label",
        dest="top_label",
        action="store_false",
        help="leave out the step that scales the fit so the confidence matches how often the top label is right "
        "(a fixed fit, as --debias)",
    )
    calibrate.add_argument("--risk-plot", metavar="PNG", help="write the held-out risk-coverage curve")
    calibrate.add_argument(
        "--head",
        choices=("probe",),
        help="also fit a trained head per field (a linear probe on the hidden state at the field's first "
        "decision point, read in the same pass) and save it in the file: a field with a head is then "
        "answered by it (needs scikit-learn: pip install 'pcd-engine[heads]'); with --abstain-risk and "
        "--coverage the head gets its own thresholds, fitted on its out-of-fold train probabilities; "
        "--answers keeps the states",
    )
    calibrate.add_argument(
        "--curve",
        metavar="PNG",
        help=f"with --head: plot held-out accuracy of heads fitted on {', '.join(map(str, CURVE_SIZES))} train "
        "examples (the learning curve, also in the --json report)",
    )
    calibrate.set_defaults(run=run_calibrate)


def _load_data(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """The schema (or, with ``--questions``, the questions) and the labelled records, all checked."""
    if args.order_samples != 1 and args.questions is None:
        # a fill's options sit in the cached head: rotating them is K heads, not K rows (docs/trust.md)
        raise PcdError("--order-samples needs --questions: a schema's options are read in the one order it gives")
    if not 1 <= args.order_samples <= MAX_ORDER_SAMPLES:
        raise PcdError(f"--order-samples {args.order_samples} must be 1 to {MAX_ORDER_SAMPLES}")
    if args.questions is not None:
        if args.schema or args.data in datasets.NAMES:
            raise PcdError("--questions takes a JSONL --data whose labels are keyed by question id, and no --schema")
        questions = common.read_questions(args.questions)["questions"]
        common.check_questions(args.questions, "", questions)
        return questions, datasets.read_jsonl(args.data)
    if args.data in datasets.NAMES:
        folder = datasets.fetch(args.data)
        schema_path = args.schema or str(folder / "schema.json")
        records = datasets.read_jsonl(folder / "data.jsonl")
    else:
        if not args.schema:
            raise PcdError("a JSONL --data needs --schema")
        schema_path, records = args.schema, datasets.read_jsonl(args.data)
    schema, _ = common.read_schema(schema_path)
    parse_schema(schema)
    return schema, records


def _selected(args: argparse.Namespace, records: list[dict[str, Any]], split: str, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` examples of ``split``; says on stderr how many that is of how many there are,
    since a limit over the split's size silently reads the whole split.
    """
    if limit < 1:
        raise PcdError(f"--limit {limit} must be at least 1")
    available = datasets.select(records, split, args.seed, None)
    if not available:
        raise PcdError(f"no {split} examples in {args.data}")
    chosen = available[:limit]
    print(f"{split}: {len(chosen)} of the {len(available)} examples of the split (seed {args.seed})", file=sys.stderr)
    return chosen


def _read(
    args: argparse.Namespace,
    engine: Any,
    source: Any,
    records: list[dict[str, Any]],
    constrained: int | None,
    cache: AnswerCache | None,
    hidden: bool = False,
) -> Answers:
    """Fill (a schema) or decide (``--questions``) every record raw; AR-constrained only for schemas.
    ``hidden`` keeps each field's hidden state for heads (schemas only: ``_load_data`` checks).
    """
    if args.questions is not None:
        answers = read_question_answers(
            engine, source, records, cache=cache, order_samples=args.order_samples, batch_size=args.batch_size
        )
    else:
        answers = read_answers(
            engine,
            source,
            records,
            constrained=constrained,
            cache=cache,
            hidden=hidden,
            batch_size=args.batch_size,
        )
    if cache is not None:
        read = len(records) - answers.reused
        print(f"{answers.reused} of {len(records)} answers were in {cache.path}; {read} read now", file=sys.stderr)
    return answers


def _meta(args: argparse.Namespace, engine: Any, split: str, n: int) -> dict[str, Any]:
    meta = {
        "model": engine.model_name,
        "data": args.data,
        "split": split,
        "seed": args.seed,
        "n": n,
        "order_samples": args.order_samples,
        "command": "pcd " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.system()}",
    }
    if args.data.startswith("20ng"):
        meta["words_per_document"] = datasets.NEWSGROUPS_WORDS
    return meta


def _finish(args: argparse.Namespace, report: dict[str, Any], answers: Any, calibration: Calibration | None) -> None:
    if calibration is not None and (calibration.abstain_risk is not None or calibration.coverage is not None):
        report["decisions"] = decision_report(answers, calibration)
    write_table(report, sys.stdout)
    if "decisions" in report:
        write_decisions(report["decisions"], sys.stdout)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    title = f"{report['meta']['model']} on {args.data}"
    if args.plot:
        write_plot(answers, calibration, args.plot, title)
    if args.risk_plot:
        write_risk_plot(answers, calibration, args.risk_plot, title)


def write_decisions(decisions: dict[str, Any], out: TextIO) -> None:
    """The held-out abstention and answer-set table: a row per field and pooled."""
    columns = ("n", "abstain_below", "coverage", "risk", "set_threshold", "set_coverage", "mean_set_size")
    out.write(
        f"\ndecisions (target risk {decisions['target_risk']}, target coverage {decisions['target_coverage']})\n"
        f"| field | {' | '.join(columns)} |\n|{'---|' * (len(columns) + 1)}\n"
    )
    rows = [*decisions["fields"].items(), ("pooled", decisions["overall"])]
    if "head" in decisions:  # the trained heads' own thresholds: what a field with a head answers by
        heads = decisions["head"]
        rows += [(f"{name} (head)", entry) for name, entry in heads["fields"].items()]
        rows.append(("pooled (head)", heads["overall"]))
    for title, entry in rows:
        out.write(f"| {title} | {' | '.join(_cell(entry.get(c)) for c in columns)} |\n")


def run_eval(args: argparse.Namespace) -> int:
    if args.fetch:
        if args.data not in datasets.NAMES:
            raise PcdError(f"--fetch builds a bundled set: {', '.join(datasets.NAMES)}")
        print(datasets.fetch(args.data))
        return 0
    calibration = Calibration.load(args.calibration) if args.calibration else None
    schema, records = _load_data(args)
    chosen = _selected(args, records, args.split, args.limit)
    cache = AnswerCache(args.answers) if args.answers else None
    heads = calibration is not None and bool(calibration.heads)
    if heads and args.questions is not None:
        raise PcdError("heads are fitted and measured on schema fields; --questions has none")
    engine = common.load_engine(args)
    answers = _read(args, engine, schema, chosen, args.constrained_limit, cache, hidden=heads)
    report = {"meta": _meta(args, engine, args.split, len(chosen)), **build_report(answers, calibration)}
    _finish(args, report, answers, calibration)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    if not args.bias_sd > 0:
        raise PcdError(f"--bias-sd {args.bias_sd} must be > 0")
    for flag, value in (("--abstain-risk", args.abstain_risk), ("--coverage", args.coverage)):
        if value is not None and not 0 < value < 1:
            raise PcdError(f"{flag} {value} must lie strictly between 0 and 1")
    if args.head is not None and args.questions is not None:
        raise PcdError("--head fits heads on schema fields; it does not take --questions")
    if args.curve is not None and args.head is None:
        raise PcdError("--curve plots the heads' learning curve: it needs --head probe")
    schema, records = _load_data(args)
    train = _selected(args, records, "train", args.train_limit)
    test = _selected(args, records, "test", args.limit)
    cache = AnswerCache(args.answers) if args.answers else None
    engine = common.load_engine(args)
    fitted_on = {"data": args.data, "split": "train", "seed": args.seed, "n": len(train), "top_label": args.top_label}
    hidden = args.head is not None
    train_answers = _read(args, engine, schema, train, 0, cache, hidden)

    def fitted(debias: bool, bias: bool) -> Calibration:
        return fit_calibration(
            train_answers,
            debias=debias,
            bias=bias,
            bias_sd=args.bias_sd,
            top_label=args.top_label,
            model=engine.model_name,
            fitted_on=fitted_on,
        )

    fixed = args.debias or args.bias or not args.top_label
    if fixed:
        calibration = fitted(args.debias, args.bias)
    else:
        calibration = choose_calibration(train_answers, engine.model_name, fitted_on, args.seed)
    calibration = with_decisions(calibration, train_answers, args.abstain_risk, args.coverage)
    if hidden:
        heads = fit_heads(train_answers, engine.model_name, args.seed, args.abstain_risk, args.coverage)
        calibration = replace(calibration, heads=heads)
    calibration.save(args.out)
    for name, found in calibration.fields.items():
        biases = f", biases {', '.join(f'{b:+.2f}' for b in found.bias)}" if any(found.bias) else ""
        how = found.fit or ("debiased" if calibration.debias else "raw")
        print(
            f"{name}: {how}: temperature {found.temperature:.3f}{biases} (fitted on {len(train)} examples)",
            file=sys.stderr,
        )
    warning = too_few(len(train), args.abstain_risk)
    if warning:
        print(warning, file=sys.stderr)
    answers = _read(args, engine, schema, test, args.constrained_limit, cache, hidden)
    report = {"meta": _meta(args, engine, "test", len(test)), **build_report(answers, calibration)}
    report["meta"]["calibration"] = {**calibration.to_dict(), "heads": _head_summary(calibration)}
    if hidden:
        report["learning_curve"] = learning_curve(
            train_answers, answers, engine.model_name, seed=args.seed, fitted=calibration.heads
        )
        if args.curve:
            title = f"{engine.model_name} on {args.data}: trained head"
            write_curve_plot(report["learning_curve"], answers, calibration, args.curve, title)
    # the other choices, fitted on the same train answers and reported on the same held-out ones:
    # whether debiasing first helps calibration, and whether the per-label biases do
    debias, bias = args.debias, args.bias
    others = {
        "calibrated_debiased" if not debias else "calibrated_raw": fitted(not debias, bias),
        "calibrated_temperature_only" if bias else "calibrated_with_bias": fitted(debias, not bias),
    }
    for variant, other in others.items():
        report["overall"][variant] = build_report(answers, other)["overall"]["calibrated"]
    report["meta"]["train_seconds"] = round(train_answers.seconds, 1)
    report["meta"]["train_reused_answers"] = train_answers.reused
    if warning:
        report["meta"]["warning"] = warning
    _finish(args, report, answers, calibration)
    print(held_out_summary(report["overall"]), file=sys.stderr)
    return 0


def _head_summary(calibration: Calibration) -> dict[str, Any]:
    """What the report keeps of each head: not its weights (the calibration file has them)."""
    return {
        name: {"model": h.model, "n_train": h.n_train, "strength": h.strength, "width": h.width}
        for name, h in calibration.heads.items()
    }


def held_out_summary(overall: dict[str, Any]) -> str:
    """One line: the saved calibration's held-out ECE beside the ECE its confidences would show by
    chance alone if they were exact (``metrics.ece_if_calibrated``, the yardstick), and the accuracy
    beside the raw and debiased readings'.
    """
    calibrated, raw, debiased = overall["calibrated"], overall["raw"], overall["debiased"]
    head = overall.get("head")
    with_head = f"; head: accuracy {head['accuracy']:.3f}, ECE {head['ece']:.3f}" if head else ""
    return (
        f"held-out (n {calibrated['n']:.0f}): ECE {calibrated['ece']:.3f} (yardstick: "
        f"{calibrated['ece_if_calibrated']:.3f} if every confidence were exact), accuracy {calibrated['accuracy']:.3f} "
        f"(raw {raw['accuracy']:.3f}, debiased {debiased['accuracy']:.3f}){with_head}"
    )


#: the report's rows, in the printed order: ``pcd calibrate`` adds the fits it did not save as
#: ``calibrated_*``, each fitted on the same train answers
VARIANTS = (
    "raw",
    "debiased",
    "calibrated",
    "calibrated_raw",
    "calibrated_debiased",
    "calibrated_temperature_only",
    "calibrated_with_bias",
    "head",
    "constrained_ar",
)


def write_table(report: dict[str, Any], out: TextIO) -> None:
    """One Markdown table per field and overall: a row per variant, a column per metric."""
    sections = [("overall", report["overall"])] + list(report["fields"].items())
    for title, entry in sections:
        out.write(f"\n{title}\n| variant | {' | '.join(COLUMNS)} |\n|{'---|' * (len(COLUMNS) + 1)}\n")
        for variant in VARIANTS:
            if variant in entry:
                values = entry[variant]
                cells = [_cell(values.get(c)) for c in COLUMNS]
                out.write(f"| {variant} | {' | '.join(cells)} |\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and value > 1:
        return str(int(value))
    return f"{value:.3f}"


def write_plot(answers: Any, calibration: Calibration | None, path: str, title: str) -> None:
    """Accuracy against confidence per bin, one line per variant, pooled over fields, with the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(figsize=(5, 5))
    axes.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    pooled: dict[str, list[Any]] = {}
    for name, out in answers.fields.items():
        for variant, rows in variants(answers, name, calibration).items():
            pooled.setdefault(variant, []).append((rows, out.gold))
    for variant, parts in pooled.items():
        width = max(rows.shape[1] for rows, _ in parts)
        rows = np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r, _ in parts])
        gold = np.concatenate([g for _, g in parts])
        bins = [b for b in reliability(rows, gold) if b["count"]]
        axes.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label=variant)
    axes.set(xlabel="confidence (top probability)", ylabel="accuracy", title=title, xlim=(0, 1), ylim=(0, 1))
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


#: the decision-quality table head of docs/quality.md; ``quality_row`` renders its rows
QUALITY_HEAD = (
    "| model | data | n held-out / train | accuracy raw | debiased | calibrated | AR-constrained (n; PCD on those) "
    "| ECE raw | ECE T | ECE T + bias | ECE T + bias, raw | ECE if calibrated | Brier raw | Brier calibrated "
    "| AUROC of candidate mass |\n|" + "---|" * 15
)


def quality_row(report: dict[str, Any]) -> str:
    """The decision-quality row (docs/quality.md) of one ``pcd calibrate --debias --bias --json`` report
    (tests/test_eval.py checks that every row there is one of docs/eval/*.json). The fitted columns:
    temperature alone on the debiased answers, temperature and per-label bias on the debiased answers
    (the saved file), and the same on the raw answers (what ``--bias`` without ``--debias`` saves);
    then the ECE the saved fit's confidences would show if they were exactly right
    (``metrics.ece_if_calibrated``), the yardstick for the three before it.
    """
    meta, overall = report["meta"], report["overall"]
    raw, debiased = overall["raw"], overall["debiased"]
    calibrated, nan = overall.get("calibrated", {}), math.nan
    temperature_only, on_raw = overall.get("calibrated_temperature_only", {}), overall.get("calibrated_raw", {})
    ar = overall.get("constrained_ar")
    ar_cell = f"{ar['accuracy']:.3f} ({ar['n']:.0f}; {ar['pcd_accuracy_same_examples']:.3f})" if ar else "–"
    trained = meta.get("calibration", {}).get("fitted_on", {}).get("n", "–")
    return (
        f"| {meta['model']} | {meta['data']} | {meta['n']} / {trained} | {raw['accuracy']:.3f} "
        f"| {debiased['accuracy']:.3f} | {calibrated.get('accuracy', nan):.3f} | {ar_cell} | {raw['ece']:.3f} "
        f"| {temperature_only.get('ece', nan):.3f} | {calibrated.get('ece', nan):.3f} | {on_raw.get('ece', nan):.3f} "
        f"| {calibrated.get('ece_if_calibrated', nan):.3f} | {raw['brier']:.3f} | {calibrated.get('brier', nan):.3f} | {raw['auroc_candidate_mass']:.3f} |"
    )


#: the trained-heads table head of docs/heads.md; ``head_row`` renders its rows
HEADS_HEAD = (
    "| model | data | n held-out / train | accuracy raw | debiased | calibrated | head | ECE calibrated | ECE head "
    "| head accuracy at n train |\n|" + "---|" * 10
)


def head_row(report: dict[str, Any]) -> str:
    """The trained-heads row (docs/heads.md) of one ``pcd calibrate --head probe --json`` report
    (tests/test_eval.py checks that every row there is one of docs/eval/heads/*.json): held-out accuracy
    of each variant, the ECE of the zero-shot calibration and of the head, and the learning curve.
    """
    meta, overall = report["meta"], report["overall"]
    curve = ", ".join(
        f"{point['n_train']}: {point['accuracy']:.3f}" if "accuracy" in point else f"{point['n_train']}: –"
        for point in report.get("learning_curve", [])
    )
    trained = meta.get("calibration", {}).get("fitted_on", {}).get("n", "–")
    calibrated, head, nan = overall.get("calibrated", {}), overall.get("head", {}), math.nan
    return (
        f"| {meta['model']} | {meta['data']} | {meta['n']} / {trained} | {overall['raw']['accuracy']:.3f} "
        f"| {overall['debiased']['accuracy']:.3f} | {calibrated.get('accuracy', nan):.3f} "
        f"| {head.get('accuracy', nan):.3f} | {calibrated.get('ece', nan):.3f} | {head.get('ece', nan):.3f} | {curve} |"
    )


#: the trained heads' abstention and answer-set table head of docs/trust.md; ``head_trust_row`` renders its rows
HEAD_TRUST_HEAD = (
    "| model | data | n train / held-out | target risk | head accuracy | threshold | coverage | risk "
    "| set coverage (target) | mean set size |\n|" + "---|" * 10
)


def head_trust_row(report: dict[str, Any]) -> str:
    """The row of docs/trust.md's heads table (tests/test_trust_docs.py checks each against its run) of
    one ``pcd calibrate --head probe --abstain-risk R --coverage C --json`` report: the heads' held-out
    accuracy, the threshold (``never`` where no threshold held the target on the train split), and the
    pooled held-out coverage, risk, set coverage and mean set size of the heads' own thresholds.
    """
    meta, decisions = report["meta"], report["decisions"]
    heads, held_out = decisions["head"]["fields"], decisions["head"]["overall"]
    thresholds = [entry["abstain_below"] for entry in heads.values()]
    shown = ", ".join("never" if t > 1 else f"{t:.3f}" for t in thresholds)
    risk = "–" if held_out.get("risk") is None else f"{held_out['risk']:.3f}"
    trained = meta.get("calibration", {}).get("fitted_on", {}).get("n", "–")
    return (
        f"| {meta['model']} | {meta['data']} | {trained} / {meta['n']} | {decisions['target_risk']:.2f} "
        f"| {report['overall']['head']['accuracy']:.3f} | {shown} | {held_out['coverage']:.3f} | {risk} "
        f"| {held_out['set_coverage']:.3f} ({decisions['target_coverage']}) | {held_out['mean_set_size']:.2f} |"
    )
