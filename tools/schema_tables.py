"""JSON schema -> Markdown: the type, default and description tables of the generated docs.

Shared by `tools.openapi_doc` (the route reference of docs/http_api.md) and `tools.config_doc`
(the field reference of docs/configuration.md), so both pages write a field the same way. A
model named by a `$ref` is written as a link to the heading of its own table, `[`Name`](#name)`:
the page must give that model a heading `Name` (GitHub's anchor is the lower-cased name).
"""

from __future__ import annotations

import json
from typing import Any

TABLE_HEADER = ["| field | type | default | description |", "|---|---|---|---|"]
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not")


def format_number(value: float) -> str:
    """A bound as written in a table: `1`, `0.5`, `1e+12` (integers without `.0`, huge ones short)."""
    if abs(value) >= 1e12:
        return f"{value:.3g}"
    return str(int(value)) if float(value).is_integer() else str(value)


def ref_name(schema: dict[str, Any]) -> str | None:
    """The model a `{"$ref": "#/.../Name"}` schema names (`Name`), else None."""
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def markdown_type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short Markdown type: `integer, >= 1`, `StepManifest`, `string or null`."""
    if (name := ref_name(schema)) is not None:
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(markdown_type(s) for s in schema["anyOf"])
    if "const" in schema:
        return f"`{json_value(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json_value(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        text = f"array of {markdown_type(schema.get('items', {}))}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        text = f"object of {markdown_type(schema['additionalProperties'])}"
    elif kind is None:
        text = "any"
    else:
        text = "null" if kind == "null" else kind
    return text + constraints(schema)


def constraints(schema: dict[str, Any]) -> str:
    """The schema's bounds as a suffix of its type (`, >= 1, <= 1000000000`), or `""` if it has none."""
    rules = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in schema:
            rules.append(f"{sign} {format_number(schema[key])}")
    for key, sign in (("minLength", ">="), ("minItems", ">=")):
        if key in schema and schema[key] > 0:
            rules.append(f"length {sign} {schema[key]}")
    if "maxLength" in schema:
        rules.append(f"length <= {schema['maxLength']}")
    if "pattern" in schema:
        rules.append(f"matching `{schema['pattern']}`")
    return f", {', '.join(rules)}" if rules else ""


def json_value(value: Any) -> str:
    """`value` as JSON (how a default, const or enum member is written)."""
    return json.dumps(value)


def cell(text: str) -> str:
    """`text` fit for one table cell: whitespace (newlines too) collapsed, `|` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def fields_table(schema: dict[str, Any]) -> list[str]:
    """The lines of an object schema's table: one row per property (field, type, default, description).

    The default column reads `required` for a required property and is empty for a property
    whose schema has no `default` (e.g. a pydantic `default_factory`)."""
    required = set(schema.get("required", []))
    lines = list(TABLE_HEADER)
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            default = "required"
        elif "default" in prop:
            default = f"`{json_value(prop['default'])}`"
        else:
            default = ""
        lines.append(f"| `{name}` | {markdown_type(prop)} | {default} | {cell(prop.get('description', ''))} |")
    return lines


def referenced(node: Any, found: set[str]) -> None:
    """Add to `found` the name of every `$ref` anywhere inside `node` (not following them)."""
    if isinstance(node, dict):
        if (name := ref_name(node)) is not None:
            found.add(name)
        for value in node.values():
            referenced(value, found)
    elif isinstance(node, list):
        for value in node:
            referenced(value, found)


def refs_in_order(node: Any) -> list[str]:
    """The names `$ref`s inside `node` name, each once, in the order they first appear."""
    names: list[str] = []

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            if (name := ref_name(n)) is not None and name not in names:
                names.append(name)
            for value in n.values():
                walk(value)
        elif isinstance(n, list):
            for value in n:
                walk(value)

    walk(node)
    return names


def ref_closure(node: Any, schemas: dict[str, Any]) -> list[str]:
    """Every model `node` needs, following `$ref`s through `schemas` (the `$defs` or OpenAPI
    `components.schemas`): each name once, depth first in order of first reference, so a model
    comes right before the models only it brings in. A name `schemas` lacks is listed, not followed."""
    order: list[str] = []

    def visit(n: Any) -> None:
        for name in refs_in_order(n):
            if name not in order:
                order.append(name)
                visit(schemas.get(name, {}))

    visit(node)
    return order


def undocumented(schema: dict[str, Any], root: str | None = None) -> list[str]:
    """Every property of `schema`, of its `$defs`, and of object schemas nested inside them, that
    has no description (missing or blank), as `Model.field` (a `$defs` entry by its name, the root
    by `root`, else by its `title`). An empty list: every field is documented."""
    missing: list[str] = []

    def walk(node: Any, owner: str) -> None:
        if not isinstance(node, dict):
            return
        for name, prop in (node.get("properties") or {}).items():
            if not str(prop.get("description", "")).strip():
                missing.append(f"{owner}.{name}")
            walk(prop, f"{owner}.{name}")
        for key in _SCHEMA_LISTS:
            for sub in node.get(key) or []:
                walk(sub, owner)
        for key in _SCHEMA_VALUES:
            walk(node.get(key), owner)
        for name, sub in (node.get("$defs") or {}).items():
            walk(sub, name)

    walk(schema, root or schema.get("title", "<root>"))
    return missing
