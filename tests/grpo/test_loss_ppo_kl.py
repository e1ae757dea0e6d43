"""The PPO loss's KL term (train.kl_beta > 0): scored with the log-prob in one fused pass from the two
velocities (kernels.sde_step_kl), it gives the loss and gradient of the unfused route (each transition's
fp32 mean, then kernels.kl_to_reference), on every kernel backend this machine runs."""
import pytest
import torch

import kernels
from kernels.sde_reference import kl_to_reference, sde_step
from paco_ds.grpo.losses.ppo import PPOClip
from paco_ds.models.base import TextEmbeds
from stub_policy import StubBatch, stub_loss

pytestmark = pytest.mark.fast

RECIPE = "configs/tiny/t2is.yaml"
W, BASE, BETA = 0.4, 0.1, 0.5


def _batch(cfg, n=3):
    g = torch.Generator().manual_seed(0)
    t_steps = len(cfg.train_timesteps)
    sig = torch.linspace(1.0, 0.0, cfg.sample.num_steps + 1)
    steps = torch.tensor(cfg.train_timesteps)
    x_t = torch.randn(n, t_steps, 4, 8, generator=g)
    sigma, sigma_next = sig[steps].expand(n, -1), sig[steps + 1].expand(n, -1)
    # x' drawn from the policy at its rollout weights (w = W - 0.05), its log-probs recorded then
    x_next = torch.empty_like(x_t)
    log_prob = torch.empty(n, t_steps)
    for t in range(t_steps):
        step = sde_step(x_t[:, t], (W - 0.05) * x_t[:, t], sigma[:, t], sigma_next[:, t], cfg.sample.noise_level,
                        sig[1].item(), noise=torch.randn(n, 4, 8, generator=g))
        x_next[:, t], log_prob[:, t] = step.prev_sample, step.log_prob
    return StubBatch(x_t=x_t, x_next=x_next, sigma=sigma.contiguous(), sigma_next=sigma_next.contiguous(),
                     sigma_max=torch.full((n,), sig[1].item()), log_prob=log_prob, steps=steps.expand(n, -1),
                     advantages=torch.tensor([1.0, -0.5, 0.25][:n]), behaviour_weight=None, condition=None,
                     embeds=TextEmbeds(torch.zeros(n, 1, 1)), height=64, width=64, positions=list(range(n)),
                     keep=torch.ones(n, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_the_fused_kl_gives_the_unfused_loss_and_gradient(backend):
    loss, policy, module, cfg = stub_loss(PPOClip, RECIPE, W, BASE, f"train.kl_beta={BETA}",
                                          f"kernels.backend={backend}", "train.ppo.clip_range=0.2")
    assert loss.fused_kl and not loss.return_mean  # no rollout writes an fp32 mean for the KL any more
    batch = _batch(cfg)
    t = 0
    value, stats = loss(module, batch, t)
    value.backward()
    assert module.forwards == 2 and stats["kl"] > 0  # the policy's forward and the reference's

    # the unfused route by hand: both transitions' means, the KL of the means, the PPO-clip term
    w = torch.tensor(W, requires_grad=True)
    x, args = batch.x_t[:, t], (batch.sigma[:, t], batch.sigma_next[:, t], cfg.sample.noise_level,
                                batch.sigma_max)
    step = sde_step(x, w * x, *args, prev_sample=batch.x_next[:, t])
    ref = sde_step(x, BASE * x, *args, prev_sample=batch.x_next[:, t])
    kl = kl_to_reference(step.mean, ref.mean, step.std).mean()
    ppo, _ = kernels.ppo_clip_loss(step.log_prob, batch.log_prob[:, t], batch.advantages, 0.2, cfg.advantage.clip,
                                   backend="torch")
    expected = ppo + BETA * kl
    expected.backward()
    assert stats["kl"] == pytest.approx(float(kl), rel=1e-5)
    assert float(value) == pytest.approx(float(expected), rel=1e-5)
    assert float(module.w.grad) == pytest.approx(float(w.grad), rel=1e-4)
    assert loss.sde_logprob_rows == 3  # one scored transition per sample (the reference's is not scored)


def test_grpo_guard_keeps_the_means_and_their_kl():
    loss, _, module, cfg = stub_loss(PPOClip, RECIPE, W, BASE, f"train.kl_beta={BETA}", "train.ppo.ratio_norm=true")
    assert not loss.fused_kl and loss.return_mean
    batch = _batch(cfg)
    batch.mean_old = torch.zeros_like(batch.x_t)
    _, stats = loss(module, batch, 0)
    assert module.forwards == 2 and stats["kl"] > 0
