"""``pcd watch``: follow a conversation turn by turn and print what each turn changed.

It opens one session (``pcd_core/sessions/session.py``) over a schema and appends the turns as they come: from
``--input FILE`` (a conversation JSON with ``turns``, or text lines) or from stdin, line by line, so a
transcript can be piped in while it is written. A text line is ``role: text`` (a role is one word) or
just text, said by ``--role``. After each turn it prints the fields whose value changed (all of them
after the first turn), each with its probability; ``--jsonl`` prints one JSON object a turn instead.
The schema and the turns already in a file are checked before the model loads. ``tests/test_watch.py``
runs it on the real model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pcd_core import Extraction, PcdError, SessionTurn, parse_schema
from pcd_integrations.commands import common

_ROLE_LINE = re.compile(r"^(?P<role>[A-Za-z][A-Za-z0-9_-]{0,31}):\s+(?P<text>\S.*)$")


def add_watch(commands: Any) -> None:
    watch = commands.add_parser(
        "watch", help="follow a conversation turn by turn and print what each turn changed, with probabilities"
    )
    watch.add_argument(
        "--schema", required=True, help="JSON Schema file, or a conversation file that carries a 'schema'"
    )
    watch.add_argument(
        "--input",
        metavar="FILE",
        help="a conversation JSON with 'turns', or one turn a line ('role: text'); default: stdin, line by line",
    )
    watch.add_argument("--role", default="user", help="the role of a line that names none (default: user)")
    watch.add_argument("--jsonl", action="store_true", help="one JSON object a turn instead of the text lines")
    watch.add_argument(
        "--keep-last-tokens",
        type=common.positive,
        metavar="N",
        help="drop whole early turns to keep N tokens of conversation (default: a conversation over the "
        "model's context is an error)",
    )
    common.add_model_options(watch)
    watch.set_defaults(run=run_watch)


def read_watch_schema(path: str) -> Any:
    data = common.read_json(path, "schema")
    if isinstance(data, dict) and "turns" in data and "schema" in data:
        data = data["schema"]
    elif isinstance(data, dict) and "json_schema" in data:
        data = data["json_schema"]
    parse_schema(data)
    return data


def line_turn(line: str, role: str) -> SessionTurn | None:
    """A text line as a turn (None for a blank line): ``role: text``, or the text said by ``role``."""
    if not line.strip():
        return None
    named = _ROLE_LINE.match(line.strip())
    return SessionTurn(named["role"], named["text"]) if named else SessionTurn(role, line.strip())


def file_turns(path: str, role: str) -> list[SessionTurn]:
    """Every turn of ``--input``, read and checked before the model loads."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PcdError(f"cannot read input {path!r}: {error}") from error
    if path.endswith(".json"):
        try:
            return [SessionTurn(turn["role"], turn["text"]) for turn in json.loads(text)["turns"]]
        except (ValueError, KeyError, TypeError) as error:
            raise PcdError(f"{path!r}: {error!r}; a conversation JSON has 'turns' of role and text") from error
    return [turn for line in text.splitlines() if (turn := line_turn(line, role)) is not None]


def stdin_turns(lines: Iterable[str], role: str) -> Iterator[SessionTurn]:
    for line in lines:
        turn = line_turn(line, role)
        if turn is not None:
            yield turn


def _reading(result: Any) -> dict[str, tuple[Any, float | None]]:
    """Each key's value and the probability of that value (None for an open field)."""
    return {name: (field.value, getattr(field, "probability", None)) for name, field in result.fields.items()}


def run_watch(args: argparse.Namespace) -> int:
    schema = read_watch_schema(args.schema)
    turns: Iterable[SessionTurn] = (
        file_turns(args.input, args.role) if args.input else stdin_turns(sys.stdin, args.role)
    )
    SessionTurn(args.role, "check")  # a bad --role fails before the model loads
    engine = common.load_engine(args)
    session = engine.session(schema, keep_last_tokens=args.keep_last_tokens)
    before: dict[str, tuple[Any, float | None]] = {}
    for index, turn in enumerate(turns, start=1):
        result = session.append(turn.text, role=turn.role)
        assert isinstance(result, Extraction)  # a schema's session fills
        now = _reading(result)
        changed = {name: reading for name, reading in now.items() if before.get(name, (object(),))[0] != reading[0]}
        if args.jsonl:
            record = {
                "turn": index,
                "role": turn.role,
                "values": result.values,
                "changed": {name: {"value": v, "probability": p} for name, (v, p) in changed.items()},
                "tokens_read": result.stats.prompt_tokens + result.stats.row_tokens,
                "ms": round(result.stats.total_ms, 1),
                "warnings": result.warnings,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            shown = turn.line if len(turn.line) <= 72 else turn.line[:71] + "\u2026"
            print(f"turn {index} {shown}")
            for name, (value, p) in changed.items():
                was = before.get(name)
                arrow = f"{json.dumps(was[0], ensure_ascii=False)} -> " if was is not None else ""
                prob = f" ({p:.2f})" if p is not None else ""
                print(f"  {name}: {arrow}{json.dumps(value, ensure_ascii=False)}{prob}")
            for warning in result.warnings:
                print(f"  warning: {warning}")
        sys.stdout.flush()
        before = now
    session.close()
    return 0
