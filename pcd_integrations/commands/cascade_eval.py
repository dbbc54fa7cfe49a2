"""``pcd eval --cascade MODEL`` and ``pcd calibrate --cascade MODEL``: a cascade measured, and its
escalation fitted, on labelled data.

``pcd eval --cascade`` reads the held-out examples with a second model too and reports, per field,
the curve of pcd_core/evaluation/cascade_curve.py (accuracy, share escalated, time per example), with
the point the calibration's fitted threshold gives when it has one, as a table on stderr, under
``cascade`` in ``--json`` and as a plot (``--cascade-plot``). ``pcd calibrate --cascade`` reads the
train split with the second model and fits, per field, the threshold that meets ``--escalate-accuracy``
or ``--escalate-share`` (``fit_escalation``), on the probabilities the saved calibration gives an
example it was not fitted on: the zero-shot fields' on the threshold part of the train split (the
part their calibration did not see), a head's out of fold. ``tests/test_cascade_eval.py`` runs both
on the embedded model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pcd_core import Calibration, PcdError
from pcd_core.evaluation.cascade_curve import CascadePoint, cascade_curve, fit_escalation
from pcd_core.evaluation.runner import Answers, variants
from pcd_core.trust.calibration import Escalation
from pcd_integrations.commands import common

#: reads records with an engine: ``evaluate._read`` with the command's flags bound
Read = Callable[[Any, list[dict[str, Any]]], Answers]


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cascade",
        metavar="MODEL",
        help="also read the examples with MODEL (same flags) and report the cascade's curve: accuracy, share "
        "escalated and time per example when the fields below each top probability go to MODEL",
    )
    parser.add_argument("--cascade-plot", metavar="PNG", help="with --cascade: plot the curve of each field")


def add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cascade",
        metavar="MODEL",
        help="also read the train split with MODEL (same flags) and fit, per field, the top probability below "
        "which a cascade sends the field to MODEL, for --escalate-accuracy or --escalate-share; saved in the file",
    )
    parser.add_argument(
        "--escalate-accuracy",
        type=float,
        metavar="A",
        help="with --cascade: escalate as few examples as reach accuracy A on the train split",
    )
    parser.add_argument(
        "--escalate-share",
        type=float,
        metavar="S",
        help="with --cascade: the most accurate threshold that escalates at most the share S of the examples",
    )


def check_args(args: argparse.Namespace) -> None:
    """The cascade flags of either command, checked before any model loads."""
    if getattr(args, "cascade_plot", None) and not args.cascade:
        raise PcdError("--cascade-plot needs --cascade MODEL")
    targets = [
        (f, v)
        for f, v in (
            ("--escalate-accuracy", getattr(args, "escalate_accuracy", None)),
            ("--escalate-share", getattr(args, "escalate_share", None)),
        )
        if v is not None
    ]
    for flag, value in targets:
        if not args.cascade:
            raise PcdError(f"{flag} needs --cascade MODEL")
        if not 0 < value <= 1:
            raise PcdError(f"{flag} {value} must lie in (0, 1]")
    if len(targets) == 2:
        raise PcdError("give --escalate-accuracy or --escalate-share, not both")
    if hasattr(args, "escalate_accuracy") and args.cascade and not targets:
        raise PcdError(
            "pcd calibrate --cascade fits a threshold for a target: give --escalate-accuracy or --escalate-share"
        )
    if args.cascade and args.questions is not None:
        raise PcdError("--cascade measures schema fields; it does not take --questions")


def second_engine(args: argparse.Namespace) -> Any:
    """The ``--cascade`` model, loaded with the same flags and no calibration."""
    return common.load_engine(argparse.Namespace(**{**vars(args), "model": args.cascade, "calibration": None}))


def _rows_by_text(answers: Answers, name: str, texts: list[str]) -> np.ndarray:
    """``answers``' raw rows of field ``name`` in the order of ``texts`` (a text read twice answers alike)."""
    out = answers.fields[name]
    by_text = dict(zip(out.texts, out.array()))
    return np.asarray([by_text[text] for text in texts])


def _seconds_each(answers: Answers, n: int) -> float | None:
    """Seconds per example read now; None when every answer came from the answers file."""
    read = n - answers.reused
    return answers.seconds / read if read > 0 else None


def fit(
    args: argparse.Namespace,
    train: list[dict[str, Any]],
    train_answers: Answers,
    thresholds_part: Answers | None,
    calibration: Calibration,
    read: Read,
) -> Escalation:
    """The escalation thresholds for the flags' target, fitted on the train split (module docstring)."""
    from pcd_core.evaluation.probing import heads_out_of_fold

    later = read(second_engine(args), train)
    held = heads_out_of_fold(train_answers, calibration.heads, args.seed)
    first, second, gold = {}, {}, {}
    for name, out in train_answers.fields.items():
        if not out.gold or name not in later.fields:
            continue
        if name in held:  # a head: its out-of-fold rows over the whole split
            part, rows = out, held[name]
        else:  # zero-shot: calibrated rows on the part the calibration was not fitted on
            if thresholds_part is None:
                raise PcdError("internal: a zero-shot field's escalation needs the threshold part of the train split")
            part = thresholds_part.fields[name]
            found = variants(thresholds_part, name, calibration)
            rows = found.get("calibrated", found["raw"])
        first[name], gold[name] = rows, np.asarray(part.gold)
        second[name] = _rows_by_text(later, name, part.texts)
    escalation, short = fit_escalation(
        first, second, gold, args.cascade, accuracy=args.escalate_accuracy, max_escalated=args.escalate_share
    )
    for name, below in escalation.below.items():
        point = escalation.on_train[name]
        print(
            f"{name}: escalate to {args.cascade} below {below:.3f}: on {int(point['n'])} train examples it "
            f"escalated {point['escalated']:.3f} and reached accuracy {point['accuracy']:.3f}",
            file=sys.stderr,
        )
    for line in short:
        print(line, file=sys.stderr)
    return escalation


def report(
    args: argparse.Namespace,
    chosen: list[dict[str, Any]],
    answers: Answers,
    calibration: Calibration | None,
    read: Read,
) -> dict[str, Any]:
    """Per field, the cascade's curve on these answers (as the calibration gives them) to
    ``--cascade MODEL``'s, read now on the same examples; the fitted point where the calibration has
    one; printed as a table on stderr and drawn with ``--cascade-plot``.
    """
    later = read(second_engine(args), chosen)
    first_s, second_s = _seconds_each(answers, len(chosen)), _seconds_each(later, len(chosen))
    fitted = calibration.escalation if calibration is not None else None
    found: dict[str, Any] = {"model": args.cascade, "fields": {}}
    if first_s is None or second_s is None:
        print(
            "cascade: times unknown (every answer of an engine came from the answers file); shown as 0", file=sys.stderr
        )
    for name, out in answers.fields.items():
        if not out.gold or name not in later.fields:
            continue
        rows = variants(answers, name, calibration)
        first = rows.get("head", rows.get("calibrated", rows["raw"]))
        second, gold = _rows_by_text(later, name, out.texts), np.asarray(out.gold)
        times = (first_s or 0.0, second_s or 0.0)
        curve = cascade_curve(first, second, gold, *times)
        entry: dict[str, Any] = {
            "first_seconds": first_s,
            "second_seconds": second_s,
            "curve": [p.to_dict() for p in curve],
        }
        point = None
        if fitted is not None and name in fitted.below:
            point = cascade_curve(first, second, gold, *times, thresholds=(fitted.below[name],))[0]
            entry["fitted"] = {**point.to_dict(), "on_train": dict(fitted.on_train.get(name, {}))}
        found["fields"][name] = entry
        _print_curve(name, args.cascade, times, curve, point)
    if args.cascade_plot:
        write_plot(found, args.cascade_plot, f"{getattr(args, 'model', '')} then {args.cascade} on {args.data}")
    return found


def _print_curve(
    name: str, model: str, times: tuple[float, float], curve: list[CascadePoint], fitted: CascadePoint | None
) -> None:
    first_s, second_s = times
    print(f"{name}: cascade to {model} (time per example: {first_s:.2f} s, then {second_s:.2f} s)", file=sys.stderr)
    shown = [(f"below {p.threshold:.2f}", p) for p in curve]
    if fitted is not None:
        shown.append((f"fitted {fitted.threshold:.3f}", fitted))
    for label, p in shown:
        ratio = f" ({p.seconds_per_example / second_s:.2f}x the second alone)" if second_s else ""
        print(
            f"  {label}: escalated {p.escalated:.3f}, accuracy {p.accuracy:.3f}, {p.seconds_per_example:.2f} s/example{ratio}",
            file=sys.stderr,
        )


def write_plot(found: dict[str, Any], path: str, title: str) -> None:
    """Accuracy against the share escalated, one line per field, the time per example against the
    second engine's alone beside it, and the fitted point marked.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy_axes, time_axes) = plt.subplots(1, 2, figsize=(10, 4.5))
    for name, entry in found["fields"].items():
        curve = entry["curve"]
        shares = [p["escalated"] for p in curve]
        line = accuracy_axes.plot(shares, [p["accuracy"] for p in curve], marker=".", label=name)[0]
        second = entry["second_seconds"] or 0.0
        if second:
            time_axes.plot(shares, [p["seconds_per_example"] / second for p in curve], marker=".", label=name)
        if "fitted" in entry:
            point = entry["fitted"]
            accuracy_axes.plot(
                [point["escalated"]],
                [point["accuracy"]],
                marker="*",
                markersize=14,
                color=line.get_color(),
                label=f"{name}: fitted threshold {point['threshold']:.3f}",
            )
    accuracy_axes.set(xlabel="share of examples escalated", ylabel="accuracy", title=title, xlim=(0, 1))
    accuracy_axes.legend(loc="lower right")
    time_axes.axhline(1.0, color="grey", linestyle=":", label=f"{found['model']} alone")
    time_axes.set(xlabel="share of examples escalated", ylabel="time per example / the second alone", xlim=(0, 1))
    time_axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
