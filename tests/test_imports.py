"""Every module of the package imports on its own, in a fresh interpreter: no import cycle depends on which module
a program (a bench, a plugin, a test) happens to import first."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import proxyvisor

MODULES = sorted(m.name for m in pkgutil.walk_packages(proxyvisor.__path__, "proxyvisor.")
                 if not m.name.endswith("__main__"))


def test_every_module_imports_first() -> None:
    # One interpreter per module, a few at a time: a cycle shows only when its module is the first imported.
    failures: list[str] = []
    for start in range(0, len(MODULES), 8):
        batch = MODULES[start:start + 8]
        procs = [(name, subprocess.Popen([sys.executable, "-c", f"import {name}"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)) for name in batch]
        for name, proc in procs:
            _, err = proc.communicate(timeout=120)
            if proc.returncode:
                failures.append(f"{name}: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    assert len(MODULES) > 50 and not failures, failures
