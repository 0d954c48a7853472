"""The Megatron trainer backend (`trainer.backend: megatron`, docs/trainer.md#megatron)."""
