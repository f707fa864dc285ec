"""The configuration's schema: the rules the configuration and the cores share agree, a configuration built in
code is checked by the file's rules, and descriptor files are refused naming the file and the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from proxyvisor.adapters.descriptors import DescriptorError, discover, load_descriptor
from proxyvisor.condense_cli import condense_command
from proxyvisor.config import (LONGEST_S, Config, ConfigError, ModelRoutingConfig, RoleConfig, UpstreamConfig, as_document,
                               parse, validate)
from proxyvisor.gate.digest import build
from proxyvisor.gate.outcome import GatePolicy
from proxyvisor.rules import DIGEST_BUDGET, FAILURE_POLICIES, REENTRY_BUDGET, VIEW_BUDGET
from proxyvisor.schema import LARGEST_INT


def _accepted(document: dict) -> bool:
    try:
        parse(document)
    except ConfigError:
        return False
    return True


def _gate(**values: object) -> dict:
    return {"supervisor": {"gate": values}}


@pytest.mark.parametrize("budget", [-1, 0, 2, int(REENTRY_BUDGET.high), int(REENTRY_BUDGET.high) + 1, 100])
def test_the_gate_and_the_configuration_accept_the_same_reentry_budgets(budget: int) -> None:
    try:
        GatePolicy(reentry_budget=budget)
        core = True
    except ValueError:
        core = False
    assert core == _accepted(_gate(reentry_budget=budget)) == REENTRY_BUDGET.admits(budget)


@pytest.mark.parametrize("policy", [*FAILURE_POLICIES, "ignore", ""])
def test_the_gate_and_the_configuration_accept_the_same_failure_policies(policy: str) -> None:
    try:
        GatePolicy(failure_policy=policy)  # type: ignore[arg-type]
        core = True
    except ValueError:
        core = False
    assert core == _accepted(_gate(failure_policy=policy)) == (policy in FAILURE_POLICIES)


@pytest.mark.parametrize("budget", [int(DIGEST_BUDGET.low) - 1, int(DIGEST_BUDGET.low), 16_384])
def test_the_digest_and_the_configuration_accept_the_same_budgets(budget: int) -> None:
    try:
        build("Fix it", ["Done."], budget=budget)
        core = True
    except ValueError:
        core = False
    assert core == _accepted(_gate(digest_budget_tokens=budget)) == (budget >= DIGEST_BUDGET.low)


@pytest.mark.parametrize("budget", [int(VIEW_BUDGET.low) - 1, int(VIEW_BUDGET.low)])
def test_condense_budget_flag_and_the_configuration_accept_the_same_view_budgets(
        budget: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.txt"
    output.write_text("".join(f"line {n}\n" for n in range(50)))
    code = condense_command(Config(), str(output), "find the error", budget, as_json=True)
    assert (code != 2) == _accepted({"supervisor": {"condense": {"view_budget_tokens": budget}}}) \
        == VIEW_BUDGET.admits(budget)
    if code == 2:
        assert f"--budget must be {VIEW_BUDGET} tokens" in capsys.readouterr().err


def test_a_configuration_built_in_code_is_checked_by_the_files_rules() -> None:
    for overrides, words in (({"proxy": {"port": 70000}}, ["[proxy] port", "0-65535", "70000"]),
                             ({"state": {"session_idle_s": float("nan")}}, ["[state] session_idle_s", "finite"]),
                             ({"supervisor": {"enabled": "yes"}}, ["[supervisor] enabled", "boolean"])):
        config = Config().with_overrides(**overrides)  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as caught:
            validate(config)
        message = str(caught.value)
        assert message.startswith("built-in defaults: ") and all(w in message for w in words), message
    validate(Config().with_overrides(proxy={"port": 9000}))


def test_a_configuration_is_its_own_document() -> None:
    routing = ModelRoutingConfig(enabled=True, roles=(RoleConfig(name="reviewer", model="m", supervises=()),),
                                 adapter_options={"litellm": {"api_base": "http://127.0.0.1:1", "n": 2}})
    config = Config(upstreams=(UpstreamConfig(name="a", url="http://127.0.0.1:1", formats=("chat",)),
                               UpstreamConfig(name="b")), model_routing=routing, source="x.toml")
    assert parse(as_document(config), source="x.toml") == config


@pytest.mark.parametrize("section", ["upstreams", "roles"])
def test_a_name_key_inside_a_named_table_is_refused(section: str) -> None:
    document = {"upstreams": {"main": {"name": "other"}}} if section == "upstreams" else \
        {"model_routing": {"roles": {"reviewer": {"name": "other"}}}}
    with pytest.raises(ConfigError, match=r"my\.toml: \[(upstreams\.main|model_routing\.roles\.reviewer)\] "
                                          r"unknown setting\(s\) name"):
        parse(document, source="my.toml")


@pytest.mark.parametrize("text, words", [
    ("foo = 1\n", ["unknown key(s) foo"]),
    ('[runtime_entrypoints]\ncapabilities = ["fly"]\n', ["[runtime_entrypoints] capabilities", "model_selection",
                                                          "'fly'"]),
    ('[runtime_entrypoints]\nbin = "x"\n', ["[runtime_entrypoints] unknown key(s) bin"]),
    ('[runtime_entrypoints]\ndispatch = "nocolon"\n', ["[runtime_entrypoints] dispatch", "module:factory"]),
    ('[[models]]\nid = "m"\nbuket = "b"\n', ["models must be a list of", "buket"]),
    ('[[models]]\nbucket = "b"\n', ["models must be a list of"]),
    ('efforts = "low"\n', ["efforts must be a list of non-empty strings"]),
    ('pool_per_model = "yes"\n', ["pool_per_model must be a boolean"]),
    ("runtime_entrypoints = 3\n", ["[runtime_entrypoints] must be a table"]),
])
def test_a_bad_descriptor_is_skipped_naming_the_file_and_the_key(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(DescriptorError) as caught:
        load_descriptor(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and all(w in message for w in words), message
    registry = discover([tmp_path])
    assert registry.ids() == [] and registry.errors == [message]


def _numbers(document: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every float setting in ``document`` (durations, most of all)."""
    found: list[tuple[str, ...]] = []
    for key, value in document.items():
        if isinstance(value, dict):
            found += _numbers(value, (*path, key))
        elif isinstance(value, float):
            found.append((*path, key))
    return found


def _with(document: dict, path: tuple[str, ...], value: object) -> dict:
    """A copy of ``document`` with ``value`` at ``path``."""
    head, *rest = path
    return {**document, head: _with(document[head], tuple(rest), value) if rest else value}


_DOCUMENT = as_document(Config())


@pytest.mark.parametrize("path", _numbers(_DOCUMENT), ids=".".join)
def test_a_huge_number_is_a_config_error_naming_its_key(path: tuple[str, ...]) -> None:
    # 1e308 s is infinite in milliseconds (a Redis expiry: OverflowError), and past what a thread's wait takes.
    with pytest.raises(ConfigError, match=rf"\b{path[-1]}\b.*must be"):
        parse(_with(_DOCUMENT, path, 1e308))


def _integers(document: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every integer setting in ``document`` (sizes, counts, budgets)."""
    found: list[tuple[str, ...]] = []
    for key, value in document.items():
        if isinstance(value, dict):
            found += _integers(value, (*path, key))
        elif isinstance(value, int) and not isinstance(value, bool):
            found.append((*path, key))
    return found


@pytest.mark.parametrize("path", _integers(_DOCUMENT), ids=".".join)
def test_an_integer_past_64_bits_is_a_config_error_naming_its_key(path: tuple[str, ...]) -> None:
    # TOML's integers end at 2**63 - 1, but Python's reader takes any; what a size reaches (SQLite, Redis, a C
    # ssize_t) does not.
    with pytest.raises(ConfigError, match=rf"\b{path[-1]}\b must be .*, got {LARGEST_INT + 1}\Z"):
        parse(_with(_DOCUMENT, path, LARGEST_INT + 1))


def test_the_largest_64_bit_integer_is_accepted_where_nothing_tighter_applies() -> None:
    assert _integers(_DOCUMENT)  # the test above covers something
    config = parse(_with(_DOCUMENT, ("proxy", "max_body_bytes"), LARGEST_INT))
    assert config.proxy.max_body_bytes == LARGEST_INT
    assert tomllib.loads(f"n = {LARGEST_INT + 1}")["n"] == LARGEST_INT + 1  # what the bound is for


def test_a_duration_of_ten_years_is_accepted() -> None:
    assert parse(_with(_DOCUMENT, ("state", "session_ttl_s"), float(LONGEST_S))).state.session_ttl_s == LONGEST_S
    assert not _accepted(_with(_DOCUMENT, ("state", "session_ttl_s"), LONGEST_S + 1.0))
