"""Puts distributions installed in one venv into another by hard links, with what they require that the
other venv lacks: `make vllm-setup` gives vLLM's venv the main venv's torch and torchvision (and their
CUDA libraries and Triton) this way. A pip install of the same wheels unpacks about 5 GiB again, which
took most of the set-up's 7.5 minutes on 2 cores and slowed the lanes running beside it.

Each file named in a distribution's RECORD is linked, its compiled __pycache__ files with it, so the
.pyc files match their sources' mtimes; files outside site-packages (console scripts, whose #! line
names the other venv's python) are left out. pip removes files rather than writing into them, so an
upgrade or uninstall in either venv leaves the other intact.

    python tests/vllm_lane/link_dists.py SRC_VENV DST_VENV torch torchvision
"""
import argparse
import os
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        sys.exit(f"link_dists: no single site-packages under {venv} (found {[str(p) for p in found]})")
    return found[0]


def installed(site: Path) -> dict[str, metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}


def closure(names: list[str], src: dict[str, metadata.Distribution], dst: dict) -> list[metadata.Distribution]:
    """`names` and, recursively, the requirements (markers evaluated here, with the extras asked for:
    torch asks for cuda-toolkit[cublas,cufile,...]) the destination lacks."""
    todo = [(canonicalize_name(n), frozenset()) for n in names]
    chosen: dict[str, metadata.Distribution] = {}
    seen: set = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in src:
            sys.exit(f"link_dists: {name} is not installed in the source venv")
        chosen[name] = src[name]
        for text in src[name].requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in dst:
                todo.append((dep, frozenset(req.extras)))
    return list(chosen.values())


def link(dist: metadata.Distribution, src_site: Path, dst_site: Path) -> int:
    count = 0
    for rel in dist.files or []:
        source = (src_site / rel).resolve()
        if not source.is_relative_to(src_site.resolve()) or not source.is_file():
            continue
        target = dst_site / source.relative_to(src_site.resolve())
        if target.exists():  # a namespace package's __init__.py several distributions share
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)
        count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("names", nargs="+")
    args = ap.parse_args()
    src_site, dst_site = site_packages(args.src), site_packages(args.dst)
    dst = installed(dst_site)
    clash = [n for n in map(canonicalize_name, args.names) if n in dst]
    if clash:
        sys.exit(f"link_dists: {', '.join(clash)} already installed in {args.dst}: uninstall first")
    for dist in closure(args.names, installed(src_site), dst):
        print(f"link_dists: {dist.metadata['Name']} {dist.version}: {link(dist, src_site, dst_site)} files")


if __name__ == "__main__":
    main()
