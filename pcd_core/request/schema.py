"""The fields of a schema: closed decisions with their labels, open fields with their own schema.

Every closed field is a finite set of labels, and every label carries the JSON spellings (``forms``)
a model may use to write it: ``true`` and ``"true"`` for a boolean, ``"NEGATIVE"`` for a string, ``3``
and ``"3"`` for an integer. A ``list[Literal]`` is one boolean decision per label. Anything else
(strings, open numbers, nested objects, other lists) is an ``OpenField``, generated under its JSON
Schema (``generation.py``). Schemas arrive as a pydantic class, a TypedDict, a JSON Schema or a plain
dict of fields; a schema that cannot be read is a ``SchemaError`` that names the field.
``tests/test_schema.py`` covers every accepted form and every rejection.

Why one module of ~470 lines: every accepted input form (pydantic, TypedDict, JSON Schema, plain dict)
ends in the same ``Field``/``Label``/``OpenField`` checks and ``depends_on`` waves, which a split by
form would have to share back.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcd_core.errors import SchemaError
from pcd_core.request.open_schema import strict_schema

JsonValue = bool | int | float | str | None


@dataclass(frozen=True)
class Label:
    """One allowed value and its JSON spellings, the canonical spelling first."""

    value: JsonValue
    forms: tuple[str, ...]

    @property
    def text(self) -> str:
        """The label as users read it: the string itself, or the JSON literal."""
        return self.value if isinstance(self.value, str) else json.dumps(self.value)


@dataclass(frozen=True)
class Field:
    name: str
    description: str
    labels: tuple[Label, ...]
    depends_on: tuple[str, ...] = ()
    #: for one label of a multi-label list: (the list's key, the label); the field is then a boolean
    member_of: tuple[str, JsonValue] | None = None


@dataclass(frozen=True)
class OpenField:
    """A field whose value is written, not chosen: generated under its own JSON Schema (``grammar.py``).

    ``value_schema_json`` is the property's schema with every ``$ref`` inlined, as canonical JSON, so
    that the field hashes and compares by value and the grammar engine gets a standalone schema.
    """

    name: str
    description: str
    value_schema_json: str
    max_new_tokens: int
    depends_on: tuple[str, ...] = ()

    @property
    def value_schema(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.value_schema_json)
        return loaded


@dataclass(frozen=True)
class Schema:
    """The closed fields in the order the object is written, the open fields beside them, and the model
    class to rebuild, if any. ``order`` is every key in the caller's order (closed and open).
    """

    fields: tuple[Field, ...]
    title: str = ""
    model_class: Any = None
    open_fields: tuple[OpenField, ...] = ()
    order: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return self.order or tuple(f.name for f in self.fields)

    def open_field(self, name: str) -> OpenField:
        return next(f for f in self.open_fields if f.name == name)

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def waves(self) -> tuple[tuple[str, ...], ...]:
        """Dependency levels. The first independent field is decided alone (wave 0), so that every later
        field is asked after one real answer line instead of as the object's first key; any
        other field goes one wave after the latest of its dependencies, and at least into wave 1.
        """
        if not self.fields:
            return ()
        first = next((f.name for f in self.fields if not f.depends_on), None)
        if first is None:
            raise SchemaError("every field depends on another, so none can be decided first")
        names = [f.name for f in self.fields]
        return dependency_levels(names, lambda name: self.field(name).depends_on, {first: 0}, floor=0)

    def rebuild(self, values: dict[str, Any]) -> Any:
        """The caller's type: a pydantic instance for a pydantic class, else the plain dict."""
        if self.model_class is not None and hasattr(self.model_class, "model_validate"):
            return self.model_class.model_validate(values)
        return dict(values)


# Characters that render as nothing: two labels that differ only by these look the same to a reader
# and, after the tokenizer, nearly the same to the model.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"), None)


def normalise_option(name: str) -> str:
    """The form two labels are compared in: NFKC, zero-width characters removed, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", name).translate(_INVISIBLE).split())


def check_distinct(names: Sequence[str], shown: Sequence[str] | None = None, what: str = "options") -> None:
    """Raise ValueError when two names are equal after :func:`normalise_option`: the model could not
    tell them apart. The one rule for a schema's labels and a question's options (HTTP, MCP, ``decide``).
    ``shown`` is how the message writes each name (default: its ``repr``).
    """
    shown = shown if shown is not None else [repr(name) for name in names]
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        key = normalise_option(name)
        if key in seen:
            raise ValueError(
                f"{what} {shown[seen[key]]} and {shown[index]} are the same after Unicode normalisation "
                "(NFKC, zero-width characters removed, whitespace collapsed)"
            )
        seen[key] = index


def _check_distinct_labels(name: str, values: Sequence[Any]) -> None:
    try:
        check_distinct([value for value in values if isinstance(value, str)], what="values")
    except ValueError as error:
        raise SchemaError(str(error), field=name) from None


def spellings(value: JsonValue) -> tuple[str, ...]:
    """Every JSON spelling of a value. Small models often quote booleans and numbers."""
    canonical = json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return canonical, json.dumps(canonical, ensure_ascii=False)
    return (canonical,)


def make_field(name: str, values: list[Any], description: str = "", depends_on: Any = ()) -> Field:
    if not isinstance(name, str) or not name:
        raise SchemaError("a field name must be a non-empty string", field=str(name))
    if not values:
        raise SchemaError("the list of allowed values is empty", field=name)
    labels = []
    seen: set[str] = set()
    for value in values:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (bool, int, str)) and value is not None:
            raise SchemaError(f"value {value!r} is not a string, integer, boolean or null", field=name)
        key = json.dumps(value)
        if key in seen:
            raise SchemaError(f"value {value!r} is listed twice", field=name)
        seen.add(key)
        labels.append(Label(value=value, forms=spellings(value)))
    if len(labels) < 2:
        raise SchemaError(f"only one allowed value ({values[0]!r}); a decision needs two", field=name)
    _check_distinct_labels(name, values)
    if isinstance(depends_on, str):
        depends_on = (depends_on,)
    if not isinstance(depends_on, list | tuple) or not all(isinstance(d, str) for d in depends_on):
        raise SchemaError(f"depends_on must be a field name or a list of them, not {depends_on!r}", field=name)
    if not isinstance(description, str | None):
        raise SchemaError(f"the description must be a string, not {description!r}", field=name)
    return Field(name, str(description or ""), tuple(labels), tuple(depends_on))


def _closed_values(name: str, spec: Mapping[str, Any], defs: Mapping[str, Any]) -> list[Any]:
    """The allowed values of one JSON Schema property, following ``$ref`` into ``$defs``."""
    if "$ref" in spec:
        ref = spec["$ref"]
        key = ref.rsplit("/", 1)[-1]
        if not ref.startswith("#/") or key not in defs:
            raise SchemaError(f"cannot resolve $ref {ref!r}", field=name)
        return _closed_values(name, {**defs[key], **{k: v for k, v in spec.items() if k != "$ref"}}, defs)
    if "enum" in spec:
        if not isinstance(spec["enum"], list | tuple):
            raise SchemaError(f"enum must be a list of values, not {spec['enum']!r}", field=name)
        return list(spec["enum"])
    if "const" in spec:
        return [spec["const"]]
    for key in ("anyOf", "oneOf"):
        if key in spec:
            values: list[Any] = []
            for option in spec[key]:
                values.extend(_closed_values(name, option, defs))
            return values
    kind = spec.get("type")
    small = _small_integer_range(spec)
    if small is not None:
        return small
    if kind == "boolean":
        return [True, False]
    if kind == "null":
        return [None]
    if isinstance(kind, list) and set(kind) <= {"boolean", "null"}:
        return ([True, False] if "boolean" in kind else []) + ([None] if "null" in kind else [])
    if kind in OPEN_KINDS or (isinstance(kind, list) and set(kind) & set(OPEN_KINDS)):
        raise _OpenValue(name)
    raise SchemaError(f"unsupported field {dict(spec)!r}: it is neither closed nor a JSON type", field=name)


#: JSON types whose values are generated under a grammar instead of chosen from a list
OPEN_KINDS = ("string", "integer", "number", "object", "array")
#: an integer with bounds this close together is a closed decision over its values
SMALL_INTEGER_SPAN = 16


class _OpenValue(Exception):
    """Raised inside ``_closed_values`` when a property (or one of its alternatives) is open."""


def _small_integer_range(spec: Mapping[str, Any]) -> list[Any] | None:
    """``{"type": "integer", "minimum": 1, "maximum": 5}`` is the closed set 1..5, not free text."""
    if spec.get("type") != "integer" or "multipleOf" in spec:
        return None
    low = spec.get("minimum", None if "exclusiveMinimum" not in spec else spec["exclusiveMinimum"] + 1)
    high = spec.get("maximum", None if "exclusiveMaximum" not in spec else spec["exclusiveMaximum"] - 1)
    if not isinstance(low, int) or not isinstance(high, int) or not 1 <= high - low + 1 <= SMALL_INTEGER_SPAN:
        return None
    return list(range(low, high + 1))


def _inline_refs(spec: Any, defs: Mapping[str, Any], seen: tuple[str, ...], name: str) -> Any:
    """The schema with every ``#/$defs/...`` reference replaced by its definition (no cycles)."""
    if isinstance(spec, list):
        return [_inline_refs(item, defs, seen, name) for item in spec]
    if not isinstance(spec, Mapping):
        return spec
    if "$ref" in spec:
        ref = spec["$ref"]
        key = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else ""
        if not isinstance(ref, str) or not ref.startswith("#/") or key not in defs:
            raise SchemaError(f"cannot resolve $ref {ref!r}", field=name)
        if key in seen:
            raise SchemaError(
                f"the schema refers to itself through {ref!r}; recursive values are not supported", field=name
            )
        rest = {k: v for k, v in spec.items() if k != "$ref"}
        return _inline_refs({**defs[key], **rest}, defs, (*seen, key), name)
    return {k: _inline_refs(v, defs, seen, name) for k, v in spec.items() if k not in ("$defs", "definitions")}


def _multi_label_values(name: str, spec: Mapping[str, Any], defs: Mapping[str, Any]) -> list[Any] | None:
    """The labels of a ``list[Literal]`` / ``list[Enum]`` property, or None for any other property."""
    resolved = _inline_refs(spec, defs, (), name)
    items = resolved.get("items") if resolved.get("type") == "array" else None
    if not isinstance(items, Mapping):
        return None
    try:
        values = _closed_values(name, items, {})
    except (_OpenValue, SchemaError):
        return None
    return values if len(values) >= 2 and not any(isinstance(v, bool) or v is None for v in values) else None


def membership_fields(name: str, labels: list[Any], description: str, depends_on: Any) -> list[Field]:
    """One boolean decision per label of a multi-label list: is this label in the list? Each is read
    like any boolean (``true``/``false``, bare or quoted) in the packed pass, so the list gets a
    membership probability per label instead of a generated array.
    """
    about = f"{description.rstrip('.')}. " if description else ""
    _check_distinct_labels(name, labels)
    fields = []
    for label in labels:
        shown = label if isinstance(label, str) else json.dumps(label)
        member = make_field(
            f"{name}: {shown}",
            [True, False],
            f"{about}Whether {shown} belongs in the {json.dumps(name, ensure_ascii=False)} list",
            depends_on,
        )
        fields.append(Field(member.name, member.description, member.labels, member.depends_on, (name, label)))
    return fields


def default_max_new_tokens(spec: Mapping[str, Any]) -> int:
    """A cap that never cuts a valid value short for bounded strings (``maxLength`` characters can take
    up to about two tokens each with escapes), and a generous one for everything else.
    """
    explicit = spec.get("x-max-new-tokens", spec.get("max_new_tokens"))
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    kind = spec.get("type")
    if kind == "string" and isinstance(spec.get("maxLength"), int):
        return 2 * int(spec["maxLength"]) + 8
    if kind == "integer":
        return 24
    if kind == "number":
        return 32
    return 256


def make_open_field(name: str, spec: Mapping[str, Any], defs: Mapping[str, Any], description: str) -> OpenField:
    resolved = _inline_refs(spec, defs, (), name)
    resolved = {k: v for k, v in resolved.items() if k not in ("depends_on", "x-depends-on", "title", "default")}
    resolved = strict_schema(resolved)  # exactly the declared keys, bounded arrays (strict.py)
    depends_on = spec.get("depends_on", spec.get("x-depends-on", ()))
    if isinstance(depends_on, str):
        depends_on = (depends_on,)
    return OpenField(
        name=name,
        description=str(description or ""),
        value_schema_json=json.dumps(resolved, sort_keys=True, ensure_ascii=False),
        max_new_tokens=default_max_new_tokens(resolved),
        depends_on=tuple(depends_on),
    )


def from_json_schema(schema: Mapping[str, Any], model_class: Any = None) -> Schema:
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        raise SchemaError("a JSON Schema needs a non-empty 'properties' object")
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    fields = []
    open_fields = []
    for name, spec in properties.items():
        if not isinstance(spec, Mapping):
            raise SchemaError(f"property spec {spec!r} is not an object", field=name)
        description = spec.get("description") or spec.get("title") or ""
        depends_on = spec.get("depends_on", spec.get("x-depends-on", ()))
        members = _multi_label_values(name, spec, defs)
        if members is not None:
            fields += membership_fields(name, members, description, depends_on)
            continue
        try:
            values = _closed_values(name, spec, defs)
        except _OpenValue:
            open_fields.append(make_open_field(name, spec, defs, description))
            continue
        fields.append(make_field(name, values, description, depends_on))
    title = str(schema.get("title", ""))
    return _checked(Schema(tuple(fields), title, model_class, tuple(open_fields), tuple(properties)))


def from_field_dict(spec: Mapping[str, Any]) -> Schema:
    """``{"name": {"enum" | "values": [...] | "type": "boolean", "description", "depends_on"}}``;
    a bare list stands for an enum and the string ``"boolean"`` for a boolean.
    """
    fields = []
    open_fields = []
    for name, item in spec.items():
        if isinstance(item, list):
            item = {"enum": item}
        elif item in ("boolean", bool):
            item = {"type": "boolean"}
        if not isinstance(item, Mapping):
            raise SchemaError(f"field spec {item!r} is neither a list nor an object", field=name)
        if "values" in item:
            item = {**item, "enum": item["values"]}
        try:
            values = _closed_values(name, item, {})
        except _OpenValue:
            open_fields.append(make_open_field(name, item, {}, item.get("description", "")))
            continue
        fields.append(make_field(name, values, item.get("description", ""), item.get("depends_on", ())))
    if not fields and not open_fields:
        raise SchemaError("the schema has no fields")
    return _checked(Schema(tuple(fields), open_fields=tuple(open_fields), order=tuple(spec)))


def _checked(schema: Schema) -> Schema:
    closed = {f.name for f in schema.fields}
    names = closed | {f.name for f in schema.open_fields}
    every: tuple[Field | OpenField, ...] = (*schema.fields, *schema.open_fields)
    for f in every:
        for dep in f.depends_on:
            if dep not in names:
                raise SchemaError(f"depends_on names {dep!r}, which is not a field", field=f.name)
            if dep == f.name:
                raise SchemaError("depends_on names the field itself", field=f.name)
    for f in schema.fields:
        if set(f.depends_on) - closed:
            # closed fields are decided before any open field is written
            raise SchemaError("a closed field cannot depend on an open field", field=f.name)
    schema.waves()  # raises on cycles
    open_waves(schema)
    return schema


def open_waves(schema: Schema) -> tuple[tuple[str, ...], ...]:
    """Waves of open fields: every open field starts after all closed answers are written; one that
    depends on another open field waits until that field's text is written in (one wave later).
    """
    opened = [f.name for f in schema.open_fields]
    return dependency_levels(
        opened, lambda name: [d for d in schema.open_field(name).depends_on if d in opened], {}, floor=-1
    )


def dependency_levels(
    names: list[str], depends_on: Callable[[str], Sequence[str]], fixed: dict[str, int], floor: int
) -> tuple[tuple[str, ...], ...]:
    """``names`` grouped by level, in their order: a name goes one level after the latest of its
    dependencies (``floor + 1`` with none), ``fixed`` names where given; a cycle is a ``SchemaError``.
    """
    wave = dict(fixed)
    visiting: set[str] = set()

    def level(name: str) -> int:
        if name in wave:
            return wave[name]
        if name in visiting:
            raise SchemaError("depends_on forms a cycle", field=name)
        visiting.add(name)
        wave[name] = 1 + max((level(d) for d in depends_on(name)), default=floor)
        visiting.discard(name)
        return wave[name]

    grouped: dict[int, list[str]] = {}
    for name in names:
        grouped.setdefault(level(name), []).append(name)
    return tuple(tuple(grouped[k]) for k in sorted(grouped))


def _typed_dict_json_schema(typed_dict: type) -> dict[str, Any]:
    """A TypedDict's JSON Schema, through an equivalent pydantic model: pydantic rejects
    ``typing.TypedDict`` itself before Python 3.12, and LangChain users pass exactly that.
    """
    import typing

    from pydantic import create_model

    hints = typing.get_type_hints(typed_dict, include_extras=True)
    fields: dict[str, Any] = {name: (hint, ...) for name, hint in hints.items()}
    model = create_model(typed_dict.__name__, **fields)
    return model.model_json_schema()


def parse_schema(schema: Any) -> Schema:
    """Any accepted schema form to a ``Schema``; a ``SchemaError`` for anything else.

    A spec of the wrong shape deep inside (``"enum": 5``, ``"anyOf": "x"``) would fail as a generic
    ``TypeError`` where it is first used; it is reported as the ``SchemaError`` it is.
    """
    try:
        return _parse_schema(schema)
    except (TypeError, AttributeError, KeyError, RecursionError) as error:
        raise SchemaError(f"the schema is malformed ({type(error).__name__}: {error})") from None


def _parse_schema(schema: Any) -> Schema:
    if isinstance(schema, Schema):
        return schema
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return from_json_schema(schema.model_json_schema(), model_class=schema)
    if isinstance(schema, type) and hasattr(schema, "__annotations__") and hasattr(schema, "__total__"):
        return from_json_schema(_typed_dict_json_schema(schema))
    if isinstance(schema, Mapping):
        if "json_schema" in schema and isinstance(schema["json_schema"], Mapping):
            return from_json_schema(schema["json_schema"])
        if "properties" in schema or schema.get("type") == "object":
            return from_json_schema(schema)
        return from_field_dict(schema)
    raise SchemaError(
        f"cannot read a schema from {type(schema).__name__}; pass a pydantic model class, a TypedDict, "
        "a JSON Schema dict or a dict of fields"
    )
