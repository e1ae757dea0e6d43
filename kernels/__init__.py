"""Fused ops with one signature per op across backends; the torch reference is the ground truth.

`backend` (config key `kernels.backend`):
  "torch"  the reference in paco_ds (sampling/sde.py, grpo/loss.py; grpo.py's torch advantages);
  "cpp"    csrc/ built on first use, CPU tensors; falls back to torch with one warning if it cannot build;
  "triton" CUDA tensors (CPU tensors only under TRITON_INTERPRET=1, for tests);
  "auto"   triton for CUDA tensors, cpp for CPU tensors (torch where neither applies).

Where a backend has no kernel for an op, the op runs the torch version: the PPO loss and the
advantages work on [B] and [K, N] vectors, so "cpp" runs them in torch; an ODE step (noise level 0)
and inputs whose x and v dtypes differ or are not fp32/bf16/fp16 run the torch reference too.
The fused linear + cross-entropy of the reward-model SFT runs chunked torch rows on CPU ("cpp" too).
"""
from __future__ import annotations

import os

import torch

from paco_ds.errors import ConfigError
from paco_ds.grpo.loss import ppo_clip_loss as _ppo_ref
from paco_ds.sampling.sde import SDEStep, kl_to_reference as _kl_ref, sde_step as _sde_ref

from . import grpo as _grpo
from . import sde_logprob as _sde
from . import weighted_ce as _wce

BACKENDS = ("auto", "triton", "cpp", "torch")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cpp_ok() -> bool:
    from . import cpp

    return cpp.ops() is not None


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """The backends that run on tensors of `device` here ("cpp" builds the C++ ops on first call)."""
    kind = torch.device(device).type
    out = ["torch"]
    if kind == "cpu" and _cpp_ok():
        out.append("cpp")
    if _has_triton() and (kind == "cuda" and torch.cuda.is_available() or kind == "cpu" and _interpreting()):
        out.append("triton")
    return out


def resolve(backend: str, device: str | torch.device = "cpu") -> str:
    """The backend that runs an op on tensors of `device`: "torch", "cpp" or "triton"."""
    if backend not in BACKENDS:
        raise ConfigError(f"config key 'kernels.backend': unknown backend '{backend}' ({', '.join(BACKENDS)})")
    kind = torch.device(device).type
    if backend == "auto":
        if kind == "cuda":
            return "triton" if _has_triton() else "torch"
        return "cpp" if kind == "cpu" and _cpp_ok() else "torch"
    if backend == "cpp":
        if kind != "cpu":
            raise ConfigError(f"config key 'kernels.backend': 'cpp' runs on CPU tensors, these are on {kind} "
                              "(use 'auto' or 'triton')")
        return "cpp" if _cpp_ok() else "torch"  # cpp.ops() has warned once
    if backend == "triton":
        if not _has_triton():
            raise ConfigError("config key 'kernels.backend': 'triton' is not installed here (use 'auto')")
        if kind != "cuda" and not (kind == "cpu" and _interpreting()):
            raise ConfigError(f"config key 'kernels.backend': 'triton' runs on CUDA tensors, these are on {kind} "
                              "(use 'auto' or 'cpp')")
    return backend


def sde_step(x, v, sigma, sigma_next, noise_level, sigma_max=None, *, prev_sample=None, noise=None,
             sde_type="flow_grpo", backend="auto", return_mean=True) -> SDEStep:
    """One SDE (or ODE) step with its per-sample log-prob; see paco_ds.sampling.sde.sde_step.

    The entry point of the fused log-prob op (kernels/sde_logprob.py) for every backend.
    `return_mean=False` skips writing the fp32 mean (then `SDEStep.mean` is None), which the loss
    needs only for the KL term.
    """
    which = resolve(backend, x.device)
    if which == "torch" or noise_level == 0 or not _sde.supports(x, v):
        step = _sde_ref(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, noise=noise,
                        sde_type=sde_type)
        return step if return_mean else SDEStep(step.prev_sample, step.log_prob, None, step.std)
    return _sde.sde_logprob(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, noise=noise,
                            sde_type=sde_type, return_mean=return_mean, backend=which)



def kl_to_reference(mean, mean_ref, std, backend="auto"):
    """Per-sample mean((mean - mean_ref)^2) / (2 std^2) (fp32 accumulation in the fused backends)."""
    which = resolve(backend, mean.device)
    if which == "torch":
        return _kl_ref(mean, mean_ref, std)
    return _sde.kl_to_reference(mean, mean_ref, std, backend=which)


def weighted_linear_ce(hidden, weight, labels, coef=None, *, normalizer=None, ignore_index=-100, chunk_size=None,
                       backend="auto") -> _wce.WeightedCE:
    """sum_j coef_j * CE(hidden_j W^T, label_j) / normalizer without materialising the logits;
    see kernels/weighted_ce.py. Returns (loss, per-row CE, per-row argmax)."""
    on_cpu = hidden.device.type == "cpu"
    # No C++ kernel for this op: "auto" and "cpp" on CPU run the torch rows without building csrc/.
    which = "torch" if on_cpu and backend in ("auto", "cpp") else resolve(backend, hidden.device)
    return _wce.weighted_linear_ce(hidden, weight, labels, coef, normalizer=normalizer, ignore_index=ignore_index,
                                   chunk_size=chunk_size, backend=which)


def ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip, backend="auto"):
    """(scalar loss, detached statistics); see paco_ds.grpo.loss.ppo_clip_loss."""
    if resolve(backend, log_prob.device) == "triton":
        return _grpo.ppo_clip_loss_triton(log_prob, old_log_prob, advantages, clip_range, adv_clip)
    return _ppo_ref(log_prob, old_log_prob, advantages, clip_range, adv_clip)


def grpo_advantages(rewards, weights, group_ids, *, log_tame=None, global_std=True, std_floor=1e-6, clip=5.0,
                    backend="auto") -> _grpo.Advantages:
    """GRPO advantages of rewards [K, N] with weights [K] and group ids [N]; see kernels/grpo.py."""
    fn = _grpo.advantages_triton if resolve(backend, rewards.device) == "triton" else _grpo.advantages_torch
    return fn(rewards, torch.as_tensor(weights, dtype=torch.float64), torch.as_tensor(group_ids), log_tame=log_tame,
              global_std=global_std, std_floor=std_floor, clip=clip)
