"""Which source a result came from: the commit and whether the tree was clean. The kernel benchmark
records it in its JSON, and the GPU lane in every results file it writes (`"source"`).

`source_state()`:
- with git and the repository's own .git: `git rev-parse HEAD`, and clean when `git status --porcelain`
  lists nothing outside the results folders (a run writes its own results into the tree);
- in a copy of the tree without .git (what a GPU machine gets), from the record that
  `python -m kernels.bench.source record` wrote before the copy was made (`make gpu-wheels` writes
  .whl/source.json, which travels with the wheels): its commit, and clean only if the tree it recorded was
  clean and every file it hashed still has that content here;
- otherwise commit "unknown" and clean null.

    python -m kernels.bench.source                         # the state, as JSON
    python -m kernels.bench.source record [PATH]           # write the record (default .whl/source.json)
    python -m kernels.bench.source stamp [--state F] FILE  # add the state to results files that lack it

`stamp` adds a "source" key to a .json file, a first line {"source": ...} to a .jsonl file and
`source_commit` / `source_clean` / `source_from` properties to a junit .xml file's test suites.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / ".whl" / "source.json"
RESULT_DIRS = ("tests/gpu/results", "kernels/bench/results", "benchmarks/results")


def _git(repo: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _own_git(repo: Path) -> bool:
    top = _git(repo, "rev-parse", "--show-toplevel")
    return top is not None and Path(top.strip()).resolve() == repo.resolve()


def _is_result(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in RESULT_DIRS)


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


def git_state(repo: Path = REPO) -> dict | None:
    """{"commit", "clean", "from": "git", "changes"} from the repository's .git; None without one (or git)."""
    if not _own_git(repo):
        return None
    head = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=all")
    if head is None or status is None:
        return None
    changes = [l[3:] for l in status.splitlines() if l.strip() and not _is_result(l[3:].strip('"'))]
    return {"commit": head.strip(), "clean": not changes, "from": "git", "changes": changes[:20]}


def record(out: Path = RECORD, repo: Path = REPO) -> dict:
    """Write the record of this tree (git's state and a digest of every tracked file) for a copy of it
    without .git; returns it."""
    state = git_state(repo)
    if state is None:
        raise SystemExit(f"{repo}: no git repository to record (git rev-parse failed)")
    files = [f for f in (_git(repo, "ls-files", "-z") or "").split("\0") if f and not _is_result(f)]
    rec = {"commit": state["commit"], "clean": state["clean"], "changes": state["changes"],
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "files": {f: _digest(repo / f) for f in files}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=0, sort_keys=True))
    return rec


def recorded_state(rec_path: Path = RECORD, repo: Path = REPO) -> dict | None:
    """The state from a record: its commit, clean if the recorded tree was clean and no file differs."""
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, ValueError):
        return None
    changed = [f for f, h in rec.get("files", {}).items() if _digest(repo / f) != h]
    where = rec_path.relative_to(repo) if rec_path.is_relative_to(repo) else rec_path
    return {"commit": rec.get("commit", "unknown"), "clean": bool(rec.get("clean")) and not changed,
            "from": f"{where} recorded {rec.get('date', '?')} (no .git here)",
            "changes": (rec.get("changes") or []) + [f"{f} (since the record)" for f in changed[:20]]}


def source_state(repo: Path = REPO, rec_path: Path | None = None) -> dict:
    """{"commit": sha or "unknown", "clean": bool or None, "from": how it is known, "changes": [...]}"""
    return git_state(repo) or recorded_state(rec_path or repo / ".whl" / "source.json", repo) or \
        {"commit": "unknown", "clean": None, "from": "no .git and no source record (.whl/source.json)", "changes": []}


def stamp(path: Path, state: dict) -> bool:
    """Add `state` to the results file `path` (.json, .jsonl or junit .xml) unless it records one already;
    True if it was added."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "source" in doc:
            return False
        path.write_text(json.dumps({**doc, "source": state}, indent=1))
    elif path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        if lines and '"source"' in lines[0] and "source" in json.loads(lines[0]):
            return False
        path.write_text("\n".join([json.dumps({"source": state}), *lines]) + "\n")
    elif path.suffix == ".xml":
        import xml.etree.ElementTree as ET

        tree = ET.parse(path)
        root = tree.getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        if not suites or any(p.get("name") == "source_commit" for s in suites for p in s.iter("property")):
            return False
        for suite in suites:
            props = suite.find("properties")
            if props is None:
                props = ET.Element("properties")
                suite.insert(0, props)
            for key in ("commit", "clean", "from"):
                ET.SubElement(props, "property", name=f"source_{key}", value=str(state.get(key)))
        tree.write(path, encoding="utf-8", xml_declaration=True)
    else:
        raise ValueError(f"{path}: cannot record the source in a {path.suffix or 'suffix-less'} file")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.bench.source", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("record", help="write the record of this tree for a copy without .git")
    r.add_argument("path", nargs="?", type=Path, default=RECORD)
    s = sub.add_parser("stamp", help="add the source state to results files that lack it")
    s.add_argument("--state", type=Path, help="a JSON state to use (default: the state now)")
    s.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        rec = record(args.path)
        print(f"{args.path}: {rec['commit'][:12]} {'clean' if rec['clean'] else 'with changes'}, "
              f"{len(rec['files'])} files hashed")
    elif args.cmd == "stamp":
        state = json.loads(args.state.read_text()) if args.state else source_state()
        for f in args.files:
            if f.is_file() and stamp(f, state):
                print(f"{f}: source {state['commit'][:12]} clean={state['clean']}")
    else:
        print(json.dumps(source_state()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
