"""Weights, one concept by job (docs/design.md#weight-transfer): `checkpoint` (what one checkpoint
is, checked and read; `safetensors_file` reads one file's header), `object_store` (weights through
the Ray object store), `collective_schema`, `buckets` and `collective` (the sync by collective: its
wire schema, its bucket plan and its protocol). Nothing is imported here, so the pure-pydantic
modules stay importable without torch or Ray."""
