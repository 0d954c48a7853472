"""Render the HTTP route reference of docs/http_api.md from the ingress's OpenAPI schema.

    python -m tools.openapi_doc            # rewrite the generated part of docs/http_api.md
    python -m tools.openapi_doc --check    # exit 1 if it is out of date with the code

The schema comes from the same FastAPI app the ingress serves at `/openapi.json`, built from the
ingress class's route mixins without starting Ray (importing the app module imports Ray's
Python package, which starts nothing). Only the part of the page between the two markers is
generated; the rest of the page is written by hand.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.generated_page import GeneratedPage
from tools.schema_tables import cell, fields_table, markdown_type, ref_closure, ref_name

if TYPE_CHECKING:
    from fastapi import FastAPI

PAGE = GeneratedPage(
    doc=Path(__file__).resolve().parents[1] / "docs" / "http_api.md",
    regenerate="python -m tools.openapi_doc",
    what="the app's routes",
    label="ROUTE REFERENCE",
)
DOC, REGENERATE, BEGIN, END = PAGE.doc, PAGE.regenerate, PAGE.begin, PAGE.end
splice = PAGE.splice

# FastAPI's default 422 model; the app's own handler answers {"detail": str, "errors": [...]}.
_FASTAPI_VALIDATION = "HTTPValidationError"
_GENERIC_DESCRIPTIONS = {"Successful Response", "Validation Error", "Additional Response"}
_STATUS_TEXT = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    409: "Conflict",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    503: "Service Unavailable",
    507: "Insufficient Storage",
}


def ingress_app() -> FastAPI:
    """The ingress's FastAPI app with every route of `serve_app.app.RolloutIngress`.

    The routes come from the mixins in the ingress class's MRO (each declares its `ENDPOINTS`),
    so a mixin added to the ingress shows up here without a change to this module."""
    from serve_app.app import RolloutIngress
    from serve_app.ingress.builder import create_fastapi_app, make_ingress

    mixins = tuple(c for c in RolloutIngress.__mro__ if "ENDPOINTS" in vars(c))
    endpoints: dict[str, Any] = {}
    for mixin in mixins:  # in MRO order, as the app registers them; the first mixin wins
        for name, route in vars(mixin)["ENDPOINTS"].items():
            endpoints.setdefault(name, route)
    app = create_fastapi_app()
    make_ingress(type("IngressRoutes", mixins, {}), endpoints, app)
    return app


def build_openapi() -> dict[str, Any]:
    """The OpenAPI schema the running app serves at /openapi.json."""
    return ingress_app().openapi()


# -- rendering ------------------------------------------------------------------------------


def _json_schema(content: dict[str, Any]) -> dict[str, Any] | None:
    media = content.get("application/json")
    return None if media is None else media.get("schema")


def _responses(op: dict[str, Any], guarded: bool) -> list[str]:
    lines = ["| status | body | when |", "|---|---|---|"]
    answers = dict(op["responses"])
    if guarded:
        answers.setdefault("401", {"description": "missing or wrong `Authorization: Bearer <token>`"})
    for code in sorted(answers, key=int):
        answer = answers[code]
        schema = _json_schema(answer.get("content", {}))
        name = ref_name(schema) if schema else None
        if name == _FASTAPI_VALIDATION:
            body = "validation error: `detail` (string), `errors` (array)"
        elif schema is None:
            body = "`detail` (string)" if code == "401" else ""
        elif schema:
            body = markdown_type(schema)
        else:
            body = "not described by the schema (see above)"
        description = answer.get("description", "")
        # FastAPI describes an answer by the interpreter's phrase for its code (422 reads "Unprocessable
        # Content" from Python 3.13 on): a phrase is no description, whichever Python wrote it.
        phrases = {_STATUS_TEXT.get(int(code)), HTTPStatus(int(code)).phrase}
        when = "" if description in _GENERIC_DESCRIPTIONS or description in phrases else description
        lines.append(f"| {code} {_STATUS_TEXT.get(int(code), '')} | {body} | {cell(when)} |")
    return lines


def render_reference(spec: dict[str, Any]) -> str:
    """The generated part of docs/http_api.md (without the markers)."""
    schemas: dict[str, Any] = spec.get("components", {}).get("schemas", {})
    out: list[str] = []
    inline: set[str] = set()
    for path, ops in spec["paths"].items():
        # A route taking several methods lists them from a set: sorted, the page is the same every run.
        for method, op in sorted(ops.items()):
            params = op.get("parameters", [])
            guarded = any(p["in"] == "header" and p["name"].lower() == "authorization" for p in params)
            out += [f"### `{method.upper()} {path}`", "", op.get("description") or op.get("summary", ""), ""]
            if guarded:
                out += [
                    "Needs `Authorization: Bearer <token>` when the app has a control token "
                    "(`control_token_env` or `control_token_file`).",
                    "",
                ]
            path_params = [p for p in params if p["in"] != "header"]
            if path_params:
                out += ["| parameter | in | type |", "|---|---|---|"]
                out += [f"| `{p['name']}` | {p['in']} | {markdown_type(p['schema'])} |" for p in path_params]
                out.append("")
            body = op.get("requestBody")
            if body is not None:
                schema = _json_schema(body["content"]) or {}
                name = ref_name(schema)
                if name is None and "anyOf" in schema:  # one of several bodies, each under Bodies
                    links = [f"[`{n}`](#{n.lower()})" for n in map(ref_name, schema["anyOf"]) if n]
                    out += [f"Request body (JSON), one of: {', '.join(links)}.", ""]
                else:
                    model = schemas.get(name, schema) if name else schema
                    inline.add(name or "")
                    strict = " Unknown fields are refused (422)." if model.get("additionalProperties") is False else ""
                    out += [f"Request body: `{name}` (JSON).{strict}", ""]
                    out += fields_table(model)
                    out.append("")
            out += _responses(op, guarded)
            out.append("")
    # A request body's model is shown where it is taken; it gets a section of its own only where an
    # answer refers to it too.
    answers = {
        path: {m: {k: v for k, v in op.items() if k != "requestBody"} for m, op in ops.items()}
        for path, ops in spec["paths"].items()
    }
    shown_once = inline - set(ref_closure(answers, schemas))
    closure = set(ref_closure(spec["paths"], schemas)) - shown_once - {_FASTAPI_VALIDATION, "ValidationError"}
    out += ["## Bodies", ""]
    for name in sorted(closure):
        schema = schemas[name]
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [cell(schema["description"]), ""]
        out += fields_table(schema)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the generated part of the page."""
    return PAGE.main(lambda: render_reference(build_openapi()), argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
