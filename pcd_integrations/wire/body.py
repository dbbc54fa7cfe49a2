r"""A strict JSON reader for request bodies: duplicate keys, NaN/Infinity and lone surrogates are errors.

Python's ``json`` keeps the last of two equal keys and accepts ``NaN``, so ``{"q": a, "q": b}`` would
silently ask only ``b``, and a NaN in a state would reach the prompt. It also decodes an unpaired
``\ud800`` escape into a string that no tokenizer or JSON encoder accepts (a question id holding one
broke the response itself). All three are rejected here, with the path to the offending value, before
any model work. ``tests/test_questions.py`` covers each case.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pcd_core import PcdError

Location = tuple[str | int, ...]


class BodyError(PcdError, ValueError):
    """A body that is not strict JSON; ``loc`` is the path to the problem inside the body."""

    def __init__(self, message: str, loc: Location = (), kind: str = "json_invalid") -> None:
        self.loc = loc
        self.kind = kind
        self.reason = message
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        super().__init__(f"{where}: {message}" if where else message)


class _Duplicated(dict[str, Any]):
    """An object that had a repeated key; the walk below reports where."""

    duplicates: list[str]


# an escaped UTF-16 surrogate: paired (an emoji under ensure_ascii) or not, the walk decides
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _unpaired(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _NonFinite:
    def __init__(self, word: str) -> None:
        self.word = word


def _first_problem(value: Any, loc: Location) -> BodyError | None:
    if isinstance(value, _NonFinite):
        return BodyError(f"{value.word} is not a JSON number", loc, "json_non_finite")
    if isinstance(value, _Duplicated):
        return BodyError(f"the key {value.duplicates[0]!r} appears more than once", loc, "json_duplicate_key")
    if isinstance(value, str):
        return (
            BodyError("the text holds an unpaired UTF-16 surrogate", loc, "json_invalid_unicode")
            if _unpaired(value)
            else None
        )
    if isinstance(value, dict):
        bad = next((key for key in value if _unpaired(key)), None)
        if bad is not None:
            return BodyError("a key holds an unpaired UTF-16 surrogate", loc, "json_invalid_unicode")
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in children:
        problem = _first_problem(item, (*loc, key))
        if problem is not None:
            return problem
    return None


def loads_strict(raw: bytes | str) -> Any:
    """Parse ``raw`` as JSON, raising `BodyError` for malformed JSON, repeated keys or NaN/Infinity."""
    raw_bytes = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    flagged = _SURROGATE_ESCAPE.search(raw_bytes) is not None

    def make_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal flagged
        result = dict(pairs)
        if len(result) == len(pairs):
            return result
        flagged = True
        marked = _Duplicated(result)
        seen: set[str] = set()
        marked.duplicates = []
        for key, _ in pairs:
            if key in seen:
                marked.duplicates.append(key)
            seen.add(key)
        return marked

    def non_finite(word: str) -> _NonFinite:
        nonlocal flagged
        flagged = True
        return _NonFinite(word)

    try:
        value = json.loads(raw, object_pairs_hook=make_object, parse_constant=non_finite)
        # the walk only runs for the rare body that has something to report, to find where it is
        problem = _first_problem(value, ()) if flagged else None
    except (ValueError, RecursionError) as error:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise BodyError(f"the body is not valid JSON: {error}") from None
    if problem is not None:
        raise problem
    return value
