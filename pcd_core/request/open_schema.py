"""The JSON Schema an open field is generated under: objects with exactly their keys, arrays bounded.

JSON Schema lets an object hold keys it does not declare unless ``additionalProperties`` is false, and
pydantic's schemas never say so. llguidance follows the standard: with an ordinary ``Address(BaseModel)``
SmolLM2 wrote ``{"city": "Lyon", "country": "France", "month": "March", "day": "12", ...`` until its token
cap. Users of OpenAI's strict structured outputs and of instructor expect the declared keys,
all of them, in order. So every object is closed and every declared key required, unless the schema
explicitly allows more keys (``additionalProperties: true`` or a schema, or ``patternProperties``; a
pydantic ``dict`` says ``true``). An array without ``maxItems`` gets ``DEFAULT_MAX_ITEMS``, marked so
that a result that reaches it says so in a warning; a schema's own ``maxItems`` overrides it.
``tests/test_schema.py`` checks the rewrite; ``tests/test_generation.py`` a nested model on the real model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the most items an array without ``maxItems`` may have: a list of tags, names or steps fits, and a
#: small model that repeats itself stops here instead of at its token cap
DEFAULT_MAX_ITEMS = 16
#: marks a ``maxItems`` that this module added, not the caller (llguidance ignores unknown keywords)
DEFAULT_BOUND_MARK = "x-pcd-default-max-items"

# the keywords whose values are schemas: maps of them, lists of them, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def strict_schema(spec: Any) -> Any:
    """``spec`` with every object closed to its declared keys (all required) and every array bounded,
    at any depth; what the schema states explicitly stays as it is.
    """
    if not isinstance(spec, Mapping):
        return spec
    strict: dict[str, Any] = {}
    for key, value in spec.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            value = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [strict_schema(sub) for sub in value]
        elif key in _SCHEMA_ONES:
            value = [strict_schema(sub) for sub in value] if isinstance(value, list) else strict_schema(value)
        strict[key] = value
    if _is(strict, "object") and strict.get("additionalProperties", False) is False:
        if "patternProperties" not in strict:
            strict["additionalProperties"] = False
            strict["required"] = list(strict.get("properties", {}))
    if _is(strict, "array") and "maxItems" not in strict and strict.get("items") is not False:
        strict["maxItems"] = max(DEFAULT_MAX_ITEMS, int(strict.get("minItems", 0)))
        strict[DEFAULT_BOUND_MARK] = True
    return strict


def _is(spec: Mapping[str, Any], kind: str) -> bool:
    """Whether ``spec`` admits values of JSON type ``kind`` (an untyped schema by its keywords)."""
    declared = spec.get("type")
    if declared is None:
        return ("properties" in spec) if kind == "object" else ("items" in spec or "prefixItems" in spec)
    return declared == kind or (isinstance(declared, list) and kind in declared)


def default_bounds_reached(spec: Any, value: Any, path: str = "$") -> list[str]:
    """The paths in ``value`` of lists that hold exactly ``DEFAULT_MAX_ITEMS`` items where the bound is
    this module's, not the caller's: the model may have had more to write.
    """
    if not isinstance(spec, Mapping):
        return []
    reached = []
    for option in (*spec.get("anyOf", ()), *spec.get("oneOf", ()), *spec.get("allOf", ())):
        reached += default_bounds_reached(option, value, path)
    if isinstance(value, list):
        if spec.get(DEFAULT_BOUND_MARK) and len(value) >= spec.get("maxItems", DEFAULT_MAX_ITEMS):
            reached.append(path)
        for index, item in enumerate(value):
            reached += default_bounds_reached(spec.get("items"), item, f"{path}[{index}]")
    elif isinstance(value, dict):
        properties = spec.get("properties", {})
        for name, item in value.items():
            reached += default_bounds_reached(properties.get(name), item, f"{path}.{name}")
    return list(dict.fromkeys(reached))


def bound_warnings(name: str, spec: Any, value: Any) -> list[str]:
    """One warning per list of a generated value that stopped at the default bound."""
    return [
        f"field {name!r}: the list at {path} stopped at the default bound of {DEFAULT_MAX_ITEMS} items (its "
        "schema has no maxItems); set maxItems to allow more"
        for path in default_bounds_reached(spec, value)
    ]
