"""The wheel bundle of the GPU lane: the packages a bare GPU machine lacks, brought in .whl/.

    python tests/gpu/bundle.py download [--dir .whl]   # here, with network: fill .whl/ (make gpu-wheels)
    python tests/gpu/bundle.py check    [--dir .whl]   # here: the set installs on CPython 3.12 by itself
    python tests/gpu/bundle.py install --target DIR    # there, no network: install what is missing
    python tests/gpu/bundle.py lock                     # here (make lock): versions from the CPU lock, hashes

The list is tests/gpu/wheels.txt, at the versions of the CPU lock (requirements-cpu.lock); the
sha256 of every file it downloads (deepspeed's sdist, which is built here) is in tests/gpu/wheels.lock,
and `download` refuses a file whose hash differs.

The list is tests/gpu/wheels.txt. `install` never touches the interpreter's own packages: it puts
the wheels it needs into DIR (`pip install --target`, no index, no dependencies) and the caller
puts DIR on PYTHONPATH. A wheel marked `need` is installed when its distribution is absent; one
marked `upgrade` only when the installed version fails a requirement of the set. torch, triton,
transformers and the other packages of the GPU image are never installed (PROTECTED).
Only the standard library and `packaging` (pip's own, vendored or installed) are used.
"""
from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIST = Path(__file__).resolve().parent / "wheels.txt"
HASHES = Path(__file__).resolve().parent / "wheels.lock"
CPU_LOCK = REPO / "requirements-cpu.lock"
IMAGE = Path(__file__).resolve().parent / "image_packages.txt"
LIMIT_MIB = 64
PY = (3, 12)
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# Requirements that the code never imports on CPython 3.12 (diffusers imports importlib_metadata
# only on Python < 3.8); they are not brought, and not counted as unmet.
IGNORED = {("diffusers", "importlib-metadata")}
PROTECTED = re.compile(r"^(torch|torchvision|torchaudio|triton|transformers|peft|accelerate|numpy|nvidia-.*|cuda-.*)$")
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

try:
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import compatible_tags, cpython_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version


def die(msg: str) -> None:
    print(f"bundle: {msg}", file=sys.stderr)
    sys.exit(1)


def entries() -> list[tuple[str, str, str]]:
    """(canonical name, version, 'need' | 'upgrade') of each line of wheels.txt."""
    out = []
    for line in LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, kind = line.split()
        name, version = spec.split("==")
        out.append((canonicalize_name(name), version, kind))
    bad = [n for n, _, _ in out if PROTECTED.match(n)]
    if bad:
        die(f"{LIST.name} lists packages of the GPU image that must not be replaced: {bad}")
    return out


def wheels(folder: Path) -> dict[str, tuple[Version, Path]]:
    """{canonical name: (version, path)} of the wheels in folder; two versions of one name is an error."""
    found: dict[str, tuple[Version, Path]] = {}
    for p in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(p.name)
        if name in found:
            die(f"two wheels of {name} in {folder}: {found[name][1].name} and {p.name} (keep one)")
        found[name] = (version, p)
    return found


def requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel that apply on CPython 3.12 / Linux x86_64 without extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def locked_hashes() -> dict[str, str]:
    """{file name: sha256} of wheels.lock."""
    out = {}
    for line in HASHES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, digest = line.split()
            out[name] = digest
    return out


def verify(path: Path, hashes: dict[str, str]) -> None:
    want = hashes.get(path.name)
    if want is None:
        die(f"{path.name} is not in {HASHES.name} (run make lock)")
    if sha256(path) != want:
        path.unlink()
        die(f"{path.name}: sha256 differs from {HASHES.name}; the file was removed")


def cpu_lock_versions() -> dict[str, str]:
    """{canonical name: version} of requirements-cpu.lock."""
    out = {}
    for line in CPU_LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", line)
        if m:
            out[canonicalize_name(m[1])] = m[2]
    return out


# ------------------------------------------------------------------------------------ download
def download(folder: Path, hashes: dict[str, str] | None = None) -> None:
    """Fill folder with the set; each downloaded file is checked against wheels.lock (`hashes`, None
    when `lock` is writing it)."""
    check_hashes = hashes is None
    if check_hashes:
        hashes = locked_hashes()
    folder.mkdir(exist_ok=True)
    want = entries()
    pip = [sys.executable, "-m", "pip"]
    # Drop wheels that are not in the list, or at another version (pip stops on two versions of one name).
    names = {n: v for n, v, _ in want}
    for name, (version, path) in wheels(folder).items():
        if names.get(name) != str(version):
            print(f"removing {path.name} (not in {LIST.name} at this version)")
            path.unlink()
    have = wheels(folder)
    binary = [f"{n}=={v}" for n, v, _ in want if n != "deepspeed" and n not in have]
    if binary:
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run(pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *plat,
                              "-d", str(folder), *binary], check=True)
    for name, (_, path) in wheels(folder).items():
        if name == "deepspeed":
            continue
        if check_hashes:
            verify(path, hashes)
        else:
            hashes[path.name] = sha256(path)
    ds = next(((n, v) for n, v, _ in want if n == "deepspeed"), None)
    if ds and "deepspeed" not in wheels(folder):
        # PyPI has only the sdist: build a pure wheel with no compiled ops (they JIT-build on use).
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(pip + ["download", "-q", "--no-deps", "--no-binary=:all:", f"deepspeed=={ds[1]}",
                                  "-d", tmp], check=True)
            sdist = next(Path(tmp).glob("deepspeed-*"))
            if check_hashes:
                verify(sdist, hashes)
            else:
                hashes[sdist.name] = sha256(sdist)
            # No op is prebuilt, so the accelerator and torch versions recorded in the wheel are never
            # checked at run time; "cuda" keeps what `ds_report` prints true to where it runs.
            env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}
            subprocess.run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", str(sdist), "-w", tmp],
                           check=True, env=env)
            built = next(Path(tmp).glob("deepspeed-*.whl"))
            if not built.name.endswith("-py3-none-any.whl"):
                die(f"deepspeed built as {built.name}, not a py3-none-any wheel")
            shutil.copy(built, folder / built.name)
    missing = sorted(set(names) - set(wheels(folder)))
    if missing:
        die(f"not downloaded: {missing}")
    report(folder)


def report(folder: Path) -> None:
    for name, (version, path) in sorted(wheels(folder).items()):
        print(f"  {path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    total = size_mib(folder)
    print(f"{folder}: {len(wheels(folder))} wheels, {total:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if total > LIMIT_MIB:
        die(f"the bundle is {total:.1f} MiB, over the {LIMIT_MIB} MiB that travels to a GPU machine")


def lock() -> None:
    """wheels.txt's versions from the CPU lock, then wheels.lock from a fresh download of the set."""
    versions = cpu_lock_versions()
    lines, changed = [], []
    for line in LIST.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)(\s+.*)$", line)
        if m and canonicalize_name(m[1]) in versions and versions[canonicalize_name(m[1])] != m[2]:
            new = versions[canonicalize_name(m[1])]
            changed.append(f"{m[1]} {m[2]} -> {new}")
            spec = f"{m[1]}=={new}"
            line = spec + m[3][max(0, len(spec) - len(m[1]) - 2 - len(m[2])):] if len(spec) <= len(m[1]) + 2 + len(m[2]) \
                else spec + " " + m[3].lstrip(" ")
        lines.append(line)
    LIST.write_text("\n".join(lines) + "\n")
    print(f"{LIST.name}: " + (", ".join(changed) if changed else "versions unchanged"))
    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        download(Path(tmp), hashes)
    HASHES.write_text("# sha256 of each file `make gpu-wheels` downloads (tests/gpu/wheels.txt), written by `make lock`.\n"
                      "# deepspeed's is its sdist's: the wheel is built from it here.\n"
                      + "".join(f"{name} {digest}\n" for name, digest in sorted(hashes.items())))
    print(f"{HASHES.name}: {len(hashes)} files")


# ------------------------------------------------------------------------------------ check (here)
def image_packages() -> dict[str, Version | None]:
    """The GPU image's packages (image_packages.txt): name -> version where recorded."""
    out: dict[str, Version | None] = {}
    for line in IMAGE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def unmet(bundle: dict[str, Version], installed: dict[str, Version | None], folder: Path,
          names: list[str]) -> list[str]:
    """Requirements of the wheels `names` that neither the bundle nor `installed` satisfies.
    An installed package of unknown version (None) satisfies only a requirement without a version
    range: whether the image's timm meets `timm>=1.0.17` cannot be known here, so it is unmet."""
    bad = []
    for name in names:
        for req in requirements(wheels(folder)[name][1]):
            dep = canonicalize_name(req.name)
            if (name, dep) in IGNORED:
                continue
            version = bundle.get(dep, installed.get(dep, "absent"))
            if version == "absent":
                bad.append(f"{name} needs {req}: not in the bundle nor installed")
            elif version is None:
                if req.specifier:
                    bad.append(f"{name} needs {req}: {dep}'s version on the GPU image is unknown (record it in "
                               f"{IMAGE.name} or bundle {dep})")
            elif not req.specifier.contains(version, prereleases=True):
                bad.append(f"{name} needs {req}: {dep} is {version}")
    return bad


def check(folder: Path) -> None:
    want = entries()
    have = wheels(folder)
    missing = sorted({n for n, _, _ in want} - set(have))
    extra = sorted(set(have) - {n for n, _, _ in want})
    if missing or extra:
        die(f"{folder} does not match {LIST.name}: missing {missing}, not listed {extra} (run make gpu-wheels)")
    tags = set(cpython_tags(PY, abis=["cp312", "abi3", "none"], platforms=PLATFORMS)) | set(
        compatible_tags(PY, "cp312", platforms=PLATFORMS))
    for name, (version, path) in have.items():
        if not parse_wheel_filename(path.name)[3] & tags:
            die(f"{path.name} does not install on CPython 3.12 / Linux x86_64")
        if str(version) != dict((n, v) for n, v, _ in want)[name]:
            die(f"{path.name} is not the version in {LIST.name}")
    # Every requirement is met by the set itself, or by the image (versions where image_packages.txt has them);
    # `upgrade` wheels count as present at their own version, since the lane installs them when needed.
    bundle = {n: v for n, (v, _) in have.items()}
    bad = unmet(bundle, image_packages(), folder, sorted(have))
    if bad:
        die("unmet requirements:\n  " + "\n  ".join(bad))
    # pip itself picks every wheel of the set for CPython 3.12 from the folder alone.
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                              "--find-links", str(folder), "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", "--abi", "cp312", *plat, "--target", tmp,
                              *[f"{n}=={v}" for n, v, _ in want]], capture_output=True, text=True)
    if out.returncode:
        die("pip --dry-run failed:\n" + out.stdout[-3000:] + out.stderr[-3000:])
    print(out.stdout.strip().splitlines()[-1])
    report(folder)
    print("check: every wheel installs on CPython 3.12 x86_64 and every requirement is met "
          "by the set or the GPU image")


# ------------------------------------------------------------------------------------ install (there)
def installed_versions(exclude: Path) -> dict[str, Version | None]:
    """Distributions visible to this interpreter, leaving out those under `exclude`."""
    out: dict[str, Version | None] = {}
    ex = str(exclude.resolve())
    for dist in md.distributions(path=[p for p in sys.path if p and not str(Path(p).resolve()).startswith(ex)]):
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name and name not in out:
            out[name] = Version(dist.version)
    return out


def install(folder: Path, target: Path) -> None:
    if not folder.is_dir() or not any(folder.glob("*.whl")):
        die(f"no wheels in {folder}: run `make gpu-wheels` on a machine with network, then bring {folder}/ along")
    want = entries()
    have = wheels(folder)
    missing = sorted({n for n, _, _ in want} - set(have))
    if missing:
        die(f"{folder} lacks {missing}: run `make gpu-wheels` again")
    present = installed_versions(target)
    chosen: list[str] = []
    while True:  # to a fixed point: what goes in may require more of the set
        needed: dict[str, list] = {}
        for c in chosen:
            for r in requirements(have[c][1]):
                if (c, canonicalize_name(r.name)) in IGNORED:
                    continue
                needed.setdefault(canonicalize_name(r.name), []).append(r.specifier)
        more = [n for n, _, kind in want if n not in chosen and (
            (n not in present and (kind == "need" or n in needed)) or
            (n in present and not all(s.contains(present[n], prereleases=True) for s in needed.get(n, []))))]
        if not more:
            break
        chosen += more
    for name, version in sorted(present.items()):
        if any(name == n for n, _, _ in want):
            note = "replaced in the overlay" if name in chosen else "kept"
            print(f"  installed: {name} {version} ({note})")
    if not chosen:
        print("bundle: every package of the set is installed already; nothing to install")
    else:
        print(f"bundle: installing {len(chosen)} wheels into {target}: {', '.join(sorted(chosen))}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(target),
                        *[str(have[n][1]) for n in chosen]], check=True)
    # What the processes will see: the overlay first, then the interpreter's own packages.
    now = {**present, **{canonicalize_name(d.metadata["Name"]): Version(d.version)
                         for d in md.distributions(path=[str(target)])}} if target.is_dir() else present
    bad = unmet({}, now, folder, [n for n, _, _ in want if n in now])
    if bad:
        die("after the install, requirements are still unmet:\n  " + "\n  ".join(bad))
    print("bundle: every requirement of the set is met")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["download", "check", "install", "size", "lock"])
    ap.add_argument("--dir", type=Path, default=REPO / ".whl")
    ap.add_argument("--target", type=Path, default=None, help="install: the overlay folder for PYTHONPATH")
    args = ap.parse_args(argv)
    if args.command == "download":
        download(args.dir)
    elif args.command == "check":
        check(args.dir)
    elif args.command == "size":
        report(args.dir)
    elif args.command == "lock":
        lock()
    else:
        if args.target is None:
            die("install needs --target DIR")
        install(args.dir, args.target)


if __name__ == "__main__":
    main()
