"""Reward-model SFT data: sharegpt records, the qwen2_vl template, labels, batches, synthetic pairs.

Records are what LLaMA-Factory's sharegpt loader reads (the format of PaCo-Reward's data), one JSON object each,
in a JSON list or a JSONL file:

    {"messages": [{"role": "user", "content": "<image><image>Do the two images ...?"},
                  {"role": "assistant", "content": "Yes. Both show ..."}],
     "images": ["images/0001_a.png", "images/0001_b.png"]}

(`conversations` with `from: human|gpt` and `value`, and a `system` string, are read too.) Each
`<image>` placeholder takes the next entry of `images`; relative paths resolve against
`data.image_dir`, else the data file's directory.

Encoding follows LLaMA-Factory's qwen2_vl template: a system turn (default "You are a helpful
assistant."), `<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n`, then
`{content}<|im_end|>\\n` for the assistant, whose tokens are the only labelled ones. An image
becomes <|vision_start|>, one <|image_pad|> per merged 28x28 patch, <|vision_end|>; the number of
patches follows the image processor's smart resize within [image_min_pixels, image_max_pixels].
The prompt is never truncated (a cut image would not match its patches): a record whose prompt
does not fit `cutoff_len` is an error; a long answer is cut at `cutoff_len`.

All checks run before any model is built, each failure one line naming the file and record.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from paco_ds.data.records import check_text, read_jsonl
from paco_ds.errors import DataError

IGNORE_INDEX = -100
IMAGE = "<image>"
DEFAULT_SYSTEM = "You are a helpful assistant."
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Record:
    where: str  # "<file>: record <i>" for messages
    system: str
    turns: tuple[tuple[str, str], ...]  # (user, assistant) pairs
    images: tuple[Path, ...]


# ------------------------------------------------------------------------------------------ loading
def _read_json_records(path: Path, key: str) -> list:
    if not path.is_file():
        raise DataError(f"{key}: data file not found: {path}")
    if path.suffix == ".jsonl":
        return [rec for _, rec in read_jsonl(path)]
    from paco_ds.recipe.loader import read_text_utf8

    text = read_text_utf8(path, DataError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records (or a .jsonl file)")
    return data


def _messages(raw: dict, where: str) -> tuple[str, list[tuple[str, str]]]:
    if "messages" in raw:
        msgs, role_key, text_key = raw["messages"], "role", "content"
    elif "conversations" in raw:
        msgs, role_key, text_key = raw["conversations"], "from", "value"
    else:
        raise DataError(f"{where}: no 'messages' (or 'conversations') list")
    if not isinstance(msgs, list):
        raise DataError(f"{where}: 'messages' must be a list")
    system = raw.get("system") or DEFAULT_SYSTEM
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get(text_key), str):
            raise DataError(f"{where}: message {j} needs a '{role_key}' and a string '{text_key}'")
        role = ROLES.get(m.get(role_key))
        if role is None:
            raise DataError(f"{where}: message {j} has role {m.get(role_key)!r} (user, assistant or system)")
        if role == "system":
            if j:
                raise DataError(f"{where}: message {j}: a system message must come first")
            system = m[text_key]
            continue
        out.append((role, m[text_key]))
    return system, out


def parse_record(raw, where: str, image_root: Path) -> Record:
    """One record, checked: alternating user/assistant turns ending with an answer, one image per
    <image> placeholder, every image file present."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object")
    check_text(raw, "", where)  # NUL or a lone surrogate would stop the tokenizer mid-run
    system, msgs = _messages(raw, where)
    if not any(role == "assistant" for role, _ in msgs):
        raise DataError(f"{where}: no assistant turn (nothing to learn)")
    roles = [role for role, _ in msgs]
    if roles != ["user", "assistant"] * (len(roles) // 2) or len(roles) % 2:
        raise DataError(f"{where}: turns must alternate user/assistant and end with the assistant (got {roles})")
    images = raw.get("images") or []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list):
        raise DataError(f"{where}: 'images' must be a list of image paths (got {type(images).__name__})")
    for j, im in enumerate(images):
        if not isinstance(im, str) or not im.strip():
            raise DataError(f"{where}: images[{j}] must be an image path (a non-empty string), got {im!r}")
    if not images:
        # Every rank must run the vision tower in every step under ZeRO-3 (its gathers are collective).
        raise DataError(f"{where}: no images (records are image pairs; text-only records are not supported)")
    placeholders = sum(text.count(IMAGE) for _, text in msgs)
    if placeholders != len(images):
        raise DataError(f"{where}: {placeholders} {IMAGE} placeholder(s) but {len(images)} image(s) in 'images'")
    paths = []
    for im in images:
        p = Path(im).expanduser()
        p = p if p.is_absolute() else image_root / p
        if not p.is_file():
            raise DataError(f"{where}: image file not found: {p}")
        paths.append(p)
    turns = tuple((msgs[k][1], msgs[k + 1][1]) for k in range(0, len(msgs), 2))
    return Record(where=where, system=system, turns=turns, images=tuple(paths))


def load_records(files: list[Path], key: str, image_dir: Path | None = None,
                 max_samples: int | None = None) -> list[Record]:
    """Every record of `files` (the first `max_samples` of each), checked (see parse_record)."""
    out = []
    for f in files:
        raw = _read_json_records(f, key)[:max_samples]
        root = image_dir or f.parent
        out += [parse_record(r, f"{f}: record {i}", root) for i, r in enumerate(raw)]
    if not out:
        raise DataError(f"{key}: no records in {', '.join(map(str, files))}")
    return out


# ------------------------------------------------------------------------------------------ encoding
@dataclass
class Example:
    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX outside the answers
    pixel_values: torch.Tensor  # [patches, C * T * P * P] as Qwen2-VL's image processor gives
    image_grid_thw: torch.Tensor  # [images, 3]
    index: int


class Encoder:
    """Records -> token ids, labels and image tensors for Qwen2.5-VL (the processor's tokenizer and
    image processor; the template is written out so the labelled span is exact)."""

    def __init__(self, processor, cutoff_len: int, min_pixels: int, max_pixels: int):
        self.tok = processor.tokenizer
        self.image_processor = processor.image_processor
        self.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        self.merge = self.image_processor.merge_size ** 2
        self.cutoff_len = cutoff_len
        ids = self.tok.convert_tokens_to_ids
        self.vision_start, self.vision_end = ids("<|vision_start|>"), ids("<|vision_end|>")
        self.image_pad = ids("<|image_pad|>")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else ids("<|endoftext|>")

    def image_tokens(self, width: int, height: int) -> int:
        limits = {"min_pixels": self.size["shortest_edge"], "max_pixels": self.size["longest_edge"]}
        return self.image_processor.get_number_of_image_patches(height, width, limits) // self.merge

    def _text(self, text: str, image_tokens: list[int]) -> list[int]:
        """Token ids of `text` with each <image> expanded (pops from image_tokens)."""
        parts = text.split(IMAGE)
        out = self.tok(parts[0], add_special_tokens=False).input_ids if parts[0] else []
        for part in parts[1:]:
            out += [self.vision_start] + [self.image_pad] * image_tokens.pop(0) + [self.vision_end]
            if part:
                out += self.tok(part, add_special_tokens=False).input_ids
        return out

    def _ids(self, rec: Record, image_tokens: list[int]) -> tuple[list[int], list[int], int]:
        """(ids, labels, prompt length) before the cutoff."""
        pending = list(image_tokens)
        ids: list[int] = []
        labels: list[int] = []
        prompt_len = None
        for k, (user, answer) in enumerate(rec.turns):
            head = f"<|im_start|>system\n{rec.system}<|im_end|>\n" if k == 0 else ""
            prompt = self._text(head + "<|im_start|>user\n", pending) + self._text(user, pending) + \
                self._text("<|im_end|>\n<|im_start|>assistant\n", pending)
            target = self._text(answer, pending) + self._text("<|im_end|>\n", pending)
            ids += prompt
            labels += [IGNORE_INDEX] * len(prompt)
            prompt_len = len(ids) if prompt_len is None else prompt_len
            ids += target
            labels += target
        return ids, labels, prompt_len

    def prompt_length(self, rec: Record, decode: bool = False) -> int:
        """Tokens before the first labelled one, from the image headers; `decode`: also decode
        every image, so that a file cut short behind a valid header fails here, not mid-run."""
        sizes = []
        for p in rec.images:
            try:
                with Image.open(p) as im:
                    if decode:
                        im.load()
                    sizes.append(im.size)
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                raise DataError(f"{rec.where}: cannot read image {p} ({err})") from None
        return self._ids(rec, [self.image_tokens(w, h) for w, h in sizes])[2]

    def check(self, rec: Record) -> None:
        """At start-up, every record of this rank's share: images decoded, prompt within the cutoff."""
        n = self.prompt_length(rec, decode=True)
        if n >= self.cutoff_len:
            raise DataError(f"{rec.where}: the prompt is {n} tokens (images included) but data.cutoff_len is "
                            f"{self.cutoff_len}: raise cutoff_len or lower model.image_max_pixels")

    def encode(self, rec: Record, index: int) -> Example:
        images = []
        for p in rec.images:
            try:
                with Image.open(p) as im:
                    images.append(im.convert("RGB"))
            except (OSError, ValueError) as err:  # e.g. replaced or cut short after the start-up check
                raise DataError(f"{rec.where}: cannot read image {p} ({err})") from None
        out = self.image_processor(images=images, size=self.size, return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        ids, labels, prompt_len = self._ids(rec, [int(t.prod()) // self.merge for t in grid])
        if prompt_len >= self.cutoff_len:
            raise DataError(f"{rec.where}: the prompt is {prompt_len} tokens but data.cutoff_len is {self.cutoff_len}")
        ids, labels = ids[:self.cutoff_len], labels[:self.cutoff_len]
        return Example(torch.tensor(ids), torch.tensor(labels), pixel_values, grid, index)


class SFTDataset(torch.utils.data.Dataset):
    def __init__(self, records: list[Record], encoder: Encoder):
        self.records, self.encoder = records, encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Example:
        return self.encoder.encode(self.records[i], i)

    def first_error(self, indices) -> tuple[int, str] | None:
        """(index, message) of the first record among `indices` whose prompt exceeds the cutoff."""
        for i in indices:
            try:
                self.encoder.check(self.records[i])
            except DataError as err:
                return i, str(err)
        return None


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor  # 1 at image tokens (Qwen2.5-VL's 3D positions need it)
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    indices: list[int]

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw")
        return {k: getattr(self, k).to(device) for k in keys}


class Collator:
    """Right-pads a list of examples into a Batch (pad id, attention 0, label IGNORE_INDEX)."""

    def __init__(self, pad_id: int, image_pad_id: int):
        self.pad_id, self.image_pad_id = pad_id, image_pad_id

    def __call__(self, examples: list[Example]) -> Batch:
        t = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), t), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(examples), t), IGNORE_INDEX, dtype=torch.int64)
        mask = torch.zeros((len(examples), t), dtype=torch.int64)
        for i, e in enumerate(examples):
            n = len(e.input_ids)
            ids[i, :n], labels[i, :n], mask[i, :n] = e.input_ids, e.labels, 1
        return Batch(ids, mask, labels, (ids == self.image_pad_id).long(),
                     torch.cat([e.pixel_values for e in examples]), torch.cat([e.image_grid_thw for e in examples]),
                     [e.index for e in examples])


# ------------------------------------------------------------------------------------------ batch order
def train_batches(n: int, world_size: int, rank: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch: a permutation seeded by (seed, epoch), padded by
    wrapping around to whole global batches (as a DistributedSampler does), dealt out in order.
    A pure function of its arguments, so a resumed run sees the same order."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    step = world_size * batch_size
    total = math.ceil(n / step) * step
    order = (order * math.ceil(total / n))[:total]
    return [order[s + rank * batch_size: s + (rank + 1) * batch_size] for s in range(0, total, step)]


def eval_batches(n: int, world_size: int, rank: int, batch_size: int) -> list[tuple[list[int], list[bool]]]:
    """This rank's eval micro-batches in dataset order, with a flag per entry: False for the
    padding that gives every rank the same number of forwards (ZeRO-3 needs that), not counted."""
    step = world_size * batch_size
    total = max(1, math.ceil(n / step)) * step
    out = []
    for s in range(0, total, step):
        pos = range(s + rank * batch_size, s + (rank + 1) * batch_size)
        out.append(([p % n for p in pos], [p < n for p in pos]))
    return out


# ------------------------------------------------------------------------------------------ synthetic data
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
QUESTION = ('Given two subfigures generated based on the theme: "{theme}", do the two images maintain consistency '
            'in terms of style, logic and identity? Answer "Yes" and "No" first, and then provide detailed reasons.')


def _draw(shape: str, color: str, size: int, rng: np.random.Generator) -> Image.Image:
    im = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(im)
    r = size * rng.uniform(0.22, 0.3)
    cx, cy = size / 2 + rng.uniform(-0.1, 0.1) * size, size / 2 + rng.uniform(-0.1, 0.1) * size
    fill = COLORS[color]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return im


def synthetic_records(n: int, split: str, image_size: int, rng: np.random.Generator, out_dir: Path) -> list[dict]:
    """n pairs, half consistent (same shape and colour, moved a little) and half not."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    records = []
    colors = list(COLORS)
    for i in range(n):
        s1, c1 = SHAPES[rng.integers(len(SHAPES))], colors[rng.integers(len(colors))]
        consistent = i % 2 == 0
        s2, c2 = s1, c1
        if not consistent:
            change = rng.integers(3)  # the colour, the shape, or both
            if change != 1:
                c2 = colors[(colors.index(c1) + 1 + rng.integers(len(colors) - 1)) % len(colors)]
            if change != 0:
                s2 = SHAPES[(SHAPES.index(s1) + 1 + rng.integers(len(SHAPES) - 1)) % len(SHAPES)]
        names = [f"images/{split}_{i:04d}_{k}.png" for k in "ab"]
        _draw(s1, c1, image_size, rng).save(out_dir / names[0])
        _draw(s2, c2, image_size, rng).save(out_dir / names[1])
        answer = (f"Yes. Both images show a {c1} {s1} in the same flat style." if consistent else
                  f"No. The first image shows a {c1} {s1}, but the second shows a {c2} {s2}.")
        records.append({"messages": [{"role": "user", "content": IMAGE * 2 + QUESTION.format(theme=f"a {c1} {s1}")},
                                     {"role": "assistant", "content": answer}],
                        "images": names})
    return records


def write_synthetic_dataset(out_dir: Path, num_train: int, num_eval: int, image_size: int,
                            seed: int = 0) -> tuple[Path, Path]:
    """train.json and eval.json (sharegpt records, relative image paths) and their PNGs under out_dir."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    paths = []
    for split, n in (("train", num_train), ("eval", num_eval)):
        path = out_dir / f"{split}.json"
        path.write_text(json.dumps(synthetic_records(n, split, image_size, rng, out_dir), indent=1))
        paths.append(path)
    return paths[0], paths[1]
