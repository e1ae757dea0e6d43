"""The locked environment: requirements-cpu.lock (what `make setup` installs, with hashes) agrees with
setup.py's requirements and the measured torch pair, and the GPU lane's wheel set is the same software
(tests/gpu/wheels.txt at the lock's versions, every file's hash in tests/gpu/wheels.lock)."""
import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO

pytestmark = pytest.mark.fast

LOCK = REPO / "requirements-cpu.lock"
# The interpreter the lock is resolved for (make lock: --python-version 3.11, Linux x86_64)
MARKERS = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def lock_entries() -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256, ...])} of the lock."""
    out, name = {}, None
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            name = canonicalize_name(m[1])
            out[name] = (m[2], [])
        for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            out[name][1].append(digest)
    return out


def setup_requirements() -> list[Requirement]:
    """install_requires and the dev extra of setup.py, read without running it."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return [Requirement(r) for r in kw["install_requires"] + kw["extras_require"]["dev"]]


def test_every_file_of_the_lock_is_pinned_with_hashes():
    entries = lock_entries()
    assert len(entries) > 50
    unhashed = [n for n, (_, h) in entries.items() if not h]
    assert not unhashed, unhashed
    assert all(not v.endswith("*") for v, _ in entries.values())


def test_the_lock_meets_every_requirement_of_setup_py():
    entries = lock_entries()
    checked = 0
    for req in setup_requirements():
        if req.marker is not None and not req.marker.evaluate(MARKERS):
            continue
        name = canonicalize_name(req.name)
        assert name in entries, f"{req} is not in {LOCK.name}: run make lock"
        assert req.specifier.contains(Version(entries[name][0]), prereleases=True), (str(req), entries[name][0])
        checked += 1
    assert checked >= 20


def test_the_lock_holds_the_measured_torch_pair():
    entries = lock_entries()
    pins = dict(l.split("==") for l in (REPO / "constraints-cpu.txt").read_text().splitlines()
                if l.strip() and not l.startswith("#"))
    assert pins and all(entries[canonicalize_name(n)][0] == v for n, v in pins.items()), pins


def test_the_gpu_wheel_set_is_the_locks_software_and_every_file_is_hashed():
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import bundle

    entries = lock_entries()
    listed = bundle.entries()
    in_lock = [(n, v) for n, v, _ in listed if n in entries]
    assert len(in_lock) >= 20
    differ = [(n, v, entries[n][0]) for n, v in in_lock if v != entries[n][0]]
    assert not differ, f"tests/gpu/wheels.txt differs from the lock (make lock): {differ}"
    hashes = bundle.locked_hashes()
    names = {canonicalize_name(re.split(r"-\d", f, maxsplit=1)[0]) for f in hashes}
    assert {n for n, _, _ in listed} <= names, sorted({n for n, _, _ in listed} - names)
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes.values())


def test_make_setup_installs_from_the_lock_with_hashes():
    make = (REPO / "Makefile").read_text()
    assert "--require-hashes --no-deps -r $(LOCK)" in make and "LOCK := requirements-cpu.lock" in make
    assert "uv pip compile setup.py" in make and "bundle.py lock" in make
