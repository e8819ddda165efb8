"""The house plan, checked: imports inside the project run one way, floor by floor, and no
module imports itself back through others (docs/architecture.md).

Every import counts, deferred ones inside functions included; only imports for type checkers
(`if TYPE_CHECKING:`) are left out, since they never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("balancer", "policies", "loadtest")
# Lower floors never import higher ones. Within a floor, any order without cycles.
FLOORS = (
    ("balancer.config", "balancer.errors", "balancer.logs", "balancer.protocol", "policies"),
    ("balancer.wire",),
    ("balancer.routing",),
    ("balancer.watchers",),
    ("balancer.serving",),
    ("balancer.ops",),
    ("balancer.app",),
    ("balancer.process",),
    ("balancer.__init__", "balancer.__main__"),
    ("loadtest",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts[:-1] != ["balancer"]:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[str, tuple[str, ...]]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (item for child in node.orelse for item in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST) -> Iterator[tuple[str, tuple[str, ...]]]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        yield node.module, tuple(alias.name for alias in node.names)
    else:
        yield from _imports(node)


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target, names in _imports(ast.parse(path.read_text(), str(path))):
            if target.split(".")[0] not in PACKAGES:
                continue
            submodules = {f"{target}.{n}" for n in names if f"{target}.{n}" in known}
            edges[name] |= submodules or ({target} if target in known else set())
    return edges


def floor_of(module: str) -> int:
    best, floor = -1, -1
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), index
    assert floor >= 0, f"{module} is on no floor of the plan"
    return floor


def test_every_module_has_a_floor_and_imports_only_its_own_floor_or_below() -> None:
    wrong = [
        f"{source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)})"
        for source, targets in graph().items() for target in sorted(targets)
        if floor_of(target) > floor_of(source)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    edges = graph()
    # Tarjan's strongly connected components: any with more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_check_sees_imports_deferred_into_functions() -> None:
    # `kvlb serve` reaches the app only from inside a function: the graph must see it.
    assert "balancer.process.serve" in graph()["balancer.process.cli"]
