"""The import graph of the library: no cycles (lazy imports included) and the layering docs/design.md
describes (the recipe schema at the bottom, kernels depending on nothing in paco_ds)."""
import ast
from pathlib import Path

from conftest import REPO


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(REPO.glob("paco_ds/**/*.py")) + sorted(REPO.glob("kernels/**/*.py")):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):  # every import, also inside functions
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                target = owner(n)
                if target and target != m and not m.startswith(target + "."):  # a package's own __init__
                    graph[m].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_import_graph()) is None, " -> ".join(_cycle(_import_graph()))


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_layers():
    graph = _import_graph()
    kernels = {m: deps for m, deps in graph.items() if m.startswith("kernels") and not m.startswith("kernels.bench")}
    assert not {d for deps in kernels.values() for d in deps if d.startswith("paco_ds")}
    # The recipe schema sits at the bottom: the loader, the serving schema and errors only.
    assert graph["paco_ds.config"] <= {"paco_ds.recipe", "paco_ds.serving.config", "paco_ds.errors"}
    assert graph["paco_ds.recipe"] <= {"paco_ds.errors"}
    assert "paco_ds.grpo.trainer" not in {d for m, deps in graph.items() if m.startswith("paco_ds.models") for d in deps}
    # The image helpers are the ground floor: nothing from paco_ds, and rewards reach no sampling code.
    assert not {d for d in graph["paco_ds.images"] if d.startswith("paco_ds")}
    assert not {d for m, deps in graph.items() if m.startswith("paco_ds.rewards") for d in deps
                if d.startswith("paco_ds.sampling")}
