"""The docs a newcomer reads: README.md stays short and reaches every page of docs/, every link
resolves (files and #anchors), and nothing in the repository cites a file a reader cannot open."""
import pytest
import io
import re
import subprocess
import tokenize
from pathlib import Path

from conftest import REPO

pytestmark = pytest.mark.fast

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OUR_DIRS = ("paco_ds", "kernels", "launch", "benchmarks", "tests", "configs", "csrc", "docs")
# What counts as the repository's text: source, recipes, scripts and docs (tracked or new, not ignored).
TEXT = (".py", ".yaml", ".yml", ".cpp", ".h", ".cu", ".sh", ".md", ".txt", ".toml", ".cfg")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    names = [n for n in out if n and not n.startswith(".venv") and (n.endswith(TEXT) or n in ("Makefile", ".ci/run"))]
    return [REPO / n for n in names if (REPO / n).is_file()]


def _outside_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code_blocks(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_slug_follows_github():
    assert slug("Model families and their defaults") == "model-families-and-their-defaults"
    assert slug("Which one? A comparison on the tiny T2IS recipe") == "which-one-a-comparison-on-the-tiny-t2is-recipe"
    assert slug("`train.loss: nft` (DiffusionNFT): config keys") == "trainloss-nft-diffusionnft-config-keys"
    assert slug("paco_ds against the reference (`benchmarks/grpo_vs_reference.py`)") == \
        "paco_ds-against-the-reference-benchmarksgrpo_vs_referencepy"


def test_readme_is_short_and_keeps_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "make demo" in text and "make test" in text


def test_readme_links_every_docs_page():
    linked = {(REPO / t.split("#")[0]).resolve() for t in LINK.findall((REPO / "README.md").read_text())
              if not t.startswith(("http:", "https:", "#"))}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")}
    assert pages, "docs/ has no pages"
    assert not pages - linked, sorted(p.name for p in pages - linked)


def test_every_docs_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(_outside_code_blocks(page.read_text())):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading '#{frag}' in {dest.name})")
    assert not broken, "\n".join(broken)


def _prose_lines(f: Path) -> set[int]:
    """Line numbers of what a reader reads as text: docs entirely; in code, comments and docstrings
    (a string literal in code may name a path on purpose, e.g. a missing one a test refers to)."""
    text = f.read_text(errors="replace")
    if f.suffix in (".md", ".txt"):
        return set(range(1, text.count("\n") + 2))
    if f.suffix != ".py":
        marker = "//" if f.suffix in (".cpp", ".h", ".cu") else "#"
        return {n for n, line in enumerate(text.splitlines(), 1) if marker in line}
    out, previous = set(), tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                                 tokenize.DEDENT, tokenize.ENCODING)
        if tok.type == tokenize.COMMENT or docstring:
            out.update(range(tok.start[0], tok.end[0] + 1))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return out


def _exists_or_output(path: str) -> bool:
    """In the repository, or a place the code writes to: a benchmark's results/ folder (a result
    appears there once the benchmark ran) or a git-ignored path (e.g. tests/gpu/results)."""
    if (REPO / path).exists() or list(REPO.glob(path + "*")):
        return True
    parts = path.split("/")
    if "results" in parts and (REPO / "/".join(parts[:parts.index("results")])).is_dir():
        return True
    return any(subprocess.run(["git", "check-ignore", "-q", p], cwd=REPO).returncode == 0 for p in (path, path + "/"))


def test_nothing_cites_a_file_that_is_not_in_the_repository():
    """Citations a reader can open: a paper (arXiv id, section), a file of the reference
    repositories named with the repository (PaCo-RL/..., flow_grpo/...), or a file here. A
    document cited by name (`X.md`) or by section sign (§) must be one of ours."""
    files = _files()
    ours_md = {f.name for f in files if f.suffix == ".md"}
    bad = []
    for f in files:
        if f.name == "test_docs.py":
            continue
        rel = f.relative_to(REPO)
        prose = _prose_lines(f)
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for doc in re.findall(r"\b([\w-]+\.md)\b", line):
                if doc not in ours_md:
                    bad.append(f"{rel}:{n}: cites {doc}, which is not in the repository")
            if "§" in line:
                bad.append(f"{rel}:{n}: a § section of a document (name the file or the paper's section)")
            if re.search(r"(\.\./|/work/)shared\b", line):
                bad.append(f"{rel}:{n}: cites a folder outside the repository")
            if n in prose:
                for path in re.findall(r"(?<![\w/.-])((?:%s)/[\w./-]*\w)" % "|".join(OUR_DIRS), line):
                    if not _exists_or_output(path):
                        bad.append(f"{rel}:{n}: {path} does not exist")
    assert not bad, "\n".join(dict.fromkeys(bad))
