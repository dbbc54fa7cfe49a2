"""Open fields, generated in parallel: every open row grows by one token per forward pass.

Closed fields are decided first; then every open field is one row after the prompt and the closed
answer lines (its key line, ``"summary":``), and each step is one ``backend.grow`` call that reads
every unfinished row and returns the next-token log-probs at each row's end. The first step reads
the answer lines too, as the trunk the rows hang from. Each row has its own llguidance matcher
(``grammar.py``): the log-probs are masked to what the field's JSON Schema allows, the likeliest
legal token is taken, and tokens the grammar forces are appended without a pass (jump-forward). So
a fill costs the closed passes and max(open lengths) steps, not their sum. A field whose
``depends_on`` names another open field waits one wave, with that field's text as the trunk of the
wave's first step.

Every value is valid by construction: a row ends only when its matcher stops after the line ending.
A row that reaches ``max_new_tokens`` is closed where the grammar allows it (a string gets its closing
quote, with a warning) and otherwise raises ``GenerationError`` with the text written so far, never
invalid JSON. The schemas arrive strict (``open_schema.py``): objects with exactly their keys, arrays bounded.
``tests/test_generation.py`` checks validity, pass counts and sequential equality on the real model.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from pcd_core.backends.base import Backend, Prefix, Rows
from pcd_core.concurrency.model_lock import no_pause
from pcd_core.cost import Meter
from pcd_core.errors import GenerationError, OptionError
from pcd_core.prompting.compiler import OpenRowSpec
from pcd_core.prompting.grammar import GrammarTokenizer, RowMatcher
from pcd_core.reading.loaded_model import LaterStep
from pcd_core.request.open_schema import bound_warnings
from pcd_core.request.schema import Schema, open_waves

#: row tokens a wave (or a plain reply, ``Engine.stream``) reserves room for behind its prefix's KV;
#: rows that outgrow it still work (the backend's buffers grow), and many uncapped strings do not
#: reserve them all
MAX_ROOM = 1024


def solo_steps(backend: Backend, pause: Callable[[], None]) -> LaterStep:
    """Later steps read alone: the boundary's ``pause``, then this generation's own pass."""

    def grow(prefix: Prefix, rows: Rows, new: Sequence[Sequence[int]]) -> Rows:
        pause()  # the rows' KV is this generation's own arena: no other request writes it
        return backend.grow(prefix, rows, new)

    return grow


@dataclass
class _Row:
    spec: OpenRowSpec
    matcher: RowMatcher
    ids: list[int]  # the opening, then every generated token (model-chosen and forced)
    logps: list[float] = field(default_factory=list)  # of the model-chosen tokens
    n_forced: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.ids[len(self.spec.opening) :]

    @property
    def done(self) -> bool:
        return self.matcher.done


@dataclass
class GeneratedField:
    """An open field's result: the text the model wrote under the grammar and how sure it was."""

    name: str
    value: Any
    text: str  # the JSON value as written
    n_tokens: int  # generated tokens, forced ones included
    n_forced: int
    logp_sum: float  # natural log-probs of the model-chosen tokens
    mean_probability: float  # mean of exp(logp) over the model-chosen tokens
    wave: int
    token_ids: list[int] = field(default_factory=list)  # the written tokens, after the key's colon
    method: Literal["generated"] = "generated"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "text": self.text,
            "n_tokens": self.n_tokens,
            "n_forced": self.n_forced,
            "logp_sum": self.logp_sum,
            "mean_probability": self.mean_probability,
            "wave": self.wave,
            "method": self.method,
        }


def check_caps(schema: Schema, max_new_tokens: Mapping[str, int] | None) -> None:
    """Refuse, before any pass, a cap for a key that is not an open field (a misspelt one would be
    ignored) and a cap that is not a positive integer.
    """
    if max_new_tokens is None:
        return
    if not isinstance(max_new_tokens, Mapping):
        raise OptionError(f"max_new_tokens must map open fields to token counts, not {max_new_tokens!r}")
    known = [item.name for item in schema.open_fields]
    for name, cap in max_new_tokens.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            listed = ", ".join(map(repr, known)) if known else "none, every field is decided"
            raise OptionError(
                f"max_new_tokens names {name!r}, which is not an open field of this schema{guess} "
                f"(its open fields: {listed})"
            )
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise OptionError(f"max_new_tokens[{name!r}] must be a positive integer, got {cap!r}")


def generate_open_fields(
    backend: Backend,
    grammar_tokenizer: GrammarTokenizer,
    prefix: Prefix,
    specs: tuple[OpenRowSpec, ...],
    schema: Schema,
    meter: Meter,
    max_new_tokens: dict[str, int] | None = None,
    pause: Callable[[], None] = no_pause,
    written_in: tuple[int, ...] = (),
    later: LaterStep | None = None,
) -> tuple[dict[str, GeneratedField], list[str]]:
    """Generate every open field after ``prefix``, wave by wave; returns results and warnings.

    ``written_in`` (the closed answer lines not yet in ``prefix``) is the trunk of the first wave's
    first step, as the previous wave's lines are of each later wave's: read in the same pass as the
    rows' openings, with room for the rows behind it (``Backend.grow``), so the steps never copy it.
    ``pause`` is called between two passes, where the engine may hand the model over (``model_lock.py``);
    a wave's steps after its first go through ``later`` (default: ``solo_steps``).
    Adds to ``meter`` the steps (``open_steps``), the row tokens they read and the tokens written
    (``output_tokens``); the caller counts the passes.
    """
    by_name = {spec.field.name: spec for spec in specs}
    results: dict[str, GeneratedField] = {}
    written: dict[str, list[int]] = {}
    warnings: list[str] = []
    # only the fields given are generated (a subset keeps its waves, minus the fields left out)
    waves = tuple(w for w in (tuple(n for n in wave if n in by_name) for wave in open_waves(schema)) if w)
    for wave_index, wave in enumerate(waves):
        caps = {name: (max_new_tokens or {}).get(name, by_name[name].field.max_new_tokens) for name in wave}
        room = min(MAX_ROOM, sum(len(by_name[name].opening) + caps[name] for name in wave))
        if wave_index:  # the previous wave's lines, exactly as generated, join the shared prefix
            ids = [t for name in waves[wave_index - 1] for t in (*by_name[name].opening, *written[name])]
            pause()
        else:
            ids = list(written_in)
        rows = [
            _Row(
                by_name[name],
                RowMatcher.start(grammar_tokenizer, by_name[name].field.value_schema, by_name[name].line_end),
                list(by_name[name].opening),
            )
            for name in wave
        ]
        steps = later if later is not None else solo_steps(backend, pause)
        prefix = _run_rows(backend, grammar_tokenizer, prefix, rows, caps, meter, steps, tuple(ids), room)
        for row in rows:
            written[row.spec.field.name] = row.generated
            result = results[row.spec.field.name] = _result(row, grammar_tokenizer, wave_index)
            warnings += row.warnings + bound_warnings(result.name, row.spec.field.value_schema, result.value)
            meter.stats = replace(meter.stats, output_tokens=meter.stats.output_tokens + result.n_tokens)
    return results, warnings


def _run_rows(
    backend: Backend,
    tokenizer: GrammarTokenizer,
    prefix: Prefix,
    rows: list[_Row],
    caps: dict[str, int],
    meter: Meter,
    later: LaterStep,
    trunk: tuple[int, ...],
    room: int,
) -> Prefix:
    """One ``backend.grow`` pass per step over every unfinished row, until each matcher stops;
    returns the prefix extended by ``trunk``, which the first pass reads before the rows.

    The first pass reads the trunk and every row's opening, with ``room`` reserved for the rows;
    each later pass (``later``) reads only the tokens a row gained since (the model's last pick and
    any forced ones), with the rows' own KV kept by the backend.
    """
    state = None
    while True:
        for row in rows:
            _jump_forward(row, tokenizer, caps)
        seen = state.ids if state is not None else tuple(() for _ in rows)
        new = [tuple(row.ids[len(had) :]) if not row.done else () for row, had in zip(rows, seen)]
        if state is not None and not any(new):
            return state.prefix
        tokens_before = backend.counter.mine().tokens_read
        read_trunk = trunk if state is None else ()  # the prompt's tokens, not row tokens
        state = backend.grow(prefix, None, new, trunk=trunk, room=room) if state is None else later(prefix, state, new)
        prefix = state.prefix
        spent = meter.stats
        read = backend.counter.mine().tokens_read - tokens_before - len(read_trunk)
        meter.stats = replace(spent, open_steps=spent.open_steps + 1, row_tokens=spent.row_tokens + read)
        for row, logp in zip(rows, state.logp):
            if logp is None:
                continue
            token = _best_allowed(row, logp)
            row.matcher.consume([token])
            row.ids.append(token)
            row.logps.append(float(logp[token]))


def _best_allowed(row: _Row, logp: np.ndarray) -> int:
    """The likeliest token the row's grammar allows (greedy, so a fill is deterministic)."""
    allowed = row.matcher.allowed()
    n = min(logp.size, allowed.size)
    masked = np.where(allowed[:n], logp[:n], -math.inf)
    token = int(np.argmax(masked))
    if masked[token] == -math.inf:
        name = row.spec.field.name
        raise GenerationError(
            f"field {name!r}: the grammar allows no token of this model", field=name, cause="no_allowed_token"
        )
    return token


def _jump_forward(row: _Row, tokenizer: GrammarTokenizer, caps: dict[str, int]) -> None:
    """Append forced tokens, and close a row that reached its cap where the grammar lets it close."""
    if row.done:
        return
    forced = row.matcher.forced()
    if forced:
        row.matcher.consume(forced)
        row.ids.extend(forced)
        row.n_forced += len(forced)
    name = row.spec.field.name
    if row.done or len(row.generated) < caps[name]:
        return
    for text in (row.spec.line_end, '"' + row.spec.line_end):
        closing = tokenizer.encode(text)
        if closing and row.matcher.accepts(closing):
            row.matcher.consume(closing)
            row.ids.extend(closing)
            row.n_forced += len(closing)  # written by us, like forced tokens: no pass, no log-prob
            row.warnings.append(
                f"field {name!r}: cut at max_new_tokens={caps[name]} and closed; the text may be incomplete"
            )
            return
    partial = tokenizer.decode(row.generated)[len(row.spec.value_prefix) :]
    shown = partial if len(partial) <= 300 else f"{partial[:150]}...{partial[-150:]}"
    raise GenerationError(
        f"field {name!r}: the value did not finish within max_new_tokens={caps[name]}; it had written "
        f"{shown!r}. Raise the cap (engine.fill(..., max_new_tokens={{field: n}})) or bound the field "
        "(maxLength, maxItems)",
        field=name,
        text=partial,
        cause="max_new_tokens",
    )


def _result(row: _Row, tokenizer: GrammarTokenizer, wave: int) -> GeneratedField:
    written = tokenizer.decode(row.generated)
    text = written[len(row.spec.value_prefix) : len(written) - len(row.spec.line_end)]
    chosen = row.logps
    return GeneratedField(
        name=row.spec.field.name,
        value=json.loads(text),
        text=text,
        n_tokens=len(row.generated),
        n_forced=row.n_forced,
        logp_sum=float(sum(chosen)),
        mean_probability=float(np.mean(np.exp(chosen))) if chosen else 1.0,
        wave=wave,
        token_ids=list(row.generated),
    )
