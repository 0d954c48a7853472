"""docs/http_api.md's route reference is the one the code's OpenAPI schema renders, and building
that schema neither starts Ray nor needs it at the generator's import."""

from __future__ import annotations

import subprocess
import sys

from tools import openapi_doc


def test_route_reference_is_up_to_date():
    page = openapi_doc.DOC.read_text()
    fresh = openapi_doc.splice(page, openapi_doc.render_reference(openapi_doc.build_openapi()))
    assert fresh == page, (
        f"{openapi_doc.DOC.name} is out of date with the app's routes; regenerate it: "
        f"{openapi_doc.REGENERATE}"
    )


def test_reference_covers_every_route_of_the_ingress():
    spec = openapi_doc.build_openapi()
    routes = {f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops}
    assert {
        "POST /profile/start",
        "POST /profile/stop",
        "GET /profile/status",
        "GET /profile/clock",
        "GET /profile/steps",
        "GET /profile/steps/{k}",
        "POST /weights/update",
        "GET /v1/models",
        "POST /v1/completions",
        "GET /get_world_size",
        "GET /server_info",
        "POST /tokenize",
        "POST /inference/v1/generate",
        "POST /pause",
        "POST /resume",
        "POST /abort_requests",
        "GET /is_paused",
        "GET /weight_info",
        "POST /update_weight_version",
        "GET /start_profile",
        "POST /start_profile",
        "GET /stop_profile",
        "POST /stop_profile",
        "POST /detokenize",
        "POST /reset_prefix_cache",
        "GET /health",
        "GET /ready",
        "GET /metrics",
        "POST /init_weight_transfer_engine",
        "POST /start_weight_update",
        "POST /start_draft_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
        "POST /shutdown_weight_transfer_engine",
        "POST /generate",
        "GET /model_info",
        "GET /get_server_info",
        "GET /get_weight_version",
        "GET /health_generate",
        "POST /update_weights_from_disk",
        "POST /pause_generation",
        "POST /continue_generation",
        "GET /flush_cache",
        "POST /flush_cache",
        "POST /init_weights_update_group",
        "POST /begin_weight_update",
        "POST /update_weights_from_distributed",
        "POST /end_weight_update",
        "POST /destroy_weights_update_group",
    } <= routes
    page = openapi_doc.DOC.read_text()
    for route in routes:
        assert f"### `{route}`" in page, f"{route} is missing from {openapi_doc.DOC.name}"


def test_schema_is_built_without_starting_ray_and_the_module_imports_no_ray():
    code = (
        "import sys\n"
        "from tools import openapi_doc\n"
        "assert 'ray' not in sys.modules, 'importing tools.openapi_doc imported ray'\n"
        "openapi_doc.build_openapi()\n"
        "import ray\n"
        "assert not ray.is_initialized(), 'building the schema started Ray'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_check_mode_names_the_command_that_regenerates(tmp_path):
    stale = tmp_path / "http_api.md"
    stale.write_text(f"# HTTP API\n\n{openapi_doc.BEGIN}\nold\n{openapi_doc.END}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.openapi_doc", "--check", "--doc", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert openapi_doc.REGENERATE in proc.stderr
