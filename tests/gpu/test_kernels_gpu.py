"""The compiled Triton kernels at FLUX latent sizes (512 and 1024 px), on a CUDA GPU."""
import pytest
import torch

import kernels
from kernel_checks import (check_advantages, check_kl, check_ppo, check_rollout_equals_training, check_sampling,
                           check_scoring, check_sde_kl)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FLUX_512, FLUX_1024 = (4, 1024, 64), (2, 4096, 64)


def test_auto_picks_triton_for_cuda_tensors():
    assert kernels.resolve("auto", DEVICE) == "triton"
    assert kernels.resolve("auto", "cpu") == "cpp"


@pytest.mark.parametrize("shape", [FLUX_512, FLUX_1024])
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scoring_matches_float64(dtype, sde_type, shape):
    check_scoring("triton", dtype, sde_type, shape, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sampling_matches_float64(dtype):
    check_sampling("triton", dtype, "flow_grpo", FLUX_1024, DEVICE)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_and_training_log_probs_are_bitwise_equal(dtype, sde_type):
    check_rollout_equals_training("triton", dtype, sde_type, (16, 1024, 64), DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_matches_float64(dtype):
    check_kl("triton", dtype, FLUX_1024, DEVICE)


@pytest.mark.parametrize("shape", [FLUX_512, FLUX_1024])
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_prob_and_kl_in_one_pass_match_float64(dtype, sde_type, shape):
    # also: its log-prob bitwise the plain scoring kernel's, compiled for the GPU (FMA contraction included)
    check_sde_kl("triton", dtype, sde_type, shape, DEVICE)


@pytest.mark.parametrize("log_tame", [None, "median"])
def test_advantages_match_the_stat_tracker(log_tame):
    check_advantages("triton", log_tame, True, DEVICE)


def test_ppo_clip_loss_matches_float64():
    check_ppo("triton", DEVICE, b=672)


def test_cuda_and_cpu_backends_agree():
    x, v, noise = (torch.randn(2, 1024, 64) for _ in range(3))
    x, v = x.bfloat16(), v.bfloat16()
    cpu = kernels.sde_step(x, v, 0.94, 0.88, 0.7, 0.95, noise=noise, backend="cpp")
    gpu = kernels.sde_step(x.cuda(), v.cuda(), 0.94, 0.88, 0.7, 0.95, prev_sample=cpu.prev_sample.cuda(),
                           backend="triton")
    assert torch.allclose(gpu.log_prob.cpu(), cpu.log_prob, rtol=1e-6, atol=1e-6)
