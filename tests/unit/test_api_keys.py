"""Several API keys (llmserve/security.py): --api-key given several times or with several values, --api-key-file,
a YAML list, a plain str from Python; constant-time matching of any one; the TLS settings' start-up checks."""

from __future__ import annotations

import argparse

import pytest

from llmserve.router import cli as route_cli
from llmserve.security import key_ok, read_key_file, resolve_api_keys, uvicorn_ssl
from llmserve.serve_config import ServerSettings, add_serve_arguments, serve_settings_from_args


def serve_settings(*argv: str) -> ServerSettings:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return serve_settings_from_args(p.parse_args(list(argv)))


def test_several_keys_from_flags_and_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    f = tmp_path / "keys"
    f.write_text("# comment\n\nk3\n  k4  \n#k5\nk1\n")
    s = serve_settings("--api-key", "k1", "k2", "--api-key", "k0", "--api-key-file", str(f))
    assert s.api_key == ["k1", "k2", "k0"]
    assert s.api_keys() == ("k1", "k2", "k0", "k3", "k4")  # in order, duplicates once
    assert serve_settings().api_keys() == ()
    assert serve_settings("--api-key-file", str(f)).api_keys() == ("k3", "k4", "k1")


def test_a_plain_str_from_python_is_one_key():
    assert ServerSettings(api_key="x").api_keys() == ("x",)
    assert ServerSettings(api_key=["a", "b"]).api_keys() == ("a", "b")
    assert ServerSettings().api_keys() == ()


def test_the_variable_still_gives_a_key(monkeypatch):
    monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
    assert serve_settings().api_keys() == ("from-env",)
    assert serve_settings("--api-key", "flag").api_keys() == ("flag",)


def test_a_yaml_list_of_keys(tmp_path, monkeypatch):
    from llmserve.server.cli import _apply_config_file

    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("api-key: [y1, y2]\n")
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--config", str(cfg)])
    _apply_config_file(args, set())
    assert serve_settings_from_args(args).api_keys() == ("y1", "y2")


def test_bad_key_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        resolve_api_keys(None, str(empty))


def test_any_one_key_matches():
    keys = ("alpha", "beta")
    assert key_ok({"authorization": "Bearer alpha"}, keys)
    assert key_ok({"authorization": "Bearer beta "}, keys)
    assert key_ok({"x-api-key": "beta"}, keys)
    assert not key_ok({"authorization": "Bearer gamma"}, keys)
    assert not key_ok({"authorization": "alpha"}, keys)  # not a bearer token
    assert not key_ok({"authorization": "Bearer alph"}, keys)
    assert not key_ok({"authorization": "Bearer ünïcode"}, keys)
    assert not key_ok({}, keys)


def test_the_router_takes_several_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("r3\n")
    p = argparse.ArgumentParser()
    route_cli.add_arguments(p)
    args = p.parse_args(["--backend", "http://a:1", "--api-key", "r1", "r2", "--api-key-file", str(f)])
    router = route_cli.build_router(args)
    assert router.api_keys == ("r1", "r2", "r3")
    assert router.authorized({"authorization": "Bearer r2"}) and router.authorized({"x-api-key": "r3"})
    assert not router.authorized({"authorization": "Bearer r4"})
    open_router = route_cli.build_router(p.parse_args(["--backend", "http://a:1"]))
    assert open_router.authorized({})


def test_tls_settings_are_checked_at_start_up(tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    assert uvicorn_ssl(ServerSettings(), "serve") == {}
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        uvicorn_ssl(ServerSettings(ssl_keyfile=str(key)), "serve")
    with pytest.raises(ValueError, match="--ssl-certfile needs --ssl-keyfile"):
        uvicorn_ssl(ServerSettings(ssl_certfile=str(cert)), "serve")
    with pytest.raises(ValueError, match="no such file"):
        uvicorn_ssl(ServerSettings(ssl_keyfile=str(key), ssl_certfile=str(tmp_path / "none")), "serve")
    got = uvicorn_ssl(ServerSettings(ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_cert_reqs=2), "serve")
    assert got == {"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_ca_certs": None, "ssl_cert_reqs": 2}


def test_launch_keeps_tls_for_the_router_and_gives_the_replicas_every_key(tmp_path):
    from llmserve.router import launch

    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    f = tmp_path / "keys"
    f.write_text("kf\n")
    args = p.parse_args(
        ["--api-key", "k1", "k2", "--api-key-file", str(f), "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    )
    (cmd,) = launch.replica_commands(args, 1, 9000)
    assert "--ssl-keyfile" not in cmd and "--ssl-certfile" not in cmd  # replicas: plain http on loopback
    i = cmd.index("--api-key")
    assert cmd[i + 1 : i + 3] == ["k1", "k2"] and cmd[cmd.index("--api-key-file") + 1] == str(f)
