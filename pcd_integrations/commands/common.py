"""What every ``pcd`` subcommand shares: argument types, the model options, file readers, the engine load.

The subcommands (``main.py``'s fill, decide, models and serve; ``bench.py``; ``evaluate.py``) import
this module and never the dispatcher, so each can be read and tested on its own. Commands call
``common.load_engine`` through the module, so that a test can replace the load in one place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pcd_core.engine import Engine  # light: torch and transformers load with the model, not with the engine
from pcd_core.errors import PcdError
from pcd_core.models import DEFAULT_MODEL, DTYPES


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
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of tokens")
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


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, HF id, local folder or .gguf path")
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx", "vllm"))
    parser.add_argument("--base-url", default=None, help="the vLLM server for --backend vllm, e.g. http://host:8000")
    parser.add_argument(
        "--vllm-api-key-env", metavar="VAR", default=None, help="send the key in environment variable VAR to vLLM"
    )
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the torch backend's weights and arithmetic (default float32, what every figure here uses)",
    )
    parser.add_argument(
        "--max-tokens-per-pass",
        type=positive,
        default=None,
        help="row tokens per forward pass; bounds memory, never changes a result",
    )


def load_engine(args: argparse.Namespace, *, debias: bool = False) -> Engine:
    """The engine ``args`` name; ``debias`` is its default for every call (``pcd serve --debias``)."""
    if args.backend == "vllm" and not args.base_url:
        raise PcdError("--backend vllm needs --base-url, the vLLM server's address")
    api_key = os.environ.get(args.vllm_api_key_env) if args.vllm_api_key_env else None
    return Engine.load(args.model, debias=debias, **engine_options(args, api_key))


def engine_options(args: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    """``Engine.load``'s keywords from the model options ``pcd`` and ``pcd-mcp`` share by name
    (``--backend``, ``--device``, ``--dtype``, ``--max-tokens-per-pass``, ``--base-url``,
    ``--calibration``), with the vLLM key each reads its own way.
    """
    return {
        "backend": args.backend,
        "device": args.device,
        "dtype": args.dtype,
        "max_tokens_per_pass": args.max_tokens_per_pass,
        "base_url": args.base_url,
        "api_key": api_key,
        "calibration": getattr(args, "calibration", None),  # --calibration (pcd_core/calibration.py)
    }


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

    from pcd_core.questions import DecideRequest

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
