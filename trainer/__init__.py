"""Trainer side: the HTTP client of the rollout app, the profiled weight sync that calls
stop -> update_weights -> start in order, and the reference fully-async training loop."""
