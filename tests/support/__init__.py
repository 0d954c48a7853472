"""Helpers shared by every kind of test, imported as `support.<module>`: tests/ is on sys.path
(pytest puts the directory of tests/conftest.py there, tests/ being no package).

* `support.apps`: a real Serve app for a test (`deploy`, `deployed`, `ServeApp`);
* `support.traces`: reading the Chrome traces the app and the merge write.

Fixtures stay in the conftest files; these are plain modules, so a test imports what it uses and
no conftest is imported by name (non-package conftests all share the module name `conftest`).
"""
