"""A verl plugin: verl's own trainers run their rollout through the app, unmodified
(docs/frameworks/verl.md). `plugin` is its entry point in verl's `verl.plugins` group; the other
modules that import verl are loaded from it."""
