"""The configuration schema's cost: msgspec (what proxyvisor uses) against pydantic, and ``proxyvisor info``'s start.

Usage (from the repository root, in the project's environment, with pydantic installed: litellm brings it)::

    python bench/schema.py [--runs 7] [--calls 2000]

Each figure is the median of ``--runs`` fresh interpreters (imports are timed once per interpreter, so every run
pays them cold from the OS's file cache, as a command does):

- *import*: ``import msgspec``; and ``import pydantic`` with the configuration's schema built as pydantic models
  (derived field by field from the msgspec structs of ``proxyvisor.config``: the same types, ranges, choices,
  patterns, unknown keys refused, strict types, ``inf``/``nan`` refused; pydantic compiles a model when it is
  built); also ``import proxyvisor.config`` as it is (msgspec, tomllib and the structs);
- *first validation*: the first check of the root ``config.toml`` document (parsed once with tomllib), where
  msgspec compiles its decoders: ``proxyvisor.config.parse`` (msgspec, with the checks after it), and the
  pydantic models on the same tables; *next validations*: the mean of ``--calls`` more;
- *info*: the wall time of ``proxyvisor info`` summing a small ledger (a temporary state directory holding one
  demo session; no proxy answers), the whole command from exec to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r'''
import json, sys, time, tomllib
t0 = time.perf_counter()
which, calls = sys.argv[1], int(sys.argv[2])
doc = tomllib.loads(open(sys.argv[3], encoding="utf-8").read())
if which == "config":
    t = time.perf_counter(); import proxyvisor.config as c; imp = time.perf_counter() - t
    print(json.dumps({"import_ms": imp * 1e3})); sys.exit()
if which == "msgspec":
    t = time.perf_counter(); import msgspec; imp = time.perf_counter() - t
    from proxyvisor.config import parse
    check = lambda: parse(doc)
else:
    import proxyvisor.config
    from bench.schema import pydantic_schema
    t = time.perf_counter()
    models = pydantic_schema()
    imp = time.perf_counter() - t
    def check():
        models["_Document"].model_validate({k: v for k, v in doc.items() if k in ("proxy", "state", "supervisor")})
        for name, table in doc["upstreams"].items():
            models["UpstreamConfig"].model_validate({**table, "name": name})
        routing = {k: v for k, v in doc["model_routing"].items() if k not in ("roles", "adapter_options")}
        models["ModelRoutingConfig"].model_validate(routing)
t = time.perf_counter(); check(); first = time.perf_counter() - t
t = time.perf_counter()
for _ in range(calls):
    check()
print(json.dumps({"import_ms": imp * 1e3, "first_ms": first * 1e3,
                  "validate_us": (time.perf_counter() - t) / calls * 1e6}))
'''


def pydantic_schema() -> dict[str, type]:
    """Pydantic models equivalent to the msgspec structs of :mod:`proxyvisor.config`, by name."""
    from typing import Annotated, Any, Literal, Union

    import msgspec
    from msgspec import inspect
    from pydantic import ConfigDict, Field, create_model

    from proxyvisor import config

    settings = ConfigDict(extra="forbid", strict=True, frozen=True, regex_engine="python-re")
    models: dict[str, type] = {}

    def annotation(t: Any) -> Any:
        if isinstance(t, inspect.Metadata):
            return annotation(t.type)
        if isinstance(t, (inspect.IntType, inspect.FloatType)):
            bounds = {k: getattr(t, k) for k in ("gt", "ge", "lt", "le") if getattr(t, k) is not None}
            kind = int if isinstance(t, inspect.IntType) else float
            extra = {"allow_inf_nan": False} if kind is float else {}
            return Annotated[kind, Field(**bounds, **extra)]
        if isinstance(t, inspect.StrType):
            return Annotated[str, Field(pattern=t.pattern, min_length=t.min_length)]
        if isinstance(t, inspect.BoolType):
            return bool
        if isinstance(t, inspect.LiteralType):
            return Literal[t.values]
        if isinstance(t, (inspect.VarTupleType, inspect.ListType)):
            # TOML arrays are lists; strict pydantic takes no list for a tuple.
            return Annotated[list[annotation(t.item_type)], Field(min_length=t.min_length)]
        if isinstance(t, inspect.DictType):
            return dict[annotation(t.key_type), annotation(t.value_type)]
        if isinstance(t, inspect.StructType):
            return model(t)
        if isinstance(t, inspect.UnionType):
            return Union[tuple(annotation(u) for u in t.types)]
        return Any

    def model(info: Any) -> type:
        name = info.cls.__name__
        if name not in models:
            fields: dict[str, Any] = {}
            for f in info.fields:
                kind = annotation(f.type)
                if f.default is not msgspec.NODEFAULT:
                    fields[f.name] = (kind, msgspec.to_builtins(f.default))
                elif f.default_factory is not msgspec.NODEFAULT:
                    fields[f.name] = (kind, Field(default_factory=lambda f=f: msgspec.to_builtins(f.default_factory())))
                else:
                    fields[f.name] = (kind, ...)
            models[name] = create_model(name, __config__=settings, **fields)
        return models[name]

    for struct in (config._Document, config.UpstreamConfig, config.ModelRoutingConfig):
        model(inspect.type_info(struct))
    return models


def _median_of(runs: int, argv: list[str], key: str, env: dict[str, str]) -> float:
    values = []
    for _ in range(runs):
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
        values.append(json.loads(out.strip().splitlines()[-1])[key])
    return statistics.median(values)


def _info_ms(runs: int, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as state:
        subprocess.run([sys.executable, "-m", "proxyvisor", "demo", "--format", "chat", "--state-dir", state],
                       capture_output=True, check=True, cwd=ROOT, env=env)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "proxyvisor", "info", "--url", "http://127.0.0.1:1",
                            "--state-dir", state], capture_output=True, cwd=ROOT, env=env)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROXYVISOR_CONFIG", None)
    document = str(ROOT / "config.toml")
    load_before = os.getloadavg()[0]
    child = [sys.executable, "-c", _CHILD]
    figures = {
        which: {key: _median_of(args.runs, [*child, which, str(args.calls), document], key, env)
                for key in ("import_ms", "first_ms", "validate_us")}
        for which in ("msgspec", "pydantic")}
    config_ms = _median_of(args.runs, [*child, "config", "0", document], "import_ms", env)
    info_ms = _info_ms(args.runs, env)
    import msgspec
    import pydantic
    print(f"medians of {args.runs} fresh interpreters; 1-minute load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print("| library | version | import (ms) | first validation (ms) | next validations (us each) |")
    print("|---|---|---|---|---|")
    for which, version in (("msgspec", msgspec.__version__), ("pydantic", pydantic.VERSION)):
        f = figures[which]
        print(f"| {which} | {version} | {f['import_ms']:.1f} | {f['first_ms']:.1f} | {f['validate_us']:.0f} |")
    print(f"\nimport proxyvisor.config: {config_ms:.1f} ms; proxyvisor info on a small ledger: {info_ms:.0f} ms")


if __name__ == "__main__":
    main()
