"""What the app answers names no server path, but keeps the app's own routes a message points to."""

from __future__ import annotations

from serve_app.redact import Redactor


def test_server_paths_go_and_the_apps_routes_stay():
    redact = Redactor({"save_path": "/srv/traces", "weights_dir": None})
    text = (
        "cannot write /srv/traces/step_3/x.json nor read /home/me/ckpt/model.safetensors: publish through "
        "POST /weights/update, see /profile/steps/3, /v1/completions and /inference/v1/generate (url http://h/a/b)"
    )
    assert redact(text) == (
        "cannot write <save_path>/step_3/x.json nor read <path>/model.safetensors: publish through "
        "POST /weights/update, see /profile/steps/3, /v1/completions and /inference/v1/generate (url http://h/a/b)"
    )
    assert redact("/weights/other/secret") == "<path>/secret", "a route's prefix alone is not enough"
