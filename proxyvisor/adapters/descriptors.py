"""Adapter descriptors: what each child runtime can do, discovered from folders of TOML files (seed 000).

An adapter is a runtime that can run child work. Its descriptor, ``<id>.toml``, declares::

    id = "claude-code"                      # optional: the file name without .toml
    description = "..."
    default_model = "claude-opus-4-8"       # the adapter's own default (resolution level 7); may be empty
    default_effort = ""
    efforts = ["low", "medium", "high"]     # accepted efforts; empty = any (with effort_selection)
    pool_per_model = false                  # true: a model without a declared bucket is its own pool

    [runtime_entrypoints]
    dispatch = "package.module:factory"     # or "file.py:factory", relative to the descriptor's folder
    capabilities = ["dispatch", "model_selection", "effort_selection", "structured_output"]

    [[models]]                              # the catalog; empty with model_selection = any model string
    id = "claude-opus-4-8"
    bucket = "opus-4x"                      # the provider's capacity pool this model is metered against

Descriptors come from the package's own ``descriptors/`` folder, then ``[model_routing] adapters_dir``; a later
descriptor with the same id replaces an earlier one. Core code never names an adapter: it only reads this data.
A capability that is not declared is unsupported: asking for it is an explicit invalid failure
(:class:`TargetError`), never a quiet downgrade.

The ``dispatch`` factory is called as ``factory(descriptor, options)`` with the adapter's
``[model_routing.adapter_options.<id>]`` table and returns a :class:`~proxyvisor.adapters.runtime.Runtime`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

from ..schema import Invalid, convert

log = logging.getLogger("proxyvisor.adapters")

Capability = Literal["dispatch", "model_selection", "effort_selection", "structured_output"]
CAPABILITIES: tuple[Capability, ...] = get_args(Capability)
DISPATCH, MODEL_SELECTION, EFFORT_SELECTION, STRUCTURED_OUTPUT = CAPABILITIES
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_Name = Annotated[str, Meta(min_length=1)]


class DescriptorError(ValueError):
    """A descriptor file is not valid TOML or breaks the schema of the module docstring; names the file."""


class TargetError(ValueError):
    """An adapter, model, effort or capability that the descriptors do not offer: an explicit invalid failure.

    The message says which and why, e.g. ``adapter 'codex' does not declare effort_selection``.
    """


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``[[models]]`` entry: a model id and the capacity pool (bucket) it is metered against."""

    id: _Name
    bucket: str = ""


class _Entrypoints(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dispatch: Annotated[str, Meta(pattern="^$|:", description="'module:factory' or 'file.py:factory'")] = ""
    capabilities: tuple[Capability, ...] = ()


class _File(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The schema of a descriptor file (module docstring)."""

    id: str = ""
    description: str = ""
    default_model: str = ""
    default_effort: str = ""
    efforts: Annotated[tuple[_Name, ...], Meta(description="a list of non-empty strings")] = ()
    pool_per_model: bool = False
    runtime_entrypoints: _Entrypoints = msgspec.field(default_factory=_Entrypoints)
    models: Annotated[tuple[ModelSpec, ...], Meta(description='a list of {id = "...", bucket = "..."} tables')] = ()


@dataclass(frozen=True)
class Descriptor:
    """One adapter's declaration (see the module docstring)."""

    id: str
    path: Path
    dispatch: str = ""
    capabilities: frozenset[str] = frozenset()
    models: tuple[ModelSpec, ...] = ()
    efforts: tuple[str, ...] = ()
    default_model: str = ""
    default_effort: str = ""
    pool_per_model: bool = False
    description: str = ""

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def require(self, capability: str, why: str = "") -> None:
        """Raises :class:`TargetError` unless the adapter declares ``capability``."""
        if capability not in self.capabilities:
            raise TargetError(f"adapter {self.id!r} does not declare {capability}" + (f" ({why})" if why else ""))

    def model(self, model_id: str) -> ModelSpec | None:
        return next((m for m in self.models if m.id == model_id), None)

    def pool(self, model_id: str) -> str:
        """The health key the model is metered against: ``<adapter>:<bucket>``, or ``<adapter>`` when the adapter
        declares no pool for it."""
        spec = self.model(model_id)
        bucket = spec.bucket if spec and spec.bucket else (model_id if self.pool_per_model and model_id else "")
        return f"{self.id}:{bucket}" if bucket else self.id

    def check(self, model: str, effort: str) -> None:
        """Check that this adapter can run ``model`` at ``effort`` (empty = the adapter's own default).

        Raises:
            TargetError: a model on an adapter without model_selection (other than its default), a model its
                non-empty catalog does not declare, an effort without effort_selection, or an undeclared effort.
        """
        if model and model != self.default_model:
            self.require(MODEL_SELECTION, f"it cannot run model {model!r}")
        if model and self.models and self.model(model) is None:
            raise TargetError(f"adapter {self.id!r} does not declare model {model!r} (declared: "
                              f"{', '.join(m.id for m in self.models)})")
        if effort and effort != self.default_effort:
            self.require(EFFORT_SELECTION, f"it cannot set effort {effort!r}")
        if effort and self.efforts and effort not in self.efforts:
            raise TargetError(f"adapter {self.id!r} does not accept effort {effort!r} (accepted: "
                              f"{', '.join(self.efforts)})")

    def load_runtime(self, options: Mapping[str, Any]) -> Any:
        """Import the dispatch entrypoint and build the runtime with ``options``.

        Raises:
            TargetError: the adapter does not declare dispatch.
            DescriptorError: the entrypoint cannot be imported or is not callable.
        """
        self.require(DISPATCH, "it cannot run child work")
        target, _, attr = self.dispatch.partition(":")
        try:
            if target.endswith(".py"):
                file = (self.path.parent / target).resolve()
                name = f"proxyvisor_adapter_{re.sub(r'[^a-z0-9_]', '_', self.id)}"
                module = sys.modules.get(name)
                if module is None or getattr(module, "__file__", None) != str(file):
                    spec = importlib.util.spec_from_file_location(name, file)
                    if spec is None or spec.loader is None:
                        raise ImportError(f"cannot load {file}")
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[name] = module
                    spec.loader.exec_module(module)
            else:
                module = importlib.import_module(target)
            factory = getattr(module, attr)
        except (ImportError, AttributeError, OSError, SyntaxError) as exc:
            raise DescriptorError(
                f"{self.path}: dispatch entrypoint {self.dispatch!r} cannot be loaded: {exc}") from None
        if not callable(factory):
            raise DescriptorError(f"{self.path}: dispatch entrypoint {self.dispatch!r} is not callable")
        return factory(self, options)


def load_descriptor(path: Path) -> Descriptor:
    """Read and validate one descriptor file against its schema (module docstring).

    Raises:
        DescriptorError: unreadable, not TOML, an unknown key or capability, a value of the wrong type, a bad id,
            duplicate models, or a default model/effort the descriptor itself does not offer; names the file and
            the key.
    """
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DescriptorError(f"{path}: cannot read the descriptor: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DescriptorError(f"{path}: not valid TOML: {exc}") from None
    try:
        declared = convert(doc, _File)
    except Invalid as exc:
        p = exc.problem
        where = "".join(f"[{t}] " for t in p.tables) + (f"{p.key} " if p.key else "")
        raise DescriptorError(f"{path}: {where}{p.message}") from None
    adapter_id = declared.id or path.stem
    if not _ID.match(adapter_id):
        raise DescriptorError(f"{path}: adapter id {adapter_id!r} must be lowercase letters, digits, '.', '_', '-'")
    entry, models = declared.runtime_entrypoints, declared.models
    if DISPATCH in entry.capabilities and not entry.dispatch:
        raise DescriptorError(f"{path}: declares dispatch but names no dispatch entrypoint")
    if len({m.id for m in models}) != len(models):
        raise DescriptorError(f"{path}: a model is declared twice")
    descriptor = Descriptor(
        id=adapter_id, path=path, dispatch=entry.dispatch, capabilities=frozenset(entry.capabilities), models=models,
        efforts=declared.efforts, default_model=declared.default_model, default_effort=declared.default_effort,
        pool_per_model=declared.pool_per_model, description=declared.description)
    if descriptor.default_model and models and descriptor.model(descriptor.default_model) is None:
        raise DescriptorError(f"{path}: default_model {descriptor.default_model!r} is not in its models")
    if descriptor.default_effort and descriptor.efforts and descriptor.default_effort not in descriptor.efforts:
        raise DescriptorError(f"{path}: default_effort {descriptor.default_effort!r} is not in its efforts")
    return descriptor


@dataclass
class Registry:
    """Every discovered descriptor by id, in discovery order, and the files that failed to load."""

    descriptors: dict[str, Descriptor] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def get(self, adapter_id: str) -> Descriptor:
        """Raises :class:`TargetError` naming the known adapters when ``adapter_id`` is not one of them."""
        try:
            return self.descriptors[adapter_id]
        except KeyError:
            raise TargetError(f"unknown adapter {adapter_id!r} (known: {', '.join(self.descriptors) or 'none'})") \
                from None

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.descriptors

    def ids(self) -> list[str]:
        return list(self.descriptors)

    def adapter_of_model(self, model: str) -> list[str]:
        """The adapters whose catalog declares ``model``."""
        return [d.id for d in self.descriptors.values() if d.model(model) is not None]


BUILTIN_DIR = Path(__file__).parent / "descriptors"
"""The descriptors shipped in the package."""


def discover(folders: Iterable[Path]) -> Registry:
    """Load every ``*.toml`` descriptor of ``folders`` in order (files sorted by name within a folder).

    A broken descriptor is logged, recorded in ``Registry.errors`` and left out; it never stops discovery. A
    missing folder counts as empty.
    """
    registry = Registry()
    for folder in folders:
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                descriptor = load_descriptor(path)
            except DescriptorError as exc:
                log.warning("adapter descriptor skipped: %s", exc)
                registry.errors.append(str(exc))
                continue
            registry.descriptors.pop(descriptor.id, None)
            registry.descriptors[descriptor.id] = descriptor
    return registry


def registry_for(adapters_dir: str) -> Registry:
    """The built-in descriptors plus those of ``[model_routing] adapters_dir`` (when set)."""
    return discover([BUILTIN_DIR] + ([Path(adapters_dir)] if adapters_dir else []))
