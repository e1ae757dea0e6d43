"""The suite itself: every test declares one tier (pytest.ini), and every test asserts something: a test function with no `assert`, no `pytest.raises` / `pytest.fail`
and no call to a helper that asserts (transitively, by name, over all of tests/) could never fail."""
import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

RAISING = {"raises", "fail", "warns", "deprecated_call", "one_line_error", "run_in_triton_interpreter"}


def _called_names(fn: ast.AST, tables: dict[str, set[str]] | None = None) -> set[str]:
    """Names of what `fn` calls; a call through a module-level table of lambdas (`CHECKS[name](...)`)
    counts as calling what those lambdas call."""
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
            if tables and isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name):
                names |= tables.get(f.value.id, set())
    return names


def _lambda_tables(tree: ast.Module) -> dict[str, set[str]]:
    """{NAME: names called by its lambdas} for each module-level `NAME = {key: lambda ..., ...}`."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name) \
                and node.value.values and all(isinstance(v, ast.Lambda) for v in node.value.values):
            out[node.targets[0].id] = set().union(*(_called_names(v) for v in node.value.values))
    return out


def _asserts_itself(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(fn)) or bool(_called_names(fn) & RAISING)


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted((REPO / "tests").rglob("*.py"))
            if "results" not in path.parts}


def _functions(trees: dict[Path, ast.Module]) -> dict[Path, list[ast.FunctionDef]]:
    return {path: [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for path, tree in trees.items()}


def asserting_helpers(functions: dict[Path, list[ast.FunctionDef]]) -> set[str]:
    """Names of the non-test functions under tests/ that assert, directly or through another such helper
    (also methods, e.g. `Run.ok`)."""
    helpers = {fn.name: fn for fns in functions.values() for fn in fns if not fn.name.startswith("test_")}
    asserting = {name for name, fn in helpers.items() if _asserts_itself(fn)}
    while True:
        more = {name for name, fn in helpers.items() if name not in asserting and _called_names(fn) & asserting}
        if not more:
            return asserting
        asserting |= more


def find_unasserting(trees: dict[Path, ast.Module]) -> list[str]:
    """'path:line name' of each test function that asserts nothing."""
    functions = _functions(trees)
    helpers = asserting_helpers(functions)
    bad = []
    for path, fns in functions.items():
        tables = _lambda_tables(trees[path])
        bad += [f"{path.relative_to(REPO)}:{fn.lineno} {fn.name}" for fn in fns if fn.name.startswith("test_")
                and not _asserts_itself(fn) and not _called_names(fn, tables) & helpers]
    return bad


def test_every_test_asserts_something():
    trees = _modules()
    assert sum(fn.name.startswith("test_") for fns in _functions(trees).values() for fn in fns) > 500
    bad = find_unasserting(trees)
    assert not bad, "tests that assert nothing:\n  " + "\n  ".join(bad)


def test_the_scan_finds_a_test_that_asserts_nothing():
    code = ("def helper(x):\n    assert x\n\n"
            "def indirect(x):\n    helper(x)\n\n"
            "def test_a():\n    x = 1 + 1\n\n"
            "def test_b():\n    indirect(2)\n\n"
            "def test_c():\n    import pytest\n    with pytest.raises(ValueError):\n        int('x')\n\n"
            "CHECKS = {'one': lambda: helper(1), 'none': lambda: print(1)}\n\n"
            "def test_d(name):\n    CHECKS[name]()\n\n"
            "PRINTS = {'p': lambda: print(1)}\n\n"
            "def test_e(name):\n    PRINTS[name]()\n")
    assert find_unasserting({REPO / "tests" / "probe.py": ast.parse(code)}) == ["tests/probe.py:7 test_a",
                                                                                "tests/probe.py:25 test_e"]


def test_a_test_without_a_tier_or_with_two_stops_the_collection(tmp_path):
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(  # the suite's own hook, loaded under another name
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n"
        "pytest_collection_modifyitems = mod.pytest_collection_modifyitems\n")
    (tmp_path / "test_probe.py").write_text("import pytest\n\ndef test_none():\n    assert 1\n\n"
                                            "@pytest.mark.fast\n@pytest.mark.runs\ndef test_two():\n    assert 1\n\n"
                                            "@pytest.mark.fast\ndef test_one():\n    assert 1\n")
    (tmp_path / "pytest.ini").write_text((REPO / "pytest.ini").read_text().replace("testpaths = tests\n", ""))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "2 tests declare no tier or several" in out.stdout + out.stderr
    assert "test_none (none)" in out.stdout + out.stderr and "test_two (fast, runs)" in out.stdout + out.stderr
