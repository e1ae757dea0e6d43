"""Prompt files and the k-repeat sampler."""
import json
from collections import Counter

import pytest

from conftest import REPO, shared_file
from paco_ds.data import KRepeatSampler, load_prompts, load_t2is_jsonl, load_text_prompts
from paco_ds.errors import DataError

pytestmark = pytest.mark.fast

TINY_TRAIN = REPO / "paco_ds" / "data" / "prompts" / "tiny_t2is_train.jsonl"


def test_shipped_t2is_file_loads_with_all_fields():
    items = load_t2is_jsonl(TINY_TRAIN)
    assert len(items) == 8
    for it in items:
        assert it.metadata["layout"] == "2x2" and set(it.metadata["criteria"]) == {"Identity", "Style", "Logic"}
        assert it.height is None and it.size(64) == (64, 64)  # no per-item size: the fallback applies


@pytest.mark.parametrize("split", ["half_2by2_small_train/train_metadata.jsonl", "half/train_metadata.jsonl",
                                   "half/test_metadata.jsonl"])
def test_real_t2is_files_load(split):
    path = shared_file("t2is", *split.split("/"))
    items = load_t2is_jsonl(path)
    assert len(items) == sum(1 for line in path.read_text().splitlines() if line.strip())
    fields = {"idx", "prompt", "height", "width", "layout", "theme", "category", "task_name", "criteria", "from",
              "original_idx", "editing_prompts"}
    assert all(fields <= set(it.metadata) for it in items)
    # per-item height/width override the resolution fallback
    for it in items:
        assert it.size(7) == (it.metadata["height"], it.metadata["width"])


def test_real_pickscore_text_prompts_load():
    path = shared_file("pickscore", "test.txt")
    items = load_text_prompts(path)
    assert len(items) == len([l for l in path.read_text().splitlines() if l.strip()])
    assert all(it.prompt == it.prompt.strip() and it.metadata == {} for it in items)


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "x", "height": -4}', "'height' must be a positive integer"),
    ('{"height": 512}', "missing or empty 'prompt'"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "x", "criteria": "all"}', "'criteria' must be an object"),
    ('{"prompt": "x",', "malformed JSON"),
])
def test_bad_records_name_file_and_line(tmp_path, line, msg):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(DataError) as err:
        load_t2is_jsonl(f)
    assert f"{f}:3:" in str(err.value) and msg in str(err.value)


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(DataError, match="config key 'data.test_file': dataset file not found"):
        load_prompts(tmp_path / "none.jsonl", "t2is", "data.test_file")


@pytest.mark.parametrize("world, bs, k, m", [(1, 1, 4, 3), (2, 1, 4, 2), (4, 2, 16, 6), (3, 1, 6, 5), (8, 1, 16, 42)])
def test_sampler_every_prompt_k_times_ranks_disjoint(world, bs, k, m):
    n = 50
    samplers = [KRepeatSampler(n, k, m, world, r, bs, seed=7) for r in range(world)]
    for epoch in (0, 1):
        positions, indices = [], []
        for s in samplers:
            batches = s.rank_batches(epoch)
            assert len(batches) == len(s) == m * k // (world * bs)
            for b in batches:
                assert len(b.indices) == bs
                positions += b.positions
                indices += b.indices
        assert sorted(positions) == list(range(m * k))  # ranks disjoint, nothing lost
        counts = Counter(indices)
        assert len(counts) == m and set(counts.values()) == {k}
        # every rank derives the same plan, so group ids agree everywhere
        plan = samplers[0].epoch_plan(epoch).tolist()
        assert all(s.epoch_plan(epoch).tolist() == plan for s in samplers)
        assert [plan[p] for p in positions] == indices


def test_sampler_is_deterministic_per_seed_and_epoch():
    a = KRepeatSampler(30, 4, 5, 2, 0, 1, seed=1)
    b = KRepeatSampler(30, 4, 5, 2, 0, 1, seed=1)
    c = KRepeatSampler(30, 4, 5, 2, 0, 1, seed=2)
    assert a.rank_batches(3) == b.rank_batches(3)
    assert a.epoch_plan(3).tolist() != a.epoch_plan(4).tolist()
    assert a.epoch_plan(3).tolist() != c.epoch_plan(3).tolist()
