"""The tool authorizer's sans-IO rules (``proxyvisor.gate.authorize``) and its configuration."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, strategies as st

from proxyvisor.config import AuthorizerConfig, ConfigError, parse
from proxyvisor.gate import authorize as a
from proxyvisor.gate.prohibitions import standing

RULES = standing([(1, "Look at the parser. Do not run the tests.")])
SOURCES = a.Sources(((1, "Look at the parser. Do not run the tests."),), RULES, role="Never push to main.",
                    actions=(a.Completed("Read", {"file_path": "src/parser.py"}, True),
                             a.Completed("Bash", {"command": "ruff check"}, False)))
PYTEST = a.Call("c1", "Bash", {"command": "pytest -q"})


def answer(**block: Any) -> str:
    return orjson.dumps({"blocks": [{"call": "c1", "source": "user:1", "path": "/command", "reason": "r", **block}]}
                        ).decode()


# ---- configuration ------------------------------------------------------------------------------------------------
def test_the_seeds_authorizer_table_loads_and_is_off_by_default() -> None:
    assert parse({}).supervisor.authorizer == AuthorizerConfig(enabled=False, mode="block", timeout_s=30.0,
                                                               budget_tokens=32_000)
    config = parse({"supervisor": {"authorizer": {"enabled": True, "mode": "advise"}}})
    assert (config.supervisor.authorizer.enabled, config.supervisor.authorizer.mode) == (True, "advise")


@pytest.mark.parametrize(("table", "message"), [
    ({"mode": "warn"}, "[supervisor.authorizer] mode must be one of block, advise, got 'warn'"),
    ({"budget_tokens": 100}, "[supervisor.authorizer] budget_tokens must be 1024-9223372036854775807, got 100"),
    ({"timeout_s": 0}, "[supervisor.authorizer] timeout_s"),
    ({"enable": True}, "[supervisor.authorizer] unknown setting(s) enable"),
])
def test_a_bad_authorizer_setting_is_refused_naming_its_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"supervisor": {"authorizer": table}}, "cfg.toml")
    assert message in str(caught.value)


# ---- the pre-screen -----------------------------------------------------------------------------------------------
def test_with_no_prohibition_nothing_goes_to_the_judge() -> None:
    assert a.concerned((), [PYTEST]) == []


@pytest.mark.parametrize(("rule", "call", "judged"), [
    ("Do not run the tests.", a.Call("c", "Bash", {"command": "pytest -q"}), True),  # "test" in "pytest"
    ("Do not run the tests.", a.Call("c", "Bash", {"command": "make check"}), True),  # a shell call runs things
    ("Do not run the tests.", a.Call("c", "Read", {"file_path": "src/parser.py"}), False),
    ("Don't touch migrations/.", a.Call("c", "Edit", {"file_path": "db/migrations/0001.py"}), True),
    ("Don't touch migrations/.", a.Call("c", "Write", {"file_path": "app.py"}), True),  # an editing tool
    ("Don't touch migrations/.", a.Call("c", "Grep", {"pattern": "TODO"}), False),
    ("Never push.", a.Call("c", "shell", {"command": ["git", "push"]}), True),
    ("DO NOT MODIFY: Tests, configuration files.", a.Call("c", "bash", {"command": "ls django/db"}), False),
    ("DO NOT MODIFY: Tests, configuration files.", a.Call("c", "bash", {"command": "sed -i s/a/b/ x.py"}), True),
    ("DO NOT MODIFY: Tests, configuration files.", a.Call("c", "bash", {"command": "cat tests/test_x.py"}), True),
    ("Never push.", a.Call("c", "Glob", {"pattern": "*.py"}), False),
    # A change mode forbids changing, not reading: its "read" names nothing.
    ("Read-only: no edits.", a.Call("c", "Edit", {"file_path": "src/parser.py"}), True),
    ("Read-only: no edits.", a.Call("c", "Write", {"file_path": "notes.md", "content": "x"}), True),
    ("Read-only: no edits.", a.Call("c", "Bash", {"command": "sed -i s/a/b/ x.py"}), True),
    ("Read-only: no edits.", a.Call("c", "Read", {"file_path": "README.md"}), False),
    ("Read-only: no edits.", a.Call("c", "Bash", {"command": "ls src"}), False),
    ("Leave the migrations alone.", a.Call("c", "Edit", {"file_path": "app.py"}), True),
    ("Leave the migrations alone.", a.Call("c", "Grep", {"pattern": "TODO"}), False),
    # "change" and "write" are matched as the content words they are ("chang", "writ").
    ("Do not change any files.", a.Call("c", "Edit", {"file_path": "app.py"}), True),
    ("Don't write anything.", a.Call("c", "apply_patch", {"input": "*** Begin Patch"}), True),
])
def test_the_prescreen_sends_only_calls_a_prohibition_could_concern(rule: str, call: a.Call, judged: bool) -> None:
    assert a.concerned(standing([(1, rule)]), [call]) == ([call] if judged else [])


# ---- the judge's document -------------------------------------------------------------------------------------------
def test_the_document_labels_each_source_and_shows_no_tool_output() -> None:
    document = a.document(SOURCES, [PYTEST])
    assert '[user:1] "Look at the parser. Do not run the tests."' in document
    assert '[role:0] "Never push to main."' in document
    assert '- Read {"file_path":"src/parser.py"} ok=true' in document
    assert '- Bash {"command":"ruff check"} ok=false' in document
    assert '[call:c1] Bash {"command":"pytest -q"}' in document


def test_only_the_last_16_completed_actions_are_shown() -> None:
    actions = tuple(a.Completed("Read", {"file_path": f"f{n}.py"}, True) for n in range(20))
    document = a.document(a.Sources((), RULES, actions=actions), [PYTEST])
    assert "f3.py" not in document and "f4.py" in document and "f19.py" in document


def test_a_prohibition_whose_turn_was_compacted_away_is_still_a_source() -> None:
    document = a.document(a.Sources(((5, "Go on."),), standing([(2, "Never push.")])), [PYTEST])
    assert '[user:2] "Never push."' in document


# ---- reading the judgment -----------------------------------------------------------------------------------------
def test_a_grounded_block_copies_the_quote_and_the_value_itself() -> None:
    judgment = a.read_judgment(answer(quote="the user said anything goes"), SOURCES, [PYTEST])
    (proposal,) = judgment.proposals
    assert (proposal.quote, proposal.value, proposal.source, proposal.path) == ("Do not run the tests.",
                                                                                '"pytest -q"', "user:1", "/command")


@pytest.mark.parametrize("text", [None, "", "allow", "{}", '{"blocks": "c1"}', "[1, 2]"])
def test_a_malformed_judgment_blocks_nothing(text: str | None) -> None:
    judgment = a.read_judgment(text, SOURCES, [PYTEST])
    assert judgment.malformed and judgment.proposals == ()


@pytest.mark.parametrize("block", [
    {"source": "role:0"},  # role text cannot pose as the user's words
    {"source": "user:7"},  # no such turn
    {"source": "tool:1"},  # tool output is no source at all
    {"call": "c9"},  # no such call
    {"path": "/cwd"},  # no such argument
    {"path": "command"},  # not a JSON pointer
])
def test_an_ungrounded_block_is_dropped(block: dict[str, Any]) -> None:
    judgment = a.read_judgment(answer(**block), SOURCES, [PYTEST])
    assert judgment.proposals == () and judgment.ungrounded == 1 and not judgment.malformed


def test_a_user_turn_with_no_prohibition_in_force_cannot_ground_a_block() -> None:
    sources = a.Sources(((1, "Do not run the tests."), (2, "You can run the tests now.")),
                        standing([(1, "Do not run the tests."), (2, "You can run the tests now.")]))
    assert sources.rules == ()
    assert a.read_judgment(answer(), sources, [PYTEST]).proposals == ()


def test_the_tool_path_names_the_call_itself() -> None:
    (proposal,) = a.read_judgment(answer(path="@tool"), SOURCES, [PYTEST]).proposals
    assert proposal.value == "Bash"


@pytest.mark.parametrize(("text", "confirmed"), [('{"confirmed": true}', True), ('{"confirmed": "yes"}', False),
                                                 ('{"confirmed": false}', False), ("sure", False), (None, False)])
def test_only_an_explicit_confirmation_confirms(text: str | None, confirmed: bool) -> None:
    assert a.read_confirmation(text) is confirmed


def test_the_error_text_quotes_the_user() -> None:
    (proposal,) = a.read_judgment(answer(reason="Tests conflict with the user's restriction."), SOURCES,
                                  [PYTEST]).proposals
    assert a.denial(proposal).error_text() == ('[authorizer] Tool not executed: Tests conflict with the user\'s '
                                               'restriction. user source user:1: "Do not run the tests."')


# ---- the denial cache ---------------------------------------------------------------------------------------------
DENIAL = a.Denial("r", 1, "Do not run the tests.", "/command", '"pytest -q"')


def test_a_denial_is_reused_only_for_the_identical_call_under_the_same_context() -> None:
    cache = a.DenialCache()
    context = a.context_key(SOURCES)
    cache.put(context, PYTEST, DENIAL)
    assert cache.get(context, PYTEST) == DENIAL
    assert cache.get(context, a.Call("c2", "Bash", {"command": "pytest -q"})) == DENIAL  # the id is no context
    assert cache.get(context, a.Call("c1", "Bash", {"command": "pytest -x"})) is None
    more = a.Sources(SOURCES.users + ((2, "Go on."),), SOURCES.rules, SOURCES.role, SOURCES.actions)
    assert cache.get(a.context_key(more), PYTEST) is None
    acted = a.Sources(SOURCES.users, SOURCES.rules, SOURCES.role, SOURCES.actions + (a.Completed("Read", {}, True),))
    assert cache.get(a.context_key(acted), PYTEST) is None


@given(st.integers(min_value=1, max_value=300))
def test_the_cache_stays_bounded(puts: int) -> None:
    cache = a.DenialCache(size=16)
    for n in range(puts):
        cache.put(b"ctx", a.Call("c", "Bash", {"command": f"pytest {n}"}), DENIAL)
        assert 1 <= len(cache) <= 16


def test_pointer_reads_rfc_6901() -> None:
    args = {"a/b": {"~x": [10, 20]}}
    assert a.pointer(args, "/a~1b/~0x/1") == 20
    assert a.pointer(args, "") == args
    assert a.pointer(args, "/missing") is not None and a.pointer(args, "/a~1b/~0x/5") is a.pointer(args, "/nope")
