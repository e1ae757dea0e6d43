"""Editing data (data.format: edit): the three layouts, grouping by (instruction, image content),
one-line errors naming file:line or row, and read_reference as the trainer calls it."""
import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, run_cli
from paco_ds.data import PromptItem, load_prompts, read_reference, read_references
from paco_ds.data.edit import clear_reference_cache, reference_cache_stats, set_reference_cache_size
from paco_ds.errors import DataError, exit_on_user_error

pytestmark = pytest.mark.fast

TINY = REPO / "paco_ds/data/prompts/tiny_edit"


def _png(w=40, h=24, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    im = Image.new("RGB", (w, h), color)
    im.putpixel((1, 2), (1, 2, 3))
    im.save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_reference_cache()
    yield
    clear_reference_cache()


# ------------------------------------------------------------------------------ the shipped tiny set
def test_tiny_edit_set_general_editing_layout():
    train = load_prompts(TINY / "train_metadata.jsonl", "edit", "data.train_file")
    test = load_prompts(TINY / "test_metadata.jsonl", "edit", "data.test_file")
    assert 6 <= len(train) <= 8 and 3 <= len(test) <= 4
    sizes = set()
    for it in train + test:
        ref = read_reference(it)
        assert ref.dtype == torch.uint8 and ref.shape[0] == 3
        with Image.open(it.image) as im:
            assert tuple(ref.shape[1:]) == (im.height, im.width)  # original size
            assert np.array_equal(ref.permute(1, 2, 0).numpy(), np.asarray(im.convert("RGB")))
        sizes.add(tuple(ref.shape[1:]))
        assert it.where.startswith(str(TINY)) and it.where.rsplit(":", 1)[1].isdigit()
        assert 100 < (TINY / it.metadata["image"]).stat().st_size < 8192
    assert {(64, 96), (96, 64), (80, 80)} <= sizes  # non-square both ways
    # One instruction on two different images: two items, two groups.
    same = [it for it in train if it.prompt == "make the circle blue"]
    assert len(same) == 2 and same[0].image_digest != same[1].image_digest
    assert len({it.group_key for it in train}) == len(train)


def test_tiny_edit_set_is_what_the_generator_draws(tmp_path):
    from paco_ds.data import make_tiny_edit

    make_tiny_edit.write(tmp_path)
    for name in ("train_metadata", "test_metadata", "train_multi", "test_multi"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (TINY / f"{name}.jsonl").read_text()
    shipped = sorted(p.name for p in (TINY / "images").glob("*.png"))
    assert shipped == sorted(p.name for p in (tmp_path / "images").glob("*.png"))
    for name in shipped:  # pixels, not bytes: zlib builds may differ
        assert np.array_equal(np.asarray(Image.open(tmp_path / "images" / name)),
                              np.asarray(Image.open(TINY / "images" / name))), name


def test_tiny_edit_files_are_package_data(tmp_path):
    """A build of the package carries every data file (tiny prompts, editing set, tiny model
    configs), and setuptools warns about no data folder it would ignore."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "build"),
                          "egg_info", "-e", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "would be ignored" not in out.stdout + out.stderr, out.stderr[-2000:]
    data = {p.relative_to(REPO).as_posix() for folder in ("paco_ds/data/prompts", "paco_ds/models/tiny/configs")
            for p in (REPO / folder).rglob("*") if p.suffix in (".jsonl", ".json", ".png")}
    built = {p.relative_to(tmp_path / "build").as_posix() for p in (tmp_path / "build").rglob("*")
             if p.suffix in (".jsonl", ".json", ".png")}
    assert any(d.startswith("paco_ds/data/prompts/tiny_edit/images/") for d in data)
    assert data <= built, sorted(data - built)


# ------------------------------------------------------------------------------ grouping
def test_duplicates_of_prompt_and_image_bytes_merge_but_other_images_stay_apart(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    (tmp_path / "copy_of_a.png").write_bytes(_png())  # same bytes, another file
    (tmp_path / "b.png").write_bytes(_png(color=(0, 0, 255)))
    f = _jsonl(tmp_path / "train_metadata.jsonl", [
        {"prompt": "make it blue", "image": "a.png"},
        {"prompt": "make it blue", "image": "copy_of_a.png"},  # merged into line 1
        {"prompt": "make it blue", "image": "b.png"},
        {"prompt": "make it green", "image": "a.png"},
    ])
    items = load_prompts(f, "edit")
    assert [(it.prompt, it.where.rsplit(":", 1)[1]) for it in items] == [
        ("make it blue", "1"), ("make it blue", "3"), ("make it green", "4")]


# ------------------------------------------------------------------------------ Flow-Factory jsonl
def test_flow_factory_layout_images_dir_lists_and_negative_prompt(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "x.png").write_bytes(_png(30, 20))
    (tmp_path / "y.png").write_bytes(_png(20, 30, (0, 255, 0)))
    f = _jsonl(tmp_path / "train.jsonl", [
        {"prompt": "add a hat", "image": "x.png", "negative_prompt": "blurry"},
        {"prompt": "add a hat", "image": ["y.png"]},  # not under images/: the folder
        {"prompt": "remove it", "images": ["x.png"]},
    ])
    items = load_prompts(f, "edit")
    assert [it.image for it in items] == [str((tmp_path / "images/x.png").resolve()),
                                           str((tmp_path / "y.png").resolve()), str((tmp_path / "images/x.png").resolve())]
    assert items[0].metadata["negative_prompt"] == "blurry"
    assert tuple(read_reference(items[1]).shape) == (3, 30, 20)


def test_several_input_images_per_record(tmp_path):
    """A list of paths is a multi-image edit: the first is `image`, the rest `extra_images`, in order;
    the group is (instruction, every image's content in order); a one-element list is one image."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(_png(30, 20))
    (tmp_path / "images" / "b.png").write_bytes(_png(20, 30, (0, 0, 255)))
    (tmp_path / "images" / "copy_of_a.png").write_bytes(_png(30, 20))
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "put picture 1 into picture 2", "image": ["a.png", "b.png"]},
                                         {"prompt": "put picture 1 into picture 2", "images": ["b.png", "a.png"]},
                                         {"prompt": "put picture 1 into picture 2", "images": ["copy_of_a.png", "b.png"]},
                                         {"prompt": "p", "image": ["a.png"]}])
    items = load_prompts(f, "edit")
    assert [it.where.rsplit(":", 1)[1] for it in items] == ["1", "2", "4"]  # line 3 repeats line 1's contents
    first, swapped, single = items
    images = tmp_path / "images"
    assert (first.image, first.extra_images) == (str((images / "a.png").resolve()), (str((images / "b.png").resolve()),))
    assert first.group_key != swapped.group_key  # the order is part of the edit
    from paco_ds.data.edit import image_md5

    assert single.extra_images == () and single.image_digest == image_md5(_png(30, 20))  # the one-image key
    assert [tuple(t.shape) for t in read_references(first)] == [(3, 20, 30), (3, 30, 20)]
    assert [tuple(t.shape) for t in read_references(swapped)] == [(3, 30, 20), (3, 20, 30)]
    assert torch.equal(read_reference(first), read_references(first)[0])
    assert [tuple(t.shape) for t in read_references(single)] == [(3, 20, 30)]


def test_tiny_multi_image_set_has_two_inputs_per_item():
    train = load_prompts(TINY / "train_multi.jsonl", "edit", "data.train_file")
    test = load_prompts(TINY / "test_multi.jsonl", "edit", "data.test_file")
    assert len(train) == 4 and len(test) == 2
    for it in train + test:
        refs = read_references(it)
        assert len(refs) == 2 and all(r.dtype == torch.uint8 and r.shape[0] == 3 for r in refs)
        assert "picture 1" in it.prompt and "picture 2" in it.prompt
        assert it.where.startswith(str(TINY / "t")) and it.where.rsplit(":", 1)[1].isdigit()
    assert len({it.group_key for it in train}) == len(train)
    assert len({tuple(read_references(it)[0].shape[1:]) for it in train}) > 1  # inputs of several shapes


def test_multi_image_data_for_a_single_image_family_is_one_line():
    """Two input images per record and a family that reads one: refused before anything starts,
    naming the record; the multi-image family takes the same file."""
    from conftest import one_line_error

    multi = TINY / "train_multi.jsonl"
    line = one_line_error(run_cli("launch/train.py", "--config", "configs/tiny/qwen_edit.yaml", "--dry-run",
                                  "--set", f"data.train_file={multi}"))
    assert f"{multi}:1: 2 input images, and model.family 'qwen_image_edit' conditions on at most 1" in line
    ok = run_cli("launch/train.py", "--config", "configs/tiny/qwen_edit.yaml", "--dry-run", "--set",
                 f"data.train_file={multi}", "--set", "model.family=qwen_image_edit_plus")
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_eval_grid_puts_each_edits_inputs_before_it_in_one_row():
    from paco_ds.grpo.evaluation import eval_grid

    a, b, out = (Image.new("RGB", (10, 10), c) for c in ("red", "blue", "green"))
    two = eval_grid([(0, [a, b], out), (1, [a], out)])  # an edit of two inputs, one of one
    assert two.size == (3 * 12 + 2, 2 * 12 + 2)  # three columns (a blank where the second has no input 2)
    assert two.getpixel((2 + 2 * 12, 2 + 12)) == (0, 128, 0)  # row 2's edit in the third column
    assert two.getpixel((2 + 12, 2 + 12)) == (255, 255, 255)
    assert eval_grid([(0, [a], out)]).size == (2 * 12 + 2, 12 + 2)
    assert eval_grid([(0, [], out), (1, [], out)]).size == (2 * 12 + 2, 12 + 2)  # text-to-image: a square grid


@pytest.mark.parametrize("row,msg", [
    ({"prompt": "p", "image": "missing.png"}, r":1: image not found: .*missing\.png$"),
    ({"prompt": "p"}, r":1: missing 'image'"),
    ({"prompt": "", "image": "a.png"}, r":1: missing or empty 'prompt'"),
    ({"prompt": "p", "image": 3}, r":1: 'image' must be a path"),
    ({"prompt": "p", "images": ["a.png", 3]}, r":1: 'images'\[1\] must be a path"),
    ({"prompt": "p", "images": ["a.png", "gone.png"]}, r":1: image not found: .*gone\.png$"),
    ({"prompt": "p", "image": "a.png", "negative_prompt": 1}, r":1: 'negative_prompt' must be a string"),
    ('{"prompt": "p", ', r":1: malformed JSON"),
])
def test_jsonl_errors_name_the_line(tmp_path, row, msg):
    (tmp_path / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "train_metadata.jsonl", [row])
    with pytest.raises(DataError, match=msg) as err:
        load_prompts(f, "edit")
    assert str(err.value).startswith(str(f)) and "\n" not in str(err.value)


def test_reference_layout_ref_image_key_is_read(tmp_path):
    """The reference's ShareGPT-4o-Image preprocessing writes `ref_image`
    (PaCo-RL/PaCo-GRPO/dataset/ShareGPT-4o-Image/preprocess.py)."""
    (tmp_path / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "test_metadata.jsonl", [{"prompt": "p", "ref_image": "a.png"}])
    assert load_prompts(f, "edit")[0].image == str((tmp_path / "a.png").resolve())


def test_missing_image_exits_2_with_one_line_from_the_trainer(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "p", "image": "a.png"},
                                                  {"prompt": "q", "image": "gone.png"}])
    out = run_cli("launch/train.py", "--config", "configs/tiny/t2is.yaml", "--dry-run",
                  "--set", "data.format=edit", "--set", f"data.train_file={f}", "--set", "data.test_file=null")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(f"train: error: {f}:2: image not found:"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------------------ parquet / arrow
def _table(rows):
    import pyarrow as pa

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table({"prompt": pa.array([r[0] for r in rows], pa.string()),
                     "image": pa.array([r[1] for r in rows], image_type),
                     "instruction_language": pa.array(["en"] * len(rows))})


def test_parquet_and_arrow_layouts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = _png(40, 24), _png(24, 40, (0, 0, 200))
    rows = [("make it blue", {"bytes": a, "path": None}), ("make it blue", {"bytes": b, "path": None}),
            ("make it blue", {"bytes": a, "path": "dup.png"})]  # same bytes as row 0: merged
    table = _table(rows)
    pq.write_table(table, tmp_path / "train.parquet")
    with pa.OSFile(str(tmp_path / "train.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)  # what `datasets` writes
    for name in ("train.parquet", "train.arrow", "stream.arrow"):
        items = load_prompts(tmp_path / name, "edit")
        assert [it.where for it in items] == [f"{tmp_path / name} row 0", f"{tmp_path / name} row 1"]
        assert items[0].image == a and items[0].metadata == {"prompt": "make it blue", "instruction_language": "en"}
        assert tuple(read_reference(items[0]).shape) == (3, 24, 40)
        assert tuple(read_reference(items[1]).shape) == (3, 40, 24)


def test_undecodable_bytes_fail_when_read_naming_the_row(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(_table([("p", {"bytes": _png(), "path": None}), ("q", {"bytes": b"not an image", "path": None})]),
                   tmp_path / "train.parquet")
    items = load_prompts(tmp_path / "train.parquet", "edit")  # bytes are checked when read
    read_reference(items[0])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'train.parquet'} row 1: cannot decode the reference image"):
        read_reference(items[1])


def test_table_without_image_bytes_or_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(_table([("p", {"bytes": None, "path": None})]), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet row 0: no image bytes"):
        load_prompts(tmp_path / "a.parquet", "edit")
    pq.write_table(pa.table({"instruction": ["p"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no column 'prompt' or 'image'"):
        load_prompts(tmp_path / "b.parquet", "edit")
    (tmp_path / "c.parquet").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"c\.parquet: cannot read as parquet"):
        load_prompts(tmp_path / "c.parquet", "edit")


# ------------------------------------------------------------------------------ read_reference
def test_read_reference_rgb_from_other_modes_and_an_lru_cache(tmp_path):
    rgba = Image.new("RGBA", (12, 8), (10, 20, 30, 128))
    rgba.save(tmp_path / "a.png")
    Image.new("L", (8, 12), 77).save(tmp_path / "b.png")
    f = _jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "p", "image": "a.png"}, {"prompt": "p", "image": "b.png"}])
    a, b = load_prompts(f, "edit")
    ra = read_reference(a)
    assert ra.shape == (3, 8, 12) and ra[:, 0, 0].tolist() == [10, 20, 30]
    assert read_reference(b).shape == (3, 12, 8) and read_reference(b)[:, 0, 0].tolist() == [77, 77, 77]
    ra[:] = 0  # the caller's copy
    assert read_reference(a)[:, 0, 0].tolist() == [10, 20, 30]
    stats = reference_cache_stats()
    assert stats["misses"] == 2 and stats["hits"] == 2
    set_reference_cache_size(1)
    try:
        assert reference_cache_stats()["size"] == 1  # the least recently used (b) went
        read_reference(a)
        read_reference(b)
        assert reference_cache_stats()["misses"] == 3 and reference_cache_stats()["hits"] == 3
    finally:
        set_reference_cache_size(64)


def test_read_reference_errors_are_one_line(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "p", "image": "a.png"}])
    (item,) = load_prompts(f, "edit")
    (tmp_path / "a.png").unlink()  # deleted after load
    with pytest.raises(DataError, match=rf"^{f}:1: image not found: "):
        read_reference(item)
    with pytest.raises(DataError, match="has no reference image"):
        read_reference(PromptItem(prompt="a T2IS prompt", where="x.jsonl:3"))
    with pytest.raises(SystemExit) as code, exit_on_user_error("train"):
        read_reference(item)
    assert code.value.code == 2


def test_other_formats_and_suffixes(tmp_path):
    with pytest.raises(DataError, match="reads .jsonl, .parquet or .arrow"):
        (tmp_path / "x.txt").write_text("p\n")
        load_prompts(tmp_path / "x.txt", "edit")
    items = load_prompts(REPO / "paco_ds/data/prompts/tiny_t2is_train.jsonl", "t2is")
    assert items[0].image is None and items[0].where.endswith("tiny_t2is_train.jsonl:1")
    from paco_ds.recipe.schema import DataConfig

    assert DataConfig(format="edit", train_file="x").format == "edit"


def test_absolute_paths_and_copied_sets(tmp_path):
    shutil.copytree(TINY, tmp_path / "set")
    items = load_prompts(tmp_path / "set" / "train_metadata.jsonl", "edit")
    assert all(it.image.startswith(str((tmp_path / "set").resolve())) for it in items)
    f = _jsonl(tmp_path / "abs_metadata.jsonl", [{"prompt": "p", "image": items[0].image}])
    assert load_prompts(f, "edit")[0].image_digest == items[0].image_digest
