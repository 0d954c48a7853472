"""verl's own profiler output made into this project's steps (docs/analysis.md#verl):
its file layout, the matching of its rollout windows to steps, and the trainer ranks' clocks the
plugin records."""
