"""Bounds on one request, and the checks that every user text is readable, run before tokenizing.

A request's cost grows with what it sends: the bytes of its body, the number of questions, options
and fields, and the row tokens those become. Each has a setting in the frozen ``Limits``, with a
default a 2-core machine survives and that admits what the OpenAI Decisions API admits (400 questions,
255 choices). The checks are pure functions of the request and ``Limits``; the engine calls
``check_decide`` / ``check_fill`` first, and the servers call ``check_body_size`` before parsing.
The questions' row tokens are counted once they are compiled, before any pass (``check_row_tokens``);
a fill's are bounded from their bytes. Over a bound is a ``LimitError`` that names the setting and
its value (HTTP 413 for the body, 422 for the rest).

The same pass rejects what the tokenizer must never read: lone surrogates (invalid Unicode, and the
sentinels ``pcd_core/tokenizer.py`` marks control tokens with) anywhere in the state, a question, an
option, a level, a field, a label or the input, and NaN or infinite numbers in a state, each as a
``TextError`` whose ``loc`` says where. ``tests/test_hardening.py`` reproduces each case.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from pydantic import ValidationError

from pcd_core.errors import LimitError, OptionError, PromptError, RequestError, TextError
from pcd_core.request.questions import ChoiceQuestion, DecideRequest, ScoreQuestion
from pcd_core.request.schema import Schema

_SURROGATE = re.compile("[\ud800-\udfff]")
# What a field's label row adds beyond the user's own text, in tokens, with room to spare: byte-level
# BPE never makes more tokens than UTF-8 bytes, so user bytes plus this bound a fill's row tokens.
_LABEL_ALLOWANCE = 8


@dataclass(frozen=True)
class Limits:
    """Per-request bounds; ``Engine(limits=Limits(max_questions=50))`` tightens them."""

    max_body_bytes: int = 1 << 20  # an HTTP or MCP-over-HTTP request body (413 above it)
    max_questions: int = 400  # questions in one decide request (OpenAI's Decisions take 1 to 400)
    max_options: int = 255  # options of one choice question, labels of one schema field
    max_fields: int = 128  # fields of one schema
    max_text_bytes: int = 256 << 10  # UTF-8 bytes of the input, of the state or of the questions, before tokenizing
    max_depth: int = 32  # nesting of a JSON state
    max_row_tokens: int = 32768  # distinct row tokens of one request: counted for questions, bounded for fields

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{setting.name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()

#: the most rotations of an option list one decide reads (each is one more row per question, same pass)
MAX_ORDER_SAMPLES = 8


def check_order_samples(order_samples: Any) -> int:
    """``order_samples`` as a whole number 1 to ``MAX_ORDER_SAMPLES``, or an ``OptionError``."""
    if (
        isinstance(order_samples, bool)
        or not isinstance(order_samples, int)
        or not 1 <= order_samples <= MAX_ORDER_SAMPLES
    ):
        raise OptionError(f"order_samples must be a whole number from 1 to {MAX_ORDER_SAMPLES}, not {order_samples!r}")
    return order_samples


def check_body_size(limits: Limits, n_bytes: int) -> None:
    if n_bytes > limits.max_body_bytes:
        raise LimitError("max_body_bytes", n_bytes, limits.max_body_bytes, "the request body's bytes")


def check_decide(limits: Limits, state: Any, questions: Any) -> DecideRequest:
    """The validated request, or a ``PcdError``; counts are checked before pydantic walks them."""
    if isinstance(questions, Mapping):
        _at_most(limits, "max_questions", len(questions), "the number of questions")
        for qid, question in questions.items():
            criteria = (
                question.get("criteria") if isinstance(question, Mapping) else getattr(question, "criteria", None)
            )
            if isinstance(criteria, Mapping | list):
                _at_most(limits, "max_options", len(criteria), f"the options of question {_shown(qid)}")
    try:
        request = DecideRequest(state=state, questions=questions)
    except ValidationError as error:
        raise request_error(error) from None
    n_bytes = check_json(limits, request.state, ("state",))
    _at_most(limits, "max_text_bytes", n_bytes, "the state's bytes")
    question_bytes = 0
    for qid, question in request.questions.items():
        check_text(qid, ("questions", qid))
        question_bytes += _question_bytes(question, ("questions", qid))
    _at_most(limits, "max_text_bytes", question_bytes, "the questions' bytes")
    return request


def check_text_bytes(limits: Limits, n_bytes: int, what: str) -> None:
    """Text read by one request, in UTF-8 bytes, against ``max_text_bytes``."""
    _at_most(limits, "max_text_bytes", n_bytes, what)


def check_row_tokens(limits: Limits, n_tokens: int) -> None:
    """The questions' row tokens as compiled (``deciding.plan_decide``), each distinct token once,
    against ``max_row_tokens``, before any pass reads them.

    The count is the real one, not a bound from the request's bytes: such a bound let a 255-option
    choice through while the engine read its option list once per branch row, 42,360 row tokens in
    15 passes.
    """
    _at_most(
        limits,
        "max_row_tokens",
        n_tokens,
        "the questions' row tokens",
        "ask fewer questions per request, give fewer options or shorter descriptions, "
        "or raise Limits(max_row_tokens=...)",
    )


def check_fill(limits: Limits, schema: Schema, text: Any) -> None:
    """Bounds and readable text for one fill: the schema's fields and labels, then the input."""
    _at_most(limits, "max_fields", len(schema.fields) + len(schema.open_fields), "the number of fields")
    row_tokens = 0
    for item in schema.open_fields:  # generated fields: their key, description and schema are user text
        loc = ("schema", item.name)
        check_text(item.name, loc)
        check_text(item.description, (*loc, "description"))
        check_text(item.value_schema_json, (*loc, "schema"))
        row_tokens += _utf8(item.name) + item.max_new_tokens
    for field in schema.fields:
        loc = ("schema", field.name)
        check_text(field.name, loc)
        check_text(field.description, (*loc, "description"))
        _at_most(limits, "max_options", len(field.labels), f"the labels of field {_shown(field.name)}")
        for label in field.labels:
            check_text(label.text, (*loc, "labels", _shown(label.text)))
            row_tokens += _utf8(field.name) + _utf8(label.forms[0]) + _LABEL_ALLOWANCE
    _at_most(limits, "max_row_tokens", row_tokens, "the fields' row tokens (bounded from their bytes)")
    if not isinstance(text, str):
        raise PromptError(f"the input must be a string, got {type(text).__name__}")
    _at_most(limits, "max_text_bytes", _utf8(text), "the input's bytes")
    check_text(text, ("input",))


def check_text(text: str, loc: tuple[str | int, ...]) -> None:
    """A ``TextError`` at ``loc`` for a lone surrogate, which no tokenizer can read and no wire can send."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise TextError(
            f"invalid Unicode: lone surrogate {match.group()!r} at character {match.start()}; send valid UTF-8",
            loc=tuple(_shown(part) if isinstance(part, str) else part for part in loc),
        )


def check_json(limits: Limits, value: Any, loc: tuple[str | int, ...]) -> int:
    """Walk a JSON value without recursion: readable strings and keys, finite numbers, bounded depth.
    Returns about how many bytes it renders to, so that its size is known before it is rendered.
    """
    n_bytes = 0
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, loc)]
    while stack:
        item, where = stack.pop()
        if len(where) - len(loc) > limits.max_depth:
            raise LimitError("max_depth", len(where) - len(loc), limits.max_depth, "the state's nesting")
        if isinstance(item, str):
            check_text(item, where)
            n_bytes += _utf8(item) + 2
        elif isinstance(item, Mapping):
            for key, child in item.items():
                check_text(str(key), where)
                n_bytes += _utf8(str(key)) + 4
                stack.append((child, (*where, str(key))))
        elif isinstance(item, list | tuple):
            stack.extend((child, (*where, index)) for index, child in enumerate(item))
            n_bytes += 2
        elif isinstance(item, float) and not math.isfinite(item):
            raise TextError(f"{item!r} is not a JSON number; send a finite number or a string", loc=where)
        else:
            n_bytes += 8
    return n_bytes


def request_error(error: ValidationError) -> RequestError:
    """A pydantic error as a ``RequestError``: loc, msg and type of each problem, never the input."""
    items = tuple(
        {"loc": [_shown(p) if isinstance(p, str) else p for p in e["loc"]], "msg": _shown(e["msg"]), "type": e["type"]}
        for e in error.errors()
    )
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in items)
    return RequestError(f"invalid request: {problems}", errors=items)


def _question_bytes(question: Any, loc: tuple[str | int, ...]) -> int:
    """The UTF-8 bytes of a question's text, each checked readable; JSON text as the row shows it."""
    texts = [
        (text if isinstance(text, str) else json.dumps(text, ensure_ascii=False), where)
        for text, where in _question_texts(question, loc)
        if text is not None
    ]
    for text, where in texts:
        check_text(text, where)
    return sum(_utf8(text) for text, _ in texts)


def _question_texts(question: Any, loc: tuple[str | int, ...]) -> Iterator[tuple[str, tuple[str | int, ...]]]:
    """Every text of a question that the model reads, with where it is."""
    instructions = question.instructions
    if isinstance(instructions, str):
        yield instructions, (*loc, "instructions")
    else:
        yield from _json_strings(instructions, (*loc, "instructions"))
    criteria = question.criteria
    if isinstance(question, ChoiceQuestion):
        for name, description in criteria.items():
            yield name, (*loc, "criteria", name)
            yield description or "", (*loc, "criteria", name)
    elif isinstance(question, ScoreQuestion):
        for index, level in enumerate(criteria):
            yield level, (*loc, "criteria", index)
    elif criteria:
        for side, description in criteria.items():
            yield description or "", (*loc, "criteria", side)


def _json_strings(value: Any, loc: tuple[str | int, ...]) -> Iterator[tuple[str, tuple[str | int, ...]]]:
    """The strings and keys of JSON instructions (small: they are a question, not a state)."""
    if isinstance(value, str):
        yield value, loc
    elif isinstance(value, Mapping):
        for key, child in value.items():
            yield str(key), loc
            yield from _json_strings(child, (*loc, str(key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _json_strings(child, (*loc, index))


def _at_most(limits: Limits, setting: str, value: int, what: str, hint: str = "") -> None:
    limit = getattr(limits, setting)
    if value > limit:
        raise LimitError(setting, value, limit, what, hint)


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _shown(text: Any) -> str:
    """A name safe to put in a message and on any wire: lone surrogates written as escapes."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")
