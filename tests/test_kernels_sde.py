"""The fused SDE log-prob and KL ops on CPU (C++ backend, csrc/) and their dispatch.

The C++ extension is built on first use (about 15 s once, then cached in .torch_extensions).
"""
import warnings

import pytest
import torch

import kernels
from kernels import cpp
from kernel_checks import (NOISE_LEVEL, SIGMA_MAX, check_kl, check_rollout_equals_training, check_sampling,
                           check_scoring, inputs, sigmas)
from paco_ds.errors import ConfigError
from paco_ds.grpo.loss import ppo_clip_loss as ppo_ref
from paco_ds.sampling.sde import SDEStep, sde_step as sde_ref

# 37 x 61 is not a multiple of the 64 lanes; 129 x 65 spans 3 chunks of 4096 with a ragged tail.
SHAPES = [(3, 37, 61), (2, 129, 65)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpp.ops() is None:
        pytest.fail("the C++ ops did not build on this machine")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scoring_matches_float64(dtype, sde_type, shape):
    check_scoring("cpp", dtype, sde_type, shape)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_sampling_matches_float64(dtype, sde_type):
    check_sampling("cpp", dtype, sde_type, SHAPES[1])


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rollout_and_training_log_probs_are_bitwise_equal(dtype, sde_type):
    check_rollout_equals_training("cpp", dtype, sde_type, (4, 129, 65))


def test_results_do_not_depend_on_the_thread_count():
    x, v, noise = inputs((4, 300, 64), torch.bfloat16, seed=3)
    sig, sig_next = sigmas(4)
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            vg = v.clone().requires_grad_(True)
            step = kernels.sde_step(x, vg, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
            step.log_prob.sum().backward()
            out.append((step.prev_sample, step.log_prob, step.mean, vg.grad))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_matches_float64(dtype):
    check_kl("cpp", dtype, (3, 129, 65))


def test_non_contiguous_inputs_are_handled():
    x, v, noise = inputs((2, 64, 40), torch.float32, seed=4)
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major strides
    sig, sig_next = sigmas(2)
    a = kernels.sde_step(x, vt, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    b = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    assert not vt.is_contiguous()
    assert torch.equal(a.log_prob, b.log_prob) and torch.equal(a.prev_sample, b.prev_sample)


@pytest.mark.parametrize("backend", ["torch", "cpp", "auto"])
def test_every_cpu_backend_returns_the_reference_types_and_gradients(backend):
    x, v, noise = inputs((2, 16, 8), torch.bfloat16, seed=5)
    v.requires_grad_(True)
    step = kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend=backend)
    ref = sde_ref(x, v.detach(), 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise)
    assert isinstance(step, SDEStep) and step.prev_sample.dtype == torch.bfloat16
    assert step.log_prob.dtype == torch.float32 and step.std.shape == (2,) and step.mean.dtype == torch.float32
    assert torch.allclose(step.log_prob, ref.log_prob, rtol=0, atol=1e-5)
    kl = kernels.kl_to_reference(step.mean, ref.mean, step.std, backend=backend)
    (step.log_prob.sum() + kl.sum()).backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["cpp", "auto"])
def test_ode_steps_run_the_reference(backend):
    x, v, _ = inputs((2, 16, 8), torch.bfloat16, seed=6)
    step = kernels.sde_step(x, v, 0.8, 0.7, 0.0, SIGMA_MAX, backend=backend)
    ref = sde_ref(x, v, 0.8, 0.7, 0.0, SIGMA_MAX)
    assert step.log_prob is None and torch.equal(step.prev_sample, ref.prev_sample)


def test_auto_picks_cpp_on_cpu_and_triton_only_for_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.resolve("auto", "cpu") == "cpp"
    assert "cpp" in kernels.available_backends("cpu") and "triton" not in kernels.available_backends("cpu")
    assert kernels.resolve("auto", "cuda") in ("triton", "torch")
    with pytest.raises(ConfigError, match="kernels.backend.*'triton' runs on CUDA tensors"):
        kernels.sde_step(*inputs((1, 4, 4), torch.float32, 0), 0.9, 0.85, NOISE_LEVEL, backend="triton",
                         prev_sample=torch.randn(1, 4, 4))
    with pytest.raises(ConfigError, match="kernels.backend.*'cpp' runs on CPU tensors"):
        kernels.resolve("cpp", "cuda")
    with pytest.raises(ConfigError, match="kernels.backend.*unknown backend 'fast'"):
        kernels.ppo_clip_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 1e-4, 5.0, backend="fast")


def test_a_failed_build_warns_once_and_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp, "_loaded", [])  # forget the build of this process (restored afterwards)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    x, v, noise = inputs((2, 16, 8), torch.float32, seed=7)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU ops could not be built .*no-such-compiler"):
        assert kernels.resolve("auto", "cpu") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning was given once, not again
        step = kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    ref = sde_ref(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise)
    assert torch.equal(step.log_prob, ref.log_prob)


def test_ppo_loss_on_cpu_is_the_reference():
    lp, old, adv = torch.randn(8) * 1e-4, torch.randn(8) * 1e-4, torch.randn(8)
    loss, stats = kernels.ppo_clip_loss(lp, old, adv, 1e-4, 5.0, backend="cpp")
    ref_loss, ref_stats = ppo_ref(lp, old, adv, 1e-4, 5.0)
    assert torch.equal(loss, ref_loss) and stats.keys() == ref_stats.keys()
