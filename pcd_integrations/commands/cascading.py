"""``--then MODEL_OR_URL``: the flags that make ``pcd fill``, ``pcd decide``, ``pcd serve`` and ``pcd-mcp``
answer through a ``Cascade`` (pcd_core/cascade.py).

Each ``--then`` adds a stage, in order: an embedded model alias, a Hugging Face id or a local path is
loaded as the first model is (same backend and flags, its own ``--then-calibration``), and an
``http(s)://`` URL is a ``/v1/decisions`` endpoint spoken through the ``openai`` client
(pcd_integrations/remote_decisions.py; ``--then-model`` names the model it serves, ``--then-timeout``
bounds its wait). The escalation rule is the same for every stage: abstained (unless
``--no-escalate-abstained``), ``--escalate-below P``, ``--escalate-mass M``, ``--escalate-set``; without
``--escalate-below``, a ``--calibration`` file with escalation thresholds (``pcd calibrate --cascade``)
gives each of its fields its own (``EscalationRule.fitted``). Every
value and file is checked before any model loads (``check_cascade_args``). ``tests/test_cascade_doors.py``
drives each door.
"""

from __future__ import annotations

import argparse
from typing import Any

from pcd_core import Calibration, Cascade, EscalationRule, PcdError, Stage
from pcd_integrations.commands import common


def add_cascade_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--then",
        action="append",
        default=[],
        metavar="MODEL_OR_URL",
        help="ask the fields this model is unsure of of a next engine: a model (loaded as --model is) or the "
        "base URL of a /v1/decisions endpoint (another pcd serve: http://host:port/v1); repeat for more stages",
    )
    parser.add_argument(
        "--then-calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="a calibration file for the --then model of the same place (a URL stage takes none)",
    )
    parser.add_argument(
        "--then-model", metavar="NAME", help="the model a --then URL serves (default: the --model name)"
    )
    parser.add_argument(
        "--then-timeout",
        type=common.positive_seconds,
        default=30.0,
        metavar="S",
        help="a --then URL slower than S seconds leaves the earlier answers (default 30)",
    )
    parser.add_argument(
        "--escalate-below",
        type=float,
        metavar="P",
        help="escalate a field whose top probability is below P",
    )
    parser.add_argument(
        "--escalate-mass",
        type=float,
        metavar="M",
        help="escalate a field whose candidate mass is below M",
    )
    parser.add_argument(
        "--escalate-set",
        action="store_true",
        help="escalate a field whose answer set (a calibration's --coverage) holds more than one label",
    )
    parser.add_argument(
        "--no-escalate-abstained",
        dest="escalate_abstained",
        action="store_false",
        help="do not escalate a field because it abstained (by default it is)",
    )


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def check_cascade_args(args: argparse.Namespace) -> None:
    """Every cascade flag checked, and the calibration files read, before any model loads."""
    then = getattr(args, "then", None) or []
    if not then:
        for flag, given in (
            ("--then-calibration", args.then_calibration),
            ("--escalate-below", args.escalate_below is not None),
            ("--escalate-mass", args.escalate_mass is not None),
            ("--escalate-set", args.escalate_set),
        ):
            if given:
                raise PcdError(f"{flag} needs --then MODEL_OR_URL")
        return
    if len(args.then_calibration) > len(then):
        raise PcdError(f"{len(args.then_calibration)} --then-calibration files for {len(then)} --then stages")
    for k, path in enumerate(args.then_calibration):
        if _is_url(then[k]):
            raise PcdError(f"--then {then[k]} is a URL: its calibration is the server's, not --then-calibration")
        Calibration.load(path)
    rule(args)  # its bounds


def rule(args: argparse.Namespace, calibration: str | None = None) -> EscalationRule:
    """The flags' rule; without ``--escalate-below``, with the thresholds ``calibration`` (the file of
    the engine whose answers the rule looks at) fitted per field, where it has them.
    """
    conditions = {
        "abstained": args.escalate_abstained,
        "probability_below": args.escalate_below,
        "mass_below": args.escalate_mass,
        "set_larger_than_one": args.escalate_set,
    }
    if args.escalate_below is not None or calibration is None:
        return EscalationRule(**conditions)
    return EscalationRule.fitted(Calibration.load(calibration), **conditions)


def stages(args: argparse.Namespace) -> list[Stage]:
    """The later stages ``--then`` names, each loaded or connected."""
    from pcd_core import Engine

    found = []
    # stage k looks at the answers of the engine before it: the first one's, then stage k - 1's
    looked_at = [getattr(args, "calibration", None), *args.then_calibration]
    for k, target in enumerate(args.then):
        escalation = rule(args, looked_at[k] if k < len(looked_at) else None)
        if _is_url(target):
            from pcd_integrations.remote_decisions import RemoteDecisions

            model = args.then_model or args.model
            engine: Any = RemoteDecisions(target, model, timeout_s=args.then_timeout, name=f"{model}@{target}")
        else:
            calibration = args.then_calibration[k] if k < len(args.then_calibration) else None
            engine = Engine.load(common.options_from_args(args, model=target, calibration=calibration))
            if target == args.model:  # the same model again (another calibration): say which stage answered
                found.append(Stage(engine, escalation, name=f"{target} (stage {k + 2})"))
                continue
        found.append(Stage(engine, escalation))
    return found


def cascaded(engine: Any, args: argparse.Namespace) -> Any:
    """``engine``, or a cascade from it through the ``--then`` stages when there are some."""
    if not getattr(args, "then", None):
        return engine
    return Cascade(engine, stages(args))


def summary(fields: dict[str, Any]) -> str | None:
    """One line: how many fields (or answers) each engine answered, and any stage that failed."""
    by_engine: dict[str, int] = {}
    failed = set()
    for found in fields.values():
        engine = getattr(found, "engine", None)
        if engine is None:
            continue
        by_engine[engine] = by_engine.get(engine, 0) + 1
        escalation = getattr(found, "escalation", None)
        if escalation is not None and not escalation["escalated"]:
            failed.add(f"{escalation['to']} ({escalation['error']})")
    if not by_engine:
        return None
    line = "answered by: " + ", ".join(f"{name} {n}" for name, n in by_engine.items())
    return line + (f"; not used: {', '.join(sorted(failed))}" if failed else "")
