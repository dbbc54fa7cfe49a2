"""The prompt a schema is decided with, split into a cached head and a per-request part.

The prompt is rendered once through the model's own chat template (``enable_thinking=False``), with
a marker where the input goes, and cut at that marker: the *head* (instructions, the catalog of every
key with every allowed value, the start of the user turn) is the same for every request on the schema
and is prefilled once; the *tail* closes the user turn and opens the assistant turn. A template that
drops or repeats the marker is a ``PromptError``. Models without a template get a plain layout, and a
template that rejects the system role gets the system text merged into the user turn.

The template is rendered around placeholders for the system text and the input, never around user
text, and only that rendering is handed to ``TextTokenizer.mark_control_tokens``: the template's own
control tokens stay control tokens, while the catalog (field names, descriptions, labels) and the
input are read as plain characters, whatever they contain (``tests/test_tokenizer.py``). The input is
fenced by ``fence``, whose nonce hashes the text, so the text cannot close its own fence; a session
(``session.py``) passes a secret nonce instead, drawn once by ``new_fence_nonce``, so that its prompt
can grow turn by turn without the fence changing.
``tests/test_prompt.py`` renders all three layouts.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pcd_core.errors import OptionError, PromptError
from pcd_core.request.schema import Field, OpenField, Schema

MARKER = "\u27e6pcd:input\u27e7"
SYSTEM_MARKER = "\u27e6pcd:system\u27e7"

INSTRUCTIONS = (
    "You are a careful classifier. Read the input, then write one JSON object that has exactly the "
    "keys below, in this order. Each value must be one of the key's allowed values, copied exactly."
)
#: for schemas with open fields: closed keys still copy an allowed value, open keys are written
MIXED_INSTRUCTIONS = (
    "You are a careful assistant. Read the input, then write one JSON object that has exactly the keys "
    "below, in this order. Where a key lists allowed values, copy one of them exactly; otherwise write "
    "the value the key describes, taken from the input."
)
FENCE_NONCE_CHARS = 16  # 64 bits: finding a text that contains its own closing line takes ~2**64 hashes
_NONCE = re.compile(f"[0-9a-f]{{{FENCE_NONCE_CHARS}}}")


class ChatTemplater(Protocol):
    """What prompt rendering needs from a tokenizer: the Hugging Face chat-template call."""

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


def _keep(text: str) -> str:
    return text


@dataclass(frozen=True)
class PromptParts:
    head: str
    tail: str
    layout: str  # "chat", "chat-merged-system" or "plain"
    shared_head: str = ""  # the head up to the first earlier turn's text (``render``); the head without turns

    def request_text(self, text: str, nonce: str | None = None) -> str:
        return fence("INPUT", normalise_input(text), nonce) + self.tail


def normalise_input(text: str) -> str:
    """Strip outer whitespace so that the head's last token never merges with the input's first."""
    if not isinstance(text, str):
        raise PromptError(f"the input must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise PromptError("the input is empty")
    return stripped


def fence(kind: str, text: str, nonce: str | None = None) -> str:
    """``text`` between an opening and a closing line that carry a nonce hashed from ``text`` itself,
    or the caller's secret ``nonce`` (a session's, ``new_fence_nonce``).

    Text that writes a closing line of its own cannot know the nonce its own hash gives, so the data
    cannot end its block and speak as the prompt; the same text always gets the same fence, so results
    stay deterministic and the head, which holds no nonce, stays cached. A hashed nonce changes with
    every character of the text, so a text that grows would be read again from its first token; a
    secret one does not depend on the text, and the text's writer, who never sees it, cannot close
    the fence with it either.
    """
    if nonce is None:
        nonce = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:FENCE_NONCE_CHARS]
    return fence_open(kind, check_nonce(nonce)) + text + fence_close(nonce)


def fence_open(kind: str, nonce: str) -> str:
    """The fence's opening line and the line break after it: what a session's text is read after."""
    return f"<<<{kind} {nonce}>>>\n"


def fence_close(nonce: str) -> str:
    return f"\n<<<END {nonce}>>>"


def new_fence_nonce() -> str:
    """A secret nonce from the operating system's random source, never derived from any text."""
    return secrets.token_hex(FENCE_NONCE_CHARS // 2)


def check_nonce(nonce: str) -> str:
    """``nonce`` if it is ``FENCE_NONCE_CHARS`` lowercase hex digits (what ``new_fence_nonce`` draws):
    anything else could hold a line break or the fence's own syntax.
    """
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise OptionError(f"a fence nonce is {FENCE_NONCE_CHARS} lowercase hex digits, not {nonce!r}")
    return nonce


def catalog_line(field: Field) -> str:
    allowed = " | ".join(label.forms[0] for label in field.labels)
    description = f" {field.description.rstrip('.')}." if field.description else ""
    return f"- {json.dumps(field.name, ensure_ascii=False)}:{description} Allowed: {allowed}"


def describe_value(spec: Any) -> str:
    """A short English description of what an open field's JSON Schema admits, for the catalog."""
    if not isinstance(spec, dict):
        return "any JSON value"
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " or ".join(dict.fromkeys(describe_value(option) for option in spec[key]))
    kind = spec.get("type")
    if kind == "string":
        bounds = []
        if "minLength" in spec:
            bounds.append(f"at least {spec['minLength']}")
        if "maxLength" in spec:
            bounds.append(f"at most {spec['maxLength']}")
        text = "a string" + (f" of {' and '.join(bounds)} characters" if bounds else "")
        if "format" in spec:
            text += f" in {spec['format']} format"
        if "pattern" in spec:
            text += f" matching the pattern {spec['pattern']}"
        return text
    if kind in ("integer", "number"):
        text = "an integer" if kind == "integer" else "a number"
        if "minimum" in spec:
            text += f" from {spec['minimum']}"
        if "maximum" in spec:
            text += f" up to {spec['maximum']}"
        return text
    if kind == "array":
        items = describe_value(spec.get("items", {}))
        limit = f" (at most {spec['maxItems']})" if "maxItems" in spec else ""
        return f"a list{limit} of {items}"
    if kind == "object":
        keys = ", ".join(json.dumps(k, ensure_ascii=False) for k in spec.get("properties", {}))
        return f"an object with the keys {keys}" if keys else "an object"
    if kind in ("boolean", "null"):
        return "true or false" if kind == "boolean" else "null"
    return "any JSON value"


def open_catalog_line(field: OpenField) -> str:
    description = f" {field.description.rstrip('.')}." if field.description else ""
    return f"- {json.dumps(field.name, ensure_ascii=False)}:{description} Write {describe_value(field.value_schema)}."


def system_text(schema: Schema, task: str = "") -> str:
    """The instructions and the catalog, every key in the caller's order. A closed-only schema keeps
    the original instructions word for word, so its decisions do not move when open fields exist.
    """
    lines = [INSTRUCTIONS if not schema.open_fields else MIXED_INSTRUCTIONS]
    if task:
        lines.append(task.strip())
    by_key: dict[str, list[str]] = {}
    for f in schema.fields:  # a multi-label list is listed as its per-label boolean keys
        by_key.setdefault(f.member_of[0] if f.member_of else f.name, []).append(catalog_line(f))
    for item in schema.open_fields:
        by_key[item.name] = [open_catalog_line(item)]
    lines += ["", "Keys:"] + [line for name in schema.keys for line in by_key[name]]
    return "\n".join(lines)


def render(
    tokenizer: ChatTemplater,
    system: str,
    user_prefix: str,
    opener: str,
    turns: Sequence[tuple[str, str]] = (),
) -> PromptParts:
    """Render ``system``, the earlier ``turns`` and ``user_prefix + <input>`` through the template and
    split at the input.

    ``system`` may hold user text (the catalog), and each turn's text is user text, so they are put in
    after the control tokens are marked. A turn is ``(role, text)``, rendered with the template's own
    markup for that role (``assistant``, ``tool``, ``user``). ``shared_head`` ends where the first
    turn's text starts: the part of the head that requests with other turns share.
    """
    user = user_prefix + MARKER
    slots = [f"\u27e6pcd:turn{index}\u27e7" for index in range(len(turns))]
    earlier = [{"role": role, "content": slot} for (role, _), slot in zip(turns, slots)]
    if not getattr(tokenizer, "chat_template", None):
        lines = "".join(f"{role.capitalize()}: {slot}\n\n" for (role, _), slot in zip(turns, slots))
        text, layout = f"{SYSTEM_MARKER}\n\n{lines}{user}\n\nOutput:\n", "plain"
    else:
        try:
            messages = [{"role": "system", "content": SYSTEM_MARKER}, *earlier, {"role": "user", "content": user}]
            text, layout = _apply(tokenizer, messages), "chat"
        except Exception as error:  # templates signal a rejected system role by raising
            if "system" not in str(error).lower():
                raise PromptError(f"the chat template failed: {error}") from error
            if turns:
                raise PromptError(
                    "the model's chat template has no system turn, so earlier turns cannot be placed "
                    "after the instructions; send the input as one user message"
                ) from error
            text = _apply(tokenizer, [{"role": "user", "content": f"{SYSTEM_MARKER}\n\n{user}"}])
            layout = "chat-merged-system"
    for marker, slot in ((MARKER, "input"), (SYSTEM_MARKER, "system"), *zip(slots, slots)):
        if text.count(marker) != 1:
            raise PromptError(f"the chat template kept {text.count(marker)} copies of the {slot} slot instead of one")
    if text.index(SYSTEM_MARKER) > text.index(MARKER):
        raise PromptError("the chat template put the system text after the input")
    mark = getattr(tokenizer, "mark_control_tokens", _keep)
    before_system, rest = text.split(SYSTEM_MARKER)
    between, tail = rest.split(MARKER)
    head = shared_head = mark(before_system) + system
    for index, (slot, (_, turn_text)) in enumerate(zip(slots, turns)):
        if slot not in between:
            raise PromptError("the chat template put an earlier turn after the input")
        before_turn, between = between.split(slot)
        head += mark(before_turn)
        shared_head = head if index == 0 else shared_head
        head += turn_text
    head += mark(between)
    return PromptParts(head=head, tail=mark(tail) + opener, layout=layout, shared_head=shared_head if turns else head)


def _apply(tokenizer: ChatTemplater, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def build_prompt(tokenizer: ChatTemplater, schema: Schema, opener: str, task: str = "") -> PromptParts:
    return render(tokenizer, system_text(schema, task), "Input:\n", opener)
