"""The one place that knows tokenizer quirks: BOS handling, in-context encoding and newline layouts.

Text is always tokenized complete and in context: ``continuation(before, text)`` encodes
``before + text`` and keeps the new tokens only if the tokens of ``before`` come out unchanged;
otherwise the seam merged and the row would not be what the model reads, so it returns ``None``
and the caller raises ``TokenizationError``. Where the newline between JSON lines attaches differs
by tokenizer (Qwen glues it to the comma before, SmolLM2 to the indentation after, Gemma keeps it
alone), so there are two layouts, and the compiler keeps the first whose every seam is clean.

Control tokens come only from the chat template. ``mark_control_tokens`` (called by ``prompt.render``
on the template's own text, never on a user's) swaps each control token the template wrote for a
sentinel, a lone surrogate; ``encode`` turns sentinels into their ids and encodes everything between
them with special-token parsing off (``split_special_tokens=True``), so ``<|im_end|>`` typed by a user
is read as the characters it is (an added token not marked special, which that switch leaves whole, is
cut apart first). Lone surrogates are invalid Unicode, so no valid text can forge a
sentinel: the engine refuses any lone surrogate in user text before tokenizing (``pcd_core/request/limits.py``),
and ``encode`` refuses one that is not a sentinel. Encoded texts are cached in a small LRU bounded in
bytes that never admits a long text (a request's state), so rejected requests leave nothing behind.
``tests/test_tokenizer.py`` probes both real tokenizers.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pcd_core.errors import PromptError

#: Sentinels are lone surrogates: no valid Unicode text holds one, so a user cannot forge them.
_SENTINEL_BASE, _SENTINEL_END = 0xD800, 0xE000
_SURROGATE = re.compile("[\ud800-\udfff]")


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


class EncodeCache:
    """An LRU of encoded texts bounded in bytes; texts longer than ``max_text_chars`` are never kept.

    What repeats across requests is short (the head, the tail, a label line); what is long is one
    request's input or state, which would only pin memory, most of all when the request is rejected.
    """

    def __init__(self, max_bytes: int = 8 << 20, max_text_chars: int = 8192) -> None:
        self.max_bytes = max_bytes
        self.max_text_chars = max_text_chars
        self.n_bytes = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        size = entry_bytes(text, ids)
        if len(text) > self.max_text_chars or size > self.max_bytes:
            return
        with self._lock:
            if text in self._entries:
                return
            self._entries[text] = ids
            self.n_bytes += size
            while self.n_bytes > self.max_bytes:
                old_text, old_ids = self._entries.popitem(last=False)
                self.n_bytes -= entry_bytes(old_text, old_ids)


def entry_bytes(text: str, ids: tuple[int, ...]) -> int:
    """What one cache entry holds in memory: the key, the tuple and its int objects (32 bytes each)."""
    return sys.getsizeof(text) + sys.getsizeof(ids) + 32 * len(ids)


class TextTokenizer:
    """A Hugging Face tokenizer seen through the few operations the compiler needs."""

    def __init__(self, hf_tokenizer: Any, cache: EncodeCache | None = None) -> None:
        self.hf = hf_tokenizer
        plain = self.hf.encode("a", add_special_tokens=False)
        special = self.hf.encode("a", add_special_tokens=True)
        # tokens the tokenizer puts before text on its own (Gemma's <bos>), kept for the head
        self.leading_ids = tuple(special[: len(special) - len(plain)]) if special[-len(plain) :] == plain else ()
        self.cache = cache if cache is not None else EncodeCache()
        control = _control_tokens(hf_tokenizer)
        # longest first, so that a token that contains another is matched whole
        self._control = (
            re.compile("|".join(map(re.escape, sorted(control, key=len, reverse=True)))) if control else None
        )
        # a vocabulary without control tokens (the test vocabularies) has nothing to switch off
        self._plain_options = {"split_special_tokens": True} if control else {}
        # added tokens not marked special (Qwen's <tool_call>, <think>) are matched even so
        unsplit = _unsplit_added_tokens(hf_tokenizer)
        self._unsplit = (
            re.compile("|".join(map(re.escape, sorted(unsplit, key=len, reverse=True)))) if unsplit else None
        )
        self._sentinels: dict[str, str] = {}  # control token text -> its sentinel
        self._sentinel_ids: dict[str, int] = {}  # sentinel -> the control token's id
        self._sentinel_lock = threading.Lock()

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        return self.hf.apply_chat_template(conversation, **kwargs)

    def mark_control_tokens(self, template_text: str) -> str:
        """The template's text with each control token it wrote swapped for its sentinel.

        Call it only on text the chat template rendered around placeholders, never on user text:
        what it marks is what ``encode`` reads as control tokens.
        """
        if self._control is None:
            return template_text
        return self._control.sub(lambda match: self._sentinel(match.group()), template_text)

    def _sentinel(self, token: str) -> str:
        with self._sentinel_lock:
            if token not in self._sentinels:
                code = _SENTINEL_BASE + len(self._sentinels)
                if code >= _SENTINEL_END:
                    raise PromptError("the chat template writes more distinct control tokens than can be marked")
                self._sentinels[token] = chr(code)
                self._sentinel_ids[chr(code)] = self.hf.convert_tokens_to_ids(token)
            return self._sentinels[token]

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        ids: list[int] = []
        start = 0
        for match in _SURROGATE.finditer(text):
            token_id = self._sentinel_ids.get(match.group())
            if token_id is None:
                raise PromptError(
                    f"the text holds invalid Unicode (lone surrogate {match.group()!r} at character "
                    f"{match.start()}); send valid UTF-8"
                )
            ids += self._encode_plain(text[start : match.start()])
            ids.append(token_id)
            start = match.end()
        ids += self._encode_plain(text[start:])
        return tuple(ids)

    def _encode_plain(self, text: str) -> list[int]:
        """Text with no control tokens: whatever looks like one is read as characters.

        ``split_special_tokens`` covers the special tokens; the tokenizer still matches an added
        token that is not special, so the text is cut after the first character of each such
        occurrence and the pieces are encoded apart, which reads it as the characters it is.
        """
        if not text:
            return []
        if self._unsplit is None:
            return self.hf.encode(text, add_special_tokens=False, **self._plain_options)
        cuts = [match.start() + 1 for match in self._unsplit.finditer(text)]
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
        return [i for piece in pieces for i in self.hf.encode(piece, add_special_tokens=False, **self._plain_options)]

    def encode(self, text: str) -> tuple[int, ...]:
        """The ids of ``text``: control tokens only where ``mark_control_tokens`` put sentinels."""
        ids = self.cache.get(text)
        if ids is None:
            ids = self._encode_uncached(text)
            self.cache.put(text, ids)
        return ids

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


def _unsplit_added_tokens(hf_tokenizer: Any) -> tuple[str, ...]:
    """The added tokens that ``split_special_tokens`` leaves whole: those not marked special."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return ()
    return tuple(str(token.content) for token in decoder.values() if not getattr(token, "special", True))


def _control_tokens(hf_tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer would read as one added token (``<|im_start|>``, ``<bos>``)."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict) and decoder:
        return tuple(str(getattr(token, "content", token)) for token in decoder.values())
    return tuple(getattr(hf_tokenizer, "all_special_tokens", ()) or ())
