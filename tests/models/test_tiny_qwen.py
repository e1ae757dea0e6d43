"""The tiny offline Qwen2.5-VL (the reward model's architecture) saves, reloads and scores a pair."""
import pytest
import numpy as np
import torch
from PIL import Image

from paco_ds.models.tiny import qwen_tokenizer
from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl, tiny_qwen2_5_vl

pytestmark = pytest.mark.fast


def test_tiny_qwen_roundtrip_and_yes_no_tokens(tmp_path):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer()
    assert tok.convert_ids_to_tokens(tok("Yes", add_special_tokens=False).input_ids) == ["Yes"]
    assert tok.convert_ids_to_tokens(tok("No", add_special_tokens=False).input_ids) == ["No"]
    save_tiny_qwen2_5_vl(tmp_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    proc = AutoProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(2)]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2 and text.endswith("<|im_start|>assistant\n")
    inputs = proc(text=[text], images=ims, return_tensors="pt")
    # the reloaded checkpoint is the model it was written from: same processor output, same logits
    fresh, fresh_proc = tiny_qwen2_5_vl(seed=0)
    want_inputs = fresh_proc(text=[text], images=ims, return_tensors="pt")
    assert set(inputs) == set(want_inputs) and all(torch.equal(inputs[k], want_inputs[k]) for k in inputs)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
        want = fresh(**want_inputs).logits[0, -1]
        other = tiny_qwen2_5_vl(seed=1)[0](**want_inputs).logits[0, -1]
    assert torch.isfinite(logits).all() and torch.allclose(logits, want, rtol=0, atol=1e-6)
    yes_no = [tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")]
    assert not torch.allclose(other[yes_no], want[yes_no])  # the weights matter: another seed scores differently
