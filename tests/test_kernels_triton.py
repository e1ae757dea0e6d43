"""The Triton kernels: in the interpreter on CPU (small sizes), compiled where CUDA is present.

TRITON_INTERPRET is read when a kernel is defined; kernels/_triton_*.py are imported at the first
launch, which happens in these tests, after this module set the variable at collection time. On a
CUDA machine the variable is left alone and the same tests run the compiled kernels.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kernel_checks import (check_advantages, check_kl, check_ppo, check_rollout_equals_training,  # noqa: E402
                           check_sampling, check_scoring)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 37 x 61 is below one block of 1024; 65 x 70 spans 3 chunks of 2048 with a ragged tail.
SHAPES = [(3, 37, 61), (2, 65, 70)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def interpreter_on_cpu(monkeypatch):
    if DEVICE == "cpu":  # another test may have cleared it; the kernels are defined at the first launch
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scoring_matches_float64(dtype, sde_type, shape):
    check_scoring("triton", dtype, sde_type, shape, DEVICE)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_sampling_matches_float64(dtype, sde_type):
    check_sampling("triton", dtype, sde_type, SHAPES[1], DEVICE)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
def test_rollout_and_training_log_probs_are_bitwise_equal(sde_type):
    check_rollout_equals_training("triton", torch.bfloat16, sde_type, (3, 65, 70), DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_matches_float64(dtype):
    check_kl("triton", dtype, (2, 65, 70), DEVICE)


@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("log_tame", [None, "mean", "median", 0.5])
def test_advantages_match_the_stat_tracker(log_tame, global_std):
    check_advantages("triton", log_tame, global_std, DEVICE)


@pytest.mark.parametrize("b", [37, 1500])  # one block, and several blocks of 1024 in backward
def test_ppo_clip_loss_matches_float64(b):
    check_ppo("triton", DEVICE, b=b)
