"""The GPU lane's per-family check (tests/gpu/family_checks.py) on the CPU in fp32, for every registered
family: a family added to POLICIES is in the GPU lane at once (test_families_gpu.py is parametrized
over it), and this is where its round trip is first seen to pass, without a GPU. A rollout with the
SDE at one step, its log-prob recomputed as training does (ratio 1), and a finite gradient in the LoRA."""
import pytest
import torch

from paco_ds.models import POLICIES

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("family", sorted(POLICIES))
def test_each_family_samples_and_trains_one_step_on_the_cpu_in_fp32(family):
    from gpu.family_checks import family_round_trip

    out = family_round_trip(family, torch.device("cpu"), "fp32")
    assert out["dtype"] == torch.float32
    assert out["images"].shape[0] == 2 and out["images"].dtype == torch.uint8
    ratio = torch.exp(out["recomputed"] - out["sampled"])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4), f"{family}: ratio {ratio.tolist()}"
    grads = [g for g in out["lora_grads"] if g is not None]  # (a last block's unused text output has none)
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
