"""Schema + prompt -> ``CompiledSchema``: the head, and per field the token paths of every spelling.

Each field's *variants* are the tokens of its complete JSON line for every spelling of every label,
tokenized in the context the model reads them in, plus the first token of whatever follows the line
(so that no variant is a prefix of another, and ``exact`` scoring sees the real line ending). The
field's row is the variants' common prefix; the decision points are where they part.
Compilation tries each newline layout in turn and keeps the first whose every seam is clean; a field
no layout can cut cleanly raises ``TokenizationError`` that names it. ``tests/test_compiler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field

from pcd_core.errors import TokenizationError
from pcd_core.prompting.prompt import PromptParts, build_prompt
from pcd_core.prompting.trie import LabelTrie, Variant
from pcd_core.request.schema import Field, OpenField, Schema
from pcd_core.tokenizer import LAYOUTS, Layout, TextTokenizer


@dataclass(frozen=True)
class CompiledField:
    field: Field
    variants: tuple[Variant, ...]
    answer_ids: tuple[tuple[int, ...], ...]  # per label: its canonical line, written into the prompt
    trie: LabelTrie = dataclass_field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.field.name


@dataclass(frozen=True)
class CompiledSchema:
    schema: Schema
    prompt: PromptParts
    layout: Layout
    head_ids: tuple[int, ...]
    fields: tuple[CompiledField, ...]
    waves: tuple[tuple[str, ...], ...]
    open_rows: tuple[OpenRowSpec, ...] = ()

    def field(self, name: str) -> CompiledField:
        return next(f for f in self.fields if f.name == name)

    @property
    def max_variant_tokens(self) -> int:
        return max((len(v.ids) for f in self.fields for v in f.variants), default=0)


def compile_schema(schema: Schema, tokenizer: TextTokenizer, task: str = "") -> CompiledSchema:
    """Compile with the first newline layout that tokenizes every line cleanly."""
    errors: list[TokenizationError] = []
    for layout in LAYOUTS:
        try:
            return _compile_with(schema, tokenizer, layout, task)
        except TokenizationError as error:
            errors.append(error)
    raise errors[0]


def _compile_with(schema: Schema, tokenizer: TextTokenizer, layout: Layout, task: str) -> CompiledSchema:
    prompt = build_prompt(tokenizer, schema, layout.opener, task)
    waves = schema.waves()
    # with open fields after them, no closed line ends the object
    last_name = schema.fields[-1].name if schema.fields and not schema.open_fields else None
    compiled = []
    after_first = prompt.tail
    if schema.fields:
        first = schema.field(waves[0][0])
        # Every field but the first is asked right after the first field's answer line.
        after_first += layout.segment(first.name, first.labels[0].forms[0], first.name == last_name)
        for field in schema.fields:
            before = prompt.tail if field is first else after_first
            compiled.append(compile_field(tokenizer, layout, field, before, field.name == last_name))
    return CompiledSchema(
        schema=schema,
        prompt=prompt,
        layout=layout,
        head_ids=tokenizer.encode_head(prompt.head),
        fields=tuple(compiled),
        waves=waves,
        open_rows=compile_open_fields(schema, tokenizer, layout, after_first),
    )


def compile_field(tokenizer: TextTokenizer, layout: Layout, field: Field, before: str, last: bool) -> CompiledField:
    following = layout.closer if last else layout.next_key_start
    variants: list[Variant] = []
    answers: list[tuple[int, ...]] = []
    for index, label in enumerate(field.labels):
        for form_index, form in enumerate(label.forms):
            line = layout.segment(field.name, form, last)
            ids = tokenizer.continuation(before, line)
            if ids is None:
                raise TokenizationError(
                    f"the line merges with the text before it under the {layout.name} layout",
                    field=field.name,
                    text=line,
                )
            tail = tokenizer.continuation(before + line, following)
            if tail is None:
                raise TokenizationError(
                    f"the line merges with the text after it under the {layout.name} layout",
                    field=field.name,
                    text=line + following,
                )
            variants.append(Variant(label=index, ids=ids + tail[:1]))
            if form_index == 0:
                answers.append(ids)
    return CompiledField(field, tuple(variants), tuple(answers), LabelTrie(tuple(variants), field.name))


@dataclass(frozen=True)
class OpenRowSpec:
    """One open field compiled: the ids of its key line up to the value, and how the line ends."""

    field: OpenField
    opening: tuple[int, ...]
    value_prefix: str  # what the grammar writes before the value: " " after the colon
    line_end: str


def compile_open_fields(
    schema: Schema, tokenizer: TextTokenizer, layout: Layout, before: str
) -> tuple[OpenRowSpec, ...]:
    """The open rows, tokenized after ``before`` (the prompt up to a written answer line).

    The row ends right after the key's colon when the colon and the value's first token stay apart,
    as they do in GPT-2-style and Qwen tokenizers (``":`` then `` "``): the space belongs to the value,
    so the grammar writes it (end the row where the tokenizer would).
    """
    probe_line = layout.segment("k", "0", last=False)
    line_end = probe_line[probe_line.index(": 0") + 3 :]
    specs = []
    for item in schema.open_fields:
        line = layout.segment(item.name, "0", last=False)
        key_part = line[: line.index(": 0") + 1]
        opening = tokenizer.continuation(before, key_part)
        after = tokenizer.continuation(before + key_part, ' "x"' + line_end)
        if opening is None or after is None:
            raise TokenizationError(
                "the open field's key line merges with the text around it", field=item.name, text=key_part
            )
        specs.append(OpenRowSpec(item, opening, " ", line_end))
    return tuple(specs)
