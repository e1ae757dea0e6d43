"""Fused SDE transition log-prob and KL surrogate: Triton (CUDA) and C++ (CPU). The transition is
the one of kernels/sde_reference.py (PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/sde_denoising_step.py).

Why fused: the torch reference (kernels/sde_reference.py) widens x_t, v and x_{t+1} to fp32 copies,
materialises the mean, the residual and its square, and keeps fp32 intermediates for backward:
about 20 passes over the latent. Here one pass reads the inputs in their own dtype (bf16 or fp32),
computes in fp32 registers and writes one fp32 partial sum per chunk; backward recomputes the mean
from the saved inputs and writes the gradient of v in v's dtype.

Both transitions (flow_grpo and cps) are affine in (x, v). The kernels compute per-sample coefficients from
(sigma, sigma_next, sigma_max, noise level) in fp64 (csrc/sde_logprob.cpp `coefficients`,
kernels/_triton_sde.py `coefficients`), then, per element in fp32:

    mean     = cx * x + cv * v
    x'       = mean + sd * noise                (sampling; rounded to the dtype of x)
    log_prob = -k1 * sum((x' - mean)^2) - k0    (per sample; the sum runs over all non-batch elements)

Flow-GRPO: k1 = 1 / (2 N sd^2), k0 = log(sd) + log(sqrt(2 pi)), i.e. the mean of the elementwise
Gaussian log-density. CPS: k1 = 1 / N, k0 = 0 (the unnormalised -mean((x' - mean)^2)).

Determinism: a row is reduced in fixed chunks (one program / task each) whose partial sums are
combined per row in a fixed order, with no atomics. The order depends on neither the batch size
nor on sampling-vs-scoring, so the log-prob stored at rollout and the one recomputed in training
for the same transition are bitwise equal (within one backend).
"""
from __future__ import annotations

import numbers

import torch

from kernels.sde_reference import SDEStep

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SDE_TYPES = {"flow_grpo": 0, "cps": 1}

# Triton launch geometry. TRITON_CHUNK elements per program fixes the reduction tree of a row.
TRITON_CHUNK = 2048
TRITON_BLOCK = 1024


def _sigmas(x: torch.Tensor, sigma, sigma_next, sigma_max) -> torch.Tensor:
    """[B, 3] fp32 (sigma, sigma_next, sigma_max); each is a python number or a [B] / scalar tensor."""
    b = x.shape[0]
    values = (sigma, sigma_next, sigma if sigma_max is None else sigma_max)
    if all(isinstance(v, numbers.Real) for v in values):
        return torch.tensor([values], dtype=torch.float32).expand(b, 3).contiguous().to(x.device)
    if all(isinstance(v, torch.Tensor) and v.shape == (b,) and v.dtype == torch.float32 and v.device == x.device
           for v in values):
        return torch.stack(values, dim=1)  # the common case, in one op
    cols = [torch.as_tensor(v, dtype=torch.float32, device=x.device) for v in values]
    return torch.stack([c.expand(b) if c.ndim == 0 else c.reshape(b) for c in cols], dim=1).contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 16, hi: int = 1024) -> int:
    return min(hi, max(lo, 1 << (n - 1).bit_length()))


# ------------------------------------------------------------------------------------------ backends
class _TritonImpl:
    """Launchers of kernels/_triton_sde.py, imported at the first launch (see its docstring).
    Every tensor argument is a contiguous [B, N] row view (see `_rows`)."""

    @staticmethod
    def sde_fwd(x, v, src, sig, a: float, sde_type: int, sample: bool, want_mean: bool):
        from kernels import _triton_sde as k

        b, n = x.shape
        n_chunk = _cdiv(n, TRITON_CHUNK)
        partial = torch.empty(b, n_chunk, dtype=torch.float32, device=x.device)
        prev = torch.empty_like(x) if sample else None
        mean = torch.empty(b, n, dtype=torch.float32, device=x.device) if want_mean else None
        log_prob = torch.empty(b, dtype=torch.float32, device=x.device)
        std = torch.empty_like(log_prob)
        # unused pointer arguments get any tensor: the constexpr flags compile their use away
        k.sde_fwd[(n_chunk, b)](x, v, src, sig, a, partial, prev if sample else x, mean if want_mean else partial,
                                n, n_chunk, SDE_TYPE=sde_type, SAMPLE=sample, WRITE_MEAN=want_mean,
                                CHUNK=TRITON_CHUNK, BLOCK=TRITON_BLOCK)
        k.sde_finalize[(b,)](partial, sig, a, log_prob, std, n, n_chunk, SDE_TYPE=sde_type, BLOCK=_pow2(n_chunk))
        return log_prob, std, prev, mean

    @staticmethod
    def sde_bwd(x, v, xn, sig, a: float, sde_type: int, g, g_mean, need_v: bool, need_x: bool):
        from kernels import _triton_sde as k

        b, n = x.shape
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        k.sde_bwd[(_cdiv(n, TRITON_BLOCK), b)](x, v, xn, sig, a, g, g if g_mean is None else g_mean,
                                               gv if need_v else x, gx if need_x else x, n, SDE_TYPE=sde_type,
                                               HAS_GM=g_mean is not None, WRITE_GV=need_v, WRITE_GX=need_x,
                                               BLOCK=TRITON_BLOCK)
        return gv, gx

    @staticmethod
    def kl_fwd(m, mr, std):
        from kernels import _triton_sde as k

        b, n = m.shape
        n_chunk = _cdiv(n, TRITON_CHUNK)
        partial = torch.empty(b, n_chunk, dtype=torch.float32, device=m.device)
        out = torch.empty(b, dtype=torch.float32, device=m.device)
        k.kl_fwd[(n_chunk, b)](m, mr, partial, n, n_chunk, CHUNK=TRITON_CHUNK, BLOCK=TRITON_BLOCK)
        k.kl_finalize[(b,)](partial, std, out, n, n_chunk, BLOCK=_pow2(n_chunk))
        return out

    @staticmethod
    def kl_bwd(m, mr, std, g, need_m: bool, need_mr: bool):
        from kernels import _triton_sde as k

        b, n = m.shape
        gm = torch.empty_like(m) if need_m else None
        gmr = torch.empty_like(mr) if need_mr else None
        k.kl_bwd[(_cdiv(n, TRITON_BLOCK), b)](m, mr, std, g, gm if need_m else m, gmr if need_mr else m, n,
                                              WRITE_GA=need_m, WRITE_GB=need_mr, BLOCK=TRITON_BLOCK)
        return gm, gmr


class _CppImpl:
    """Allocates the outputs and calls csrc/sde_logprob.cpp (torch.ops.paco_kernels)."""

    @staticmethod
    def _ops():
        from kernels import cpp

        return cpp.ops()

    @classmethod
    def sde_fwd(cls, x, v, src, sig, a: float, sde_type: int, sample: bool, want_mean: bool):
        log_prob = torch.empty(x.shape[0], dtype=torch.float32)
        std = torch.empty_like(log_prob)
        prev = torch.empty_like(x) if sample else None
        mean = torch.empty(x.shape, dtype=torch.float32) if want_mean else None
        cls._ops().sde_fwd(x, v, src, sig, a, sde_type, sample, log_prob, std, prev, mean)
        return log_prob, std, prev, mean

    @classmethod
    def sde_bwd(cls, x, v, xn, sig, a: float, sde_type: int, g, g_mean, need_v: bool, need_x: bool):
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        cls._ops().sde_bwd(x, v, xn, sig, a, sde_type, g, g_mean, gv, gx)
        return gv, gx

    @classmethod
    def kl_fwd(cls, m, mr, std):
        out = torch.empty(m.shape[0], dtype=torch.float32)
        cls._ops().kl_fwd(m, mr, std, out)
        return out

    @classmethod
    def kl_bwd(cls, m, mr, std, g, need_m: bool, need_mr: bool):
        gm = torch.empty_like(m) if need_m else None
        gmr = torch.empty_like(mr) if need_mr else None
        cls._ops().kl_bwd(m, mr, std, g, gm, gmr)
        return gm, gmr


IMPLS = {"triton": _TritonImpl, "cpp": _CppImpl}


# ------------------------------------------------------------------------------------------ autograd
class SDELogProbFn(torch.autograd.Function):
    """(log_prob [B], std_t [B], prev [B, N] or None, mean [B, N] or None) of one SDE transition.

    Gradients flow to x and v from log_prob and from mean; the sampled x' is not differentiable
    (rollouts run without grad, and the log-prob treats x' as data, as the reference detaches it).
    Only the inputs are saved for backward, in their own dtype.
    """

    @staticmethod
    def forward(ctx, impl, x, v, src, sig, a: float, sde_type: int, sample: bool, want_mean: bool):
        log_prob, std, prev, mean = impl.sde_fwd(x, v, src, sig, a, sde_type, sample, want_mean)
        ctx.impl, ctx.a, ctx.sde_type = impl, a, sde_type
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, v, prev if sample else src, sig)
        ctx.mark_non_differentiable(*([std, prev] if sample else [std]))
        return log_prob, std, prev, mean

    @staticmethod
    def backward(ctx, g_lp, _g_std, _g_prev, g_mean):
        x, v, xn, sig = ctx.saved_tensors
        need_x, need_v = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if g_lp is None:
            g_lp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        gv, gx = ctx.impl.sde_bwd(x, v, xn, sig, ctx.a, ctx.sde_type, g_lp.float().contiguous(),
                                  None if g_mean is None else g_mean.float().contiguous(), need_v, need_x)
        return None, gx, gv, None, None, None, None, None, None


class KLFn(torch.autograd.Function):
    """Per-sample sum((mean - mean_ref)^2) / (2 N std^2); gradients to both means."""

    @staticmethod
    def forward(ctx, impl, m, mr, std):
        ctx.impl = impl
        ctx.save_for_backward(m, mr, std)
        return impl.kl_fwd(m, mr, std)

    @staticmethod
    def backward(ctx, g):
        m, mr, std = ctx.saved_tensors
        gm, gmr = ctx.impl.kl_bwd(m, mr, std, g.float().contiguous(), ctx.needs_input_grad[1],
                                  ctx.needs_input_grad[2])
        return None, gm, gmr, None


# ------------------------------------------------------------------------------------------ entry points
def supports(x: torch.Tensor, v: torch.Tensor) -> bool:
    """The fused op takes x and v of one dtype among fp32, bf16, fp16 (the dispatcher routes the rest to torch)."""
    return x.dtype == v.dtype and x.dtype in NATIVE_DTYPES


def _rows(t: torch.Tensor, allowed: tuple) -> torch.Tensor:
    t = t.reshape(t.shape[0], -1)
    return (t if t.dtype in allowed else t.float()).contiguous()


def sde_logprob(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float, sigma_max=None, *,
                prev_sample: torch.Tensor | None = None, noise: torch.Tensor | None = None,
                sde_type: str = "flow_grpo", return_mean: bool = False, backend: str) -> SDEStep:
    """The stochastic transition x -> x' of kernels/sde_reference.py with its per-sample log-prob.

    Exactly one of `prev_sample` (score a stored transition) or `noise` (sample one) is given.
    `backend` is "triton" or "cpp" (the dispatcher in kernels/__init__.py chooses); x and v must
    satisfy `supports`. The mean (fp32, shaped like x) is returned only when `return_mean`.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r} (flow_grpo or cps)")
    if noise_level <= 0:
        raise ValueError("the fused transition needs noise_level > 0 (an ODE step has no log-prob)")
    if (prev_sample is None) == (noise is None):
        raise ValueError("pass exactly one of `prev_sample` (score a transition) or `noise` (sample one)")
    sample = noise is not None
    src = _rows((noise if sample else prev_sample).detach(), (x.dtype, torch.float32))
    log_prob, std, prev, mean = SDELogProbFn.apply(IMPLS[backend], _rows(x, NATIVE_DTYPES), _rows(v, NATIVE_DTYPES),
                                                   src, _sigmas(x, sigma, sigma_next, sigma_max), float(noise_level),
                                                   SDE_TYPES[sde_type], sample, return_mean)
    return SDEStep(prev_sample=prev.view(x.shape) if sample else prev_sample, log_prob=log_prob,
                   mean=mean.view(x.shape) if return_mean else None, std=std)


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor, *, backend: str) -> torch.Tensor:
    """Per-sample mean((mean - mean_ref)^2) / (2 std^2), accumulated in fp32."""
    work = mean.dtype if mean.dtype == mean_ref.dtype and mean.dtype in NATIVE_DTYPES else torch.float32
    return KLFn.apply(IMPLS[backend], _rows(mean, (work,)), _rows(mean_ref, (work,)),
                      std.detach().reshape(-1).float().contiguous())
