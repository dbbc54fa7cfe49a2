"""``pcd eval`` and ``pcd calibrate``: arguments, data selection, the printed table, JSON and plot.

Arguments, the data file and the schema are checked before the model loads. ``pcd calibrate`` reads
the train split, fits per field (by default the cross-validated choice of pcd_core/trust/calibration_choice.py;
``--debias`` / ``--bias`` / ``--no-top-label`` a fixed fit), adds the ``--abstain-risk`` and
``--coverage`` thresholds (pcd_core/evaluation/decisions.py), saves the file, then reports on the test
split with it applied, so one command gives raw, debiased and calibrated numbers on held-out data
(with ``--head probe`` also a trained head per field, with its own thresholds, and its learning curve,
pcd_core/evaluation/probing.py),
ending with the held-out ECE beside its yardstick; beside them it reports the fixed fits it did not
save, from the same train answers (debiased or not, with per-label biases or not).
Both commands say on stderr how many examples each split gave, of how many it has. What they print
and draw is rendered by ``eval_output.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pcd_core import Calibration, PcdError, parse_schema
from pcd_core.evaluation import datasets
from pcd_core.evaluation.cache import AnswerCache
from pcd_core.evaluation.decisions import (
    THRESHOLD_SHARE,
    choose_calibration,
    decision_report,
    threshold_split,
    too_few,
    unsupported,
    with_decisions,
    write_risk_plot,
)
from pcd_core.evaluation.probing import CURVE_SIZES, fit_heads, learning_curve, write_curve_plot
from pcd_core.evaluation.runner import (
    Answers,
    build_report,
    fit_calibration,
    read_answers,
    read_question_answers,
)
from pcd_core.request.limits import MAX_ORDER_SAMPLES
from pcd_core.trust.calibration_fitting import BIAS_SD
from pcd_core.trust.selective import CONFIDENCE, DEFAULT_CONFIDENCE
from pcd_integrations.commands import cascade_eval, common
from pcd_integrations.commands.eval_output import held_out_summary, write_decisions, write_plot, write_table


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
    cascade_eval.add_eval_options(evaluate)
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
        help="per field, fit the probability below which an answer is abstained from, so that the error among "
        "answered examples is at most R (a Clopper-Pearson bound at --abstain-confidence, fitted on the "
        "--threshold-share of the train split the calibration is not fitted on)",
    )
    calibrate.add_argument(
        "--abstain-confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        metavar="L",
        help=f"the bound's confidence level (default {DEFAULT_CONFIDENCE}: the risk is at most R in 9 of 10 draws "
        f"of the labels); {CONFIDENCE} aims at R without promising it, and answers more",
    )
    calibrate.add_argument(
        "--threshold-share",
        type=float,
        default=THRESHOLD_SHARE,
        metavar="S",
        help=f"with --abstain-risk or --coverage: the share of the train split that fits the thresholds, the rest "
        f"fitting the calibration (default {THRESHOLD_SHARE}); thresholds fitted on the calibration's own examples "
        "answer new ones less well than they promise",
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
    cascade_eval.add_calibrate_options(calibrate)
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
    if answers.refused:
        print(f"{len(answers.refused)} of {len(records)} examples were refused and left out:", file=sys.stderr)
        for refusal in answers.refused[:5]:
            print(f"  example {refusal['example']} ({refusal['text']!r}): {refusal['error']}", file=sys.stderr)
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


def _reader(args: argparse.Namespace, source: Any, cache: AnswerCache | None) -> cascade_eval.Read:
    """How the ``--cascade`` model reads records: as the first one does, raw, without the AR baseline."""

    def read(engine: Any, records: list[dict[str, Any]]) -> Answers:
        return _read(args, engine, source, records, 0, cache)

    return read


def run_eval(args: argparse.Namespace) -> int:
    if args.fetch:
        if args.data not in datasets.NAMES:
            raise PcdError(f"--fetch builds a bundled set: {', '.join(datasets.NAMES)}")
        print(datasets.fetch(args.data))
        return 0
    cascade_eval.check_args(args)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    if calibration is not None:
        print(fitted_on_line(calibration), file=sys.stderr)
    schema, records = _load_data(args)
    chosen = _selected(args, records, args.split, args.limit)
    cache = AnswerCache(args.answers) if args.answers else None
    heads = calibration is not None and bool(calibration.heads)
    if heads and args.questions is not None:
        raise PcdError("heads are fitted and measured on schema fields; --questions has none")
    engine = common.load_engine(args)
    answers = _read(args, engine, schema, chosen, args.constrained_limit, cache, hidden=heads)
    report = {"meta": _meta(args, engine, args.split, len(chosen)), **build_report(answers, calibration)}
    if args.cascade:
        report["cascade"] = cascade_eval.report(args, chosen, answers, calibration, _reader(args, schema, cache))
    _finish(args, report, answers, calibration)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    if not args.bias_sd > 0:
        raise PcdError(f"--bias-sd {args.bias_sd} must be > 0")
    if not CONFIDENCE <= args.abstain_confidence < 1:
        raise PcdError(f"--abstain-confidence {args.abstain_confidence} must lie in [{CONFIDENCE}, 1)")
    targets = (("--abstain-risk", args.abstain_risk), ("--coverage", args.coverage))
    for flag, value in (*targets, ("--threshold-share", args.threshold_share)):
        if value is not None and not 0 < value < 1:
            raise PcdError(f"{flag} {value} must lie strictly between 0 and 1")
    if args.head is not None and args.questions is not None:
        raise PcdError("--head fits heads on schema fields; it does not take --questions")
    if args.curve is not None and args.head is None:
        raise PcdError("--curve plots the heads' learning curve: it needs --head probe")
    cascade_eval.check_args(args)
    schema, records = _load_data(args)
    train = _selected(args, records, "train", args.train_limit)
    test = _selected(args, records, "test", args.limit)
    cache = AnswerCache(args.answers) if args.answers else None
    engine = common.load_engine(args)
    fitted_on = {"data": args.data, "split": "train", "seed": args.seed, "n": len(train), "top_label": args.top_label}
    hidden = args.head is not None
    train_answers = _read(args, engine, schema, train, 0, cache, hidden)
    decisions = args.abstain_risk is not None or args.coverage is not None
    # an escalation threshold is a threshold too: fitted on the part the calibration did not see
    thresholds = decisions or args.cascade is not None
    # the calibration is fitted on one part of the train split and the thresholds on the other, so
    # that the thresholds see answers as new to the calibration as held-out ones (pcd_core/trust/selective.py)
    parted = threshold_split(train_answers, args.threshold_share) if thresholds else None
    fit_answers = parted.fit if parted is not None else train_answers
    if parted is not None:
        n_fit, n_thresholds = parted.sizes()
        fitted_on = {**fitted_on, "n_fit": n_fit, "n_thresholds": n_thresholds}
        print(
            f"train split: {n_fit} examples fit the calibration, the other {n_thresholds} the thresholds "
            f"(--threshold-share {args.threshold_share}: risk {args.abstain_risk} at confidence "
            f"{args.abstain_confidence}, coverage {args.coverage}, escalation to {args.cascade})",
            file=sys.stderr,
        )

    def fitted(debias: bool, bias: bool) -> Calibration:
        return fit_calibration(
            fit_answers,
            debias=debias,
            bias=bias,
            bias_sd=args.bias_sd,
            top_label=args.top_label,
            model=engine.model_name,
            fitted_on=fitted_on,
        )

    fitting = time.perf_counter()
    fixed = args.debias or args.bias or not args.top_label
    if fixed:
        calibration = fitted(args.debias, args.bias)
    else:
        calibration = choose_calibration(fit_answers, engine.model_name, fitted_on, args.seed)
    level = args.abstain_confidence
    if parted is not None and decisions:
        calibration = with_decisions(calibration, parted.thresholds, args.abstain_risk, args.coverage, level)
    if hidden:
        heads = fit_heads(
            train_answers,
            engine.model_name,
            args.seed,
            args.abstain_risk,
            args.coverage,
            level,
            parts=engine.backend.hidden_parts,
        )
        calibration = replace(calibration, heads=heads)
    fit_seconds = time.perf_counter() - fitting  # the fits and thresholds saved, heads included
    if args.cascade:  # after the clock: it reads the train split with the second model
        parts = parted.thresholds if parted is not None else None
        escalation = cascade_eval.fit(args, train, train_answers, parts, calibration, _reader(args, schema, cache))
        calibration = replace(calibration, escalation=escalation)
    calibration.save(args.out)
    for name, found in calibration.fields.items():
        biases = f", biases {', '.join(f'{b:+.2f}' for b in found.bias)}" if any(found.bias) else ""
        how = found.fit or ("debiased" if calibration.debias else "raw")
        n_fit = len(fit_answers.fields[name].gold) if name in fit_answers.fields else 0
        print(f"{name}: {how}: temperature {found.temperature:.3f}{biases} (fitted on {n_fit} labels)", file=sys.stderr)
        if found.abstain_below is not None or found.set_threshold is not None:
            assert parted is not None  # thresholds are only fitted on the part the calibration did not see
            n_thresholds = len(parted.thresholds.fields[name].gold)
            print(f"{name}: thresholds fitted on the other {n_thresholds} labels", file=sys.stderr)
    print(
        f"fitted in {fit_seconds:.1f} s (the model's reading of the train split: {train_answers.seconds:.1f} s)",
        file=sys.stderr,
    )
    warning = too_few(parted.sizes()[1] if parted else len(train), args.abstain_risk, level)
    if warning:
        print(warning, file=sys.stderr)
    short = unsupported(calibration, parted.thresholds, args.abstain_risk, level) if parted is not None else []
    for line in short:
        print(line, file=sys.stderr)
    answers = _read(args, engine, schema, test, args.constrained_limit, cache, hidden)
    report = {"meta": _meta(args, engine, "test", len(test)), **build_report(answers, calibration)}
    report["meta"]["calibration"] = {**calibration.to_dict(), "heads": _head_summary(calibration)}
    if hidden:
        report["learning_curve"] = learning_curve(
            train_answers,
            answers,
            engine.model_name,
            seed=args.seed,
            fitted=calibration.heads,
            parts=engine.backend.hidden_parts,
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
    report["meta"]["fit_seconds"] = round(fit_seconds, 1)
    report["meta"]["train_reused_answers"] = train_answers.reused
    report["meta"]["train_forward_passes"] = train_answers.forward_passes
    report["meta"]["train_refused"] = train_answers.refused
    if warning:
        report["meta"]["warning"] = warning
    if short:
        report["meta"]["unsupported"] = short
    _finish(args, report, answers, calibration)
    print(held_out_summary(report["overall"]), file=sys.stderr)
    return 0


def fitted_on_line(calibration: Calibration) -> str:
    """What a calibration file says it was fitted on: the labels of each part and the targets."""
    fitted = calibration.fitted_on
    if "n_thresholds" in fitted:
        split = f"{fitted.get('n_fit')} train examples fit it, {fitted['n_thresholds']} others its thresholds"
    else:
        split = f"{fitted.get('n', '?')} train examples fit it"
    targets = []
    if calibration.abstain_risk is not None:
        targets.append(f"risk {calibration.abstain_risk} at confidence {calibration.abstain_confidence}")
    if calibration.coverage is not None:
        targets.append(f"coverage {calibration.coverage}")
    return f"calibration: {split}" + (f" ({', '.join(targets)})" if targets else "")


def _head_summary(calibration: Calibration) -> dict[str, Any]:
    """What the report keeps of each head: not its weights (the calibration file has them)."""
    return {
        name: {"model": h.model, "n_train": h.n_train, "strength": h.strength, "width": h.width, "parts": list(h.parts)}
        for name, h in calibration.heads.items()
    }
