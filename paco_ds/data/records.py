"""Small readers every data format shares: JSON lines with file:line errors, and checked sizes."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from paco_ds.errors import DataError
from paco_ds.recipe.loader import read_text_utf8


def read_jsonl(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, parsed value) for each non-empty line; a malformed line is `file:line: ...`."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(read_text_utf8(path, DataError).split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
    return out


# NUL and lone UTF-16 surrogates (JSON's "\ud83d" without its pair) are not text a tokenizer or an
# HTTP request can carry: the run would die minutes later inside the tokenizer. They are refused,
# not cleaned, so that a prompt is never silently changed; emoji (a surrogate *pair* in JSON, one
# character once parsed), right-to-left text and long prompts are ordinary text.
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")


def check_text(value: Any, key: str, where: str) -> None:
    """Refuse NUL and lone surrogates anywhere in a record's strings (keys included), naming the
    field and the character's position."""
    if isinstance(value, str):
        m = _BAD_CHAR.search(value)
        if m:
            what = "NUL" if m.group() == "\x00" else f"a lone surrogate \\u{ord(m.group()):04x}"
            raise DataError(f"{where}: '{key}' contains {what} at character {m.start()}; such text cannot be "
                            "tokenized or sent to a judge (remove it from the file)")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, key, where)
            check_text(v, f"{key}.{k}" if key else str(k), where)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{key}[{i}]", where)


# The largest image side a record may ask for (height, width): the models train at 512-2048 px; a typo's
# 1048576 x 1048576 would be a 256 GiB allocation at the first rollout instead of a line at load.
MAX_IMAGE_SIDE = 16384


def positive_int(value: Any, key: str, where: str, maximum: int | None = None) -> int | None:
    """An optional positive integer field of a record (None stays None), at most `maximum`."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN / Infinity: int() would raise
        raise DataError(f"{where}: '{key}' must be a positive integer (got {value!r})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise DataError(f"{where}: '{key}' must be a positive integer (got {value!r})")
    if maximum is not None and value > maximum:
        raise DataError(f"{where}: '{key}' is {int(value)}, more than {maximum} px")
    return int(value)
