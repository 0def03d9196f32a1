"""No import cycle inside a package (issue 28, step 4), agent, simulator and nodepoolctl included.

grimp's graph holds every import, function-local ones too (a cycle held together by an import
inside a function is still a cycle). Imports under ``if TYPE_CHECKING:`` are left out.

Cycles that were there when this test came are listed in ``KNOWN_CYCLES``: the list may only
shrink. The test fails on a module in a cycle that is not listed, and on a listed module that no
longer is in any cycle (take it off the list).
"""

from __future__ import annotations

import grimp

PACKAGES = (
    "humanunits",
    "nodepool",
    "fleet",
    "leases",
    "maintenance",
    "operations",
    "marketplace",
    "agent",
    "simulator",
    "nodepoolctl",
)

# Modules still in a cycle inside their package: 28 modules in 8 cycles when this test came
# (2026-12-02), none now (agent, maintenance, operations, marketplace, both of fleet's cycles
# and leases' services <-> fencing/reconcile broken; leases' queue kick and marketplace's
# reconciliation send their tasks by name).
# Never add one: break a new cycle (move the shared piece down, or enqueue a task by name).
KNOWN_CYCLES: set[str] = set()


def strongly_connected(modules: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(edges[successor])))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycles_by_package() -> dict[str, list[list[str]]]:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=True)
    result = {}
    for package in PACKAGES:
        modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
        inside = set(modules)
        edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside - {m}) for m in modules}
        result[package] = strongly_connected(modules, edges)
    return result


def test_strongly_connected_finds_cycles_and_only_cycles():
    edges = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"], "e": ["e"]}
    assert strongly_connected(list(edges), edges) == [["a", "b", "c"]]


def test_no_new_import_cycle_inside_any_package_and_the_known_ones_only_shrink():
    in_cycles = {module for cycles in cycles_by_package().values() for cycle in cycles for module in cycle}
    new = sorted(in_cycles - KNOWN_CYCLES)
    assert not new, f"modules in a new import cycle inside their package: {new}"
    gone = sorted(KNOWN_CYCLES - in_cycles)
    assert not gone, f"no longer in a cycle: take them off KNOWN_CYCLES: {gone}"
