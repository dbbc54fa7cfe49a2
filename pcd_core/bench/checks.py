"""What the benchmark judges about an output: schema validity, lenient parsing of free text, agreement.

Validity is checked twice over: by a JSON Schema validator (``jsonschema``) against the schema as
given, and strictly against its parsed fields: every key, no other key, and each value an allowed
label of the right JSON type (``"true"`` is not a boolean), even where the JSON Schema would let a
key be missing. Agreement is lenient on purpose:
it asks whether two methods made the same *decision*, so a free-running model that writes ``"true"``
for a boolean still agrees with ``true``. ``tests/test_bench.py`` checks both on hand-made outputs.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pcd_core.request.schema import Field, Schema

#: one ``"key": value`` pair written by a model: a JSON string, a literal, or a number
_PAIR = r'"{key}"\s*:\s*("(?:[^"\\]|\\.)*"|true|false|null|-?\d+(?:\.\d+)?)'


def same_value(got: Any, want: Any) -> bool:
    """Equal with the JSON type: ``True`` is not ``1`` and ``"1"`` is not ``1``."""
    return type(got) is type(want) and got == want


def is_valid(schema: Schema, output: Any) -> bool:
    """Every key present, no other key, every closed value an allowed label of the right JSON type
    (open values and multi-label lists are left to the JSON Schema validator).
    """
    if not isinstance(output, dict) or set(output) != set(schema.keys):
        return False
    closed = [f for f in schema.fields if f.member_of is None]
    return all(any(same_value(output[f.name], label.value) for label in f.labels) for f in closed)


def valid_output(json_schema: dict[str, Any], schema: Schema, output: Any) -> bool:
    """``output`` passes the JSON Schema's own validator and the strict check of ``is_valid``."""
    try:
        from jsonschema import validators
    except ImportError as error:
        raise ImportError("pcd bench checks outputs with jsonschema; run: pip install 'pcd-engine[bench]'") from error
    validator = validators.validator_for(json_schema)(json_schema)
    return is_valid(schema, output) and validator.is_valid(output)


def label_of(field: Field, value: Any) -> int | None:
    """The label a written value means, exact type first, then by its text; None if it means none."""
    for index, label in enumerate(field.labels):
        if same_value(value, label.value):
            return index
    text = value if isinstance(value, str) else json.dumps(value)
    for index, label in enumerate(field.labels):
        if text == label.text:
            return index
    return None


def agreement(schema: Schema, ours: dict[str, Any], theirs: dict[str, Any]) -> int:
    """Fields on which both outputs name the same label (a missing or unknown value never agrees)."""
    count = 0
    for field in schema.fields:
        if field.name not in ours or field.name not in theirs:
            continue
        mine = label_of(field, ours[field.name])
        if mine is not None and mine == label_of(field, theirs[field.name]):
            count += 1
    return count


class ObjectScanner:
    """Finds the brace that closes the first top-level object, fed one chunk at a time.

    Braces inside JSON strings do not count. Incremental, so that a token-by-token loop pays for each
    new token only, not for rescanning everything it wrote.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.seen = 0  # characters fed so far

    def feed(self, chunk: str) -> int | None:
        """Index (in everything fed) just past the closing brace, once it arrives; else None."""
        for offset, char in enumerate(chunk):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"' and self.depth > 0:
                self.in_string = True
            elif char == "{":
                self.depth += 1
            elif char == "}" and self.depth > 0:
                self.depth -= 1
                if self.depth == 0:
                    return self.seen + offset + 1
        self.seen += len(chunk)
        return None


def json_object_end(text: str) -> int | None:
    """Index just past the brace that closes the first top-level object, or None if it never closes."""
    return ObjectScanner().feed(text)


def parse_lenient(schema: Schema, text: str) -> dict[str, Any]:
    """A model's free text as a dict: ``json.loads`` up to the closing brace, else one regex per key.

    The regex fallback reads what a human would from a truncated or looping object: the first value
    written after each key, so that agreement can still be counted when the JSON never closes.
    """
    end = json_object_end(text)
    start = text.find("{")
    if end is not None and start >= 0:
        try:
            data = json.loads(text[start:end])
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            return data
    found: dict[str, Any] = {}
    for field in schema.fields:
        match = re.search(_PAIR.format(key=re.escape(field.name)), text)
        if match is not None:
            found[field.name] = json.loads(match.group(1))
    return found
