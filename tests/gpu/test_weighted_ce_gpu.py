"""The fused linear + CE on a CUDA GPU: exactness at small sizes, and memory at Qwen2.5-VL's vocabulary."""
import pytest
import torch

import kernels
from paco_ds.sft.loss import naive_weighted_ce, sft_loss
from weighted_ce_checks import check_against_float64, make_case, rel

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [None, 0.1, 1.0])
def test_matches_float64(alpha, dtype):
    check_against_float64("triton", dtype, alpha, "exact", device=DEVICE)
    check_against_float64("triton", dtype, alpha, "share", device=DEVICE, v=40000, chunk_size=8)


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_qwen_vocabulary_in_a_quarter_of_the_memory():
    # 4096 supervised tokens, hidden 3584 and vocabulary 152,064 (Qwen2.5-VL-7B), bf16
    hidden, weight, labels = make_case([(1, 4097)], 4097, 3584, 152064, torch.bfloat16, device=DEVICE)
    assert kernels.resolve("auto", DEVICE) == "triton"
    grads = {}

    def fused():
        h = hidden.clone().requires_grad_(True)
        sft_loss(h, weight, labels, 0.1).loss.backward()
        grads["fused"] = h.grad

    def naive():
        h = hidden.clone().requires_grad_(True)
        naive_weighted_ce(h @ weight.t(), labels, 0.1).backward()
        grads["naive"] = h.grad

    fused_bytes, naive_bytes = _peak(fused), _peak(naive)
    assert fused_bytes <= naive_bytes / 4, (fused_bytes, naive_bytes)
    assert rel(grads["fused"], grads["naive"]) < 1e-2
