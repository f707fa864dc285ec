"""Configuration: errors name the key, the bind rule, upstream keys, and config.toml in step with the code."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest
from msgspec.structs import fields, replace

from proxyvisor.config import Config, ConfigError, UpstreamConfig, load, parse
from proxyvisor.proxy.service import running, upstream_keys

from helpers import FORMATS, anthropic_client, ask, assert_error_shape, http_client, raw_stream, request_body

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("document, words", [
    ({"proxy": {"port": "8080"}}, ["[proxy]", "port", "int"]),
    ({"proxy": {"max_body_bytes": 1.5}}, ["[proxy]", "max_body_bytes"]),
    ({"state": {"max_sessions": True}}, ["[state]", "max_sessions"]),
    ({"supervisor": {"enabled": "yes"}}, ["[supervisor]", "enabled", "bool"]),
    ({"upstreams": {"main": {"idle_timeout_s": "10"}}}, ["[upstreams.main]", "idle_timeout_s"]),
    ({"upstreams": {"main": {"formats": "chat"}}}, ["[upstreams.main]", "formats"]),
    ({"upstreams": {"main": {"formats": ["chat", "gemini"]}}}, ["[upstreams.main]", "formats"]),
    ({"upstreams": {"main": {"url": "ftp://x"}}}, ["[upstreams.main]", "url"]),
    ({"upstreams": {"main": {"first_byte_timeout_s": 0}}}, ["[upstreams.main]", "first_byte_timeout_s"]),
    ({"upstreams": {"main": "https://x"}}, ["[upstreams.main]", "table"]),
    ({"upstreams": {}}, ["[upstreams]"]),
    ({"proxy": {"port": 70000}}, ["[proxy]", "port"]),
    ({"proxy": {"max_body_bytes": 10}}, ["[proxy]", "max_body_bytes"]),
    ({"state": {"session_idle_s": 0}}, ["[state]", "session_idle_s"]),
])
def test_invalid_values_name_the_file_and_key(document: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(document, source="my.toml")
    message = str(caught.value)
    assert message.startswith("my.toml"), message
    for word in words:
        assert word in message, (word, message)


def test_a_value_of_the_wrong_type_is_quoted_as_the_file_spells_it() -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"proxy": {"port": True}}, source="my.toml")
    assert str(caught.value).endswith("got true"), str(caught.value)


@pytest.mark.parametrize("document, name", [
    ({"proxy": {"prot": 1}}, "prot"), ({"proxi": {}}, "proxi"), ({"state": {"directory": "x"}}, "directory"),
    ({"upstreams": {"main": {"api_key": "sk-x"}}}, "api_key"), ({"supervisor": {"enable": False}}, "enable"),
])
def test_unknown_keys_are_rejected(document: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        parse(document)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com"])
def test_a_non_loopback_host_needs_an_auth_token(host: str) -> None:
    with pytest.raises(ConfigError, match="auth_token"):
        parse({"proxy": {"host": host}})
    assert parse({"proxy": {"host": host, "auth_token": "s3cret"}}).proxy.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_no_token(host: str) -> None:
    assert parse({"proxy": {"host": host}}).proxy.auth_token == ""


def test_load_reads_the_file_and_names_it_in_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[proxy]\nport = 9000\n[upstreams.main]\nurl = "http://127.0.0.1:1/v1"\nformats = ["chat"]\n')
    config = load(str(good))
    assert (config.proxy.port, config.upstreams[0].name, config.upstreams[0].formats) == (9000, "main", ("chat",))
    assert config.source == str(good)
    monkeypatch.setenv("PROXYVISOR_CONFIG", str(good))
    assert load().proxy.port == 9000
    bad = tmp_path / "bad.toml"
    bad.write_text("[proxy\nport = ")
    with pytest.raises(ConfigError, match="bad.toml.*not valid TOML"):
        load(str(bad))
    with pytest.raises(ConfigError, match="missing.toml"):
        load(str(tmp_path / "missing.toml"))
    monkeypatch.delenv("PROXYVISOR_CONFIG")
    assert load() == Config()  # no file anywhere: the built-in defaults


def test_state_dir_order(tmp_path: Path) -> None:
    env = {"PROXYVISOR_STATE_DIR": "/env/state", "XDG_STATE_HOME": "/xdg", "HOME": "/home/u"}
    assert Config().with_overrides(state={"dir": "/explicit"}).state_dir(env) == Path("/explicit")
    assert Config().state_dir(env) == Path("/env/state")
    assert Config().state_dir({"XDG_STATE_HOME": "/xdg"}) == Path("/xdg/proxyvisor")
    assert Config().state_dir({"HOME": "/home/u"}) == Path("/home/u/.local/state/proxyvisor")


def test_config_toml_documents_every_setting_with_its_default() -> None:
    text = (ROOT / "config.toml").read_text(encoding="utf-8")
    document = tomllib.loads(text)
    assert replace(parse(document), source="x") == replace(Config(), source="x")
    missing: list[str] = []

    def walk(table: dict, value: Any, where: str) -> None:
        for f in fields(value):
            child = getattr(value, f.name)
            if isinstance(child, msgspec.Struct):
                walk(table.get(f.name, {}), child, f"{where}.{f.name}")
            # Collections of tables (roles, adapter options) are empty by default and shown as examples.
            elif f.name not in table and not (isinstance(child, (tuple, dict)) and not child
                                              and f"[{where}.{f.name}." in text):
                missing.append(f"{where}.{f.name}")

    for section in fields(Config):
        if section.name in ("source", "upstreams"):
            continue
        walk(document.get(section.name, {}), getattr(Config(), section.name), section.name)
    upstream = UpstreamConfig(name="scripted")
    for f in fields(upstream):
        if f.name != "name" and f.name not in document["upstreams"]["scripted"]:
            missing.append(f"upstreams.scripted.{f.name}")
    assert missing == []


# ---- upstream keys ----------------------------------------------------------------------------------------


def test_an_unset_api_key_env_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PV_MISSING_KEY", raising=False)
    config = Config(upstreams=(UpstreamConfig(name="main", url="http://127.0.0.1:1", api_key_env="PV_MISSING_KEY"),))
    with pytest.raises(ConfigError, match="PV_MISSING_KEY"):
        upstream_keys(config)
    assert upstream_keys(config, {"PV_MISSING_KEY": "k"}) == {"main": "k"}


async def test_running_refuses_to_start_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PV_MISSING_KEY", raising=False)
    config = Config(upstreams=(UpstreamConfig(name="main", api_key_env="PV_MISSING_KEY"),))
    with pytest.raises(ConfigError, match="PV_MISSING_KEY"):
        async with running(config, port=0):
            pass  # pragma: no cover - must not be reached


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
async def test_a_configured_key_replaces_the_clients_credentials(supervised: bool, start_proxy,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PV_UPSTREAM_KEY", "sk-configured")
    async with start_proxy(supervised=supervised, upstream={"api_key_env": "PV_UPSTREAM_KEY"}) as rp:
        upstream = rp.scripted["scripted"]
        client_creds = {"authorization": "Bearer sk-client-key", "x-api-key": "sk-client-key",
                        "api-key": "sk-client-key"}
        for fmt in FORMATS:
            await ask(fmt, rp.url, stream=False, headers=client_creds)
            _target, _body, headers = upstream.requests[-1]
            assert "sk-client-key" not in str(headers)
            if fmt == "messages":
                assert headers["x-api-key"] == "sk-configured" and "authorization" not in headers
            else:
                assert headers["authorization"] == "Bearer sk-configured" and "x-api-key" not in headers
        # count_tokens and models go to the same upstream with the same rule; the scripted upstream does not
        # record them, so look at what it answered: it got through.
        async with http_client(rp.url) as client:
            assert (await client.post("/v1/messages/count_tokens", json=request_body("messages"))).status_code == 200
            assert (await client.get("/v1/models")).status_code == 200


async def test_auth_token_guards_everything_but_health(start_proxy) -> None:
    async with start_proxy(proxy={"auth_token": "tok-1"}) as rp, http_client(rp.url) as client:
        for fmt in FORMATS:
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt))
            assert reply.status_code == 401
            assert "x-proxyvisor-auth" in assert_error_shape(fmt, 401, data)["message"]
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt), headers={"x-proxyvisor-auth": "wrong"})
            assert reply.status_code == 401
            assert "does not hold this proxy's auth_token" in assert_error_shape(fmt, 401, data)["message"]
            reply, _ = await raw_stream(rp.url, fmt, request_body(fmt), headers={"x-proxyvisor-auth": "tok-1"})
            assert reply.status_code == 200
            assert "x-proxyvisor-auth" not in rp.scripted["scripted"].requests[-1][2]
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.head("/")).status_code == 200
        async with anthropic_client(rp.url) as anthropic_sdk:
            with pytest.raises(anthropic.AuthenticationError):
                await anthropic_sdk.messages.create(**request_body("messages"))


def _numeric_keys() -> list[tuple[tuple[str, ...], str, float]]:
    """Every numeric setting of the defaults (ints and floats, not booleans), as (the path of its table, e.g.
    ``("upstreams", "scripted")``, its key, its value); with a role, so per-role tables are walked too."""

    def walk(table: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str, float]]:
        for f in fields(table):
            value = getattr(table, f.name)
            if isinstance(value, msgspec.Struct):
                yield from walk(value, path + (f.name,))
            elif isinstance(value, tuple) and value and all(isinstance(v, msgspec.Struct) for v in value):
                for item in value:
                    yield from walk(item, path + (f.name, item.name))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield path, f.name, value

    return list(walk(parse({"model_routing": {"roles": {"r": {}}}}), ()))


@pytest.mark.parametrize("path, key, default", _numeric_keys(), ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1])
def test_every_numeric_setting_refuses_nan_inf_and_negatives_naming_the_key(
        path: tuple[str, ...], key: str, default: float, bad: float) -> None:
    value = bad if isinstance(default, float) or not float(bad).is_integer() else int(bad)
    document: dict = {}
    table = document
    for part in path:
        table = table.setdefault(part, {})
    table[key] = value
    with pytest.raises(ConfigError) as caught:
        parse(document, source="my.toml")
    message = str(caught.value)
    assert message.startswith("my.toml") and f"[{'.'.join(path)}]" in message and key in message, message


def test_the_numeric_settings_walked_are_every_number_of_the_defaults() -> None:
    keys = {(path, key) for path, key, _ in _numeric_keys()}
    assert (("proxy",), "request_body_timeout_s") in keys and (("upstreams", "scripted"), "idle_timeout_s") in keys
    assert (("state",), "session_idle_s") in keys and (("model_routing", "children"), "wall_clock_s") in keys
    assert len(keys) == sum(line.split("=")[1].strip()[:1].isdigit() for line in
                            (ROOT / "config.toml").read_text().splitlines() if "=" in line and not line.startswith("#"))
