"""The sans-IO cores import alone: with the event loop, HTTP, caches, model SDKs and the shell made unimportable,
every core module still imports (the static contract is `lint-imports` in .ci/run; this is its runtime check)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import proxyvisor

CORE_PACKAGES = ("detectors", "gate", "condense")
CORE_MODULES = ("proxyvisor.transcript", "proxyvisor.adapters.health", "proxyvisor.adapters.failures")
# socket and threading are left importable: the standard library imports them itself (email.utils, shutdown);
# the static contract forbids a core importing them directly.
BLOCKED = ("trio", "h11", "diskcache", "litellm", "subprocess", "asyncio", "sqlite3",
           "proxyvisor.proxy", "proxyvisor.scripted", "proxyvisor.store", "proxyvisor.supervisor_model",
           "proxyvisor.config")


def core_modules() -> list[str]:
    root = Path(proxyvisor.__file__).parent
    names = list(CORE_MODULES)
    for package in CORE_PACKAGES:
        names.append(f"proxyvisor.{package}")
        names += [f"proxyvisor.{package}.{m.name}" for m in pkgutil.iter_modules([str(root / package)])]
    return names


def test_every_core_module_imports_without_the_shell_or_io_libraries() -> None:
    modules = core_modules()
    assert len(modules) > 20
    # A None entry in sys.modules makes `import x` raise ImportError, for x and everything under it.
    script = (f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"
              f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_the_check_fails_when_a_core_reaches_the_shell() -> None:
    # The same harness, on a module that does import the shell, must fail: the test above can fail.
    script = "import sys\nsys.modules['trio'] = None\nimport proxyvisor.proxy.condense_engine\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "trio" in done.stderr
