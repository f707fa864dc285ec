"""``[supervisor.model]`` and ``[supervisor.condense]``: every key documented in config.toml, values parsed, and
bad values refused with the key named."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from proxyvisor.config import Config, ConfigError, parse

ROOT_CONFIG = Path(__file__).resolve().parent.parent / "config.toml"


def test_every_supervisor_key_in_config_toml_has_its_comment() -> None:
    # Equality with the defaults is tests/test_config.py's job; here: each key is explained right above it.
    text = ROOT_CONFIG.read_text(encoding="utf-8")
    for section in ("[supervisor.model]", "[supervisor.condense]"):
        body = text.split(section, 1)[1].split("\n[", 1)[0]
        keys = [line.split("=")[0].strip() for line in body.splitlines() if line and not line.startswith("#")]
        assert keys == [f.name for f in msgspec.structs.fields(getattr(Config().supervisor, section[12:-1]))]
        for key in keys:
            above = body.split(f"\n{key} =", 1)[0].rstrip().splitlines()[-1]
            assert above.startswith("#"), f"{section} {key} is not documented"


def test_supervisor_sections_parse() -> None:
    config = parse({"supervisor": {"enabled": True,
                                   "model": {"name": "anthropic/claude-haiku-4-5", "max_tokens": 2048,
                                             "temperature": 0, "request_timeout_s": 30},
                                   "condense": {"tokens_threshold": 8000, "adaptive": True, "timeout_s": 20}}})
    assert config.supervisor.model.name == "anthropic/claude-haiku-4-5"
    assert config.supervisor.model.temperature == 0.0 and config.supervisor.model.request_timeout_s == 30.0
    assert config.supervisor.condense.tokens_threshold == 8000 and config.supervisor.condense.adaptive


@pytest.mark.parametrize(("document", "message"), [
    ({"supervisor": {"model": {"nam": "x"}}}, "[supervisor.model] unknown setting(s) nam"),
    ({"supervisor": {"model": "gpt"}}, "[supervisor.model] must be a table"),
    ({"supervisor": {"model": {"max_tokens": "8192"}}}, "[supervisor.model] max_tokens must be an integer"),
    ({"supervisor": {"model": {"temperature": 3}}}, "[supervisor.model] temperature must be 0-2"),
    ({"supervisor": {"model": {"top_p": 0}}}, "[supervisor.model] top_p must be in (0, 1]"),
    ({"supervisor": {"condense": {"tokens_threshold": -1}}}, "[supervisor.condense] tokens_threshold must be 0-9223372036854775807"),
    ({"supervisor": {"condense": {"view_budget_tokens": 100}}}, "[supervisor.condense] view_budget_tokens must be"),
    ({"supervisor": {"condense": {"timeout_s": 0}}}, "[supervisor.condense] timeout_s must be in (0, 315360000], got 0"),
    ({"supervisor": {"condense": {"adaptive": "yes"}}}, "[supervisor.condense] adaptive must be a boolean"),
])
def test_bad_supervisor_values_name_the_key(document: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse(document, source="cfg.toml")
    assert message in str(error.value) and "cfg.toml" in str(error.value)
