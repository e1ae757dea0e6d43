"""Image-editing data (`data.format: edit`): one instruction and one reference image per record.

Layouts, told apart by the file name:
  * `{split}_metadata.jsonl` (PaCo-RL `general_editing`): `prompt`, and `image`, a path relative
    to the file's folder. The reference's ShareGPT-4o-Image preprocessing writes `ref_image`
    instead (PaCo-RL/PaCo-GRPO/dataset/ShareGPT-4o-Image/preprocess.py); that key is read when `image` is absent.
  * any other `*.jsonl`, e.g. `{split}.jsonl` (Flow-Factory): `prompt`; `image` as a path or a
    list of paths (or `images`, a list); optional `negative_prompt` (kept in the metadata). A
    relative path is looked up under `{folder}/images` (Flow-Factory's default image root), then
    under the folder.
  * `{split}.parquet` / `{split}.arrow` (PaCo-RL `arrow_editing`, e.g. GEdit-Bench): columns
    `prompt` and `image` (a struct with `bytes`, as `datasets` writes it, or raw bytes), read with
    pyarrow. The encoded bytes stay in memory (one copy per process); the other scalar columns
    become the metadata. `.arrow` is the IPC file format, or the stream format `datasets` writes.

Several input images. In both jsonl layouts `image` (or `images`, `ref_image`) may list several
paths: a multi-image edit (Qwen-Image-Edit-2509/2511 read up to three), in the order the
instruction numbers them ("Picture 1", "Picture 2", ...). A single path and a one-element list
are the same record. The item keeps the first as `image` and the others as `extra_images`;
`read_references(item)` returns all of them. Whether the model can read that many is checked
against the family when the run starts (paco_ds/grpo/preflight.py: one line naming file:line).
The table layouts hold one image per row.

Optional per-record `height`/`width` override the resolution fallback, as for T2IS data.

Grouping. GRPO groups the k samples of a prompt by its dataset index. For editing a prompt is
(instruction, reference image): the same instruction on two images is two groups. Records with
the same instruction and the same image bytes (md5, as the reference groups by
`prompt + md5(image bytes)`; for several input images the md5 of their md5s, in order) are merged
at load, keeping the first and logging how many were dropped, so one (instruction, images) pair is
one dataset index and one group.

Errors (a DataError: one line naming `file:line` or `file row N`, exit code 2): a missing image
file is found at load; encoded bytes are decoded, and an undecodable image reported, when first
read by `read_reference`.

`read_references(item)` is what the trainer calls at rollout: each input image as uint8
[3, H, W], RGB, at its original size, from a small LRU cache keyed by the image's content hash
(`read_reference(item)`: the first, for single-image editing).
"""
from __future__ import annotations

import hashlib
import io
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from paco_ds.data.records import MAX_IMAGE_SIDE, check_text, positive_int as _positive_int, read_jsonl
from paco_ds.errors import DataError

log = logging.getLogger(__name__)

TABLE_SUFFIXES = (".parquet", ".arrow")


def image_md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _prompt(rec: dict, where: str) -> str:
    prompt = rec.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: missing or empty 'prompt'")
    check_text(prompt, "prompt", where)
    check_text(rec.get("negative_prompt"), "negative_prompt", where)
    return prompt


# ------------------------------------------------------------------------------------ jsonl layouts
def _image_fields(rec: dict, where: str) -> list[str]:
    """The input image paths of a jsonl record, in order (one or several)."""
    key = next((k for k in ("image", "images", "ref_image") if rec.get(k) not in (None, "", [])), None)
    if key is None:
        raise DataError(f"{where}: missing 'image' (the reference image's path)")
    values = rec[key] if isinstance(rec[key], list) else [rec[key]]
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            what = f"'{key}'" if len(values) == 1 and not isinstance(rec[key], list) else f"'{key}'[{i}]"
            raise DataError(f"{where}: {what} must be a path (a string), got {value!r}")
    return values


def _resolve(value: str, roots: list[Path], where: str) -> Path:
    p = Path(value).expanduser()
    candidates = [p] if p.is_absolute() else [root / p for root in roots]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DataError(f"{where}: image not found: {' or '.join(str(c) for c in candidates)}")


def _jsonl_records(path: Path) -> list[dict]:
    general = path.name.endswith("_metadata.jsonl")  # PaCo-RL: relative to the file's folder
    roots = [path.parent] if general else [path.parent / "images", path.parent]
    out = []
    for lineno, rec in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        check_text(rec, "", where)  # the whole record is the item's metadata
        prompt = _prompt(rec, where)
        neg = rec.get("negative_prompt")
        if neg is not None and not isinstance(neg, str):
            raise DataError(f"{where}: 'negative_prompt' must be a string")
        images = [_resolve(v, roots, where) for v in _image_fields(rec, where)]
        digests = [image_md5(p.read_bytes()) for p in images]
        out.append({"prompt": prompt, "metadata": rec, "where": where, "image": str(images[0]),
                    "extra_images": tuple(str(p) for p in images[1:]),
                    # one image: its md5 (the reference's group key); several: the md5 of their md5s
                    "image_digest": digests[0] if len(digests) == 1 else image_md5("".join(digests).encode()),
                    "height": _positive_int(rec.get("height"), "height", where, MAX_IMAGE_SIDE),
                    "width": _positive_int(rec.get("width"), "width", where, MAX_IMAGE_SIDE)})
    return out


# ------------------------------------------------------------------------------------ table layout
def _read_table(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading .parquet/.arrow data needs pyarrow (pip install pyarrow)") from None
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        try:
            with pa.memory_map(str(path)) as src:
                return pa.ipc.open_file(src).read_all()
        except pa.ArrowInvalid:  # `datasets` writes the IPC stream format
            with pa.memory_map(str(path)) as src:
                return pa.ipc.open_stream(src).read_all()
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: cannot read as {path.suffix[1:]}: {err}") from None


def _table_records(path: Path) -> list[dict]:
    table = _read_table(path)
    missing = [c for c in ("prompt", "image") if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {' or '.join(map(repr, missing))} (columns: "
                        f"{', '.join(table.column_names)})")
    rows = table.to_pylist()
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        prompt = _prompt(row, where)
        cell = row["image"]
        data, image = None, None
        if isinstance(cell, dict):
            data = cell.get("bytes")
            if data is None and cell.get("path"):  # `datasets` may keep only the path
                image = _resolve(cell["path"], [path.parent], where)
        elif isinstance(cell, (bytes, bytearray)):
            data = cell
        if data is None and image is None:
            raise DataError(f"{where}: no image bytes in column 'image' (got {type(cell).__name__})")
        if data is not None:
            data = bytes(data)
            if not data:
                raise DataError(f"{where}: the image bytes are empty")
        meta = {k: v for k, v in row.items() if k != "image" and (v is None or isinstance(v, (str, int, float, bool)))}
        out.append({"prompt": prompt, "metadata": meta, "where": where,
                    "image": data if data is not None else str(image),
                    "image_digest": image_md5(data if data is not None else image.read_bytes()),
                    "height": _positive_int(row.get("height"), "height", where, MAX_IMAGE_SIDE),
                    "width": _positive_int(row.get("width"), "width", where, MAX_IMAGE_SIDE)})
    return out


# ------------------------------------------------------------------------------------ loading
def load_edit_records(path: str | Path) -> list[dict]:
    """The records of an editing data file as PromptItem keyword arguments, duplicates of
    (prompt, image bytes) merged (the first kept)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        records = _jsonl_records(path)
    elif path.suffix in TABLE_SUFFIXES:
        records = _table_records(path)
    else:
        raise DataError(f"{path}: data.format 'edit' reads .jsonl, .parquet or .arrow files")
    seen: dict[tuple[str, str], dict] = {}
    for rec in records:
        seen.setdefault((rec["prompt"], rec["image_digest"]), rec)
    if len(seen) < len(records):
        log.info("%s: %d records repeat an earlier (prompt, image) pair and were merged into it (%d left)",
                 path, len(records) - len(seen), len(seen))
    if not seen:
        raise DataError(f"{path}: no prompts")
    return list(seen.values())


# ------------------------------------------------------------------------------------ reading
def decode_image(source: str | bytes, where: str) -> Image.Image:
    """An RGB PIL image from a path or encoded bytes; a DataError naming `where` otherwise."""
    what = f" {source}" if isinstance(source, str) else ""
    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source)) as im:
            im.load()
            return im.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: image not found: {source}") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(f"{where}: cannot decode the reference image{what}: {err}") from None


class _ReferenceCache:
    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._data: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, source: str | bytes, key: str | None, where: str) -> torch.Tensor:
        key = key or (source if isinstance(source, str) else image_md5(source))
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key].clone()
            self.misses += 1
        arr = np.asarray(decode_image(source, where))
        tensor = torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()
        with self._lock:
            self._data[key] = tensor
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)
        return tensor.clone()

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0


_CACHE = _ReferenceCache()


def _item_sources(item) -> tuple[list, str]:
    source = getattr(item, "image", None)
    where = getattr(item, "where", None) or repr(getattr(item, "prompt", item))
    if source is None:
        raise DataError(f"{where}: this prompt has no reference image (editing needs data.format: edit)")
    return [source, *getattr(item, "extra_images", ())], where


def read_references(item) -> list[torch.Tensor]:
    """Every input image of an edit PromptItem, in order: uint8 [3, H, W], RGB, original size
    (copies: the caller may modify them). Decoded once per content and kept in an LRU cache of
    `reference_cache_size()` images; a missing or undecodable image is a DataError naming the
    record's file:line or row."""
    sources, where = _item_sources(item)
    return [_CACHE.get(s, _cache_key(item, sources), where) if i == 0 else _CACHE.get(s, None, where)
            for i, s in enumerate(sources)]


def read_reference(item) -> torch.Tensor:
    """The (first) reference image of an edit PromptItem, as `read_references` reads it."""
    sources, where = _item_sources(item)
    return _CACHE.get(sources[0], _cache_key(item, sources), where)


def _cache_key(item, sources: list) -> str | None:
    """The first image's cache key: a single image's md5, read at load (several images' item digest
    is their set's, so each is then keyed by its path or its bytes' md5)."""
    return getattr(item, "image_digest", None) if len(sources) == 1 else None


def set_reference_cache_size(n: int) -> None:
    if n < 1:
        raise ValueError("the reference cache holds at least one image")
    with _CACHE._lock:
        _CACHE.capacity = n
        while len(_CACHE._data) > n:
            _CACHE._data.popitem(last=False)


def reference_cache_size() -> int:
    return _CACHE.capacity


def reference_cache_stats() -> dict[str, int]:
    return {"size": len(_CACHE._data), "capacity": _CACHE.capacity, "hits": _CACHE.hits, "misses": _CACHE.misses}


def clear_reference_cache() -> None:
    _CACHE.clear()
