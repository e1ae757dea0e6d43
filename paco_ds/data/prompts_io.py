"""Prompt files: T2IS jsonl (prompt + layout + size + consistency criteria), plain text lists, and
image-editing records (an instruction + one or several input images; paco_ds/data/edit.py).

Every malformed line is reported as `file:line: reason` (a DataError, exit code 2), never skipped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paco_ds.errors import DataError
from paco_ds.data.records import MAX_IMAGE_SIDE, check_text, positive_int as _positive_int, read_jsonl
from paco_ds.recipe.loader import read_text_utf8

@dataclass
class PromptItem:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    height: int | None = None  # per-item size; overrides the resolution fallback when set
    width: int | None = None
    # Editing (data.format: edit): the reference image as a resolved path or its encoded bytes,
    # and the md5 of those bytes. Read it with paco_ds.data.edit.read_reference(item).
    image: str | bytes | None = field(default=None, repr=False)
    image_digest: str | None = None  # with extra_images: the md5 of every input image's md5, in order
    # A multi-image edit's further input images (paths), in the instruction's order after `image`;
    # read_references(item) reads them all.
    extra_images: tuple[str, ...] = field(default=(), repr=False)
    where: str | None = None  # "file:line" or "file row N", for error messages

    def size(self, fallback: int | tuple[int, int]) -> tuple[int, int]:
        """(height, width): the item's own, else the recipe's resolution (a side, or [height, width])."""
        h, w = (fallback, fallback) if isinstance(fallback, int) else fallback
        return (self.height or h, self.width or w)

    @property
    def group_key(self) -> tuple[str, str | None]:
        """What makes a GRPO group: the prompt, and for editing the reference image's content."""
        return (self.prompt, self.image_digest)


_LAYOUT = re.compile(r"\s*(\d+)\s*[x\u2a09\u00d7]\s*(\d+)\s*")
_LAYOUT_IN_PROMPT = re.compile(r"(\d+)\s*[x\u2a09\u00d7]\s*(\d+)")


def _check_layout(rec: dict, prompt: str, where: str) -> None:
    """A T2IS grid layout is exactly 'RxC' with R, C >= 1: the record's `layout`, else the first
    'RxC' of the prompt (what paco_ds/images.py reads). '0x2' would divide by zero in a
    reward, and '2x2x2' would silently be read as 2x2."""
    layout = rec.get("layout")
    if layout is not None:
        m = _LAYOUT.fullmatch(layout) if isinstance(layout, str) else None
        if m is None:
            raise DataError(f"{where}: 'layout' must be 'RxC' with R, C >= 1 (got {layout!r})")
    else:
        m = _LAYOUT_IN_PROMPT.search(prompt)
        if m is None:
            return
        after = prompt[m.end():m.end() + 2].lstrip()
        if after[:1] in ("x", "\u2a09", "\u00d7") and after[1:2].isdigit():
            raise DataError(f"{where}: the prompt's layout '{prompt[m.start():m.end() + 3].strip()}...' must be "
                            "'RxC' (give a 'layout' field)")
    rows, cols = int(m.group(1)), int(m.group(2))
    if rows < 1 or cols < 1:
        what = f"'layout' {layout!r}" if layout is not None else f"the prompt's layout '{m.group(0)}'"
        raise DataError(f"{where}: {what} must have R, C >= 1 rows and columns")


def load_t2is_jsonl(path: str | Path) -> list[PromptItem]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    items: list[PromptItem] = []
    for lineno, rec in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        check_text(rec, "", where)  # criteria and metadata reach the judge too
        prompt = rec.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: missing or empty 'prompt'")
        _check_layout(rec, prompt, where)
        crit = rec.get("criteria")
        if crit is not None and not isinstance(crit, dict):
            raise DataError(f"{where}: 'criteria' must be an object of dimensions")
        items.append(PromptItem(prompt=prompt, metadata=rec,
                                height=_positive_int(rec.get("height"), "height", where, MAX_IMAGE_SIDE),
                                width=_positive_int(rec.get("width"), "width", where, MAX_IMAGE_SIDE), where=where))
    if not items:
        raise DataError(f"{path}: no prompts")
    return items


def load_text_prompts(path: str | Path) -> list[PromptItem]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    items = []
    for lineno, line in enumerate(read_text_utf8(path, DataError).split("\n"), 1):
        if line.strip():
            check_text(line, "prompt", f"{path}:{lineno}")  # UTF-8 has no lone surrogates; NUL it has
            items.append(PromptItem(prompt=line.strip(), where=f"{path}:{lineno}"))
    if not items:
        raise DataError(f"{path}: no prompts")
    return items


def load_prompts(path: str | Path, fmt: str, key: str | None = None) -> list[PromptItem]:
    """Load a prompt file; `key` (e.g. 'data.train_file') is named when the file is missing."""
    if key and not Path(path).is_file():
        raise DataError(f"config key '{key}': dataset file not found: {path}")
    if fmt == "t2is":
        return load_t2is_jsonl(path)
    if fmt == "text":
        return load_text_prompts(path)
    if fmt == "edit":
        return load_edit(path)
    raise DataError(f"unknown data format '{fmt}' (t2is, text or edit)")


def load_edit(path: str | Path) -> list[PromptItem]:
    """Editing records (paco_ds/data/edit.py): one item per distinct (instruction, reference image)."""
    from paco_ds.data.edit import load_edit_records

    return [PromptItem(**rec) for rec in load_edit_records(path)]
