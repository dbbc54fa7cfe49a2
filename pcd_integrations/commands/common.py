"""What every ``pcd`` subcommand shares: argument types, the model options, file readers, the engine load.

The subcommands (``main.py``'s fill, decide, models and serve; ``bench.py``; ``evaluate.py``) import
this module and never the dispatcher, so each can be read and tested on its own. Commands call
``common.load_engine`` through the module, so that a test can replace the load in one place. The model
flags are generated from ``pcd_core.loading.options.LoadOptions`` (``add_model_options``, used by ``pcd-mcp`` too)
and read back into one (``options_from_args``); ``tests/test_options.py`` checks both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Literal

from pcd_core import (
    Engine,  # light: torch and transformers load with the model, not with the engine
    LoadOptions,
    PcdError,
)


def read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise PcdError(f"cannot read {what} {path!r}: {error}") from error


def read_schema(path: str) -> tuple[Any, str | None]:
    """A JSON Schema file, or a case file (``{"json_schema", "input"}``) that also carries an input."""
    data = read_json(path, "schema")
    if isinstance(data, dict) and "json_schema" in data:
        return data["json_schema"], data.get("input")
    return data, None


def read_jsonl(path: str) -> list[tuple[dict[str, Any], str]]:
    """Each non-blank line: a JSON string, or an object with a string ``text`` (and an optional ``id``)."""
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise PcdError(f"{path}:{number}: not JSON ({error.msg})") from error
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            ident = {"id": item["id"]} if "id" in item else {}
            items.append(({"line": number, **ident}, item["text"]))
        elif isinstance(item, str):
            items.append(({"line": number}, item))
        else:
            raise PcdError(f"{path}:{number}: expected a JSON string or an object with a string 'text'")
    if not items:
        raise PcdError(f"{path}: no inputs")
    return items


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not 0 or more")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_model_options(
    parser: argparse.ArgumentParser,
    *,
    environment: bool = False,
    opt_in: Collection[str] = (),
    more_backends: Sequence[str] = (),
) -> None:
    """The model flags, one per ``LoadOptions`` field that has one, from the field's metadata (help,
    metavar, the values of a ``Literal``): ``pcd``'s subcommands, ``pcd bench`` and ``pcd-mcp`` all call
    this, so none declares a model flag of its own. ``environment`` defaults each flag to its variable
    (``pcd-mcp``); then no ``choices`` are given, since argparse does not check defaults against them,
    and ``options_from_args`` checks every value instead. ``opt_in`` names the fields offered only where
    asked for (``dummy_weights``: ``pcd bench``); ``more_backends`` are extra ``--backend`` values the
    command handles itself (``pcd bench --backend all``).
    """
    hints = typing.get_type_hints(LoadOptions)
    for spec in dataclasses.fields(LoadOptions):
        meta = spec.metadata
        if not meta.get("flag") or (meta.get("opt_in") and spec.name not in opt_in):
            continue
        env, default = meta.get("env"), spec.default
        flag, dest = _flag(spec)
        if meta.get("secret"):  # a key never travels in argv: the flag names the variable that holds it
            default = env if environment else None
            help_text = meta["help"] + (f" (default {env})" if environment else "")
        else:
            if environment and env:
                default = os.environ.get(env, default)
            help_text = meta["help"] + (f" ({env})" if environment and env else "")
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if hints[spec.name] is bool:  # a switch: --offline
            parser.add_argument(flag, dest=dest, action="store_true", help=help_text)
            continue
        if _int_typed(hints[spec.name]) and not meta.get("secret"):
            kwargs["type"] = positive
        allowed = _literal_values(hints[spec.name])
        if allowed:
            values = (*allowed, *more_backends) if spec.name == "backend" else allowed
            if environment:
                kwargs["help"] += f"; one of {', '.join(values)}"
            else:
                kwargs["choices"] = values
        parser.add_argument(flag, **kwargs)


def _flag(spec: dataclasses.Field) -> tuple[str, str]:
    """A field's flag (the one its metadata names, else ``--`` and its name) and the flag's own dest,
    which keeps ``--vllm-api-key-env`` apart from ``pcd serve``'s ``--api-key-env``.
    """
    named = spec.metadata["flag"]
    flag = named if isinstance(named, str) else f"--{spec.name.replace('_', '-')}"
    return flag, flag.removeprefix("--").replace("-", "_")


def _literal_values(hint: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` field (``X | None`` too), else none."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return tuple(value for arg in typing.get_args(hint) for value in _literal_values(arg))


def _int_typed(hint: Any) -> bool:
    return hint is int or int in typing.get_args(hint)


def options_from_args(args: argparse.Namespace, **overrides: Any) -> LoadOptions:
    """The ``LoadOptions`` the model flags name (``add_model_options``), checked: a bad value or a
    combination the backend cannot honour is an ``OptionError`` here, before anything loads.
    """
    given: dict[str, Any] = {}
    for spec in dataclasses.fields(LoadOptions):
        if not spec.metadata.get("flag"):
            continue
        _, dest = _flag(spec)
        if not hasattr(args, dest):
            continue
        if spec.metadata.get("secret"):
            variable = getattr(args, dest)
            given[spec.name] = os.environ.get(variable) if variable else None
        else:
            given[spec.name] = getattr(args, dest)
    return LoadOptions(**{**given, **overrides})


def load_engine(args: argparse.Namespace, *, debias: bool = False) -> Engine:
    """The engine ``args`` name; ``debias`` is its default for every call (``pcd serve --debias``), and a
    ``--calibration`` file, where the command has one, is applied to every answer it was fitted on.
    """
    return Engine.load(options_from_args(args, calibration=getattr(args, "calibration", None), debias=debias))


def print_json(record: Any) -> None:
    json.dump(record, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


def read_questions(path: str) -> dict[str, Any]:
    """A question file in the ``POST /v1/systemone`` shape: an object with ``questions`` (and a ``state``)."""
    data = read_json(path, "question file")
    if not isinstance(data, dict) or not isinstance(data.get("questions"), dict):
        raise PcdError(f"question file {path!r} needs a 'questions' object (and a 'state')")
    return data


def check_questions(path: str, state: Any, questions: Any) -> None:
    """The request checked as ``/v1/systemone`` checks it, before any model loads."""
    from pydantic import ValidationError

    from pcd_core import DecideRequest

    try:
        DecideRequest(state=state, questions=questions)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in error.errors())
        raise PcdError(f"question file {path!r}: {problems}") from error


def read_state(path: str) -> Any:
    """A ``.json`` file is the state as JSON (object, array or string); any other file is its text."""
    if path.endswith(".json"):
        return read_json(path, "state")
    return Path(path).read_text(encoding="utf-8")
