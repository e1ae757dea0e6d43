"""The FLUX schedule (golden numbers: diffusers' time shift with FLUX.1-dev's scheduler config, as
PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/flux_pipeline.py applies it) and the SDE step with log-probs."""
import math

import pytest
import torch

from kernels.sde_reference import kl_to_reference, sde_step, transition_stats
from paco_ds.models.schedule import calculate_mu, flux_sigmas

pytestmark = pytest.mark.fast


def test_flux_sigma_table_512():
    s = flux_sigmas(10, (512 // 16) ** 2)
    assert calculate_mu(1024) == pytest.approx(0.630, abs=1e-3)
    want = [1, .9441, .8825, .8142, .7380, .6525, .5559, .4459, .3195, .1726, 0]
    assert s.tolist() == pytest.approx(want, abs=5e-5)


def test_flux_sigmas_1024_and_kontext_384():
    s = flux_sigmas(10, (1024 // 16) ** 2)
    assert calculate_mu(4096) == pytest.approx(1.15)
    assert (s[1].item(), s[2].item()) == pytest.approx((.9660, .9266), abs=5e-5)
    k = flux_sigmas(8, (384 // 16) ** 2)
    assert calculate_mu(576) == pytest.approx(0.554, abs=1e-3)
    assert (k[1].item(), k[2].item()) == pytest.approx((.9241, .8393), abs=5e-5)


def _noise_std(sigmas, a, j=1):
    x = torch.zeros(1, 4, 4)
    _, std_t, std_dev = transition_stats(x, x, sigmas[j], sigmas[j + 1], a, sigmas[1])
    return std_t.item(), std_dev.item()


def test_noise_std_golden():
    s = flux_sigmas(10, 1024)
    assert (s[2] - s[1]).item() == pytest.approx(-0.0616, abs=1e-4)
    std_t, std_dev = _noise_std(s, 0.7)
    assert std_t == pytest.approx(2.878, abs=2e-3) and std_dev == pytest.approx(0.714, abs=1e-3)
    k = flux_sigmas(8, 576)
    assert _noise_std(k, 0.9)[1] == pytest.approx(0.915, abs=1e-3)


def _inputs(dtype=torch.float32, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, 8, generator=g).to(dtype)
    v = torch.randn(b, 16, 8, generator=g).to(dtype)
    noise = torch.randn(b, 16, 8, generator=g)
    return x, v, noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_prob_is_the_closed_form_gaussian(dtype):
    x, v, noise = _inputs(dtype)
    sig, sig_next = torch.tensor([0.94, 0.88, 0.81]), torch.tensor([0.88, 0.81, 0.74])
    step = sde_step(x, v, sig, sig_next, 0.7, 0.94, noise=noise)
    # independent formula in float64
    s, sn = sig.double().view(-1, 1, 1), sig_next.double().view(-1, 1, 1)
    dt = sn - s
    std_t = 0.7 * torch.sqrt(s / (1 - s))
    mean = x.double() * (1 + std_t**2 / (2 * s) * dt) + v.double() * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    sd = std_t * torch.sqrt(-dt)
    want = torch.distributions.Normal(mean, sd).log_prob(step.prev_sample.double()).mean(dim=(1, 2))
    assert torch.allclose(step.log_prob.double(), want, rtol=0, atol=1e-4)
    assert step.prev_sample.dtype == dtype and step.log_prob.dtype == torch.float32


def test_sigma_one_uses_sigma_max():
    x, v, noise = _inputs()
    step = sde_step(x, v, 1.0, 0.94, 0.7, 0.94, noise=noise)
    assert torch.isfinite(step.log_prob).all()
    assert step.std[0].item() == pytest.approx(0.7 * math.sqrt(1 / (1 - 0.94)), rel=1e-5)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
def test_noise_level_zero_is_the_euler_step(sde_type):
    x, v, _ = _inputs()
    step = sde_step(x, v, 0.8, 0.7, 0.0, 0.94, sde_type=sde_type)
    assert step.log_prob is None
    assert torch.allclose(step.prev_sample, x + v * (0.7 - 0.8), atol=1e-6)


def test_cps_branch():
    x, v, noise = _inputs()
    a, s, sn = 0.8, 0.8, 0.7
    step = sde_step(x, v, s, sn, a, 0.94, noise=noise, sde_type="cps")
    std = sn * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mean = x0 * (1 - sn) + x1 * math.sqrt(sn**2 - std**2)
    assert torch.allclose(step.mean, mean, atol=1e-6)
    assert torch.allclose(step.prev_sample, mean + std * noise, atol=1e-6)
    assert torch.allclose(step.log_prob, -((step.prev_sample - mean) ** 2).mean(dim=(1, 2)), atol=1e-6)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
def test_scoring_a_sampled_transition_reproduces_its_log_prob_bitwise(sde_type):
    x, v, noise = _inputs(torch.bfloat16)
    sampled = sde_step(x, v, 0.9, 0.85, 0.7, 0.95, noise=noise, sde_type=sde_type)
    scored = sde_step(x, v, 0.9, 0.85, 0.7, 0.95, prev_sample=sampled.prev_sample, sde_type=sde_type)
    assert torch.equal(sampled.log_prob, scored.log_prob)


def test_log_prob_gradient_reaches_x_and_v_through_the_mean_never_through_the_sample():
    """The log-prob treats x' as data: its gradient reaches x and v only through the mean,
    d lp / d mean = (x' - mean) / (N sd^2) per element, and the stored sample gets none."""
    x, v, noise = _inputs()
    x.requires_grad_(True)
    v.requires_grad_(True)
    with torch.no_grad():  # as rollouts sample
        prev = sde_step(x, v, 0.9, 0.85, 0.7, 0.95, noise=noise).prev_sample
    prev.requires_grad_(True)
    step = sde_step(x, v, 0.9, 0.85, 0.7, 0.95, prev_sample=prev)
    step.log_prob.sum().backward()
    assert prev.grad is None
    mean, std_t, sd = transition_stats(x.detach(), v.detach(), 0.9, 0.85, 0.7, 0.95)
    n = x[0].numel()
    g_mean = (prev.detach() - mean) / (n * sd.view(-1, 1, 1) ** 2)
    s, dt = 0.9, 0.85 - 0.9
    cx = 1 + std_t**2 / (2 * s) * dt  # mean = cx * x + cv * v
    cv = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    assert torch.allclose(x.grad, g_mean * cx.view(-1, 1, 1), rtol=1e-4, atol=1e-7)
    assert torch.allclose(v.grad, g_mean * cv.view(-1, 1, 1), rtol=1e-4, atol=1e-7)
    assert v.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_kl_surrogate():
    m1, m2 = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    kl = kl_to_reference(m1, m2, torch.tensor([1.0, 2.0]))
    assert kl.tolist() == pytest.approx([0.5, 0.125])
