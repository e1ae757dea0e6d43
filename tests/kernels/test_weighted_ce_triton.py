"""The Triton row kernel of the fused linear + CE, in the interpreter on CPU (compiled where CUDA is).

As in test_triton_interpreter.py, TRITON_INTERPRET must be set before triton is imported, so on CPU this
module reruns itself in a subprocess started with TRITON_INTERPRET=1, where the kernel tests run.
"""

import pytest
import torch

from conftest import TRITON_DEVICE, in_parent_on_cpu, run_in_triton_interpreter, triton_kernel_test
from weighted_ce_checks import N_FIRST, check_against_float64

pytestmark = pytest.mark.runs  # a pytest of its own under TRITON_INTERPRET=1 (tens of seconds)

pytest.importorskip("triton")

DEVICE = TRITON_DEVICE
kernel_test = triton_kernel_test


@in_parent_on_cpu
def test_in_the_interpreter():
    run_in_triton_interpreter(__file__, min_passed=23)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["exact", "share"])
@pytest.mark.parametrize("alpha", [None, 0.0, 0.1, 1 / N_FIRST, 1.0])
def test_fused_loss_matches_float64(alpha, mode, dtype):
    check_against_float64("triton", dtype, alpha, mode, device=DEVICE)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_longer_than_one_block(dtype):
    # 40,000 entries: two blocks of 32,768 with a ragged tail
    check_against_float64("triton", dtype, 0.1, "exact", device=DEVICE, v=40000, chunk_size=8)


@kernel_test
def test_triton_rows_equal_torch_rows():
    from kernels.weighted_ce import rows_torch, rows_triton

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 1000, generator=g) * 3).to(DEVICE)
    labels = torch.tensor([0, 999, 5, 17, 500, 3], device=DEVICE)
    coef = torch.rand(6, generator=g).to(DEVICE)
    a, b = logits.clone(), logits.clone()
    ce_a, pred_a = rows_triton(a, labels, coef, True)
    ce_b, pred_b = rows_torch(b, labels, coef, True)
    assert torch.equal(pred_a, pred_b)
    assert torch.allclose(ce_a, ce_b, rtol=1e-6, atol=1e-6) and torch.allclose(a, b, rtol=1e-5, atol=1e-7)
