"""Fixtures of the integration tests; the session's cluster, model and shared `app` come from
tests/conftest.py, the helpers from integ_util.py (this directory is no package: pytest puts it on
sys.path) and tests/support/.

`http` is each module's HTTP client to the app it tests. By default it talks to the shared `app`
with the default timeout; a module that needs otherwise says so with a module-level
`HTTP = HttpOptions(...)` (integ_util.HttpOptions).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from integ_util import HttpOptions, client, stop_if_active
from support.apps import ServeApp


@pytest.fixture(scope="module")
def http(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    """An HTTP client to the module's app, as its `HTTP` (an HttpOptions) says."""
    options: HttpOptions = getattr(request.module, "HTTP", HttpOptions())
    served: ServeApp = request.getfixturevalue(options.app)
    with client(served.base_url, token=options.token, timeout=options.timeout) as c:
        try:
            yield c
        finally:
            stop = options.stop_at_end
            if stop(served) if callable(stop) else stop:
                stop_if_active(c)
