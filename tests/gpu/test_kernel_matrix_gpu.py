"""Every Triton kernel, forward and backward, in fp32 and bf16, on a CUDA GPU: one test per cell.

The other files of tests/gpu go deeper per op (both SDE types, FLUX 1024 px, sampling, bitwise
rollout/training equality, the Qwen vocabulary's memory); this one is the matrix a reader checks
first. "Backward" is the gradient reaching each differentiable input, compared with a float64
autograd of the reference; the advantage op has none (its outputs are constants of the loss), so
its cells check that it carries no graph. bf16 inputs give fp32 (log-probs, losses) or fp64
(advantages) outputs and gradients in bf16, within one bf16 rounding of float64.
"""
import pytest
import torch

from .gpu_checks import check_advantages_dtype, check_ppo_dtype
from kernel_checks import check_kl, check_scoring
from weighted_ce_checks import check_against_float64

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FLUX_512 = (4, 1024, 64)  # [B, L, C] packed latents of 512 px images

MATRIX = {
    "sde_logprob": lambda dtype: check_scoring("triton", dtype, "flow_grpo", FLUX_512, DEVICE),
    "sde_logprob_cps": lambda dtype: check_scoring("triton", dtype, "cps", FLUX_512, DEVICE),
    "kl": lambda dtype: check_kl("triton", dtype, FLUX_512, DEVICE),
    "grpo_advantages": lambda dtype: check_advantages_dtype(dtype, None, True, DEVICE),
    "grpo_advantages_log_tame": lambda dtype: check_advantages_dtype(dtype, "median", False, DEVICE),
    "ppo_clip": lambda dtype: check_ppo_dtype(dtype, DEVICE, b=672),
    "weighted_ce": lambda dtype: check_against_float64("triton", dtype, 0.1, "exact", device=DEVICE),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", list(MATRIX))
def test_forward_and_backward(kernel, dtype):
    MATRIX[kernel](dtype)


@pytest.mark.parametrize("log_tame", [None, "mean", "median"])
@pytest.mark.parametrize("global_std", [True, False])
def test_advantages_bf16_rewards_every_variant(global_std, log_tame):
    check_advantages_dtype(torch.bfloat16, log_tame, global_std, DEVICE)


@pytest.mark.parametrize("b", [16, 672, 5000])  # one block, and several blocks in the backward
def test_ppo_clip_bf16_batch_sizes(b):
    check_ppo_dtype(torch.bfloat16, DEVICE, b=b)
