"""Image helpers, on the ground floor (this module imports nothing from paco_ds): `to_pil` turns
decoded tensors into PIL images, `make_grid` tiles images for logs and reports, and the T2IS
grid helpers below cut a grid image into its panels.

T2IS grids: the model draws the whole grid as one image; rewards look at its panels.
`grid_shape` reads the layout (the item's `layout` field, else the first "RxC" in the prompt),
`split_panels` crops row-major, `split_prompt` separates the global description from the per-panel
prompts at markers such as ". [TOP]-[LEFT]:" or ". PANEL-2:" (PaCo-RL/PaCo-GRPO/paco_grpo/utils.py:
divide_prompt, extract_grid_info).
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np
from PIL import Image

_LAYOUT = re.compile(r"(\d+)\s*[x⨉×]\s*(\d+)")
_PANEL_SEP = re.compile(r'[."]\s+[A-Z0-9\-\[\]]+:')


def grid_shape(prompt: str, metadata: dict | None = None) -> tuple[int, int]:
    """(rows, cols); (1, 1) when neither the metadata nor the prompt names a layout."""
    for text in ((metadata or {}).get("layout"), prompt):
        if isinstance(text, str):
            m = _LAYOUT.search(text)
            if m:
                return int(m.group(1)), int(m.group(2))
    return 1, 1


def split_panels(image: Image.Image, rows: int, cols: int) -> list[Image.Image]:
    w, h = image.size
    ph, pw = h // rows, w // cols
    return [image.crop((c * pw, r * ph, (c + 1) * pw, (r + 1) * ph)) for r in range(rows) for c in range(cols)]


def split_prompt(prompt: str) -> list[str]:
    """[global description, panel 1 prompt, panel 2 prompt, ...], each ending with a period."""
    parts, last = [], 0
    for m in _PANEL_SEP.finditer(prompt):
        parts.append(prompt[last:m.start() + 1])  # keep the '.' or '"' that ends the part
        last = m.end()
    parts.append(prompt[last:])
    out = []
    for p in parts:
        p = p.strip()
        if p and not p.endswith((".", '"')):
            p += "."
        out.append(p)
    return out


def to_pil(images) -> list[Image.Image]:
    """uint8 [B,3,H,W] tensor/array (or PIL list) -> list of RGB PIL images."""
    if isinstance(images, (list, tuple)) and (not images or isinstance(images[0], Image.Image)):
        return list(images)
    arr = images.cpu().numpy() if hasattr(images, "cpu") else np.asarray(images)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0, 1) * 255).round().astype(np.uint8)
    return [Image.fromarray(a.transpose(1, 2, 0)) for a in arr]


def make_grid(images: Sequence[Image.Image], ncols: int | None = None, pad: int = 2,
              captions: Sequence[str] | None = None) -> Image.Image:
    """Tile images (possibly of different sizes) into one picture for logs and reports."""
    if not images:
        raise ValueError("no images to tile")
    n = len(images)
    ncols = ncols or math.ceil(math.sqrt(n))
    nrows = math.ceil(n / ncols)
    cw = max(im.size[0] for im in images)
    ch = max(im.size[1] for im in images)
    text_h = 12 if captions else 0
    canvas = Image.new("RGB", (ncols * (cw + pad) + pad, nrows * (ch + pad + text_h) + pad), "white")
    if captions:
        from PIL import ImageDraw
        draw = ImageDraw.Draw(canvas)
    for i, im in enumerate(images):
        r, c = divmod(i, ncols)
        x, y = pad + c * (cw + pad), pad + r * (ch + pad + text_h)
        canvas.paste(im.convert("RGB"), (x, y))
        if captions:
            draw.text((x, y + ch), str(captions[i])[: max(4, cw // 6)], fill="black")
    return canvas
