"""The fused ops compiled: a trained micro-step (the SDE log-prob, the PPO-clip loss and the KL, forward and
backward) through inductor with fullgraph=True equals eager. The runs tier (`make test-runs`): the first
inductor compile takes about half a minute of a core, past the fast tier's room."""
import pytest
import torch

import kernels

pytestmark = pytest.mark.runs

B, L, C = 2, 16, 8


def test_compiled_logprob_and_ppo_micro_step_equals_eager():
    """A trained micro-step (log-prob of a stored transition, PPO-clip loss, backward) compiled by
    inductor with fullgraph=True (a graph break fails) equals eager, value and gradient."""
    if kernels.active_backend("sde_step", "cpu", "cpp") != "cpp":
        pytest.skip("the C++ ops cannot be built here")
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(B, L, C, generator=g) for _ in range(3))
    sig = torch.tensor([0.9, 0.8])
    prev = kernels.sde_step(x, v, sig, sig - 0.05, 0.7, sig, noise=noise, backend="cpp").prev_sample
    old = torch.tensor([-1.1, -0.9])
    adv = torch.tensor([0.7, -1.3])

    def micro_step(v):
        step = kernels.sde_step(x, v, sig, sig - 0.05, 0.7, sig, prev_sample=prev, backend="cpp")
        loss, _ = kernels.ppo_clip_loss(step.log_prob, old, adv, 0.2, 5.0, backend="auto")  # torch on CPU
        kl = kernels.kl_to_reference(step.mean, step.mean.detach() + 0.01, step.std, backend="cpp").mean()
        return loss + 0.1 * kl

    def value_and_grad(fn):
        vg = v.clone().requires_grad_(True)
        loss = fn(vg)
        loss.backward()
        return loss.detach(), vg.grad

    torch._dynamo.reset()
    compiled = torch.compile(micro_step, backend="inductor", fullgraph=True)
    eager_loss, eager_grad = value_and_grad(micro_step)
    loss, grad = value_and_grad(compiled)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-6, atol=1e-9)
    assert grad.abs().sum() > 0
