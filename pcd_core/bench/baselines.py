"""The token-by-token competitors PCD is measured against, all on the engine's own backend and head.

- ``generate_free`` (AR): the model writes the whole object, greedy, one token per forward pass with
  the KV cache on, from the same prompt and the same cached head; it stops at the closing brace, at
  an end-of-turn token, or at the cap.
- ``generate_grammar`` (AR-constrained, ``arc``): the same loop, masked by llguidance over
  the whole object's JSON Schema, the grammar engine vLLM and SGLang users run; every token, forced
  or not, costs a pass, as in those servers without jump-forward. It handles open fields too.
- ``decide_sequential`` (jump-forward): one field at a time on the compiled rows and tries, every
  earlier answer in the prompt and every forced token fast-forwarded: the chosen answer's remaining
  tokens and the next field's row are read in one prefill, whose last position already gives the next
  field's first decision. The best a grammar engine with jump-forward can do. Open fields follow, one
  after another, each generated under its grammar with jump-forward and written in before the next.

Each returns a ``BaselineRun``; the pass counts come from ``backend.forward_passes``.

With dummy weights (``pcd bench --dummy-weights``) a generator given a ``script`` writes that
document (PCD's answer) instead of its own choice: a random model never closes the object, so left
alone it would run to the cap, and the token count, which sets the time, would be the cap's. Every
step still runs the forward pass, the argmax and, for AR-constrained, the grammar's mask, and a
token the grammar refuses ends the script; only the choice is replaced.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcd_core.backends.base import Prefix
from pcd_core.bench.checks import ObjectScanner
from pcd_core.errors import BackendError
from pcd_core.prompting.compiler import CompiledField, CompiledSchema
from pcd_core.reading.read_path import after_head
from pcd_core.reading.rounds import DecisionTask, RoundStats, decode


@dataclass
class BaselineRun:
    text: str  # what was written after the prompt, the opener included
    values: dict[str, Any] = field(default_factory=dict)  # decisions, where the method makes them
    tokens: int = 0  # tokens written (AR) or decisions read (sequential)
    stop: str = ""  # "brace" | "cap" | "eos" for the generators
    prefix: Prefix | None = field(default=None, repr=False)  # where a sequential run ended


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


def generate_free(
    engine: Any, compiled: CompiledSchema, head: Prefix, text: str, cap: int, script: Sequence[int] = ()
) -> BaselineRun:
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
        if len(written) < len(script):
            token = script[len(written)]
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
        else:
            run.prefix = backend.prefill(spec.answer_ids[readout.best][len(spec.trie.row) :], parent=prefix)
    return run


def fill_sequential(engine: Any, compiled: CompiledSchema, head: Prefix, text: str) -> BaselineRun:
    """Closed fields one by one (``decide_sequential``), then each open field alone after them."""
    from pcd_core.cost import Meter
    from pcd_core.reading.generation import generate_open_fields

    if compiled.fields:
        run = decide_sequential(engine, compiled, head, text)
        prefix = run.prefix
    else:
        run, prefix = BaselineRun(text=""), read_request(engine, compiled, head, text)
    assert prefix is not None
    grammar = engine.model.grammar
    for spec in compiled.open_rows:
        done, _ = generate_open_fields(engine.backend, grammar, prefix, (spec,), compiled.schema, Meter())
        generated = done[spec.field.name]
        run.values[spec.field.name] = generated.value
        run.tokens += generated.n_tokens
        prefix = engine.backend.prefill(spec.opening + tuple(generated.token_ids), parent=prefix)
    return run


def generate_grammar(
    engine: Any, compiled: CompiledSchema, head: Prefix, text: str, cap: int, script: Sequence[int] = ()
) -> BaselineRun:
    """Greedy token-by-token generation of the whole object under llguidance's JSON Schema mask."""
    from pcd_core.prompting.grammar import object_matcher

    backend, grammar = engine.backend, engine.model.grammar
    matcher = object_matcher(grammar, compiled.schema)
    opener = compiled.layout.opener
    matcher.consume(grammar.encode(opener))  # the prompt already ends with it
    prefix = read_request(engine, compiled, head, text)
    written: list[int] = []
    run = BaselineRun(text=opener, stop="cap")
    while len(written) < cap:
        logp = backend.next_logp(prefix)
        allowed = matcher.allowed()
        n = min(logp.size, allowed.size)
        token = int(np.argmax(np.where(allowed[:n], logp[:n], -np.inf)))
        if len(written) < len(script):
            wanted = script[len(written)]
            if wanted < n and allowed[wanted]:
                token = wanted
            else:  # the grammar writes this document another way: the model's choices from here
                script = ()
        matcher.consume([token])
        written.append(token)
        if matcher.matcher.is_accepting():
            run.stop = "brace"
            break
        prefix = backend.prefill([token], parent=prefix)
    run.text, run.tokens = opener + grammar.decode(written), len(written)
    return run


def scripted_document(engine: Any, compiled: CompiledSchema, value: dict[str, Any]) -> tuple[int, ...]:
    """The tokens of ``value`` written as an indented JSON object after the prompt's opener: the
    script that the generators follow with dummy weights.
    """
    document = json.dumps(value, indent=2, ensure_ascii=False)
    opener = compiled.layout.opener
    rest = document[len(opener) :] if document.startswith(opener) else document
    return tuple(engine.tokenizer.hf.encode(rest, add_special_tokens=False))


def _below_row(spec: CompiledField) -> Any:
    """The field's trie as seen from a prefix that already holds its row: the same nodes, no row."""
    view = copy.copy(spec.trie)
    view.row = ()
    return view
