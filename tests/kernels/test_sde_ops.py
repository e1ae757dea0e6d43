"""The fused SDE log-prob and KL ops on CPU (C++ backend, csrc/) and their dispatch.

The C++ extension is built on first use (about 15 s once, then cached in .torch_extensions).
Every check that asks for "cpp" fails if the torch reference runs instead (kernel_checks.py
`require_backend`): a fallback is never counted as a pass of the C++ kernels.
"""
import subprocess
import sys
import warnings

import pytest
import torch

import kernels
from conftest import REPO
from kernel_checks import (NOISE_LEVEL, SIGMA_MAX, check_kl, check_rollout_equals_training, check_sampling,
                           check_scoring, check_sde_kl, inputs, sigmas)
from kernels import cpp
from kernels.sde_reference import SDEStep, sde_step as sde_ref

pytestmark = pytest.mark.fast

# 37 x 61 is not a multiple of the 64 lanes; 129 x 65 spans 3 chunks of 4096 with a ragged tail; a
# video family's 5-D latents [B, C, F', H', W'] (Wan's 16 channels, 3 latent frames) are rows too.
SHAPES = [(3, 37, 61), (2, 129, 65), (2, 16, 3, 9, 13)]
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
    check_kl("cpp", dtype, SHAPES[2])  # 5-D video latents


@pytest.mark.parametrize("sde_type", ["flow_grpo", "cps"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_log_prob_and_kl_in_one_pass_match_float64(dtype, sde_type):
    check_sde_kl("cpp", dtype, sde_type, (3, 129, 65))
    check_sde_kl("cpp", dtype, sde_type, SHAPES[2])


def test_log_prob_and_kl_in_one_pass_on_the_torch_reference():
    check_sde_kl("torch", torch.bfloat16, "flow_grpo", (3, 37, 61))


def test_non_contiguous_inputs_are_handled():
    x, v, noise = inputs((2, 64, 40), torch.float32, seed=4)
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major strides
    sig, sig_next = sigmas(2)
    a = kernels.sde_step(x, vt, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    b = kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    assert not vt.is_contiguous()
    assert torch.equal(a.log_prob, b.log_prob) and torch.equal(a.prev_sample, b.prev_sample)


@pytest.mark.parametrize("backend, runs", [("torch", "torch"), ("cpp", "cpp"), ("auto", "cpp")],
                         ids=["torch", "cpp", "auto-is-cpp"])
def test_every_cpu_backend_returns_the_reference_types_and_gradients(backend, runs):
    assert kernels.active_backend("sde_step", "cpu", backend) == runs
    assert kernels.active_backend("kl_to_reference", "cpu", backend) == runs
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
    with pytest.raises(kernels.BackendError, match="'triton' runs on CUDA tensors, these are on cpu"):
        kernels.sde_step(*inputs((1, 4, 4), torch.float32, 0), 0.9, 0.85, NOISE_LEVEL, backend="triton",
                         prev_sample=torch.randn(1, 4, 4))
    with pytest.raises(kernels.BackendError, match="'cpp' runs on CPU tensors"):
        kernels.resolve("cpp", "cuda")
    with pytest.raises(kernels.BackendError, match="unknown backend 'fast'"):
        kernels.ppo_clip_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 1e-4, 5.0, backend="fast")


def test_which_backend_runs_each_op_on_cpu():
    table = {op: {b: kernels.active_backend(op, "cpu", b) for b in ("torch", "cpp", "auto")} for op in kernels.KERNELS}
    assert table == {"sde_step": {"torch": "torch", "cpp": "cpp", "auto": "cpp"},
                     "kl_to_reference": {"torch": "torch", "cpp": "cpp", "auto": "cpp"},
                     "sde_step_kl": {"torch": "torch", "cpp": "cpp", "auto": "cpp"},
                     "ppo_clip_loss": {"torch": "torch", "cpp": "torch", "auto": "torch"},
                     "grpo_advantages": {"torch": "torch", "cpp": "torch", "auto": "torch"},
                     "weighted_linear_ce": {"torch": "torch", "cpp": "torch", "auto": "torch"}}
    with pytest.raises(ValueError, match="unknown op 'sde'"):
        kernels.active_backend("sde", "cpu")


def test_inputs_the_cpp_op_does_not_take_run_the_reference_and_say_so():
    x, v, noise = inputs((2, 16, 8), torch.float64, seed=8)
    kernels._warned.clear()
    with pytest.warns(RuntimeWarning, match="sde_step runs the torch reference: 'cpp' takes x and v of one dtype"):
        step = kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    assert torch.equal(step.log_prob, sde_ref(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise).log_prob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per dtype pair, and never under "auto"
        kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
        kernels.sde_step(x.float(), v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="auto")


def test_a_failed_build_warns_and_every_op_asked_for_cpp_says_it_runs_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp, "_loaded", [])  # forget the build of this process (restored afterwards)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    x, v, noise = inputs((2, 16, 8), torch.float32, seed=7)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU ops could not be built .*no-such-compiler"):
        assert kernels.resolve("auto", "cpu") == "torch"
    assert kernels.active_backend("sde_step", "cpu", "cpp") == "torch" == kernels.active_backend("sde_step", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" falls back quietly: the build failure has been reported
        kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="auto")
    with pytest.warns(RuntimeWarning, match="sde_step runs the torch reference: 'cpp' is not available here"):
        step = kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")
    ref = sde_ref(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise)
    assert torch.equal(step.log_prob, ref.log_prob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op
        kernels.sde_step(x, v, 0.9, 0.85, NOISE_LEVEL, SIGMA_MAX, noise=noise, backend="cpp")


def test_kernels_imports_nothing_from_paco_ds():
    code = ("import importlib, importlib.util, pkgutil, sys, kernels\n"
            "for m in pkgutil.walk_packages(kernels.__path__, 'kernels.'):\n"
            "    if importlib.util.find_spec('triton') or not m.name.startswith('kernels._triton'):\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'paco_ds'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_backend_that_cannot_run_here_is_a_one_line_config_error(capsys):
    from paco_ds.errors import exit_on_user_error

    with pytest.raises(SystemExit) as exit_:
        with exit_on_user_error("train"):
            kernels.resolve("cpp", "cuda")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("train: error: config key 'kernels.backend': 'cpp' runs on CPU tensors, "
                                       "these are on cuda (use 'auto' or 'triton')\n")
    with pytest.raises(ValueError, match="not a backend error"):  # other ValueErrors keep their traceback
        with exit_on_user_error("train"):
            raise ValueError("not a backend error")
