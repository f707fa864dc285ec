"""What model tokens cost: litellm's cost map, read without importing litellm.

Importing litellm takes seconds, and pricing a ledger needs only its table of per-token prices, which litellm ships
as a JSON file inside its package (the map it uses itself with ``LITELLM_LOCAL_MODEL_COST_MAP``, which
``proxyvisor.adapters.litellm_bridge`` sets). :func:`price` reads that file once (about 25 ms) and prices as
``litellm.cost_per_token`` does for the plain token counts a ledger holds: the model's entry, else, for a
``provider/model`` name, the entry of ``model``; the rates of the highest ``..._above_NNNk_tokens`` tier the prompt
exceeds, for input and output alike. A model without an entry has no price (None), never $0. Only when the file is
missing (another litellm layout) is litellm imported for its ``model_cost``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import orjson

COST_MAP_FILE = "model_prices_and_context_window_backup.json"
_TIER = re.compile(r"^input_cost_per_token_above_(\d+)k_tokens$")

Rates = tuple[float, float, tuple[tuple[int, float, float], ...]]
"""(USD per input token, USD per output token, tiers: (prompt tokens above which they apply, input, output),
highest threshold first)."""


def cost_map_path() -> Path | None:
    """litellm's bundled cost map file, found without importing litellm; None when litellm or the file is absent."""
    try:
        spec = importlib.util.find_spec("litellm")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / COST_MAP_FILE
        if path.is_file():
            return path
    return None


def _rates(entry: Any) -> Rates | None:
    if not isinstance(entry, dict):
        return None
    base_in, base_out = entry.get("input_cost_per_token"), entry.get("output_cost_per_token")
    if not isinstance(base_in, (int, float)) or not isinstance(base_out, (int, float)):
        return None
    tiers = []
    for key, value in entry.items():
        match = _TIER.match(key)
        out = entry.get(f"output_cost_per_token_above_{match[1]}k_tokens") if match else None
        if match and isinstance(value, (int, float)) and isinstance(out, (int, float)):
            tiers.append((int(match[1]) * 1000, float(value), float(out)))
    return float(base_in), float(base_out), tuple(sorted(tiers, reverse=True))


@functools.cache
def rates_table() -> dict[str, Rates]:
    """Per-token rates by model name, from litellm's cost map (loaded once; imports litellm only when its file
    cannot be found). Empty when litellm is not installed."""
    path = cost_map_path()
    if path is not None:
        try:
            table: Any = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            table = None
    else:
        table = None
    if not isinstance(table, dict):
        try:
            from .adapters.litellm_bridge import import_litellm

            table = import_litellm().model_cost
        except Exception:  # noqa: BLE001 - no litellm, or one without a cost map: nothing is priced
            table = {}
    return {name: rates for name, entry in table.items() if (rates := _rates(entry)) is not None}


def rates_of(model: str) -> Rates | None:
    """The rates of ``model`` (a name as a request or litellm gives it); None when the cost map does not price it."""
    table = rates_table()
    found = table.get(model)
    if found is None and "/" in model:
        found = table.get(model.partition("/")[2])
    return found


def price(model: str, input_tokens: int, output_tokens: int) -> float | None:
    """The cost in USD of ``input_tokens`` and ``output_tokens`` of ``model``; None when the model has no price
    in litellm's cost map (a local model, a name the map does not know)."""
    rates = rates_of(model)
    if rates is None:
        return None
    rate_in, rate_out, tiers = rates
    for threshold, tier_in, tier_out in tiers:
        if input_tokens > threshold:
            rate_in, rate_out = tier_in, tier_out
            break
    return input_tokens * rate_in + output_tokens * rate_out


__all__ = ["COST_MAP_FILE", "cost_map_path", "price", "rates_of", "rates_table"]
