"""Reward-SFT data: records, the qwen2_vl template, labels, cutoff, batch order, synthetic pairs."""
import json

import pytest
import torch
from PIL import Image

from paco_ds.errors import DataError
from paco_ds.sft.data import (IGNORE_INDEX, Collator, Encoder, SFTDataset, eval_batches, load_records,
                              train_batches, write_synthetic_dataset)

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def processor():
    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

    return tiny_qwen2_5_vl()[1]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("syn"), num_train=8, num_eval=4, image_size=64)


def encoder(processor, cutoff=1024):
    return Encoder(processor, cutoff, 28 * 28, 56 * 56)


def write(tmp_path, records, name="d.json"):
    path = tmp_path / name
    path.write_text(json.dumps(records))
    Image.new("RGB", (40, 30), "red").save(tmp_path / "a.png")
    return path


def pair(answer="Yes. Same.", images=("a.png", "a.png"), question="<image><image>Same?"):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "images": list(images)}


def test_encoding_is_the_chat_template_and_labels_only_the_answer(processor, synthetic):
    train, _ = synthetic
    rec = load_records([train], "data.train_files")[0]
    raw = json.loads(train.read_text())[0]
    ex = encoder(processor).encode(rec, 0)
    # the prompt part is what the processor makes of the same pair through the model's chat template,
    # i.e. what the reward server builds from an OpenAI request (images first, then the question)
    images = [Image.open(train.parent / p).convert("RGB") for p in raw["images"]]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": raw["messages"][0]["content"][14:]}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    ref = processor(text=[text], images=images, return_tensors="pt")
    n_prompt = ref["input_ids"].shape[1]
    assert torch.equal(ex.input_ids[:n_prompt], ref["input_ids"][0])
    assert torch.equal(ex.pixel_values, ref["pixel_values"]) and torch.equal(ex.image_grid_thw, ref["image_grid_thw"])
    assert (ex.labels[:n_prompt] == IGNORE_INDEX).all()
    answer = raw["messages"][1]["content"]
    assert processor.tokenizer.decode(ex.labels[n_prompt:]) == answer + "<|im_end|>\n"
    assert torch.equal(ex.labels[n_prompt:], ex.input_ids[n_prompt:])
    assert processor.tokenizer.convert_ids_to_tokens(int(ex.labels[n_prompt])) in ("Yes", "No")  # the decision token


def test_multi_turn_system_and_conversations_format(tmp_path, processor):
    rec = {"conversations": [{"from": "system", "value": "Judge."}, {"from": "human", "value": "<image>A?"},
                             {"from": "gpt", "value": "No."}, {"from": "human", "value": "B?"},
                             {"from": "gpt", "value": "Yes."}], "images": ["a.png"]}
    r = load_records([write(tmp_path, [rec])], "k")[0]
    ex = encoder(processor).encode(r, 0)
    text = processor.tokenizer.decode(ex.input_ids)
    assert text.startswith("<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n<|vision_start|>")
    labelled = processor.tokenizer.decode(ex.labels[ex.labels != IGNORE_INDEX])
    assert labelled == "No.<|im_end|>\nYes.<|im_end|>\n"  # every answer, no prompt


def test_cutoff_cuts_the_answer_and_rejects_a_long_prompt(tmp_path, processor):
    r = load_records([write(tmp_path, [pair(answer="Yes. " + "x" * 200)])], "k")[0]
    full = encoder(processor).encode(r, 0)
    n_prompt = int((full.labels == IGNORE_INDEX).sum())
    cut = encoder(processor, cutoff=n_prompt + 3).encode(r, 0)
    assert len(cut.input_ids) == n_prompt + 3 and (cut.labels != IGNORE_INDEX).sum() == 3
    enc = encoder(processor, cutoff=n_prompt)
    assert enc.prompt_length(r) == n_prompt
    with pytest.raises(DataError,
                       match=rf"d.json: record 0: the prompt is {n_prompt} tokens .*data.cutoff_len is {n_prompt}"):
        enc.check(r)
    ds = SFTDataset([r, r], enc)
    assert ds.first_error([1])[0] == 1 and SFTDataset([r], encoder(processor)).first_error([0]) is None


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "<image><image>Same?"}], "images": ["a.png", "a.png"]},
     "record 1: no assistant turn"),
    (pair(images=["a.png"]), r"record 1: 2 <image> placeholder\(s\) but 1 image\(s\)"),
    (pair(images=["a.png", "missing.png"]), r"record 1: image file not found: .*missing.png"),
    (pair(images=[]), "record 1: no images"),
    (pair(images=["a.png", 7]), r"record 1: images\[1\] must be an image path \(a non-empty string\), got 7"),
    ({**pair(), "images": {"a": "a.png"}}, "record 1: 'images' must be a list of image paths"),
    ({"messages": [{"role": "assistant", "content": "Yes"}, {"role": "user", "content": "<image>?"}],
      "images": ["a.png"]}, "record 1: turns must alternate"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "record 1: message 0 has role 'bot'"),
])
def test_bad_records_name_the_file_and_record(tmp_path, record, message):
    with pytest.raises(DataError, match=message):
        load_records([write(tmp_path, [pair(), record])], "data.train_files")


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="data.train_files: data file not found"):
        load_records([tmp_path / "none.json"], "data.train_files")
    (tmp_path / "x.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: malformed JSON"):
        load_records([tmp_path / "x.jsonl"], "k")


def test_collator_pads_right(processor, synthetic):
    train, _ = synthetic
    enc = encoder(processor)
    ds = SFTDataset(load_records([train], "k"), enc)
    examples = [ds[0], ds[1]]
    b = Collator(enc.pad_id, enc.image_pad)(examples)
    t = max(len(e.input_ids) for e in examples)
    assert b.input_ids.shape == (2, t) and b.indices == [0, 1]
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        assert b.attention_mask[i].sum() == n and (b.labels[i, n:] == IGNORE_INDEX).all()
    assert int(b.mm_token_type_ids.sum()) == sum(int(e.image_grid_thw.prod(-1).sum()) // 4 for e in examples)
    assert b.pixel_values.shape[0] == sum(e.pixel_values.shape[0] for e in examples)


def test_train_order_is_seeded_by_epoch_and_covers_the_data():
    n, world, bs = 10, 2, 3
    e0 = [train_batches(n, world, r, bs, seed=1, epoch=0) for r in range(world)]
    assert e0 == [train_batches(n, world, r, bs, seed=1, epoch=0) for r in range(world)]  # a pure function
    assert e0 != [train_batches(n, world, r, bs, seed=1, epoch=1) for r in range(world)]
    assert len(e0[0]) == len(e0[1]) == 2  # 12 slots: 2 wrapped around
    flat = [i for rank in e0 for b in rank for i in b]
    assert len(flat) == 12 and set(flat) == set(range(n))


def test_eval_counts_every_record_once():
    n, world, bs = 5, 2, 2
    counted = [i for r in range(world) for idx, keep in eval_batches(n, world, r, bs) for i, k in zip(idx, keep) if k]
    assert sorted(counted) == list(range(n))
    assert len({len(eval_batches(n, world, r, bs)) for r in range(world)}) == 1  # same forwards on every rank


def test_synthetic_pairs(synthetic):
    train, evalf = synthetic
    records = json.loads(train.read_text())
    answers = [r["messages"][1]["content"].split(".")[0] for r in records]
    assert answers.count("Yes") == answers.count("No") == 4
    for r in records:
        q = r["messages"][0]["content"]
        assert q.startswith("<image><image>Given two subfigures")
        assert q.endswith('Answer "Yes" and "No" first, and then provide detailed reasons.')
        assert all(not p.startswith("/") and (train.parent / p).is_file() for p in r["images"])
    consistent = [r for r, a in zip(records, answers) if a == "Yes"]
    a, b = (Image.open(train.parent / p) for p in consistent[0]["images"])
    assert a.size == b.size == (64, 64)
    assert len(json.loads(evalf.read_text())) == 4
