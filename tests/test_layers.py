"""The import graph of the library: no cycles (lazy imports included) and the layering docs/design.md
describes (the recipe schema at the bottom, kernels depending on nothing in paco_ds)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast


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
    kernels = {m: deps for m, deps in graph.items() if m.startswith("kernels")}
    assert not {d for deps in kernels.values() for d in deps if d.startswith("paco_ds")}
    # The recipe schema sits at the bottom: the loader, the serving schema and errors only. The losses'
    # own sections live with the losses, above it (paco_ds/grpo/losses/), and join the schema at load.
    assert graph["paco_ds.recipe.schema"] <= {"paco_ds.recipe.loader", "paco_ds.recipe.servers", "paco_ds.errors"}
    assert graph["paco_ds.recipe.loader"] <= {"paco_ds.errors"}
    assert "paco_ds.grpo.trainer" not in {d for m, deps in graph.items() if m.startswith("paco_ds.models") for d in deps}
    # The sigma schedule is the policy's (paco_ds/models/schedule.py): models never import sampling.
    assert not {d for m, deps in graph.items() if m.startswith("paco_ds.models") for d in deps
                if d.startswith("paco_ds.sampling")}
    # The offline tiny builders (paco_ds/models/tiny/) import no policy: a policy reaches for its
    # tiny twin only when a recipe asks for it.
    tiny = {m for m in graph if m.startswith("paco_ds.models.tiny")}
    assert {"paco_ds.models.tiny", "paco_ds.models.tiny.flux", "paco_ds.models.tiny.sd3"} <= tiny
    assert not {d for m in tiny for d in graph[m] if d.startswith("paco_ds.models") and d not in tiny}
    # Serving sits above the models (its engine loads them), never below: the tiny judge's shape,
    # which both read, is paco_ds/recipe/tiny_judge.py beneath both.
    assert not {d for m, deps in graph.items() if m.startswith("paco_ds.models") for d in deps
                if d.startswith("paco_ds.serving")}
    assert graph["paco_ds.recipe.tiny_judge"] == set()
    # The image helpers are the ground floor: nothing from paco_ds, and rewards reach no sampling code.
    assert not {d for d in graph["paco_ds.images"] if d.startswith("paco_ds")}
    assert not {d for m, deps in graph.items() if m.startswith("paco_ds.rewards") for d in deps
                if d.startswith("paco_ds.sampling")}
    # Within a floor, rooms that must not lean on each other.
    beside = {"paco_ds.rewards": ("sampling", "serving"), "paco_ds.sampling": ("rewards", "serving"),
              "paco_ds.serving": ("rewards", "sampling"), "paco_ds.grpo": ("eval", "gpu_plan")}
    across = sorted((m, d) for room, banned in beside.items() for m, deps in graph.items() if m.startswith(room)
                    for d in deps if any(d.startswith(f"paco_ds.{b}") for b in banned))
    assert not across, across


# The package's rooms, floor by floor (docs/design.md draws them): a module imports from its own
# floor or the floors below, never from a floor above. Every module of paco_ds is in one room.
FLOORS = [
    ("ground", ("paco_ds", "paco_ds.errors", "paco_ds.images")),
    ("recipe", ("paco_ds.recipe",)),
    ("runtime", ("paco_ds.runtime",)),
    ("models and data", ("paco_ds.models", "paco_ds.data")),
    ("sampling, rewards, serving, report", ("paco_ds.sampling", "paco_ds.rewards", "paco_ds.serving", "paco_ds.report")),
    ("trainers and plans", ("paco_ds.grpo", "paco_ds.sft", "paco_ds.eval", "paco_ds.gpu_plan")),
    ("launchers", ("paco_ds.launchers",)),
]


def floor_of(module: str) -> int | None:
    """The floor of the longest room that holds `module` (None: outside paco_ds)."""
    best = None
    for i, (_, rooms) in enumerate(FLOORS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best[0])):
                best = (room, i)
    return best[1] if best else None


def arrows_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() if m.startswith("paco_ds") for d in deps
                  if floor_of(d) is not None and floor_of(d) > floor_of(m))


def test_no_arrow_runs_back_up_and_every_module_has_a_room():
    graph = _import_graph()
    assert all(floor_of(m) is not None for m in graph if m.startswith("paco_ds")), \
        [m for m in graph if m.startswith("paco_ds") and floor_of(m) is None]
    assert not arrows_up(graph), arrows_up(graph)
    # the package root holds the ground floor only: every other module lives in a room
    loose = sorted(p.stem for p in (REPO / "paco_ds").glob("*.py") if p.stem != "__init__")
    assert loose == ["errors", "images"], loose
    # what the check finds: a model importing the trainer, the schema importing serving
    assert arrows_up({"paco_ds.models.flux": {"paco_ds.grpo.trainer"}, "paco_ds.recipe.schema":
                      {"paco_ds.serving.config", "paco_ds.errors"}}) == [
        ("paco_ds.models.flux", "paco_ds.grpo.trainer"), ("paco_ds.recipe.schema", "paco_ds.serving.config")]



def test_the_recipe_schema_imports_no_torch():
    # The schema stays light: pydantic, not torch (the losses' sections join it at load, from above).
    out = subprocess.run([sys.executable, "-c", "import sys, paco_ds.recipe.schema; print(sorted(m for m in sys.modules "
                          "if m.split('.')[0] in ('torch', 'kernels') or m.startswith('paco_ds.models')))"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _trainer_private_names() -> set[str]:
    """The private methods and attributes GRPOTrainer defines (def _x, self._x = ...)."""
    tree = ast.parse((REPO / "paco_ds/grpo/trainer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self" and n.attr.startswith("_") and isinstance(n.ctx, ast.Store)}
    return {n for n in names if not n.startswith("__")}


def _reaches_into_the_trainer(source: str, private: set[str]) -> list[str]:
    """`x._name` where x is a trainer (`trainer`, `self.trainer`), or `_name` is one of the
    trainer's private names on anything but a class's own `self`/`cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
        if owner in ("self", "cls"):
            continue
        if owner in ("trainer", "_trainer") or node.attr in private:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_trainer_reaches_into_its_private_parts():
    private = _trainer_private_names()
    assert {"_micro_step", "_epoch_start", "_progress"} <= private  # the scan sees the trainer's names
    files = [p for d in ("paco_ds", "launch", "benchmarks", "kernels", "tests") for p in sorted((REPO / d).rglob("*.py"))
             if p != REPO / "paco_ds/grpo/trainer.py"]
    found = [f"{p.relative_to(REPO)}:{hit}" for p in files for hit in _reaches_into_the_trainer(p.read_text(), private)]
    assert not found, "\n".join(found)
    # what it looks for: a trainer's private method, by name or through any object
    assert _reaches_into_the_trainer("trainer._by_size(p, 64)\nt.x._micro_step(b)\nself._micro_step(b)", private) \
        == ["1: trainer._by_size", "2: t.x._micro_step"]


def test_a_rollout_walks_down_the_sampling_package():
    graph = _import_graph()
    order = ["paco_ds.sampling.rollouts", "paco_ds.sampling.window", "paco_ds.sampling.trajectory",
             "paco_ds.sampling.solver"]
    for i, m in enumerate(order):
        above = set(order[:i + 1])
        assert not graph[m] & above, f"{m} imports {graph[m] & above}"
    assert not {d for m in order for d in graph[m] if d.startswith("paco_ds.grpo")}  # sampling sits below the trainer


def _parameter_counts(source: str) -> dict[str, int]:
    """Every function's (and method's, nested one's) parameters, `self`, keyword-only ones, *args and
    **kwargs each counted: name -> count."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out[f"{node.lineno}: {node.name}"] = len(a.posonlyargs + a.args + a.kwonlyargs) + (a.vararg is not None) \
                + (a.kwarg is not None)
    return out


def test_sampling_takes_typed_records_not_long_parameter_lists():
    """The sampler takes the epoch's SamplingSpec and a RolloutBatch (paco_ds/sampling/spec.py):
    `sample_trajectories` at most 6 parameters, every other function of paco_ds/sampling at most 8."""
    counts = {f"{p.relative_to(REPO)}:{name}": n for p in sorted((REPO / "paco_ds/sampling").glob("*.py"))
              for name, n in _parameter_counts(p.read_text()).items()}
    sampler = [n for name, n in counts.items() if name.endswith(": sample_trajectories")]
    assert sampler and max(sampler) <= 6, sampler
    long = {name: n for name, n in counts.items() if n > 8}
    assert not long, long
    # what it counts: self, keyword-only parameters and **kwargs alike
    assert list(_parameter_counts("class A:\n    def f(self, a, *, b=1, **kw): pass").values()) == [4]
