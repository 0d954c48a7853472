"""`engine: transformers`, the embedded engine: HF transformers + torch in the replica's process
(`engine.py`), with vLLM's sampling semantics (`sampler.py`). Its options are in `options.py`."""
