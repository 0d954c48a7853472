"""`engine: vllm`: vLLM's `AsyncLLM` in the replica (`engine.py`), profiled inside vLLM's workers by
a worker extension (`worker.py`). Its options are in `options.py`; importing this package imports
no vLLM."""
