"""docs/configuration.md's field reference is the one the config models render, and every field of
the app's args and of the trainer's config (nested models included) has a description."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, Field

from profiling.config import StrictModel
from serve_app.config import AppArgs
from serve_app.engines.registry import ENGINE_OPTIONS
from tools import config_doc
from tools.schema_tables import undocumented
from trainer.config import TrainerConfig


def test_config_reference_is_up_to_date():
    page = config_doc.DOC.read_text()
    fresh = config_doc.splice(page, config_doc.render_reference(config_doc.build_schemas()))
    assert fresh == page, (
        f"{config_doc.DOC.name} is out of date with the config models; regenerate it: {config_doc.REGENERATE}"
    )


@pytest.mark.parametrize("model", [AppArgs, TrainerConfig], ids=lambda m: m.__name__)
def test_every_config_field_is_documented(model):
    schema = model.model_json_schema()
    assert schema.get("$defs"), "the walk must reach the nested models"
    missing = undocumented(schema)
    assert missing == [], (
        "config fields without a description (add Field(description=...) or a docstring under the field): "
        + ", ".join(missing)
    )


def test_the_generators_schemas_are_all_documented_too():
    assert config_doc.undocumented_fields() == []


class _Nested(BaseModel):
    documented: int = Field(1, description="Has one.")
    bare: int = 2


class _Undocumented(StrictModel):
    described: str = Field("x", description="Has one.")
    docstring: int = 0
    """Documented by its docstring."""
    blank: int = Field(0, description="  ")
    missing: float = 1.0
    nested: _Nested = Field(default_factory=_Nested, description="A nested model.")
    maybe: _Nested | None = Field(None, description="A nested model or null.")


def test_checker_reports_undocumented_fields_of_the_model_and_of_its_nested_models():
    assert undocumented(_Undocumented.model_json_schema()) == [
        "_Undocumented.blank",
        "_Undocumented.missing",
        "_Nested.bare",
    ]
    assert undocumented(_Nested.model_json_schema(), root="Nested") == ["Nested.bare"]
    assert config_doc.undocumented_fields({"t": _Undocumented.model_json_schema()}) == [
        "_Undocumented.blank",
        "_Undocumented.missing",
        "_Nested.bare",
    ]


def test_reference_has_a_table_for_every_nested_model_and_the_links_resolve():
    page = config_doc.DOC.read_text()
    for model in (AppArgs, TrainerConfig):
        for name in model.model_json_schema()["$defs"]:
            assert f"\n### {name}\n" in page, f"{name} has no table in {config_doc.DOC.name}"
    for name in ("## App args", "## Trainer config"):
        assert f"\n{name}\n" in page
    # Keys a reader looks for, at their dotted paths.
    assert "`args.profiler.npu`" in page and "`args.sglang`" in page and "`global_profiler`" in page


def test_hand_written_rules_name_each_engines_profiler_tools():
    page = config_doc.DOC.read_text()
    for engine, options in ENGINE_OPTIONS.items():
        tools = ", ".join(f"`{t}`" for t in options.tools)
        assert f"`engine: {engine}`: {tools}" in page, (
            f"docs/configuration.md's rules must list engine {engine}'s tools as {options.tools}"
        )


def test_check_mode_names_the_command_that_regenerates(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# Configuration\n\n{config_doc.BEGIN}\nold\n{config_doc.END}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.config_doc", "--check", "--doc", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert config_doc.REGENERATE in proc.stderr
    assert stale.read_text().endswith(f"{config_doc.BEGIN}\nold\n{config_doc.END}\n"), "--check must not write"


def test_write_mode_regenerates_a_stale_copy(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# Configuration\n\nhand-written\n\n{config_doc.BEGIN}\nold\n{config_doc.END}\n")
    assert config_doc.main(["--doc", str(stale)]) == 0
    assert "### ProfileOptions" in stale.read_text() and "hand-written" in stale.read_text()
    assert config_doc.main(["--check", "--doc", str(stale)]) == 0
