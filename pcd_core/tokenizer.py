"""The one place that knows tokenizer quirks: BOS handling, in-context encoding and newline layouts.

Text is always tokenized complete and in context: ``continuation(before, text)`` encodes
``before + text`` and keeps the new tokens only if the tokens of ``before`` come out unchanged;
otherwise the seam merged and the row would not be what the model reads, so it returns ``None``
and the caller raises ``TokenizationError``. Where the newline between JSON lines attaches differs
by tokenizer (Qwen glues it to the comma before, SmolLM2 to the indentation after, Gemma keeps it
alone), so there are two layouts, and the compiler keeps the first whose every seam is clean.
``tests/test_tokenizer.py`` probes both real tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Layout:
    """How a JSON object is cut into per-field segments whose seams are token boundaries."""

    name: str
    opener: str  # written after the prompt, before the first key
    indent: str
    newline_after: bool  # True: segments start with "\n"; False: segments end with "\n"

    def segment(self, key: str, form: str, last: bool) -> str:
        line = f"{self.indent}{json.dumps(key, ensure_ascii=False)}: {form}"
        if self.newline_after:
            return "\n" + line + ("" if last else ",")
        return line + ("\n" if last else ",\n")

    @property
    def closer(self) -> str:
        return "\n}" if self.newline_after else "}"

    @property
    def next_key_start(self) -> str:
        """The text that follows a non-last segment: the start of the next key."""
        return ("\n" if self.newline_after else "") + self.indent + '"'


#: SmolLM2-style first: "\n  " is one token there, and it must open the segment.
LAYOUTS = (
    Layout("newline-after", "{", "  ", True),
    Layout("newline-before", "{\n", "  ", False),
)


class TextTokenizer:
    """A Hugging Face tokenizer seen through the few operations the compiler needs."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        plain = self.hf.encode("a", add_special_tokens=False)
        special = self.hf.encode("a", add_special_tokens=True)
        # tokens the tokenizer puts before text on its own (Gemma's <bos>), kept for the head
        self.leading_ids = tuple(special[: len(special) - len(plain)]) if special[-len(plain) :] == plain else ()
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        return self.hf.apply_chat_template(conversation, **kwargs)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.hf.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> tuple[int, ...]:
        return self._encode(text)

    def encode_head(self, text: str) -> tuple[int, ...]:
        """The head's ids, with the tokenizer's own leading special tokens unless the text has them."""
        ids = self.encode(text)
        if self.leading_ids and ids[: len(self.leading_ids)] != self.leading_ids:
            ids = self.leading_ids + ids
        return ids

    def decode(self, ids: Any) -> str:
        return self.hf.decode(list(ids))

    def continuation(self, before: str, text: str) -> tuple[int, ...] | None:
        """The ids ``text`` adds after ``before`` when both are read together, or None on a merge."""
        base = self.encode(before)
        whole = self.encode(before + text)
        if whole[: len(base)] != base or len(whole) == len(base):
            return None
        return whole[len(base) :]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        for name in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
            token_id = self.hf.convert_tokens_to_ids(name)
            if isinstance(token_id, int) and token_id != getattr(self.hf, "unk_token_id", None):
                ids.add(token_id)
        return tuple(sorted(ids))
