"""Fakes of external systems for tests. Each one says in its name and docstring that it is a fake,
and which upstream sources it copies."""
