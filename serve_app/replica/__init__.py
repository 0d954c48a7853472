"""The rollout replica deployment, split by plane: generation (data plane) and the calls the
controller broadcasts (control plane)."""

from serve_app.replica.deployment import RolloutReplica

__all__ = ["RolloutReplica"]
