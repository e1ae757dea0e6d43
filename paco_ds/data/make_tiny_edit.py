"""Writes the tiny image-editing set (general_editing layout) that tests and tiny recipes read:
`paco_ds/data/prompts/tiny_edit/{train,test}_metadata.jsonl` and `images/*.png`, and beside them
the multi-image set `{train,test}_multi.jsonl` (Flow-Factory layout: an `images` list per record,
two input images each, paths under `images/`), whose instructions name the inputs "picture 1" and
"picture 2" as Qwen-Image-Edit-2509/2511 number them. Both sets draw on the same images.

The images are simple shapes drawn with PIL on non-square and square canvases; the output is
deterministic, so re-running this script reproduces the committed files:

    python -m paco_ds.data.make_tiny_edit [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent / "prompts" / "tiny_edit"


def _canvas(w: int, h: int, bg) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    im = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(im)
    for y in range(h):  # a soft vertical shading, so the background is not a flat colour
        k = 0.92 + 0.08 * y / max(1, h - 1)
        draw.line([(0, y), (w, y)], fill=tuple(int(c * k) for c in bg))
    return im, draw


def _star(cx: float, cy: float, r: float, n: int = 5) -> list[tuple[float, float]]:
    import math

    pts = []
    for i in range(2 * n):
        rad = r if i % 2 == 0 else r * 0.45
        a = math.pi / n * i - math.pi / 2
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def _images() -> dict[str, Image.Image]:
    out = {}
    im, d = _canvas(96, 64, (235, 235, 225))  # landscape
    d.ellipse([30, 14, 66, 50], fill=(210, 40, 40), outline=(90, 20, 20), width=2)
    out["red_circle_96x64"] = im

    im, d = _canvas(80, 80, (150, 150, 160))  # square, another red circle on grey
    d.ellipse([12, 20, 52, 60], fill=(200, 30, 60), outline=(40, 40, 40), width=2)
    d.rectangle([58, 58, 74, 74], fill=(60, 60, 70))
    out["red_circle_on_grey_80x80"] = im

    im, d = _canvas(64, 96, (245, 240, 230))  # portrait
    d.rectangle([14, 30, 50, 66], fill=(40, 80, 200), outline=(10, 20, 60), width=2)
    out["blue_square_64x96"] = im

    im, d = _canvas(80, 80, (200, 230, 250))
    d.polygon([(40, 14), (68, 64), (12, 64)], fill=(40, 160, 60), outline=(20, 70, 30))
    d.rectangle([0, 66, 79, 79], fill=(120, 90, 60))
    out["green_triangle_80x80"] = im

    im, d = _canvas(96, 64, (250, 250, 250))
    d.polygon([(20, 12), (40, 50), (4, 50)], fill=(230, 160, 20))
    d.ellipse([54, 14, 88, 48], fill=(120, 40, 160))
    out["triangle_and_circle_96x64"] = im

    im, d = _canvas(80, 80, (255, 255, 255))
    for i, y in enumerate(range(0, 80, 16)):
        d.rectangle([0, y, 79, y + 7], fill=(30, 30, 30) if i % 2 == 0 else (220, 60, 40))
    out["horizontal_stripes_80x80"] = im

    im, d = _canvas(64, 96, (20, 30, 70))
    d.polygon(_star(32, 40, 22), fill=(250, 220, 60))
    d.ellipse([22, 72, 42, 92], fill=(230, 230, 230))
    out["star_at_night_64x96"] = im

    im, d = _canvas(96, 64, (230, 250, 230))
    d.ellipse([10, 14, 46, 50], fill=(150, 60, 200))
    d.rectangle([56, 18, 84, 46], fill=(240, 240, 240), outline=(0, 0, 0))
    out["purple_circle_white_square_96x64"] = im
    return out


TRAIN = [
    ("make the circle blue", "red_circle_96x64"),
    ("make the circle blue", "red_circle_on_grey_80x80"),  # one instruction, two images: two groups
    ("turn the square into a circle", "blue_square_64x96"),
    ("add a small yellow sun in the top left corner", "green_triangle_80x80"),
    ("remove the triangle", "triangle_and_circle_96x64"),
    ("make the stripes vertical", "horizontal_stripes_80x80"),
    ("change the background to a daytime sky", "star_at_night_64x96"),
]
TEST = [
    ("make the circle green", "purple_circle_white_square_96x64"),
    ("make the square yellow", "blue_square_64x96"),
    ("replace the star with a crescent moon", "star_at_night_64x96"),
]

# Multi-image edits: two input images per item, the instruction numbering them in list order. The
# inputs have different shapes; the last one sets the output's aspect ratio (as in diffusers'
# QwenImageEditPlusPipeline).
TRAIN_MULTI = [
    ("put the circle of picture 1 into the scene of picture 2", ("red_circle_96x64", "green_triangle_80x80")),
    ("paint the square of picture 1 with the stripes of picture 2", ("blue_square_64x96", "horizontal_stripes_80x80")),
    ("place the star of picture 1 beside the shapes of picture 2", ("star_at_night_64x96", "triangle_and_circle_96x64")),
    ("give the circle of picture 2 the night sky of picture 1", ("star_at_night_64x96", "red_circle_on_grey_80x80")),
]
TEST_MULTI = [
    ("move the shapes of picture 1 onto the grass of picture 2", ("purple_circle_white_square_96x64",
                                                                  "green_triangle_80x80")),
    ("show the circle of picture 1 and the square of picture 2 side by side", ("red_circle_96x64",
                                                                               "blue_square_64x96")),
]


def write(out: Path = OUT) -> list[Path]:
    """Write the images and both metadata files under `out`; returns the written paths."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    written = []
    for name, im in _images().items():
        p = out / "images" / f"{name}.png"
        im.save(p, format="PNG", optimize=True)
        written.append(p)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        p = out / f"{split}_metadata.jsonl"
        p.write_text("".join(json.dumps({"prompt": prompt, "image": f"images/{name}.png"}) + "\n"
                             for prompt, name in rows))
        written.append(p)
    for split, rows in (("train", TRAIN_MULTI), ("test", TEST_MULTI)):
        p = out / f"{split}_multi.jsonl"
        p.write_text("".join(json.dumps({"prompt": prompt, "images": [f"{name}.png" for name in names]}) + "\n"
                             for prompt, names in rows))
        written.append(p)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    for p in write(args.out):
        print(f"{p}  {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
