"""The app's control token (docs/operations.md#auth): read from where `control_token_env` or
`control_token_file` says, in the process that checks it, never from the args themselves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

MIN_TOKEN_CHARS = 16
"""A control token is at least this long."""
CONTROL_TOKEN_ENV = "ROLLOUT_PROFILER_CONTROL_TOKEN"
"""The one environment variable name for the token: the image's, config/serve.vllm-gpu.yaml's
`control_token_env`, and where `python -m profiling status|start|stop` reads it."""
DEPRECATED_TOKEN_ENV = "ROLLOUT_CONTROL_TOKEN"
"""The CLI's former name, still read with a deprecation warning."""


class TokenSource(Protocol):
    """Where a control token is read from: the app's args, or a client's settings (the verl
    plugin's) that name it the same way."""

    @property
    def control_token_env(self) -> str | None: ...

    @property
    def control_token_file(self) -> str | None: ...


def read_control_token(args: TokenSource) -> str | None:
    """The control token from control_token_env or control_token_file, read where this runs
    (None: neither is set). ValueError naming the source and the fix when it is missing,
    unreadable or shorter than MIN_TOKEN_CHARS."""
    if args.control_token_env is not None:
        source = f"environment variable {args.control_token_env}"
        token = os.environ.get(args.control_token_env)
        if token is None:
            raise ValueError(
                f"control_token_env names {args.control_token_env}, which is not set in this process's "
                "environment: export it where Ray starts (the shell of `serve run` or `ray start`)"
            )
    elif args.control_token_file is not None:
        source = f"control_token_file {args.control_token_file}"
        try:
            token = Path(args.control_token_file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read {source} ({e.strerror}): make it readable where the ingress runs") from e
    else:
        return None
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the control token from {source} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return token
