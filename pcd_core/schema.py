"""Closed decisions: the fields of a schema, their labels and the waves they are decided in.

Every field is a finite set of labels, and every label carries the JSON spellings (``forms``) a model
may use to write it: ``true`` and ``"true"`` for a boolean, ``"NEGATIVE"`` for a string, ``3`` and
``"3"`` for an integer. Schemas arrive as a pydantic class, a TypedDict, a JSON Schema or a plain dict
of fields; anything open (free text, unbounded numbers, nested objects) is a ``SchemaError`` that names
the field. ``tests/test_schema.py`` covers every accepted form and every rejection.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SchemaError

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


@dataclass(frozen=True)
class Schema:
    """The closed fields in the order the object is written, and the model class to rebuild, if any."""

    fields: tuple[Field, ...]
    title: str = ""
    model_class: Any = None

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def waves(self) -> tuple[tuple[str, ...], ...]:
        """Dependency levels. The first independent field is decided alone (wave 0), so that every later
        field is asked after one real answer line instead of as the object's first key (seed 000); any
        other field goes one wave after the latest of its dependencies, and at least into wave 1.
        """
        first = next((f.name for f in self.fields if not f.depends_on), None)
        if first is None:
            raise SchemaError("every field depends on another, so none can be decided first")
        wave: dict[str, int] = {first: 0}
        visiting: set[str] = set()

        def level(name: str) -> int:
            if name in wave:
                return wave[name]
            if name in visiting:
                raise SchemaError("depends_on forms a cycle", field=name)
            visiting.add(name)
            wave[name] = 1 + max((level(d) for d in self.field(name).depends_on), default=0)
            visiting.discard(name)
            return wave[name]

        for f in self.fields:
            level(f.name)
        grouped: dict[int, list[str]] = {}
        for f in self.fields:
            grouped.setdefault(wave[f.name], []).append(f.name)
        return tuple(tuple(grouped[k]) for k in sorted(grouped))

    def rebuild(self, values: dict[str, Any]) -> Any:
        """The caller's type: a pydantic instance for a pydantic class, else the plain dict."""
        if self.model_class is not None and hasattr(self.model_class, "model_validate"):
            return self.model_class.model_validate(values)
        return dict(values)


def spellings(value: JsonValue) -> tuple[str, ...]:
    """Every JSON spelling of a value. Small models often quote booleans and numbers (seed 000)."""
    canonical = json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return canonical, json.dumps(canonical, ensure_ascii=False)
    return (canonical,)


def make_field(name: str, values: list[Any], description: str = "", depends_on=()) -> Field:
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
    if kind == "boolean":
        return [True, False]
    if kind == "null":
        return [None]
    if isinstance(kind, list) and set(kind) <= {"boolean", "null"}:
        return ([True, False] if "boolean" in kind else []) + ([None] if "null" in kind else [])
    reasons = {
        "string": "free-text string fields are not supported yet; give it an enum",
        "integer": "a number without a closed set of values; give it an enum",
        "number": "a number without a closed set of values; give it an enum",
        "object": "nested objects are not supported; flatten it into closed fields",
        "array": "arrays are not supported; use one boolean per item",
    }
    raise SchemaError(reasons.get(kind, f"unsupported field {dict(spec)!r}: it is not closed"), field=name)


def from_json_schema(schema: Mapping[str, Any], model_class: Any = None) -> Schema:
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        raise SchemaError("a JSON Schema needs a non-empty 'properties' object")
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    fields = []
    for name, spec in properties.items():
        if not isinstance(spec, Mapping):
            raise SchemaError(f"property spec {spec!r} is not an object", field=name)
        description = spec.get("description") or spec.get("title") or ""
        values = _closed_values(name, spec, defs)
        depends_on = spec.get("depends_on", spec.get("x-depends-on", ()))
        fields.append(make_field(name, values, description, depends_on))
    return _checked(Schema(tuple(fields), str(schema.get("title", "")), model_class))


def from_field_dict(spec: Mapping[str, Any]) -> Schema:
    """``{"name": {"enum" | "values": [...] | "type": "boolean", "description", "depends_on"}}``;
    a bare list stands for an enum and the string ``"boolean"`` for a boolean.
    """
    fields = []
    for name, item in spec.items():
        if isinstance(item, list):
            item = {"enum": item}
        elif item in ("boolean", bool):
            item = {"type": "boolean"}
        if not isinstance(item, Mapping):
            raise SchemaError(f"field spec {item!r} is neither a list nor an object", field=name)
        if "values" in item:
            item = {**item, "enum": item["values"]}
        values = _closed_values(name, item, {})
        fields.append(make_field(name, values, item.get("description", ""), item.get("depends_on", ())))
    if not fields:
        raise SchemaError("the schema has no fields")
    return _checked(Schema(tuple(fields)))


def _checked(schema: Schema) -> Schema:
    names = {f.name for f in schema.fields}
    for f in schema.fields:
        for dep in f.depends_on:
            if dep not in names:
                raise SchemaError(f"depends_on names {dep!r}, which is not a field", field=f.name)
            if dep == f.name:
                raise SchemaError("depends_on names the field itself", field=f.name)
    schema.waves()  # raises on cycles
    return schema


def _typed_dict_json_schema(typed_dict: type) -> dict[str, Any]:
    """A TypedDict's JSON Schema, through an equivalent pydantic model: pydantic rejects
    ``typing.TypedDict`` itself before Python 3.12, and LangChain users pass exactly that.
    """
    import typing

    from pydantic import create_model

    hints = typing.get_type_hints(typed_dict, include_extras=True)
    model = create_model(typed_dict.__name__, **{name: (hint, ...) for name, hint in hints.items()})
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
