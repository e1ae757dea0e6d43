"""The two reward-model benchmarks in the layouts they ship in, and tiny offline versions of both.

ConsistencyRank-Bench (`X-GenGroup/ConsistencyRank-Bench`), a folder with
    prompt_data.jsonl            {"idx", "criteria", "prompt"} per prompt
    consistency_full_rank.jsonl  {"folder", "ref_image", "comp_images": [4], "rank_images": best first}
    images/<folder>/<file>
A rank record finds its prompt by its `idx` field when it has one, else by `folder` == idx.

EditReward-Bench (`EditScore/EditReward-Bench`, split `train`), the dataset's parquet files under
the folder (`data/train-*.parquet`, or any `*.parquet` below it) with columns `key` ([2] output
keys), `instruction`, `input_image`, `output_images` ([2], the human-preferred first; images as
{"bytes", "path"}), `task_type` and `dimension`.

    python -m paco_ds.eval.benchmarks --out DIR     # writes DIR/consistency_rank and DIR/edit_reward
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw

from paco_ds.data.records import read_jsonl
from paco_ds.errors import DataError


# ------------------------------------------------------------------------------------ ConsistencyRank
@dataclass
class RankItem:
    folder: str
    ref_image: str
    comp_images: list[str]
    gt_rank: list[int]  # candidate indices, best first
    prompt: str = ""
    criteria: dict = field(default_factory=dict)
    where: str = ""  # file:line

    def identity(self) -> dict:
        return {"folder": self.folder, "ref": self.ref_image, "comp": self.comp_images, "gt": self.gt_rank,
                "prompt": self.prompt, "criteria": self.criteria}

    def paths(self, root: Path) -> tuple[Path, list[Path]]:
        d = root / "images" / self.folder
        return d / self.ref_image, [d / c for c in self.comp_images]


def _jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of a benchmark file; a missing file or a line that is not a JSON object is
    one line naming the file (and line)."""
    if not path.is_file():
        raise DataError(f"{path}: no such file (the benchmark folder must hold it)")
    rows = read_jsonl(path)
    for n, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: a record must be a JSON object")
    return rows


def load_consistency_rank(root: str | Path) -> list[RankItem]:
    root = Path(root)
    prompts = {}
    for n, row in _jsonl(root / "prompt_data.jsonl"):
        if "idx" not in row:
            raise DataError(f"{root / 'prompt_data.jsonl'}:{n}: no 'idx'")
        prompts[str(row["idx"])] = row
    items = []
    ranks = root / "consistency_full_rank.jsonl"
    for n, row in _jsonl(ranks):
        where = f"{ranks}:{n}"
        for k in ("folder", "ref_image", "comp_images", "rank_images"):
            if k not in row:
                raise DataError(f"{where}: no '{k}'")
        comps, order = list(row["comp_images"]), list(row["rank_images"])
        if sorted(comps) != sorted(order) or len(set(comps)) != len(comps):
            raise DataError(f"{where}: 'rank_images' must order exactly the 'comp_images'")
        p = prompts.get(str(row.get("idx", row["folder"])), {})
        item = RankItem(str(row["folder"]), row["ref_image"], comps, [comps.index(x) for x in order],
                        p.get("prompt", ""), p.get("criteria") or {}, where)
        ref, cands = item.paths(root)
        for f in (ref, *cands):
            if not f.is_file():
                raise DataError(f"{where}: image {f} does not exist")
        items.append(item)
    if not items:
        raise DataError(f"{ranks}: no records")
    return items


# ------------------------------------------------------------------------------------ EditReward-Bench
@dataclass
class EditRecord:
    keys: tuple[str, str]
    instruction: str
    input_image: bytes
    output_images: tuple[bytes, bytes]
    task_type: str
    dimension: str
    where: str

    def identity(self) -> dict:
        return {"keys": list(self.keys), "instruction": self.instruction, "task_type": self.task_type,
                "dimension": self.dimension, "input": hashlib.sha256(self.input_image).hexdigest(),
                "outputs": [hashlib.sha256(b).hexdigest() for b in self.output_images]}


def _image_bytes(v, where: str) -> bytes:
    if isinstance(v, dict) and v.get("bytes"):
        return v["bytes"]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    raise DataError(f"{where}: expected an image ({{'bytes', 'path'}}), got {type(v).__name__}")


def load_edit_reward(root: str | Path) -> list[EditRecord]:
    import pyarrow.parquet as pq

    from paco_ds.eval.metrics import DIMENSIONS

    root = Path(root)
    files = sorted(root.rglob("*.parquet"))
    if not files:
        raise DataError(f"{root}: no *.parquet files (EditReward-Bench's data/train-*.parquet)")
    out = []
    for f in files:
        table = pq.read_table(f)
        missing = {"key", "instruction", "input_image", "output_images", "task_type", "dimension"} - set(table.column_names)
        if missing:
            raise DataError(f"{f}: missing column(s) {', '.join(sorted(missing))}")
        for i, row in enumerate(table.to_pylist()):
            where = f"{f}:row {i}"
            if len(row["key"] or []) != 2 or len(row["output_images"] or []) != 2:
                raise DataError(f"{where}: 'key' and 'output_images' must have 2 entries")
            if row["dimension"] not in DIMENSIONS:
                raise DataError(f"{where}: dimension '{row['dimension']}' is not one of {', '.join(DIMENSIONS)}")
            out.append(EditRecord(tuple(row["key"]), row["instruction"], _image_bytes(row["input_image"], where),
                                  tuple(_image_bytes(o, where) for o in row["output_images"]), row["task_type"],
                                  row["dimension"], where))
    return out


def open_image(b: bytes) -> Image.Image:
    return Image.open(io.BytesIO(b)).convert("RGB")


# ------------------------------------------------------------------------------------ tiny versions
def _scene(w: int, h: int, bg, shape: str, fg, shift: int = 0, extra: bool = False) -> Image.Image:
    im = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(im)
    for y in range(h):
        k = 0.9 + 0.1 * y / max(1, h - 1)
        d.line([(0, y), (w, y)], fill=tuple(int(c * k) for c in bg))
    box = [w // 4 + shift, h // 4, 3 * w // 4 + shift, 3 * h // 4]
    (d.ellipse if shape == "circle" else d.rectangle)(box, fill=fg)
    if extra:
        d.polygon([(w // 8, h - 4), (w // 4, h // 2), (3 * w // 8, h - 4)], fill=(250, 250, 250))
    return im


def make_tiny_consistency_rank(out: str | Path) -> Path:
    """3 items, each a reference and 4 candidates drifting away from it; annotated best first."""
    out = Path(out)
    specs = [("0000", (40, 90, 160), "circle", (230, 200, 40)),
             ("0001", (120, 60, 60), "square", (60, 200, 120)),
             ("0002", (30, 30, 30), "circle", (200, 80, 200))]
    prompts, ranks = [], []
    for folder, bg, shape, fg in specs:
        d = out / "images" / folder
        d.mkdir(parents=True, exist_ok=True)
        _scene(64, 64, bg, shape, fg).save(d / "ref.png")
        drift = [_scene(64, 64, bg, shape, fg, shift=2),                           # nearly the same
                 _scene(64, 64, bg, shape, tuple(255 - c for c in fg)),             # colour changed
                 _scene(64, 64, bg, "square" if shape == "circle" else "circle", fg, extra=True),
                 _scene(64, 64, tuple(255 - c for c in bg), "square", (0, 0, 0), shift=8)]
        names = [f"cand_{i}.png" for i in range(4)]
        for im, n in zip(drift, names):
            im.save(d / n)
        comp = [names[2], names[0], names[3], names[1]]  # shipped order differs from the annotated one
        ranks.append({"folder": folder, "ref_image": "ref.png", "comp_images": comp, "rank_images": names})
        prompts.append({"idx": folder, "prompt": f"A {shape} on a plain background, four variations.",
                        "criteria": {"Identity": {"1": f"The {shape} keeps its shape."},
                                     "Style": {"1": "The colours stay the same.", "2": "The shading stays the same."}}})
    (out / "prompt_data.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "consistency_full_rank.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ranks))
    return out


def make_tiny_edit_reward(out: str | Path) -> Path:
    """4 edit pairs x the 3 dimensions (12 records) over 4 task types; non-square inputs and
    outputs at other sizes (the runner resizes each output to its input's size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def png(im: Image.Image) -> dict:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    pairs = [("subject-add", "add a white triangle", _scene(80, 48, (40, 90, 160), "circle", (230, 200, 40)),
              _scene(64, 64, (40, 90, 160), "circle", (230, 200, 40), extra=True),
              _scene(64, 64, (40, 90, 160), "circle", (230, 200, 40))),
             ("color_alter", "make the square green", _scene(48, 80, (120, 60, 60), "square", (200, 60, 60)),
              _scene(48, 80, (120, 60, 60), "square", (60, 200, 60)),
              _scene(56, 56, (60, 120, 60), "circle", (200, 60, 60))),
             ("background_change", "make the background black", _scene(64, 64, (200, 200, 200), "circle", (20, 90, 200)),
              _scene(64, 64, (10, 10, 10), "circle", (20, 90, 200)),
              _scene(64, 64, (200, 200, 200), "circle", (20, 90, 200), shift=10)),
             ("text_change", "move the shape right", _scene(72, 56, (90, 40, 120), "square", (240, 240, 240)),
              _scene(72, 56, (90, 40, 120), "square", (240, 240, 240), shift=10),
              _scene(36, 28, (90, 40, 120), "square", (240, 240, 240)))]
    rows = []
    for n, (task, instr, inp, good, bad) in enumerate(pairs):
        for dim in ("prompt_following", "consistency", "overall"):
            rows.append({"key": [f"{task}_{n}_a", f"{task}_{n}_b"], "instruction": instr, "input_image": png(inp),
                         "output_images": [png(good), png(bad)], "task_type": task, "dimension": dim})
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("key", pa.list_(pa.string())), ("instruction", pa.string()), ("input_image", image),
                        ("output_images", pa.list_(image)), ("task_type", pa.string()), ("dimension", pa.string())])
    out = Path(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "data" / "train-00000-of-00001.parquet")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write tiny offline ConsistencyRank and EditReward-Bench folders.")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    print(make_tiny_consistency_rank(Path(args.out) / "consistency_rank"))
    print(make_tiny_edit_reward(Path(args.out) / "edit_reward"))


if __name__ == "__main__":
    main()
