"""The fused ops as torch custom ops: fake CUDA tensors, meta tensors, torch.compile(fullgraph=True).

No GPU here: FakeTensorMode makes tensors that claim device "cuda", so `backend="auto"` picks Triton
as on a GPU, and only the ops' fake implementations may run (a real launch would fail: no driver).
The compiled micro-step (the first inductor compile, about half a minute) is tests/kernels/test_custom_ops_compiled.py's.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels
from kernels import sde_logprob

pytestmark = pytest.mark.fast

pytest.importorskip("triton")
B, L, C = 2, 16, 8


def _fake_cuda(*shapes, dtype=torch.bfloat16, grad=False):
    out = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
    for t in out:
        t.requires_grad_(grad)
    return out


def test_ops_are_registered_with_fake_impls():
    from kernels import grpo, weighted_ce  # noqa: F401 - `import kernels` alone imports no op (nor torch)

    for name in ("sde_logprob", "sde_logprob_backward", "sde_logprob_kl", "sde_logprob_kl_backward",
                 "kl_to_reference", "kl_to_reference_backward", "ppo_clip",
                 "ppo_clip_backward", "grpo_advantages", "weighted_linear_ce"):
        op = getattr(torch.ops.paco, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") or \
            torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sde_step_and_kl_on_fake_cuda_tensors(dtype):
    with FakeTensorMode(allow_non_fake_inputs=False):
        x, v, noise = _fake_cuda((B, L, C), (B, L, C), (B, L, C), dtype=dtype)
        vg = v.clone().requires_grad_(True)
        sig = torch.full((B,), 0.9, device="cuda")
        assert kernels.active_backend("sde_step", x.device) == "triton"
        rollout = kernels.sde_step(x, v, sig, sig - 0.05, 0.7, sig, noise=noise)
        assert rollout.prev_sample.shape == x.shape and rollout.prev_sample.dtype == dtype
        assert rollout.prev_sample.device.type == "cuda" and rollout.mean.dtype == torch.float32
        step = kernels.sde_step(x, vg, sig, sig - 0.05, 0.7, sig, prev_sample=rollout.prev_sample)
        assert step.log_prob.shape == (B,) and step.log_prob.dtype == torch.float32
        assert step.log_prob.device.type == "cuda" and step.std.shape == (B,)
        kl = kernels.kl_to_reference(step.mean, rollout.mean, step.std)
        assert kl.shape == (B,) and kl.device.type == "cuda"
        # torch's autograd engine wants a real CUDA device for a backward on fake CUDA tensors, so
        # the backward ops' fake implementations are called as the registered autograd calls them
        g = torch.empty(B, device="cuda")
        gv, gx = torch.ops.paco.sde_logprob_backward(x, v, rollout.prev_sample, torch.stack([sig] * 3, 1), 0.7, 0,
                                                     g, None, True, False, "triton")
        assert gv.shape == v.shape and gv.dtype == dtype and gv.device.type == "cuda" and gx.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sde_step_and_kl_backward_on_meta_tensors(dtype):
    x = torch.empty(B, L, C, dtype=dtype, device="meta")
    v = torch.empty(B, L, C, dtype=dtype, device="meta", requires_grad=True)
    sig = torch.full((B,), 0.9, device="meta")
    step = sde_logprob.sde_logprob(x, v, sig, sig - 0.05, 0.7, sig, prev_sample=x, backend="triton",
                                    return_mean=True)
    kl = sde_logprob.kl_to_reference(step.mean, step.mean.detach(), step.std, backend="triton")
    (step.log_prob.sum() + kl.sum()).backward()
    assert v.grad.shape == v.shape and v.grad.dtype == dtype and v.grad.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_log_prob_and_kl_in_one_pass_on_fake_cuda_and_meta_tensors(dtype):
    with FakeTensorMode(allow_non_fake_inputs=False):
        x, v, v_ref, prev = _fake_cuda((B, L, C), (B, L, C), (B, L, C), (B, L, C), dtype=dtype)
        sig = torch.full((B,), 0.9, device="cuda")
        assert kernels.active_backend("sde_step_kl", x.device) == "triton"  # not in AUTO_TORCH_ON_CUDA
        step, kl = kernels.sde_step_kl(x, v.requires_grad_(True), v_ref, sig, sig - 0.05, 0.7, sig, prev_sample=prev)
        assert step.mean is None and step.log_prob.shape == kl.shape == (B,) and kl.device.type == "cuda"
        g = torch.empty(B, device="cuda")
        gv, gx = torch.ops.paco.sde_logprob_kl_backward(x, v, v_ref, prev, torch.stack([sig] * 3, 1), 0.7, 0, g, g,
                                                        True, False, "triton")
        assert gv.shape == v.shape and gv.dtype == dtype and gv.device.type == "cuda" and gx.numel() == 0
    meta = [torch.empty(B, L, C, dtype=dtype, device="meta") for _ in range(3)]
    vg = meta[1].clone().requires_grad_(True)
    step, kl = sde_logprob.sde_logprob_kl(meta[0], vg, meta[2], torch.full((B,), 0.9, device="meta"), 0.85, 0.7,
                                          prev_sample=meta[0], backend="triton")
    (step.log_prob.sum() + kl.sum()).backward()
    assert vg.grad.shape == vg.shape and vg.grad.dtype == dtype and vg.grad.device.type == "meta"
    with pytest.raises(ValueError, match="v_ref must not require a gradient"):
        sde_logprob.sde_logprob_kl(meta[0], vg, vg, 0.9, 0.85, 0.7, prev_sample=meta[0], backend="triton")


def test_ppo_and_advantages_on_fake_cuda_tensors():
    with FakeTensorMode():
        lp = torch.empty(6, device="cuda", requires_grad=True)
        old, adv = torch.empty(6, device="cuda"), torch.empty(6, device="cuda")
        assert kernels.active_backend("ppo_clip_loss", lp.device) == "triton"
        loss, stats = kernels.ppo_clip_loss(lp, old, adv, 1e-4, 5.0)
        assert loss.shape == () and loss.device.type == "cuda" and stats["clipfrac"].shape == ()
        grad = torch.ops.paco.ppo_clip_backward(lp, old, adv, torch.empty(1, device="cuda"), 1e-4, 5.0)
        assert grad.shape == (6,) and grad.dtype == torch.float32 and grad.device.type == "cuda"
        rewards = torch.empty(3, 6, device="cuda")
        out = kernels.grpo_advantages(rewards, [1.0, 0.5, 2.0], torch.arange(6, device="cuda") // 2, log_tame="median")
        assert out.advantages.shape == (6,) and out.advantages.dtype == torch.float64
        assert out.advantages.device.type == "cuda" and out.tamed.shape == (3,) and out.tamed.dtype == torch.bool


def test_weighted_linear_ce_on_fake_cuda_and_meta_tensors():
    for mode, device in ((FakeTensorMode(), "cuda"), (torch.device("meta"), "meta")):
        with mode:
            h = torch.empty(2, 5, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
            w = torch.empty(151936, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
            y = torch.zeros(2, 5, dtype=torch.int64, device=device)
            out = kernels.weighted_linear_ce(h, w, y, backend="triton" if device == "cuda" else "torch")
            assert out.loss.shape == () and out.token_loss.shape == (2, 5) and out.predictions.dtype == torch.int64
            assert out.loss.device.type == device and out.token_loss.device.type == device
            if device == "meta":
                out.loss.backward()
                assert h.grad.shape == h.shape and h.grad.dtype == torch.bfloat16 and w.grad.shape == w.shape


def test_sde_step_on_meta_tensors_with_cpp_backend():
    x = torch.empty(B, L, C, device="meta")
    step = sde_logprob.sde_logprob(x, x, 0.9, 0.85, 0.7, 0.9, prev_sample=x, backend="cpp", return_mean=True)
    assert step.log_prob.shape == (B,) and step.mean.shape == x.shape and step.log_prob.device.type == "meta"


def test_a_host_tensor_in_a_fused_op_on_fake_cuda_raises():
    """As torch's ops do under FakeTensorMode (and a kernel would on a GPU): the fake impl of the
    Triton SDE op does not hide a CPU noise tensor among CUDA inputs."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with FakeTensorMode():
        x = torch.empty(B, L, C, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(FakeTensorDeviceMismatchError):
            kernels.sde_step(x, x, 0.9, 0.85, 0.7, 0.9, noise=torch.empty(B, L, C), backend="triton")
        with pytest.raises(FakeTensorDeviceMismatchError):
            lp = torch.empty(4, device="cuda")
            kernels.ppo_clip_loss(lp, torch.empty(4), torch.empty_like(lp), 0.2, 5.0)
