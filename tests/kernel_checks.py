"""Float64 references and input makers shared by the kernel tests (CPU, interpreter and GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

SIGMA = (0.94, 0.90, 1.0)  # the last sample exercises the sigma == 1 -> sigma_max substitution
SIGMA_NEXT = (0.88, 0.85, 0.94)
SIGMA_MAX = 0.95
NOISE_LEVEL = 0.7


def sigmas(b: int, device="cpu"):
    pick = [i % len(SIGMA) for i in range(b)]
    return (torch.tensor([SIGMA[i] for i in pick], device=device),
            torch.tensor([SIGMA_NEXT[i] for i in pick], device=device))


def inputs(shape, dtype, seed: int, device="cpu"):
    """x, v (dtype) and fp32 noise, fresh normals: never zeros, never a multiple of the blocks."""
    g = torch.Generator().manual_seed(seed)
    x, v, noise = (torch.randn(shape, generator=g) for _ in range(3))
    return x.to(device, dtype), v.to(device, dtype), noise.to(device)


def sde_ref64(x, v, sigma, sigma_next, a, sigma_max, sde_type, prev=None, noise=None):
    """(prev, log_prob, mean, std_t) of
    PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/sde_denoising_step.py, all float64, differentiable in x
    and v.

    With `noise`, prev = mean + std * noise in float64 (the caller rounds it as it needs).
    """
    x, v = x.double(), v.double()
    view = (x.shape[0],) + (1,) * (x.ndim - 1)
    s = sigma.double().reshape(view)
    sn = sigma_next.double().reshape(view)
    if sde_type == "flow_grpo":
        dt = sn - s
        s_safe = torch.where(s == 1, torch.full_like(s, sigma_max), s)
        std_t = a * torch.sqrt(s / (1 - s_safe))
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        sd = std_t * torch.sqrt(-dt)
    else:
        std_t = sn * math.sin(a * math.pi / 2)
        mean = (x - s * v) * (1 - sn) + (x + (1 - s) * v) * torch.sqrt(sn**2 - std_t**2)
        sd = std_t
    if prev is None:
        prev = mean.detach() + sd * noise.double()
    diff = prev.double() - mean
    lp = -(diff**2) if sde_type == "cps" else -(diff**2) / (2 * sd**2) - torch.log(sd) - 0.5 * math.log(2 * math.pi)
    return prev, lp.mean(dim=tuple(range(1, x.ndim))), mean, std_t.reshape(-1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def ulp(t: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` at |t| (float64), for "within one unit in the last place" checks."""
    t = t.double().abs().to(dtype)
    return (torch.nextafter(t, torch.full_like(t, math.inf)).double() - t.double()).clamp_min(
        torch.finfo(dtype).tiny)


def assert_rounded(out: torch.Tensor, ref64: torch.Tensor, tol: float = 1e-3):
    """A bf16 output equals the float64 ref up to its own rounding: within one ulp of each element
    (plus 1e-6 of the largest, for values that cancel in fp32), and within `tol` in norm of the
    reference rounded to bf16. Against the unrounded reference, bf16 rounding alone is ~1.5e-3."""
    ref64 = ref64.detach()
    slack = 1e-6 * ref64.abs().max()
    assert ((out.double() - ref64).abs() <= ulp(ref64, out.dtype) + slack).all()
    assert rel_err(out, ref64.to(out.dtype)) < tol


# ----------------------------------------------------------------------------- checks shared by backends
def require_backend(op: str, backend: str, device="cpu") -> None:
    """Fail when `backend` is asked for by name but another one (the torch reference) would run `op`:
    a fallback must never pass as a check of the fused kernels."""
    import kernels

    runs = kernels.active_backend(op, device, backend)
    if backend in ("cpp", "triton") and runs != backend:
        pytest.fail(f"{op}: '{backend}' was asked for, but '{runs}' runs it on {device} here "
                    "(a fallback is not a pass of the fused kernel)")


def check_scoring(backend, dtype, sde_type, shape, device="cpu", seed=0):
    """Score a transition: log-prob, mean and the gradients of both reach x and v as in float64."""
    import kernels

    require_backend("sde_step", backend, device)
    x, v, noise = inputs(shape, dtype, seed, device)
    sig, sig_next = sigmas(shape[0], device)
    prev64, _, _, _ = sde_ref64(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, noise=noise)
    prev = prev64.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    w_lp = torch.randn(shape[0], generator=g).to(device)
    w_mean = torch.randn(shape, generator=g).to(device) * 1e-2

    xk, vk = x.clone().requires_grad_(True), v.clone().requires_grad_(True)
    step = kernels.sde_step(xk, vk, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev, sde_type=sde_type,
                            backend=backend)
    ((step.log_prob * w_lp).sum() + (step.mean * w_mean).sum()).backward()

    x64, v64 = x.double().requires_grad_(True), v.double().requires_grad_(True)
    _, lp64, mean64, std64 = sde_ref64(x64, v64, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, prev=prev)
    ((lp64 * w_lp.double()).sum() + (mean64 * w_mean.double()).sum()).backward()

    assert step.log_prob.dtype == torch.float32 and step.log_prob.shape == (shape[0],)
    assert step.mean.dtype == torch.float32 and step.mean.shape == x.shape
    assert step.prev_sample is prev
    assert rel_err(step.log_prob, lp64) < 1e-6
    assert rel_err(step.mean, mean64) < 1e-6
    assert rel_err(step.std, std64) < 1e-6
    for got, want in ((vk.grad, v64.grad), (xk.grad, x64.grad)):
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert rel_err(got, want) < 1e-6
        else:
            assert_rounded(got, want)


def check_sampling(backend, dtype, sde_type, shape, device="cpu", seed=0):
    """Sample a transition: x' is mean + std * noise rounded to x's dtype; its log-prob is exact."""
    import kernels

    require_backend("sde_step", backend, device)
    x, v, noise = inputs(shape, dtype, seed, device)
    sig, sig_next = sigmas(shape[0], device)
    step = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, sde_type=sde_type,
                            backend=backend, return_mean=False)
    prev64, _, _, _ = sde_ref64(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, noise=noise)
    assert step.prev_sample.dtype == dtype and step.mean is None
    if dtype == torch.float32:
        assert rel_err(step.prev_sample, prev64) < 1e-6
    else:
        assert_rounded(step.prev_sample, prev64)
    _, lp64, _, _ = sde_ref64(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, prev=step.prev_sample)
    assert rel_err(step.log_prob, lp64) < 1e-6


def check_rollout_equals_training(backend, dtype, sde_type, shape, device="cpu", seed=0):
    """The log-prob stored at rollout equals, bit for bit, the one recomputed for training:
    in a batch or alone, with or without grad and the mean, and on a second run."""
    import kernels

    require_backend("sde_step", backend, device)
    x, v, noise = inputs(shape, dtype, seed, device)
    sig, sig_next = sigmas(shape[0], device)
    with torch.no_grad():
        rollout = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, sde_type=sde_type,
                                   backend=backend, return_mean=False)
        again = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, sde_type=sde_type,
                                 backend=backend, return_mean=False)
    assert torch.equal(rollout.prev_sample, again.prev_sample) and torch.equal(rollout.log_prob, again.log_prob)
    vg = v.clone().requires_grad_(True)
    train = kernels.sde_step(x, vg, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=rollout.prev_sample,
                             sde_type=sde_type, backend=backend)
    assert torch.equal(train.log_prob.detach(), rollout.log_prob)
    j = shape[0] - 1
    alone = kernels.sde_step(x[j:], v[j:], sig[j:], sig_next[j:], NOISE_LEVEL, SIGMA_MAX,
                             prev_sample=rollout.prev_sample[j:], sde_type=sde_type, backend=backend,
                             return_mean=False)
    assert torch.equal(alone.log_prob, rollout.log_prob[j:])
    train.log_prob.sum().backward()
    first = vg.grad.clone()
    vg.grad = None
    kernels.sde_step(x, vg, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=rollout.prev_sample,
                     sde_type=sde_type, backend=backend).log_prob.sum().backward()
    assert torch.equal(vg.grad, first)


def check_kl(backend, dtype, shape, device="cpu", seed=0):
    import kernels

    require_backend("kl_to_reference", backend, device)
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True)
    mr = (m.detach().float() + 0.1 * torch.randn(shape, generator=g).to(device)).to(dtype).requires_grad_(True)
    std = (torch.rand(shape[0], generator=g) + 0.5).to(device)
    w = torch.randn(shape[0], generator=g).to(device)
    kl = kernels.kl_to_reference(m, mr, std, backend=backend)
    (kl * w).sum().backward()
    m64, mr64 = m.detach().double().requires_grad_(True), mr.detach().double().requires_grad_(True)
    kl64 = ((m64 - mr64) ** 2).mean(dim=tuple(range(1, len(shape)))) / (2 * std.double() ** 2)
    (kl64 * w.double()).sum().backward()
    assert kl.dtype == torch.float32 and rel_err(kl, kl64) < 1e-6
    for got, want in ((m.grad, m64.grad), (mr.grad, mr64.grad)):
        if dtype == torch.float32:
            assert rel_err(got, want) < 1e-6
        else:
            assert_rounded(got, want)
    assert torch.equal(kernels.kl_to_reference(m, mr, std, backend=backend), kl)


def advantage_case(seed: int):
    """[K, N] positive rewards of 3 types with different scales and spreads (coefficients of
    variation about 0.7, 0.2 and 1.4), in groups of 5 with scattered ids, one group with zero
    spread, and two single-sample groups, in shuffled order."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.repeat(rng.choice(10_000, 8, replace=False), 5), [20_001, 20_002]])
    shapes, scales = np.array([2.0, 20.0, 0.5])[:, None], np.array([1.0, 40.0, 0.05])[:, None]
    rewards = rng.gamma(shapes, 1.0, size=(3, ids.size)) * scales
    rewards[:, ids == ids[0]] = rewards[:, :1]  # zero std in the first group
    order = rng.permutation(ids.size)
    return rewards[:, order], [0.2, 1.0, 1.5], ids[order]


def check_advantages(backend, log_tame, global_std, device="cpu", seed=0):
    """The fused advantage op (aggregation included) against the StatTracker (paco_ds/grpo/advantages.py),
    which aggregates in torch and normalises through the op's torch version on CPU."""
    import kernels
    from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
    from paco_ds.grpo.advantages import StatTracker

    require_backend("grpo_advantages", backend, device)
    clip = 1.5
    rewards, weights, ids = advantage_case(seed)
    names = [f"r{k}" for k in range(len(weights))]
    agg = AggregationConfig(fn="weighted_sum" if log_tame is None else "log_tame", threshold=log_tame or "mean")
    ref = StatTracker(AdvantageConfig(global_std=global_std, clip=clip), agg, dict(zip(names, weights)),
                      backend="torch").compute(dict(zip(names, rewards)), ids)
    out = kernels.grpo_advantages(torch.tensor(rewards, device=device), weights, torch.tensor(ids, device=device),
                                  log_tame=log_tame, global_std=global_std, clip=clip, backend=backend)
    assert (np.abs(ref.advantages) == clip).any()  # the case exercises the clip
    np.testing.assert_allclose(out.advantages.cpu().numpy(), ref.advantages, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.combined.cpu().numpy(), ref.combined, rtol=1e-12)
    if log_tame is None:
        assert out.tamed is None
    else:
        assert out.tamed.tolist() == [bool(ref.stats[f"log_tame/tamed/{n}"]) for n in names]
        assert 0 < sum(out.tamed.tolist()) < len(names)  # the case exercises the choice
        np.testing.assert_allclose(out.cv.cpu().numpy(), [ref.stats[f"log_tame/h/{n}"] for n in names], rtol=1e-12)
        assert out.threshold.item() == pytest.approx(ref.stats["log_tame/threshold"], rel=1e-12)
    again = kernels.grpo_advantages(torch.tensor(rewards, device=device), weights, torch.tensor(ids, device=device),
                                    log_tame=log_tame, global_std=global_std, clip=clip, backend=backend)
    assert torch.equal(again.advantages, out.advantages)


def ppo_case(b: int, seed: int, clip_range: float):
    """log-probs whose ratios fall inside and outside the clip range, none within 1e-6 of its edge
    (fp32 exp may round either way there), and advantages beyond the +-5 clip and exactly 0."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(b, generator=g, dtype=torch.float64) * 2 * clip_range
    near = (delta.abs() - clip_range).abs() < 1e-6
    delta[near] = 0.5 * clip_range
    log_prob = torch.randn(b, generator=g, dtype=torch.float64) * 0.1 - 1.0
    adv = torch.randn(b, generator=g, dtype=torch.float64) * 3
    adv[:3] = torch.tensor([7.0, -6.0, 0.0], dtype=torch.float64)
    return log_prob.float(), (log_prob + delta).float(), adv.float()


def ppo_reference64(lp, old, adv, clip_range, adv_clip):
    """The PPO-clip formula in float64 autograd, backward of 3 x loss done (the kernels' tests call
    backward on 3 x loss too): (lp64, old64, loss64, ratio, unclipped, clipped)."""
    lp64, old64 = lp.double().requires_grad_(True), old.double().requires_grad_(True)
    a = adv.double().clamp(-adv_clip, adv_clip)
    ratio = torch.exp(lp64 - old64)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss64 = torch.maximum(unclipped, clipped).mean()
    (3 * loss64).backward()
    return lp64, old64, loss64, ratio, unclipped, clipped


def check_ppo(backend, device="cpu", b=37, seed=0, clip_range=1e-4, adv_clip=5.0):
    """Loss, statistics and gradients against a float64 autograd of the reference formula."""
    import kernels

    require_backend("ppo_clip_loss", backend, device)
    lp, old, adv = (t.to(device) for t in ppo_case(b, seed, clip_range))
    lpk, oldk = lp.clone().requires_grad_(True), old.clone().requires_grad_(True)
    loss, stats = kernels.ppo_clip_loss(lpk, oldk, adv, clip_range, adv_clip, backend=backend)
    (3 * loss).backward()

    lp64, old64, loss64, ratio, unclipped, clipped = ppo_reference64(lp, old, adv, clip_range, adv_clip)
    r = ratio.detach()
    want = {"policy_loss": loss64.detach(), "unclipped_loss": unclipped.mean(), "clipped_loss": clipped.mean(),
            "ratio": r.mean(), "clipfrac": ((r - 1).abs() > clip_range).double().mean(),
            "clipfrac_gt_one": (r - 1 > clip_range).double().mean(),
            "clipfrac_lt_one": (1 - r > clip_range).double().mean()}
    assert stats.keys() == want.keys() and 0 < want["clipfrac"] < 1
    for key in ("clipfrac", "clipfrac_gt_one", "clipfrac_lt_one"):  # the same samples are counted
        assert round(stats[key].item() * b) == round(want[key].item() * b)
    for key in ("policy_loss", "unclipped_loss", "clipped_loss", "ratio"):
        assert abs(stats[key].item() - want[key].item()) <= 1e-6 * abs(want[key].item())
    assert rel_err(loss, loss64) < 1e-6
    assert rel_err(lpk.grad, lp64.grad) < 1e-6 and rel_err(oldk.grad, old64.grad) < 1e-6


def check_sde_kl(backend, dtype, sde_type, shape, device="cpu", seed=0):
    """The fused log-prob + KL: the log-prob bitwise `sde_step`'s on the same backend, the KL and the
    gradients of both (through v and x) as in float64, v_ref frozen."""
    import kernels

    require_backend("sde_step_kl", backend, device)
    x, v, noise = inputs(shape, dtype, seed, device)
    g = torch.Generator().manual_seed(seed + 2)
    v_ref = (v.float() + 0.05 * torch.randn(shape, generator=g).to(device)).to(dtype)
    sig, sig_next = sigmas(shape[0], device)
    prev = sde_ref64(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, noise=noise)[0].to(dtype)
    w_lp, w_kl = torch.randn(shape[0], generator=g).to(device), torch.randn(shape[0], generator=g).to(device)

    xk, vk = x.clone().requires_grad_(True), v.clone().requires_grad_(True)
    step, kl = kernels.sde_step_kl(xk, vk, v_ref, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev,
                                   sde_type=sde_type, backend=backend)
    ((step.log_prob * w_lp).sum() + (kl * w_kl).sum()).backward()

    x64, v64 = x.double().requires_grad_(True), v.double().requires_grad_(True)
    _, lp64, mean64, std64 = sde_ref64(x64, v64, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, prev=prev)
    mean_ref64 = sde_ref64(x.double(), v_ref.double(), sig, sig_next, NOISE_LEVEL, SIGMA_MAX, sde_type, prev=prev)[2]
    kl64 = ((mean64 - mean_ref64) ** 2).mean(dim=tuple(range(1, len(shape)))) / (2 * std64**2)
    ((lp64 * w_lp.double()).sum() + (kl64 * w_kl.double()).sum()).backward()

    assert step.mean is None and step.prev_sample is prev
    assert kl.dtype == torch.float32 and kl.shape == (shape[0],) and (kl > 0).all()
    assert rel_err(step.log_prob, lp64) < 1e-6 and rel_err(step.std, std64) < 1e-6
    # the KL's terms are cv (v - v_ref), exact in fp32 for inputs of one dtype: only the sum rounds
    assert rel_err(kl, kl64) < 1e-5
    assert vk.grad.dtype == xk.grad.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(vk.grad, v64.grad) < 1e-5
    else:
        assert_rounded(vk.grad, v64.grad)
    # x's gradient is the log-prob's alone (the KL's two means share x): the plain step's, whose fp32
    # residual x' - mean cancels values of order 1 down to the noise's size (0.05-0.5 % of float64 here)
    xp = x.clone().requires_grad_(True)
    (kernels.sde_step(xp, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev, sde_type=sde_type,
                      backend=backend, return_mean=False).log_prob * w_lp).sum().backward()
    assert rel_err(xk.grad, x64.grad) < 1e-2
    if backend != "torch":  # the fused backward does the plain one's arithmetic for x
        assert torch.equal(xk.grad, xp.grad)
    else:  # autograd rounds the reference's bf16 / fp16 gradients in another order
        assert rel_err(xk.grad, xp.grad) < 2e-3
    # the log-prob the rollout stored, recomputed in training: the same bits with and without the KL
    plain = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev, sde_type=sde_type,
                             backend=backend, return_mean=False)
    assert torch.equal(step.log_prob.detach(), plain.log_prob)
    # and the KL matches the unfused kernels' (both means written, then kl_to_reference)
    with torch.no_grad():
        m = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev, sde_type=sde_type,
                             backend=backend)
        mr = kernels.sde_step(x, v_ref, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, prev_sample=prev, sde_type=sde_type,
                              backend=backend)
        unfused = kernels.kl_to_reference(m.mean, mr.mean, m.std, backend=backend)
    assert rel_err(kl.detach(), unfused) < 1e-4
