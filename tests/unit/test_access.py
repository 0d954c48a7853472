"""Who may drive the app (serve_app/ingress/auth.py, serve_app/control_token.py): the control
token comes from an environment variable or a file and is long enough, a port beyond loopback
needs one, and a loopback-only app answers only requests naming a loopback host."""

from __future__ import annotations

import pytest

from serve_app.app import parse_args
from serve_app.control_token import MIN_TOKEN_CHARS, read_control_token
from serve_app.ingress.auth import AccessError, _host_name, check_exposure
from serve_app.net import is_loopback

TOKEN = "t" * MIN_TOKEN_CHARS


def test_the_token_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("ROLLOUT_TEST_TOKEN", f"  {TOKEN}\n")
    assert read_control_token(parse_args({"control_token_env": "ROLLOUT_TEST_TOKEN"})) == TOKEN


def test_the_token_comes_from_the_named_file(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert read_control_token(parse_args({"control_token_file": str(tmp_path / "token")})) == TOKEN


def test_no_token_source_means_no_token():
    assert read_control_token(parse_args({})) is None


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ({"control_token_env": "ROLLOUT_TEST_TOKEN"}, None, "not set"),
        ({"control_token_env": "ROLLOUT_TEST_TOKEN"}, "short", f"use at least {MIN_TOKEN_CHARS}"),
        ({"control_token_env": "ROLLOUT_TEST_TOKEN"}, "   ", "has 0 characters"),
        ({"control_token_file": "/nonexistent/token"}, None, "cannot read control_token_file"),
    ],
)
def test_a_missing_or_short_token_is_refused_naming_its_source(monkeypatch, args, env, message):
    monkeypatch.delenv("ROLLOUT_TEST_TOKEN", raising=False)
    if env is not None:
        monkeypatch.setenv("ROLLOUT_TEST_TOKEN", env)
    with pytest.raises(ValueError, match=message):
        read_control_token(parse_args(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"control_token": TOKEN}, "control_token_env"),
        ({"control_token_env": "A", "control_token_file": "/x"}, "not both"),
        ({"control_token_env": "not-a-name"}, "environment variable name"),
    ],
)
def test_token_settings_that_cannot_work_are_refused_when_read(args, message):
    with pytest.raises(ValueError, match=message):
        parse_args(args)


def test_a_port_beyond_loopback_needs_a_token():
    with pytest.raises(AccessError, match="control_token_env"):
        check_exposure("0.0.0.0", None)
    with pytest.raises(AccessError):
        check_exposure("192.0.2.10", None)
    check_exposure("0.0.0.0", TOKEN)
    check_exposure("127.0.0.1", None)
    check_exposure("localhost", None)
    check_exposure(None, None)  # unknown here: the ingress checks again where it is known


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("attacker.example", False),
        ("192.0.2.10", False),
        ("", False),
    ],
)
def test_loopback_names(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("attacker.example:80", "attacker.example"),
        ("::1", "::1"),
    ],
)
def test_host_header_names_without_their_port(header, name):
    assert _host_name(header) == name
