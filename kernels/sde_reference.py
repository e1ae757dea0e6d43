"""The torch reference of the SDE ops: one denoising step with its log-prob, and the KL surrogate.

PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/sde_denoising_step.py (Flow-GRPO's SDE, arXiv 2505.05470,
and its CPS variant). This is the ground truth for the fused kernels beside it (kernels/sde_logprob.py,
csrc/sde_logprob.cpp, kernels/_triton_sde.py) and the "torch" backend of `kernels.sde_step` and
`kernels.kl_to_reference`: everything is computed in fp32 whatever the input dtype, and the log-prob
is the per-element Gaussian density averaged over all non-batch elements (one scalar per sample,
as in Flow-GRPO and PaCo).

The same function serves sampling (pass `noise`: x' = mean + std_dev * noise) and training
(pass the stored `prev_sample`), so both paths score a transition with identical arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStep:
    prev_sample: torch.Tensor  # x_{t+1}, in the dtype of x
    log_prob: torch.Tensor | None  # [B] fp32; None for a deterministic (ODE) step
    mean: torch.Tensor | None  # transition mean, fp32 (None when kernels.sde_step had return_mean=False)
    std: torch.Tensor  # [B] fp32: std_t of the reference (KL denominator); 0 for ODE


def _per_sample(value, batch: int, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    return t.expand(batch) if t.ndim == 0 else t.reshape(batch)


def transition_stats(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float, sigma_max,
                     sde_type: str = "flow_grpo") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, std_t, std_dev) of p(x_{t+1} | x_t) in fp32; std_dev is the std of the injected noise."""
    b = x.shape[0]
    view = (b,) + (1,) * (x.ndim - 1)
    s = _per_sample(sigma, b, x.device).reshape(view)
    s_next = _per_sample(sigma_next, b, x.device).reshape(view)
    x32, v32 = x.float(), v.float()
    if sde_type == "flow_grpo":
        s_max = _per_sample(sigma_max, b, x.device).reshape(view)
        dt = s_next - s
        # sigma == 1 at step 0 would divide by zero: the reference substitutes sigma_max there.
        s_safe = torch.where(s == 1, s_max, s)
        std_t = noise_level * torch.sqrt(s / (1 - s_safe))
        mean = x32 * (1 + std_t**2 / (2 * s) * dt) + v32 * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std_dev = std_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        std_t = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x32 - s * v32
        x1 = x32 + (1 - s) * v32
        mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std_t**2)
        std_dev = std_t
    else:
        raise ValueError(f"unknown sde_type {sde_type!r} (flow_grpo or cps)")
    return mean, std_t.reshape(b), std_dev.reshape(b)


def gaussian_log_prob(prev_sample: torch.Tensor, mean: torch.Tensor, std_dev: torch.Tensor,
                      sde_type: str = "flow_grpo") -> torch.Tensor:
    """Per-sample mean over elements of log N(x'; mean, std_dev^2) (CPS: the unnormalised -(x'-mean)^2)."""
    b = prev_sample.shape[0]
    view = (b,) + (1,) * (prev_sample.ndim - 1)
    diff = prev_sample.detach().float() - mean
    if sde_type == "cps":
        lp = -(diff**2)
    else:
        sd = std_dev.reshape(view)
        lp = -(diff**2) / (2 * sd**2) - torch.log(sd) - LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float, sigma_max=None, *,
             prev_sample: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             sde_type: str = "flow_grpo") -> SDEStep:
    """One step from x (at sigma) to x' (at sigma_next) given velocity v.

    noise_level == 0 is the Euler ODE step x + v * (sigma_next - sigma), with no log-prob.
    Otherwise exactly one of `prev_sample` (score a stored transition) or `noise` (sample one) is given.
    """
    if sigma_max is None:
        sigma_max = sigma
    mean, std_t, std_dev = transition_stats(x, v, sigma, sigma_next, noise_level, sigma_max, sde_type)
    if noise_level == 0:
        out = mean.to(x.dtype) if prev_sample is None else prev_sample
        return SDEStep(prev_sample=out, log_prob=None, mean=mean, std=std_t)
    if prev_sample is None:
        if noise is None:
            raise ValueError("sampling an SDE step needs `noise` (or pass `prev_sample` to score one)")
        view = (x.shape[0],) + (1,) * (x.ndim - 1)
        # Round to the latent dtype first, so the log-prob is that of the stored transition.
        prev_sample = (mean + std_dev.reshape(view) * noise.float()).to(x.dtype)
    log_prob = gaussian_log_prob(prev_sample, mean, std_dev, sde_type)
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std_t)


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample mean((mu_theta - mu_ref)^2) / (2 std_t^2), the reference's KL surrogate."""
    b = mean.shape[0]
    sq = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return sq / (2 * std.reshape(b) ** 2)


def sde_step_kl(x: torch.Tensor, v: torch.Tensor, v_ref: torch.Tensor, sigma, sigma_next, noise_level: float,
                sigma_max=None, *, prev_sample: torch.Tensor,
                sde_type: str = "flow_grpo") -> tuple[SDEStep, torch.Tensor]:
    """The scored step of `sde_step` and `kl_to_reference` from its mean to the mean of the reference
    velocity `v_ref` from the same x: (the step, without its mean; the per-sample KL)."""
    if noise_level == 0:
        raise ValueError("the KL surrogate needs an SDE step (noise_level > 0): an ODE step has std 0")
    if sigma_max is None:
        sigma_max = sigma
    step = sde_step(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, sde_type=sde_type)
    mean_ref, _, _ = transition_stats(x, v_ref, sigma, sigma_next, noise_level, sigma_max, sde_type)
    kl = kl_to_reference(step.mean, mean_ref, step.std)
    return SDEStep(step.prev_sample, step.log_prob, None, step.std), kl
