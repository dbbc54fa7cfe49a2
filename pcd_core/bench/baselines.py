"""The token-by-token competitors PCD is measured against, all on the engine's own backend and head.

- ``generate_free`` (AR): the model writes the whole object, greedy, one token per forward pass with
  the KV cache on, from the same prompt and the same cached head; it stops at the closing brace, at
  an end-of-turn token, or at the cap.
- ``generate_constrained`` (AR-constrained): the same loop, with every step masked to the tokens the
  schema's JSON allows next (keys in schema order, one of each field's allowed value lines, then the
  closing brace). Forced tokens still cost a pass each, as in a grammar engine without jump-forward.
- ``decide_sequential`` (jump-forward): one field at a time on the compiled rows and tries, every
  earlier answer in the prompt and every forced token fast-forwarded: the chosen answer's remaining
  tokens and the next field's row are read in one prefill, whose last position already gives the next
  field's first decision. The best a grammar engine with jump-forward can do.

Each returns a ``BaselineRun``; the pass counts come from ``backend.forward_passes``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import Prefix
from ..compiler import CompiledField, CompiledSchema
from ..decoding import DecisionTask, RoundStats, decode
from ..engine import after_head
from ..errors import BackendError
from .checks import ObjectScanner


@dataclass
class BaselineRun:
    text: str  # what was written after the prompt, the opener included
    values: dict[str, Any] = field(default_factory=dict)  # decisions, where the method makes them
    tokens: int = 0  # tokens written (AR) or decisions read (sequential)
    stop: str = ""  # "brace" | "cap" | "eos" for the generators


def request_ids(engine: Any, compiled: CompiledSchema, text: str) -> tuple[tuple[int, ...], bool]:
    """The per-request tokens after the head, and whether they can be read on the cached head."""
    whole = engine.request_ids(compiled, text)
    rest = after_head(whole, compiled.head_ids)
    return (tuple(whole), False) if rest is None else (rest, True)  # merged: read everything, as fill does


def read_request(engine: Any, compiled: CompiledSchema, head: Prefix, text: str, extra: tuple[int, ...] = ()) -> Prefix:
    ids, on_head = request_ids(engine, compiled, text)
    return engine.backend.prefill(ids + extra, parent=head if on_head else None)


def ar_cap(n_fields: int) -> int:
    """The issue's cap on AR's new tokens: room for every line of a verbose model, then some."""
    return 16 * n_fields + 32


def generate_free(engine: Any, compiled: CompiledSchema, head: Prefix, text: str, cap: int) -> BaselineRun:
    backend, tokenizer = engine.backend, engine.tokenizer
    eos = set(tokenizer.eos_ids)
    opener = compiled.layout.opener
    scanner = ObjectScanner()
    scanner.feed(opener)
    prefix = read_request(engine, compiled, head, text)
    written: list[int] = []
    run = BaselineRun(text=opener, stop="cap")
    while len(written) < cap:
        token = int(np.argmax(backend.next_logp(prefix)))
        if token in eos:
            run.stop = "eos"
            break
        written.append(token)
        if scanner.feed(tokenizer.decode([token])) is not None:
            run.stop = "brace"
            break
        if len(written) < cap:
            prefix = backend.prefill([token], parent=prefix)
    run.text, run.tokens = opener + tokenizer.decode(written), len(written)
    return run


def constrained_lines(engine: Any, compiled: CompiledSchema) -> list[tuple[tuple[int, ...], ...]]:
    """Per step of the object, the token sequences the schema allows: each field's value lines, then
    the closing brace. The lines are the compiler's canonical spellings, tokenized in context.
    """
    steps = [field.answer_ids for field in compiled.fields]
    last = compiled.fields[-1].field
    written = compiled.prompt.tail + compiled.layout.segment(last.name, last.labels[0].forms[0], True)
    closer = engine.tokenizer.continuation(written, compiled.layout.closer)
    steps.append((closer or engine.tokenizer.encode(compiled.layout.closer),))
    return steps


def generate_constrained(
    engine: Any, compiled: CompiledSchema, head: Prefix, text: str, cap: int | None = None
) -> BaselineRun:
    backend, tokenizer = engine.backend, engine.tokenizer
    steps = constrained_lines(engine, compiled)
    prefix = read_request(engine, compiled, head, text)
    written: list[int] = []
    run = BaselineRun(text="", stop="brace")
    for step, lines in enumerate(steps):
        line: list[int] = []
        alive = list(lines)
        while not any(len(candidate) == len(line) for candidate in alive):
            if cap is not None and len(written) >= cap:
                run.stop = "cap"
                break
            allowed = sorted({candidate[len(line)] for candidate in alive})
            logp = backend.next_logp(prefix)
            token = max(allowed, key=lambda t: (logp[t], -t))
            line.append(token)
            written.append(token)
            alive = [c for c in alive if len(c) > len(line) - 1 and c[len(line) - 1] == token]
            if step < len(steps) - 1 or any(len(c) > len(line) for c in alive):
                prefix = backend.prefill([token], parent=prefix)
        if run.stop == "cap":
            break
        if step < len(compiled.fields):
            f = compiled.fields[step]
            run.values[f.name] = f.field.labels[f.answer_ids.index(tuple(line))].value
    run.text, run.tokens = compiled.layout.opener + tokenizer.decode(written), len(written)
    return run


def decide_sequential(engine: Any, compiled: CompiledSchema, head: Prefix, text: str) -> BaselineRun:
    backend = engine.backend
    fields = compiled.fields
    prefix = read_request(engine, compiled, head, text, extra=fields[0].trie.row)
    run = BaselineRun(text="")
    for index, spec in enumerate(fields):
        readout = decode(backend, prefix, [DecisionTask(_below_row(spec))], RoundStats()).readouts[0]
        run.values[spec.name] = spec.field.labels[readout.best].value
        run.tokens += 1
        if index + 1 < len(fields):
            answer, row = spec.answer_ids[readout.best], spec.trie.row
            if answer[: len(row)] != row:
                raise BackendError(f"field {spec.name!r}: its answer line does not start with its row")
            prefix = backend.prefill(answer[len(row) :] + fields[index + 1].trie.row, parent=prefix)
    return run


def _below_row(spec: CompiledField) -> Any:
    """The field's trie as seen from a prefix that already holds its row: the same nodes, no row."""
    view = copy.copy(spec.trie)
    view.row = ()
    return view
