"""Every model family's tiny twin on the GPU in bf16 (tests/gpu/family_checks.py): it samples, the
training recomputation of the sampled step's log-prob gives an importance ratio of 1 (within bf16
rounding), and the gradient reaches the LoRA, finite. The CPU tiers check each family
against its diffusers pipeline in fp32; this is the same code path on CUDA kernels."""
import pytest
import torch

from paco_ds.models import POLICIES

from .family_checks import family_round_trip

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", sorted(POLICIES))
def test_each_family_samples_and_trains_one_step_in_bf16(family):
    out = family_round_trip(family, torch.device("cuda"), "bf16")
    assert out["dtype"] == torch.bfloat16
    assert out["images"].shape[0] == 2 and out["images"].dtype == torch.uint8
    assert torch.isfinite(out["sampled"]).all() and torch.isfinite(out["recomputed"]).all()
    ratio = torch.exp(out["recomputed"] - out["sampled"])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=2e-2), f"{family}: ratio {ratio.tolist()}"
    grads = [g for g in out["lora_grads"] if g is not None]  # (a last block's unused text output has none)
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
