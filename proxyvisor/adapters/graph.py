"""The supervision graph: which role may delegate to which, as configured data (seed 004).

An edge ``A -> B`` (``[model_routing.roles.A] supervises = ["B"]``) lets role A delegate to role B. The
conversation's own agent is the root: it may delegate to every role that no role supervises. Rules, checked when
a policy is written and again when it is loaded:

- every edge names a configured role, and no role supervises itself;
- one supervisor per subordinate (the result returns to exactly one accountable parent);
- no cycle: ``A -> B -> A`` is an unbounded money-spending loop reachable by configuration alone;
- depth is limited, counted in delegation hops from the root (a top-level role is at depth 1). It is measured
  in **both directions** when an edge is added: the chain above the supervisor plus the chain below the
  subordinate, since checking one side alone would admit a tower well past the limit.

Pure functions over plain data; every walk is visited-guarded, so a graph that is already cyclic terminates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

ROOT = ""
"""The conversation's own agent, the root of the graph (it has no role name)."""


class GraphError(ValueError):
    """A supervision graph breaks a rule; the message names the roles and the rule, readable by an operator."""


def _supervisors(edges: Mapping[str, Iterable[str]]) -> dict[str, str]:
    parent: dict[str, str] = {}
    for sup, subs in edges.items():
        for sub in subs:
            parent.setdefault(sub, sup)
    return parent


def _height(edges: Mapping[str, Iterable[str]], role: str, seen: frozenset[str] = frozenset()) -> int:
    """Hops in the longest chain below ``role`` (0 for a role that supervises nobody)."""
    if role in seen:
        return 0
    below = [_height(edges, sub, seen | {role}) for sub in edges.get(role, ())]
    return 1 + max(below) if below else 0


def depth_of(edges: Mapping[str, Iterable[str]], role: str) -> int:
    """Delegation hops from the root to ``role`` (1 for a top-level role)."""
    parent = _supervisors(edges)
    depth, seen = 1, {role}
    while role in parent and parent[role] not in seen:
        role = parent[role]
        seen.add(role)
        depth += 1
    return depth


def _path(edges: Mapping[str, Iterable[str]], start: str, goal: str) -> list[str] | None:
    """A chain of edges from ``start`` to ``goal``, or None."""
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        for sub in edges.get(path[-1], ()):
            if sub == goal:
                return path + [sub]
            if sub not in seen:
                seen.add(sub)
                stack.append(path + [sub])
    return None


def add_edge(edges: Mapping[str, Iterable[str]], sup: str, sub: str, max_depth: int,
             roles: Iterable[str] | None = None) -> dict[str, tuple[str, ...]]:
    """``edges`` with ``sup -> sub`` added, after checking every rule of the module docstring.

    ``roles`` are the configured role names (default: every name in ``edges``).

    Raises:
        GraphError: the edge names an unknown role, is a self-edge, gives ``sub`` a second supervisor, closes a
            cycle, or makes a chain longer than ``max_depth`` hops.
    """
    known = set(edges) if roles is None else set(roles)
    graph = {k: tuple(v) for k, v in edges.items()}
    for name in (sup, sub):
        if name not in known:
            raise GraphError(f"role {name!r} is not configured (known roles: {', '.join(sorted(known)) or 'none'})")
    if sup == sub:
        raise GraphError(f"role {sup!r} cannot supervise itself")
    if sub in graph.get(sup, ()):
        return graph
    current = _supervisors(graph).get(sub)
    if current is not None:
        raise GraphError(f"role {sub!r} already has a supervisor ({current!r}); a subordinate has exactly one")
    back = _path(graph, sub, sup)
    if back is not None:
        raise GraphError("this would make a cycle: " + " -> ".join([sup] + back))
    above, below = depth_of(graph, sup), _height(graph, sub)
    if above + 1 + below > max_depth:
        raise GraphError(
            f"{sup!r} -> {sub!r} would make a delegation chain {above + 1 + below} deep ({above} down to {sup!r}, "
            f"1 to {sub!r}, {below} below it); max_depth is {max_depth}")
    graph[sup] = graph.get(sup, ()) + (sub,)
    return graph


def check_graph(edges: Mapping[str, Iterable[str]], max_depth: int) -> None:
    """Check a whole graph (role name -> the roles it supervises; every role appears as a key).

    Raises:
        GraphError: the first rule broken, as :func:`add_edge` words it.
    """
    graph: dict[str, tuple[str, ...]] = {name: () for name in edges}
    for sup in sorted(edges):
        for sub in edges[sup]:
            graph = add_edge(graph, sup, sub, max_depth, roles=edges)


def may_delegate(edges: Mapping[str, Iterable[str]], caller: str, role: str) -> bool:
    """Whether ``caller`` (a role, or :data:`ROOT` for the conversation's agent) may delegate to ``role``."""
    if role not in edges:
        return False
    if caller == ROOT:
        return role not in _supervisors(edges)
    return role in tuple(edges.get(caller, ()))
