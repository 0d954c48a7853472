"""Render the field reference of docs/configuration.md from the config models.

    python -m tools.config_doc            # rewrite the generated part of docs/configuration.md
    python -m tools.config_doc --check    # exit 1 if it is out of date with the code

The reference comes from the JSON schemas of `serve_app.config.AppArgs` (the `args:` block of
config/serve*.yaml) and `trainer.config.TrainerConfig` (config/trainer.yaml): each field's type,
bounds, default and description (a `Field(description=...)` or the attribute docstring under
the field). Only the part of the page between the two markers is generated; the rest of the
page, the rules that tie keys together included, is written by hand.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from tools.generated_page import GeneratedPage
from tools.schema_tables import cell, fields_table, ref_closure, ref_name, undocumented

PAGE = GeneratedPage(
    doc=Path(__file__).resolve().parents[1] / "docs" / "configuration.md",
    regenerate="python -m tools.config_doc",
    what="the config models",
    label="CONFIG REFERENCE",
)
DOC, REGENERATE, BEGIN, END = PAGE.doc, PAGE.regenerate, PAGE.begin, PAGE.end
splice = PAGE.splice


@dataclass(frozen=True)
class Root:
    """One config file's model and how the page introduces it."""

    title: str
    """The section heading (its anchor is linked from the hand-written part of the page)."""
    model: str
    """`module:Class` of the model, imported when the reference is rendered."""
    prefix: str
    """How the errors name a top-level key: `args.` for the app, nothing for the trainer."""
    intro: str
    """The section's first paragraph."""

    def load(self) -> type[BaseModel]:
        import importlib

        module, _, name = self.model.partition(":")
        model: type[BaseModel] = getattr(importlib.import_module(module), name)
        return model


ROOTS = (
    Root(
        title="App args",
        model="serve_app.config:AppArgs",
        prefix="args.",
        intro="The `args:` block of the application in `config/serve*.yaml` (`serve_app.config.AppArgs`), "
        "read by the app builder when `serve run` or `serve deploy` builds the app.",
    ),
    Root(
        title="Trainer config",
        model="trainer.config:TrainerConfig",
        prefix="",
        intro="`config/trainer.yaml` (`trainer.config.TrainerConfig`), read by "
        "`python -m trainer --config config/trainer.yaml [key.path=value ...]`.",
    ),
)


class _WithFactoryDefaults(GenerateJsonSchema):
    """The JSON schema with the defaults of `default_factory` fields too (`[]`, `{}`, `["cpu"]`),
    except a nested model's: its own table lists its fields' defaults."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        default = super().get_default_value(schema)
        factory = schema.get("default_factory")
        if default is NoDefault and factory is not None and not schema.get("default_factory_takes_data"):
            value = factory()  # type: ignore[call-arg]
            return NoDefault if isinstance(value, BaseModel) else value
        return default


def config_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema as the config reads it (validation mode), factory defaults included."""
    return model.model_json_schema(schema_generator=_WithFactoryDefaults)


def build_schemas() -> dict[str, dict[str, Any]]:
    """Each root's schema, by its section title."""
    return {root.title: config_schema(root.load()) for root in ROOTS}


# -- rendering ------------------------------------------------------------------------------


def _ref_paths(prop: Any, path: str) -> Iterator[tuple[str, str]]:
    """(model name, key path) for each model a property's schema names: `path` itself, `path[]`
    through array items, `path.<key>` through the values of a mapping."""
    if not isinstance(prop, dict):
        return
    if (name := ref_name(prop)) is not None:
        yield name, path
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in prop.get(key) or []:
            yield from _ref_paths(sub, path)
    yield from _ref_paths(prop.get("items"), f"{path}[]")
    yield from _ref_paths(prop.get("additionalProperties"), f"{path}.<key>")


def key_paths(schema: dict[str, Any], prefix: str) -> dict[str, list[str]]:
    """The dotted keys at which each model of `schema`'s `$defs` sits in the config file."""
    defs: dict[str, Any] = schema.get("$defs", {})
    found: dict[str, list[str]] = {}

    def walk(node: dict[str, Any], prefix: str, stack: tuple[str, ...]) -> None:
        for field, prop in node.get("properties", {}).items():
            for name, path in _ref_paths(prop, f"{prefix}{field}"):
                paths = found.setdefault(name, [])
                if path not in paths:
                    paths.append(path)
                if name not in stack and name in defs:
                    walk(defs[name], f"{path}.", (*stack, name))

    walk(schema, prefix, ())
    return found


def _keys(paths: list[str]) -> str:
    return ", ".join(f"`{p}`" for p in paths)


def _model_table(name: str, schema: dict[str, Any], paths: dict[str, list[str]]) -> list[str]:
    """A model's heading, description, the keys it sits at (by root when several roots use it),
    and its fields table."""
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [cell(schema["description"]), ""]
    keys = [p for found in paths.values() for p in found]
    if len(paths) > 1:
        where = "; ".join(f"{_keys(found)} ({title.lower()})" for title, found in paths.items())
        out += [f"Keys: {where}.", ""]
    elif keys:
        out += [f"{'Key' if len(keys) == 1 else 'Keys'}: {_keys(keys)}.", ""]
    return out + fields_table(schema) + [""]


def render_reference(schemas: dict[str, dict[str, Any]]) -> str:
    """The generated part of docs/configuration.md (without the markers): one section per root
    (its fields, then one table per model of its `$defs` closure, in order of first use, each
    naming the keys it sits at). A model two roots share gets one table, under the first root,
    listing the keys of both; the second root's section links it."""
    out: list[str] = []
    written: dict[str, dict[str, Any]] = {}
    paths: dict[str, dict[str, list[str]]] = {}  # model -> root title -> keys
    for root in ROOTS:
        for name, found in key_paths(schemas[root.title], root.prefix).items():
            paths.setdefault(name, {})[root.title] = found
    for root in ROOTS:
        schema = schemas[root.title]
        defs: dict[str, Any] = schema.get("$defs", {})
        own = key_paths(schema, root.prefix)
        out += [f"## {root.title}", "", root.intro, ""]
        out += [*fields_table(schema), ""]
        shared = []
        for name in ref_closure(schema.get("properties", {}), defs):
            model = defs[name]
            if name in written:
                if written[name] != model:
                    raise ValueError(f"two different models are named {name!r}; a page has one #{name.lower()}")
                shared.append(name)
                continue
            written[name] = model
            out += _model_table(name, model, paths.get(name, {}))
        if shared:
            names = " and ".join(f"[`{n}`](#{n.lower()})" for n in shared)
            at = "; ".join(f"`{n}` at {_keys(own.get(n, []))}" for n in shared)
            verb = "is" if len(shared) == 1 else "are"
            out += [f"{names} {verb} described above ({at}).", ""]
    return "\n".join(out).rstrip() + "\n"


def undocumented_fields(schemas: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Every config field without a description, as `Model.field`; empty: every field of every
    root and of every model they use is documented. `schemas`: `build_schemas()` by default."""
    schemas = build_schemas() if schemas is None else schemas
    missing: list[str] = []
    for schema in schemas.values():
        missing += [m for m in undocumented(schema) if m not in missing]
    return missing


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the generated part of the page."""
    return PAGE.main(lambda: render_reference(build_schemas()), argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
