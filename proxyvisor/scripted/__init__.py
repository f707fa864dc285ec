"""The built-in scripted model: proxyvisor's default upstream (no network, no key) and every test's model double.

- :mod:`.upstream`: the model endpoint in all three wire formats, played from a script of steps, with faults;
- :mod:`.verifier`, :mod:`.planner`, :mod:`.condenser`, :mod:`.authorizer`, :mod:`.distiller`: its fixed answers to proxyvisor's own supervisor calls;
- :mod:`.runtime`: the ``scripted`` child adapter, the same model played in process.

It is shell: it may import :mod:`proxyvisor.proxy`; no core imports it.
"""
