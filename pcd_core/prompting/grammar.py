"""Token masks for open fields, from llguidance: one matcher per generated row.

An open field's row ends right after its key (``"summary":``); what follows is generated under a
grammar made of a space, the field's own JSON Schema as a value, and the text that ends the line in
the compiler's layout (``,`` where SmolLM2 glues the newline to the next line, a comma and a newline where Qwen
glues it to the comma). Ending the grammar with the line's real ending lets the model close a string
with the token it would write anyway (``",`` is one token in both families), and tells us the value is
complete the moment the matcher stops. JSON is compact (no free whitespace), so a small model cannot
pad a value with newlines until the cap.

llguidance does the hard part: JSON Schema (string length, ``pattern``, formats, numeric bounds,
``multipleOf``, nested objects with forced keys, arrays with ``maxItems``, ``anyOf`` with null) to a
mask over the real vocabulary, and the forced continuation (jump-forward) where only one is legal.
``tests/test_grammar.py`` checks masks and forced tokens on the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from pcd_core.errors import BackendUnavailableError, SchemaError
from pcd_core.request.schema import Schema

#: compact JSON inside generated values: one way to write each value, no whitespace runs
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise BackendUnavailableError("open", error.name or "llguidance") from error
    return llguidance


class GrammarTokenizer:
    """The llguidance view of one Hugging Face tokenizer; building it reads the whole vocabulary once."""

    def __init__(self, hf_tokenizer: Any, eos_ids: tuple[int, ...]) -> None:
        llguidance = _llguidance()
        if hasattr(hf_tokenizer, "token_bytes"):  # a vocabulary of our own (pcd_core/testing.py)
            self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_OwnVocabulary(hf_tokenizer, eos_ids)))
        else:
            self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_ids) or None)
        self.vocab_size = int(self.ll.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Plain tokens of ``text`` (no special tokens), for endings the engine writes itself."""
        return [int(t) for t in self.ll.tokenize_str(text)]

    def decode(self, ids: list[int]) -> str:
        """Exact text of ``ids``, byte for byte (no clean-up of spaces)."""
        return str(self.ll.decode_str(list(ids)))


class _OwnVocabulary:
    """What llguidance's wrapper reads from a tokenizer that is not a Hugging Face fast one: the
    bytes of every token id, the end-of-text id, and an encoder.
    """

    def __init__(self, vocabulary: Any, eos_ids: tuple[int, ...]) -> None:
        self.tokens = list(vocabulary.token_bytes())
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = None
        self._encode = vocabulary.encode

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


@lru_cache(maxsize=256)
def _grammar_text(value_schema_json: str, line_end: str) -> str:
    from llguidance import LLMatcher

    lark = f'start: " " value {json.dumps(line_end)}\nvalue: %json {value_schema_json}'
    return str(LLMatcher.grammar_from_lark(lark))


def value_grammar(value_schema: Mapping[str, Any], line_end: str) -> str:
    """The llguidance grammar of one open row: space, value, line ending."""
    _llguidance()
    schema = {**value_schema, "x-guidance": _COMPACT}
    return _grammar_text(json.dumps(schema, sort_keys=True, ensure_ascii=False), line_end)


def check_value_schema(name: str, value_schema: Mapping[str, Any], tokenizer: GrammarTokenizer) -> None:
    """Refuse a schema llguidance cannot compile, naming the field, before any model pass."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(value_grammar(value_schema, ","), tokenizer.ll)
    if is_error:
        raise SchemaError(f"the grammar engine cannot compile this field's schema: {messages[0]}", field=name)


@dataclass
class RowMatcher:
    """The grammar state of one generated row: what may come next, and whether the value is complete."""

    matcher: Any
    vocab_size: int

    @classmethod
    def start(cls, tokenizer: GrammarTokenizer, value_schema: Mapping[str, Any], line_end: str) -> RowMatcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(tokenizer.ll, value_grammar(value_schema, line_end), log_level=0)
        if matcher.is_error():
            raise SchemaError(f"the grammar engine rejected the schema: {matcher.get_error()}")
        return cls(matcher, tokenizer.vocab_size)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation: appended without a model pass."""
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    def allowed(self) -> np.ndarray:
        """Boolean mask over the vocabulary of the tokens the grammar allows next."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        return bits.reshape(-1)[: self.vocab_size].astype(bool)

    def consume(self, ids: list[int]) -> None:
        if not self.matcher.consume_tokens(list(ids)):
            # the mask only offers legal tokens, so this is a broken contract, not bad input
            raise RuntimeError(f"the grammar refused tokens it allowed: {self.matcher.get_error()}")

    def accepts(self, ids: list[int]) -> bool:
        """Whether ``ids`` would complete the value from here, without changing this matcher."""
        trial = self.matcher.deep_copy()
        return bool(trial.consume_tokens(list(ids)) and trial.is_stopped())


def object_schema(schema: Schema) -> dict[str, Any]:
    """The whole object as one JSON Schema, every key required and in order: what a grammar engine
    constrains token-by-token generation with. Closed fields are enums of their labels, a multi-label
    list an array of its labels, open fields their own schema.
    """
    properties: dict[str, Any] = {}
    members: dict[str, list[Any]] = {}
    for field in schema.fields:
        if field.member_of is not None:
            members.setdefault(field.member_of[0], []).append(field.member_of[1])
        else:
            properties[field.name] = {"enum": [label.value for label in field.labels]}
    for name, labels in members.items():
        properties[name] = {"type": "array", "items": {"enum": labels}, "uniqueItems": True}
    for item in schema.open_fields:
        properties[item.name] = item.value_schema
    ordered = {name: properties[name] for name in schema.keys}
    return {"type": "object", "properties": ordered, "required": list(ordered), "additionalProperties": False}


def object_matcher(tokenizer: GrammarTokenizer, schema: Schema) -> RowMatcher:
    """A matcher for the whole object, JSON whitespace as the grammar engine allows it by default."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(json.dumps(object_schema(schema)))
    matcher = LLMatcher(tokenizer.ll, grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(f"the grammar engine rejected the object schema: {matcher.get_error()}")
    return RowMatcher(matcher, tokenizer.vocab_size)
