"""Checks the GPU tests add to tests/kernel_checks.py: the PPO-clip and advantage ops on bf16 inputs.

Each takes a device, so that the same check runs on CUDA and, for a check of the check, on CPU
tensors under TRITON_INTERPRET=1 (with small shapes: the interpreter is slow).
"""
from __future__ import annotations

import numpy as np
import torch

from kernel_checks import advantage_case, assert_rounded, ppo_reference64, rel_err


def ppo_case_rounded(b: int, dtype, seed: int = 0, clip_range: float = 0.2):
    """log-probs, old log-probs and advantages already rounded to `dtype`, whose ratios fall inside
    and outside [1 - clip, 1 + clip], none within 1e-3 of an edge (fp32 exp may round either way
    there); advantages beyond the +-5 clip and exactly 0 included."""
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, generator=g, dtype=torch.float64) * 0.5 - 2.0).to(dtype)
    old = (lp.double() + torch.randn(b, generator=g, dtype=torch.float64) * 2 * clip_range).to(dtype)
    ratio = torch.exp(lp.double() - old.double())
    near = ((ratio - 1).abs() - clip_range).abs() < 1e-3
    old[near] = lp[near]  # ratio exactly 1
    adv = (torch.randn(b, generator=g, dtype=torch.float64) * 3)
    adv[:3] = torch.tensor([7.0, -6.0, 0.0], dtype=torch.float64)
    return lp, old, adv.to(dtype)


def check_ppo_dtype(dtype, device="cuda", b=672, seed=0, clip_range=0.2, adv_clip=5.0):
    """The Triton PPO-clip loss on `dtype` inputs: loss, statistics and both gradients against a
    float64 autograd of the reference formula on the same (rounded) values; gradients come back in
    `dtype`, rounded from the fp32 kernel's."""
    import kernels

    lp, old, adv = (t.to(device) for t in ppo_case_rounded(b, dtype, seed, clip_range))
    lpk, oldk = lp.clone().requires_grad_(True), old.clone().requires_grad_(True)
    loss, stats = kernels.ppo_clip_loss(lpk, oldk, adv, clip_range, adv_clip, backend="triton")
    (3 * loss).backward()

    lp64, old64, loss64, ratio, _, _ = ppo_reference64(lp, old, adv, clip_range, adv_clip)
    r = ratio.detach()
    clipfrac = ((r - 1).abs() > clip_range).double().mean().item()
    assert 0 < clipfrac < 1, clipfrac  # the case exercises the clip both ways
    assert loss.dtype == torch.float32 and rel_err(loss, loss64) < 1e-6
    assert round(stats["clipfrac"].item() * b) == round(clipfrac * b)
    assert abs(stats["ratio"].item() - r.mean().item()) <= 1e-6 * r.mean().item()
    for got, want in ((lpk.grad, lp64.grad), (oldk.grad, old64.grad)):
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert rel_err(got, want) < 1e-6
        else:
            assert_rounded(got, want)


def check_advantages_dtype(dtype, log_tame=None, global_std=True, device="cuda", seed=0, clip=1.5):
    """The Triton advantage op on `dtype` rewards (it computes in fp64) against the StatTracker on CPU
    (torch) on the same rounded rewards. The op has no backward: the advantages are constants of
    the loss, so they never carry a graph even when the rewards do."""
    import kernels
    from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
    from paco_ds.grpo.advantages import StatTracker

    rewards, weights, ids = advantage_case(seed)
    r = torch.tensor(rewards).to(dtype)
    names = [f"r{k}" for k in range(len(weights))]
    agg = AggregationConfig(fn="weighted_sum" if log_tame is None else "log_tame", threshold=log_tame or "mean")
    ref = StatTracker(AdvantageConfig(global_std=global_std, clip=clip), agg, dict(zip(names, weights)),
                      backend="torch").compute(dict(zip(names, r.double().numpy())), ids)
    rk = r.to(device).requires_grad_(dtype.is_floating_point)
    out = kernels.grpo_advantages(rk, weights, torch.tensor(ids, device=device), log_tame=log_tame,
                                  global_std=global_std, clip=clip, backend="triton")
    assert out.advantages.dtype == torch.float64 and not out.advantages.requires_grad
    assert (np.abs(ref.advantages) == clip).any()  # the case exercises the clip
    np.testing.assert_allclose(out.advantages.detach().cpu().numpy(), ref.advantages, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.combined.detach().cpu().numpy(), ref.combined, rtol=1e-12)
    if log_tame is not None:
        assert out.tamed.tolist() == [bool(ref.stats[f"log_tame/tamed/{n}"]) for n in names]
