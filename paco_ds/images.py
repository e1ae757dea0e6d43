"""Image helpers, on the ground floor (this module imports nothing from paco_ds): `to_pil` turns
decoded tensors into PIL images, `make_grid` tiles images for logs and reports, and the T2IS
grid helpers below cut a grid image into its panels.

Videos: a video family decodes uint8 [B, F, 3, H, W]; `to_media` gives each sample as a list of PIL
frames (what a reward receives for a video), `make_video_grid` tiles videos frame by frame and
`save_animation` writes frames as an animated WebP, which browsers play in an <img> (Pillow writes it:
no video encoder needed).

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


def is_video(media) -> bool:
    """Whether `media` holds videos: a uint8 [B, F, 3, H, W] tensor/array, or one list of frames per sample."""
    if isinstance(media, (list, tuple)):
        return bool(media) and isinstance(media[0], (list, tuple))
    return getattr(media, "ndim", 0) == 5


def to_media(images) -> list:
    """Images (as `to_pil` takes them) -> a list of PIL images; videos ([B, F, 3, H, W], or lists of
    frames) -> a list per sample of its PIL frames."""
    if not is_video(images):
        return to_pil(images)
    if isinstance(images, (list, tuple)):
        return [to_pil(list(frames)) if isinstance(frames[0], Image.Image) else to_pil(frames) for frames in images]
    return [to_pil(video) for video in images]


def make_video_grid(videos: Sequence[Sequence[Image.Image]], ncols: int | None = None, pad: int = 2,
                    captions: Sequence[str] | None = None) -> list[Image.Image]:
    """Tile videos frame by frame (`make_grid` of every video's f-th frame): the frames of one
    animated grid. A shorter video holds its last frame."""
    if not videos:
        raise ValueError("no videos to tile")
    length = max(len(v) for v in videos)
    return [make_grid([v[min(f, len(v) - 1)] for v in videos], ncols, pad, captions) for f in range(length)]


FPS = 8  # frames per second of the written animations (Wan's videos are 16 fps; slower reads better in a report)


def save_animation(frames: Sequence[Image.Image], path, fps: int = FPS) -> None:
    """An animated WebP of `frames` that loops (lossy at quality 90: a 16-frame 512 x 512 grid stays
    small enough to embed in the report page)."""
    first, *rest = [f.convert("RGB") for f in frames]
    first.save(path, format="WEBP", save_all=True, append_images=rest, duration=round(1000 / fps), loop=0,
               quality=90)


def save_media(media: "Image.Image | Sequence[Image.Image]", stem) -> "object":
    """An image as `stem`.png, a video's frames as `stem`.webp (save_animation); the path written."""
    from pathlib import Path

    stem = Path(stem)
    if isinstance(media, Image.Image):
        path = stem.with_name(stem.name + ".png")
        media.save(path)
    else:
        path = stem.with_name(stem.name + ".webp")
        save_animation(media, path)
    return path


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
