"""Fused ops with one signature per op across backends; the torch reference is the ground truth.

`backend`: "torch" (reference), "cpp" (csrc/, CPU), "triton" (CUDA), or "auto" (the fastest one
available for the tensors' device).
"""
from __future__ import annotations

from paco_ds.errors import ConfigError
from paco_ds.grpo.loss import ppo_clip_loss as _ppo_ref
from paco_ds.sampling.sde import SDEStep, kl_to_reference as _kl_ref, sde_step as _sde_ref

BACKENDS = ("auto", "triton", "cpp", "torch")


def available_backends() -> list[str]:
    return ["torch"]


def _resolve(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"config key 'kernels.backend': unknown backend '{backend}' ({', '.join(BACKENDS)})")
    if backend == "auto":
        return "torch"
    if backend not in available_backends():
        raise ConfigError(f"config key 'kernels.backend': backend '{backend}' is not available here "
                          f"(available: {', '.join(available_backends())})")
    return backend


def sde_step(x, v, sigma, sigma_next, noise_level, sigma_max=None, *, prev_sample=None, noise=None,
             sde_type="flow_grpo", backend="auto") -> SDEStep:
    _resolve(backend)
    return _sde_ref(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, noise=noise,
                    sde_type=sde_type)


def kl_to_reference(mean, mean_ref, std, backend="auto"):
    _resolve(backend)
    return _kl_ref(mean, mean_ref, std)


def ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip, backend="auto"):
    _resolve(backend)
    return _ppo_ref(log_prob, old_log_prob, advantages, clip_range, adv_clip)
