"""Fused ops with one signature per op across backends; the torch reference is the ground truth.

kernels/ is the bottom layer: it imports nothing from paco_ds (paco_ds imports it). Each op's torch
reference lives beside its kernels: kernels/sde_reference.py (SDE step, KL surrogate), kernels/grpo.py
(advantages, PPO-clip loss), kernels/weighted_ce.py (torch rows of the fused linear + CE).

`backend` (config key `kernels.backend`):
  "torch"  the torch reference;
  "cpp"    csrc/ built on first use, CPU tensors; if it cannot build, kernels/cpp.py warns once;
  "triton" CUDA tensors (CPU tensors only under TRITON_INTERPRET=1, for tests);
  "auto"   triton for CUDA tensors, cpp for CPU tensors (torch where neither applies), except for the
           ops whose kernel measured slower than eager torch on the GPUs (AUTO_TORCH_ON_CUDA).

Not every backend has a kernel for every op (see KERNELS): the PPO loss, the advantages and the
fused linear + CE have no C++ kernel, so on CPU they run torch; an ODE step (noise level 0) and
x, v whose dtypes differ or are not fp32/bf16/fp16 run the torch reference too. The backend that
actually runs is never hidden: `active_backend(op, device, backend)` answers it, and an op asked
for "cpp" or "triton" by name that runs torch instead warns once (RuntimeWarning) per op and reason.

Errors: a backend that cannot run here raises `BackendError` (a ValueError); the log-tame of the
advantages raises `grpo.LogTameDomainError` (a ValueError). paco_ds turns them into its one-line
user errors (paco_ds/errors.py, paco_ds/grpo/advantages.py).

`import kernels` imports no torch: each function imports torch and the op's module when first
called (then the custom ops register), so `python -m kernels.bench --help` answers at once.
"""
from __future__ import annotations

import os
import warnings

BACKENDS = ("auto", "triton", "cpp", "torch")
# The fused ops are torch.library custom ops (namespace `paco`) with fake implementations and
# autograd: they run under FakeTensorMode (device "cuda" without a GPU: no kernel is launched on a
# fake tensor), on meta tensors and inside torch.compile(fullgraph=True).
# The backends with a kernel of their own for each op; every other backend runs the op in torch.
KERNELS = {
    "sde_step": ("triton", "cpp"),
    "kl_to_reference": ("triton", "cpp"),
    "sde_step_kl": ("triton", "cpp"),
    "ppo_clip_loss": ("triton",),
    "grpo_advantages": ("triton",),
    "weighted_linear_ce": ("triton",),
}


# Ops that "auto" runs in torch on CUDA tensors: their Triton kernel measured slower than eager torch on
# the GPUs it was benchmarked on (kernels/bench/results/nvidia-h100-80gb-hbm3.json and nvidia-h200.json:
# kl_fwd_bwd at 0.37-0.60x at every shape). Named by "triton" it still runs; tests/kernels/test_auto_backend.py
# holds this table to the committed benchmark results.
AUTO_TORCH_ON_CUDA = frozenset({"kl_to_reference"})


class BackendError(ValueError):
    """The requested backend cannot run on these tensors here (unknown, not installed, wrong device)."""


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
    import torch

    kind = torch.device(device).type
    out = ["torch"]
    if kind == "cpu" and _cpp_ok():
        out.append("cpp")
    if _has_triton() and (kind == "cuda" and torch.cuda.is_available() or kind == "cpu" and _interpreting()):
        out.append("triton")
    return out


def resolve(backend: str, device: str | torch.device = "cpu") -> str:
    """The backend that runs fused ops on tensors of `device`: "torch", "cpp" or "triton".

    It says nothing of a single op (see `active_backend`). "cpp" gives "torch" when the C++ ops
    cannot be built (kernels/cpp.py has warned); "auto" gives "torch" on CUDA without Triton.
    """
    import torch

    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}' ({', '.join(BACKENDS)})")
    kind = torch.device(device).type
    if backend == "auto":
        if kind == "cuda":
            return "triton" if _has_triton() else "torch"
        return "cpp" if kind == "cpu" and _cpp_ok() else "torch"
    if backend == "cpp":
        if kind != "cpu":
            raise BackendError(f"'cpp' runs on CPU tensors, these are on {kind} (use 'auto' or 'triton')")
        return "cpp" if _cpp_ok() else "torch"  # cpp.ops() has warned once
    if backend == "triton":
        if not _has_triton():
            raise BackendError("'triton' is not installed here (use 'auto')")
        if kind != "cuda" and not (kind == "cpu" and _interpreting()):
            raise BackendError(f"'triton' runs on CUDA tensors, these are on {kind} (use 'auto' or 'cpp')")
    return backend


def active_backend(op: str, device: str | torch.device = "cpu", backend: str = "auto") -> str:
    """The backend that actually runs `op` (a key of KERNELS) on tensors of `device` when `backend`
    is asked for: "torch" wherever that backend has no kernel for the op or is not available here.

    For `sde_step` this is the backend of a noised step with x and v of one dtype among fp32, bf16,
    fp16; other inputs run the torch reference (and warn once when a fused backend was named).
    """
    if op not in KERNELS:
        raise ValueError(f"unknown op '{op}' ({', '.join(KERNELS)})")
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}' ({', '.join(BACKENDS)})")
    import torch

    if torch.device(device).type == "cpu" and backend in ("auto", "cpp") and "cpp" not in KERNELS[op]:
        return "torch"  # no C++ kernel for the op: do not build csrc/ to find that out
    if torch.device(device).type == "cuda" and backend == "auto" and op in AUTO_TORCH_ON_CUDA:
        return "torch"  # the eager reference measured faster there
    which = resolve(backend, device)
    return which if which in KERNELS[op] else "torch"


_warned: set = set()


def _dispatch(op: str, device, backend: str) -> str:
    """active_backend, plus one RuntimeWarning per (op, backend, device type) where a backend asked
    for by name does not run the op, or "auto" finds no Triton for CUDA tensors."""
    import torch

    which = active_backend(op, device, backend)
    kind = torch.device(device).type
    if backend in ("cpp", "triton") and which != backend:
        why = f"'{backend}' has no kernel for it" if backend not in KERNELS[op] else \
            f"'{backend}' is not available here"
        _warn_once((op, backend, kind), f"kernels: {op} runs the torch reference: {why} "
                   "(backend 'auto' or 'torch' silences this)")
    elif backend == "auto" and kind == "cuda" and which == "torch" and op not in AUTO_TORCH_ON_CUDA:
        _warn_once((op, backend, kind), f"kernels: {op} runs the torch reference on CUDA tensors: triton is not "
                   "installed")
    return which


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def sde_step(x, v, sigma, sigma_next, noise_level, sigma_max=None, *, prev_sample=None, noise=None,
             sde_type="flow_grpo", backend="auto", return_mean=True) -> SDEStep:
    """One SDE (or ODE) step with its per-sample log-prob; see kernels/sde_reference.py sde_step.

    The entry point of the fused log-prob op (kernels/sde_logprob.py) for every backend.
    `return_mean=False` skips writing the fp32 mean (then `SDEStep.mean` is None), which the loss
    needs only for the KL term.
    """
    from . import sde_logprob as _sde
    from .sde_reference import SDEStep, sde_step as _sde_ref

    which = _dispatch("sde_step", x.device, backend)
    if which != "torch" and noise_level != 0 and not _sde.supports(x, v):
        if backend != "auto":
            _warn_once(("sde_step", backend, x.dtype, v.dtype), f"kernels: sde_step runs the torch reference: "
                       f"'{which}' takes x and v of one dtype among fp32, bf16, fp16, not {x.dtype} and {v.dtype}")
        which = "torch"
    if which == "torch" or noise_level == 0:
        step = _sde_ref(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, noise=noise,
                        sde_type=sde_type)
        return step if return_mean else SDEStep(step.prev_sample, step.log_prob, None, step.std)
    return _sde.sde_logprob(x, v, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, noise=noise,
                            sde_type=sde_type, return_mean=return_mean, backend=which)


def sde_step_kl(x, v, v_ref, sigma, sigma_next, noise_level, sigma_max=None, *, prev_sample, sde_type="flow_grpo",
                backend="auto"):
    """(SDEStep without its mean, per-sample KL): the scored step of `sde_step` and `kl_to_reference` from its
    mean to the mean of the reference velocity `v_ref` (from the same x), in one fused pass that keeps
    neither mean; see kernels/sde_logprob.py sde_logprob_kl. The log-prob is bitwise `sde_step`'s on the
    same backend. v_ref is the frozen reference's: computed under no_grad."""
    from . import sde_logprob as _sde
    from .sde_reference import sde_step_kl as _ref

    which = _dispatch("sde_step_kl", x.device, backend)
    if which != "torch" and not (_sde.supports(x, v) and v_ref.dtype == x.dtype):
        if backend != "auto":
            _warn_once(("sde_step_kl", backend, x.dtype, v.dtype, v_ref.dtype),
                       f"kernels: sde_step_kl runs the torch reference: '{which}' takes x, v and v_ref of one dtype "
                       f"among fp32, bf16, fp16, not {x.dtype}, {v.dtype} and {v_ref.dtype}")
        which = "torch"
    if which == "torch":
        return _ref(x, v, v_ref, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample, sde_type=sde_type)
    return _sde.sde_logprob_kl(x, v, v_ref, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample,
                               sde_type=sde_type, backend=which)


def kl_to_reference(mean, mean_ref, std, backend="auto"):
    """Per-sample mean((mean - mean_ref)^2) / (2 std^2) (fp32 accumulation in the fused backends)."""
    from . import sde_logprob as _sde
    from .sde_reference import kl_to_reference as _kl_ref

    which = _dispatch("kl_to_reference", mean.device, backend)
    if which == "torch":
        return _kl_ref(mean, mean_ref, std)
    return _sde.kl_to_reference(mean, mean_ref, std, backend=which)


def weighted_linear_ce(hidden, weight, labels, coef=None, *, normalizer=None, ignore_index=-100, chunk_size=None,
                       backend="auto") -> _wce.WeightedCE:
    """sum_j coef_j * CE(hidden_j W^T, label_j) / normalizer without materialising the logits;
    see kernels/weighted_ce.py. Returns (loss, per-row CE, per-row argmax)."""
    from . import weighted_ce as _wce

    which = _dispatch("weighted_linear_ce", hidden.device, backend)
    return _wce.weighted_linear_ce(hidden, weight, labels, coef, normalizer=normalizer, ignore_index=ignore_index,
                                   chunk_size=chunk_size, backend=which)


def ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip, backend="auto"):
    """(scalar loss, detached statistics); see kernels/grpo.py ppo_clip_loss_torch."""
    from . import grpo as _grpo

    if _dispatch("ppo_clip_loss", log_prob.device, backend) == "triton":
        return _grpo.ppo_clip_loss_triton(log_prob, old_log_prob, advantages, clip_range, adv_clip)
    return _grpo.ppo_clip_loss_torch(log_prob, old_log_prob, advantages, clip_range, adv_clip)


def grpo_advantages(rewards, weights, group_ids, *, log_tame=None, global_std=True, std_floor=1e-6, clip=5.0,
                    backend="auto") -> _grpo.Advantages:
    """GRPO advantages of rewards [K, N] with weights [K] and group ids [N]; see kernels/grpo.py."""
    import torch

    from . import grpo as _grpo

    which = _dispatch("grpo_advantages", rewards.device, backend)
    if which == "triton" and rewards.shape[0] > _grpo.MAX_REWARD_TYPES:
        # the kernel holds all reward types of a sample in one tile (kernels/geometry.py)
        _warn_once(("grpo_advantages", "reward types"), f"kernels: grpo_advantages runs the torch reference: the "
                   f"Triton kernel takes at most {_grpo.MAX_REWARD_TYPES} reward types, not {rewards.shape[0]}")
        which = "torch"
    fn = _grpo.advantages_triton if which == "triton" else _grpo.advantages_torch
    return fn(rewards, torch.as_tensor(weights, dtype=torch.float64), torch.as_tensor(group_ids), log_tame=log_tame,
              global_std=global_std, std_floor=std_floor, clip=clip)
