"""T2IS grid splitting on every layout present in the data, and prompt splitting on real prompts."""
import json

import numpy as np
import pytest
from PIL import Image

from conftest import SHARED_DATA, shared_file
from paco_ds.images import grid_shape, make_grid, split_panels, split_prompt

pytestmark = pytest.mark.fast


def _real_items():
    items = []
    for f in ("half/train_metadata.jsonl", "half/test_metadata.jsonl", "half_2by2_small_train/train_metadata.jsonl"):
        path = shared_file("t2is", *f.split("/"))
        items += [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return items


def _one_per_layout():
    if not SHARED_DATA.exists():
        return []
    seen = {}
    for it in _real_items():
        seen.setdefault(it["layout"], it)
    return sorted(seen.values(), key=lambda it: it["layout"])


def test_data_has_the_expected_layouts():
    layouts = {it["layout"] for it in _real_items()}
    assert {"1x2", "1x3", "1x5", "1x7", "2x2", "2x3", "2x4"} <= layouts


@pytest.mark.parametrize("item", _one_per_layout(), ids=lambda it: it["layout"])
def test_split_panels_on_each_real_layout(item):
    rows, cols = grid_shape(item["prompt"], item)
    assert f"{rows}x{cols}" == item["layout"] and grid_shape(item["prompt"]) == (rows, cols)
    h, w = item["height"] // 8, item["width"] // 8  # same aspect, smaller canvas
    canvas = np.zeros((h, w, 3), dtype=np.uint8)
    ph, pw = h // rows, w // cols
    for r in range(rows):
        for c in range(cols):
            canvas[r * ph:(r + 1) * ph, c * pw:(c + 1) * pw] = (r * cols + c) * 20 + 10
    panels = split_panels(Image.fromarray(canvas), rows, cols)
    assert len(panels) == rows * cols
    for i, p in enumerate(panels):  # row-major, each panel exactly its own cell
        a = np.asarray(p)
        assert a.shape == (ph, pw, 3) and (a == i * 20 + 10).all()


def test_split_prompt_on_all_real_prompts():
    for it in _real_items():
        rows, cols = grid_shape(it["prompt"], it)
        parts = split_prompt(it["prompt"])
        assert len(parts) == 1 + rows * cols, it["idx"]
        assert "grid layout" in parts[0]
        assert all(p.endswith((".", '"')) and not p.startswith(("[", "PANEL")) for p in parts)
        # nothing is lost but the panel markers
        assert sum(len(p) for p in parts) <= len(it["prompt"]) + len(parts)


def test_split_prompt_markers():
    p = 'TWO-PANEL Images with a 1x2 grid layout of a cat.Shared style. [LEFT]:A cat sleeps. [RIGHT]:A cat "jumps" high'
    assert split_prompt(p) == ["TWO-PANEL Images with a 1x2 grid layout of a cat.Shared style.", "A cat sleeps.",
                               'A cat "jumps" high.']
    assert split_prompt("A plain prompt without panels") == ["A plain prompt without panels."]
    assert grid_shape("no layout here") == (1, 1)
    assert grid_shape("x", {"layout": "2x3"}) == (2, 3)


def test_make_grid_tiles_mixed_sizes():
    ims = [Image.new("RGB", (8, 6), "red"), Image.new("RGB", (4, 4), "blue"), Image.new("RGB", (8, 6), "green")]
    g = make_grid(ims, ncols=2, pad=1)
    assert g.size == (2 * 9 + 1, 2 * 7 + 1)
    assert g.getpixel((1, 1)) == (255, 0, 0) and g.getpixel((10, 1)) == (0, 0, 255) and g.getpixel((1, 8)) == (0, 128, 0)
