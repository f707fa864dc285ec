"""Pricing from litellm's cost map without importing litellm (``proxyvisor.pricing``): the same figures as
``litellm.cost_per_token`` for common models, "price unknown" rather than $0 for others, and an offline
``proxyvisor info`` that answers quickly and never imports litellm."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from proxyvisor.pricing import price, rates_table

from helpers import LITELLM_PROBE

COMMON = ("claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-5", "claude-sonnet-4-5-20250929", "gpt-4o",
          "gpt-4o-mini", "gpt-4.1", "gpt-4.1-mini", "gpt-5", "gpt-5-mini", "gpt-5-codex", "o3", "o4-mini",
          "gemini-2.5-pro", "gemini-2.5-flash", "gemini/gemini-2.5-pro", "anthropic/claude-sonnet-4-5",
          "openai/gpt-4o", "deepseek/deepseek-chat")


def litellm_cost(litellm, model: str, tokens_in: int, tokens_out: int) -> float | None:
    """litellm's own figure; None where it prices nothing (it raises, or answers 0 for a model it does not map)."""
    try:
        prompt, completion = litellm.cost_per_token(model=model, prompt_tokens=tokens_in,
                                                    completion_tokens=tokens_out)
    except Exception:  # noqa: BLE001 - litellm raises several types for a model it cannot price
        return None
    return (prompt + completion) or None


def test_prices_agree_with_litellm_for_common_models() -> None:
    from proxyvisor.adapters.litellm_bridge import import_litellm

    litellm = import_litellm()
    priced = 0
    for model in COMMON:
        for tokens_in, tokens_out in ((1_000, 100), (300_000, 2_000)):
            theirs = litellm_cost(litellm, model, tokens_in, tokens_out)
            ours = price(model, tokens_in, tokens_out)
            if theirs is None:
                assert not ours, model  # "unknown" (or free) for us too
            else:
                assert ours == pytest.approx(theirs, rel=1e-9), (model, tokens_in)
                priced += 1
    assert priced >= len(COMMON)  # most of the list is in the map: the comparison is not vacuous


def test_a_long_prompt_takes_the_rates_of_its_tier() -> None:
    """A model with rates above some prompt size (``..._above_200k_tokens``) is priced as litellm prices it on
    both sides of the threshold."""
    from proxyvisor.adapters.litellm_bridge import import_litellm

    litellm = import_litellm()
    tiered = sorted(name for name, (_i, _o, tiers) in rates_table().items() if tiers and "/" not in name)[:5]
    assert tiered
    for model in tiered:
        threshold = rates_table()[model][2][-1][0]
        for tokens_in in (threshold // 2, threshold + 1000):
            theirs = litellm_cost(litellm, model, tokens_in, 500)
            if theirs is not None:
                assert price(model, tokens_in, 500) == pytest.approx(theirs, rel=1e-9), (model, tokens_in)


def test_a_model_the_map_does_not_know_has_no_price() -> None:
    assert price("my-local-llm", 1000, 10) is None
    assert price("openai/gpt-4o", 1_000_000, 0) == price("gpt-4o", 1_000_000, 0) > 0




def test_offline_info_prices_without_importing_litellm(tmp_path: Path) -> None:
    ledger = tmp_path / "state" / "ledger"
    ledger.mkdir(parents=True)
    lines = [{"time": "2026-01-01T00:00:00.000+00:00", "format": "messages", "model": "claude-sonnet-4-5",
              "status": 200, "input_tokens": 10_000, "output_tokens": 1_000, "overhead_ms": 1.5},
             {"time": "2026-01-01T00:00:01.000+00:00", "format": "chat", "model": "my-local-llm", "status": 200,
              "input_tokens": 500, "output_tokens": 50, "overhead_ms": 0.5}]
    (ledger / "quick.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    runner = tmp_path / "runner.py"
    runner.write_text(LITELLM_PROBE)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, str(runner), "info", "quick", "--state-dir", str(tmp_path / "state"),
                           "--url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "litellm not imported"
    expected = price("claude-sonnet-4-5", 10_000, 1_000)
    assert expected and f"${expected:,.4f} + price unknown for my-local-llm" in done.stdout
    # Importing litellm alone takes seconds of CPU; the command takes a fraction of one. CPU time, unlike wall
    # time, does not grow with the machine's load (the wall time is measured in bench/offline_info.py).
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 1.0, cpu
