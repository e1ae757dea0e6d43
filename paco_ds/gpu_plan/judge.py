"""FLOPs of one judge request: Qwen2.5-VL-7B's prefill of two panels and the question, counted
with torch.utils.flop_counter on fake CUDA tensors (the judge answers one token, so prefill is the
whole cost). The image tokens come from the real Qwen2-VL geometry (14-pixel patches merged 2x2);
the question's text tokens are given (the offline tokenizer is byte-level, longer than Qwen's).
"""
from __future__ import annotations

import torch


def judge_request_flops(panel_height: int, panel_width: int, text_tokens: int = 100, images: int = 2) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLForConditionalGeneration

    from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda
    from paco_ds.models.full_size import empty, qwen_vl_config

    mode = FakeCuda()
    tok, config = qwen_vl_config()
    model = empty(lambda: Qwen2_5_VLForConditionalGeneration(config))
    to_fake_cuda(mode, model, torch.bfloat16)
    ids = {n: tok.convert_tokens_to_ids(n) for n in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    gh, gw = max(2, round(panel_height / 28)) * 2, max(2, round(panel_width / 28)) * 2  # patch grid
    per_image = gh * gw // 4
    seq = []
    for _ in range(images):
        seq += [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * per_image + [ids["<|vision_end|>"]]
    seq += [tok.convert_tokens_to_ids("Yes")] * text_tokens
    patch = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14
    with mode, torch.no_grad(), FlopCounterMode(display=False) as fc:
        input_ids = torch.tensor([seq]).to("cuda")
        pixel_values = torch.zeros(images * gh * gw, patch).to("cuda", torch.bfloat16)
        grid = torch.tensor([[1, gh, gw]] * images).to("cuda")
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixel_values,
              image_grid_thw=grid, mm_token_type_ids=(input_ids == ids["<|image_pad|>"]).long(), logits_to_keep=1)
    return float(fc.get_total_flops())
