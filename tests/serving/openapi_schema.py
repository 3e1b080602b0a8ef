"""Checks JSON values against component schemas of OpenAI's openapi.yaml (a small JSON-Schema subset).

jsonschema is not installed in this environment, so this covers what the chat, completions, models and
error schemas use: $ref, type (incl. lists), nullable (3.0 style, used by the stream chunk schema),
enum, const, required, properties, additionalProperties, items, anyOf, oneOf, allOf.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

SPEC = Path(__file__).resolve().parents[3] / "shared" / "openai" / "openapi.yaml"

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@functools.cache
def _schemas() -> dict:
    if not SPEC.exists():
        pytest.skip(f"{SPEC} is not available")
    with SPEC.open() as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["components"]["schemas"]


def check(value: object, name: str) -> None:
    """Fails the test with every mismatch between `value` and components/schemas/`name`."""
    errors = list(_errors(value, {"$ref": f"#/components/schemas/{name}"}, "$"))
    assert not errors, f"{name} mismatch:\n" + "\n".join(errors)


def _errors(value: object, schema: dict, path: str):
    if value is None and schema.get("nullable"):
        return
    if "$ref" in schema:
        yield from _errors(value, _schemas()[schema["$ref"].rsplit("/", 1)[1]], path)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branches = [list(_errors(value, branch, path)) for branch in schema[key]]
            if all(branches):
                yield f"{path}: matches no branch of {key}: " + "; ".join(min(branches, key=len))
    for branch in schema.get("allOf", ()):
        yield from _errors(value, branch, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            yield f"{path}: {value!r} is not of type {schema['type']}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: {value!r} not in {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        yield f"{path}: {value!r} != {schema['const']!r}"
    if isinstance(value, dict):
        yield from _object_errors(value, schema, path)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _errors(item, schema["items"], f"{path}[{i}]")


def _object_errors(value: dict, schema: dict, path: str):
    for key in schema.get("required", ()):
        if key not in value:
            yield f"{path}: missing required {key!r}"
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            yield from _errors(item, properties[key], f"{path}.{key}")
        elif extra is False:
            yield f"{path}: unexpected property {key!r}"
        elif isinstance(extra, dict):
            yield from _errors(item, extra, f"{path}.{key}")
