"""The verl plugin's settings (docs/frameworks/verl.md#settings): one block of verl's config,
`actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_profiler`, read where each part
of the plugin runs (the rollout replica and its server, every trainer rank's checkpoint engine)
and validated there. verl hands a checkpoint engine only its own `engine_kwargs` block, so that
block is the one place every part can read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from profiling.config import StrictModel, describe_validation_error
from profiling.weight_source import WeightSource
from serve_app.control_token import read_control_token
from trainer.client import RolloutClient

PLUGIN_NAME = "rollout_profiler"
"""The plugin's name in verl: `actor_rollout_ref.rollout.name` and `checkpoint_engine.backend`."""
SETTINGS_KEY = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{PLUGIN_NAME}"
"""Where the settings are in verl's config."""

Transfer = Literal[WeightSource.PATH, WeightSource.OBJECT_STORE, WeightSource.COLLECTIVE]


class PluginConfigError(ValueError):
    """A verl config the plugin cannot run with; the message names the key and the fix."""


class PluginSettings(StrictModel):
    """The app verl's rollout goes to, and how each version's weights reach it."""

    url: str = Field(
        pattern=r"^https?://",
        description="The app's URL for generation: its replica listener (e.g. http://127.0.0.1:8002), or Serve's port.",
    )
    control_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="The app's control listener (e.g. http://127.0.0.1:8001), where weight and schedule calls "
        "go; null: they go to url.",
    )
    control_token_env: str | None = Field(
        None, description="The environment variable holding the app's control token (in every verl process)."
    )
    control_token_file: str | None = Field(None, description="A file holding the app's control token.")
    transfer: Transfer = Field(
        WeightSource.PATH,
        description="How trainer rank 0 publishes each version: path (a safetensors file in weights_dir, "
        "which the app reads), object_store (Ray's object store: verl and the app in one Ray cluster), or "
        "collective (a broadcast to the replicas; the app's weight_transfer must be collective).",
    )
    weights_dir: str | None = Field(
        None, description="transfer path: the app's weights_dir as trainer rank 0 sees it (a shared filesystem)."
    )
    app_name: str = Field("rollout", description="transfer object_store: the app's Serve application name.")
    collective_address: str = Field(
        "127.0.0.1",
        description="transfer collective: trainer rank 0's address as the replicas reach it (127.0.0.1: the "
        "app on rank 0's machine).",
    )
    timeout_s: float = Field(60.0, gt=0, description="How long a control call or a read waits for the app.")

    @model_validator(mode="after")
    def _consistent(self) -> PluginSettings:
        if self.transfer == WeightSource.PATH and self.weights_dir is None:
            raise ValueError("transfer path needs weights_dir: the app's weights_dir, where rank 0 writes each version")
        if self.control_token_env is not None and self.control_token_file is not None:
            raise ValueError("give the control token in one place: control_token_env or control_token_file")
        return self

    def client(self, *, generation: bool = False, max_connections: int = 64) -> RolloutClient:
        """A client of the app with its control token (read where this runs). `generation`: its
        calls wait as long as they take (a generation's length is verl's to bound), else
        `timeout_s`. `max_connections`: requests in flight at once."""
        try:
            token = read_control_token(self)
        except ValueError as e:
            raise PluginConfigError(f"{SETTINGS_KEY}: {e}") from None
        return RolloutClient(
            self.url,
            control_url=self.control_url,
            control_token=token,
            timeout_s=None if generation else self.timeout_s,
            max_connections=max_connections,
        )


def read_settings(engine_kwargs: Mapping[str, Any] | None) -> PluginSettings:
    """The plugin's settings from verl's `checkpoint_engine.engine_kwargs` (a dict, or OmegaConf's
    DictConfig); PluginConfigError naming each bad key."""
    block = (engine_kwargs or {}).get(PLUGIN_NAME)
    if block is None:
        raise PluginConfigError(
            f"{SETTINGS_KEY} is missing: give the app's URL there, e.g. "
            f"+{SETTINGS_KEY}.url=http://127.0.0.1:8002 (docs/frameworks/verl.md#settings)"
        )
    return validate_settings(_plain(block))


def validate_settings(values: Mapping[str, Any]) -> PluginSettings:
    """`values` as PluginSettings; PluginConfigError naming each bad key under SETTINGS_KEY."""
    try:
        return PluginSettings.model_validate(dict(values))
    except ValidationError as e:
        raise PluginConfigError(describe_validation_error(e, SETTINGS_KEY)) from None


def _plain(block: Any) -> dict[str, Any]:
    """A verl config block (DictConfig, or a dict already) as a plain dict."""
    if isinstance(block, Mapping):
        return {str(k): _plain(v) if isinstance(v, Mapping) else v for k, v in block.items()}
    raise PluginConfigError(f"{SETTINGS_KEY} must be a mapping of settings, not {type(block).__name__}")
