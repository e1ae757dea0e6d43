"""The Triton kernels: in the interpreter on CPU (small sizes), compiled where CUDA is present.

TRITON_INTERPRET must be set before `import triton` (triton.language's own helpers are @triton.jit
functions), and any earlier test may import triton (deepspeed does). So on CPU this module runs
itself in a subprocess that starts with TRITON_INTERPRET=1 (`test_in_the_interpreter`), where the
kernel tests run; in the parent process they are skipped. On a CUDA machine they run here,
compiled.
"""

import pytest
import torch

from conftest import TRITON_DEVICE, in_parent_on_cpu, run_in_triton_interpreter, triton_kernel_test
from kernel_checks import (check_advantages, check_kl, check_ppo, check_rollout_equals_training, check_sampling,
                           check_scoring, check_sde_kl)

pytestmark = pytest.mark.runs  # a pytest of its own under TRITON_INTERPRET=1 (tens of seconds)

pytest.importorskip("triton")

DEVICE = TRITON_DEVICE
kernel_test = triton_kernel_test
# 37 x 61 is below one block of 1024; 65 x 70 spans 3 chunks of 2048 with a ragged tail; a video
# family's 5-D latents [B, C, F', H', W'] reduce over all their elements the same way (2 chunks).
SHAPES = [(3, 37, 61), (2, 65, 70), (2, 4, 3, 19, 11)]
DTYPES = [torch.float32, torch.bfloat16]


@in_parent_on_cpu
def test_in_the_interpreter():
    run_in_triton_interpreter(__file__, min_passed=36)


@kernel_test
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scoring_matches_float64(dtype, sde_type, shape):
    check_scoring("triton", dtype, sde_type, shape, DEVICE)


@kernel_test
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_sampling_matches_float64(dtype, sde_type):
    check_sampling("triton", dtype, sde_type, SHAPES[1], DEVICE)


@kernel_test
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
def test_rollout_and_training_log_probs_are_bitwise_equal(sde_type):
    check_rollout_equals_training("triton", torch.bfloat16, sde_type, (3, 65, 70), DEVICE)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_matches_float64(dtype):
    check_kl("triton", dtype, (2, 65, 70), DEVICE)


@kernel_test
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_and_kl_in_one_pass_match_float64(dtype, sde_type):
    check_sde_kl("triton", dtype, sde_type, (2, 65, 70), DEVICE)


@kernel_test
@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("log_tame", [None, "mean", "median", 0.5])
def test_advantages_match_the_stat_tracker(log_tame, global_std):
    check_advantages("triton", log_tame, global_std, DEVICE)


@kernel_test
@pytest.mark.parametrize("b", [37, 1500])  # one block, and several blocks of 1024 in backward
def test_ppo_clip_loss_matches_float64(b):
    check_ppo("triton", DEVICE, b=b)
