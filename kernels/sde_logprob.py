"""Fused SDE transition log-prob (REFERENCE.md §2.1) and KL surrogate: Triton (CUDA) and C++ (CPU).

Why fused: the torch reference (`paco_ds.sampling.sde`) widens x_t, v and x_{t+1} to fp32 copies,
materialises the mean, the residual and its square, and keeps fp32 intermediates for backward:
about 20 passes over the latent. Here one pass reads the inputs in their own dtype (bf16 or fp32),
computes in fp32 registers and writes one fp32 partial sum per chunk; backward recomputes the mean
from the saved inputs and writes the gradient of v in v's dtype.

Both transitions of §2.1 are affine in (x, v), so every backend shares per-sample coefficients
computed here in fp32 (`transition_coefficients`):

    mean     = cx * x + cv * v
    x'       = mean + sd * noise                (sampling; rounded to the dtype of x)
    log_prob = -k1 * sum((x' - mean)^2) - k0    (per sample; the sum runs over all non-batch elements)

Flow-GRPO: k1 = 1 / (2 N sd^2), k0 = log(sd) + log(sqrt(2 pi)), i.e. the mean of the elementwise
Gaussian log-density. CPS: k1 = 1 / N, k0 = 0 (the unnormalised -mean((x' - mean)^2)).

Determinism: a row is reduced in fixed chunks (one program / task each) whose partial sums are
combined by a per-row kernel in a fixed order, with no atomics. The order depends on neither the
batch size nor on sampling-vs-scoring, so the log-prob stored at rollout and the one recomputed in
training for the same transition are bitwise equal (within one backend).
"""
from __future__ import annotations

import math

import torch

from paco_ds.sampling.sde import SDEStep

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SDE_TYPES = ("flow_grpo", "cps")

# Triton launch geometry. TRITON_CHUNK elements per program fixes the reduction tree of a row.
TRITON_CHUNK = 2048
TRITON_BLOCK = 1024


def _per_sample(value, batch: int, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    return t.expand(batch) if t.ndim == 0 else t.reshape(batch)


def transition_coefficients(x: torch.Tensor, sigma, sigma_next, noise_level: float, sigma_max=None,
                            sde_type: str = "flow_grpo") -> tuple[torch.Tensor, torch.Tensor]:
    """(coef [B, 5] = (cx, cv, sd, k1, k0), std_t [B]), all fp32; see the module docstring."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r} (flow_grpo or cps)")
    b, n = x.shape[0], x[0].numel()
    s = _per_sample(sigma, b, x.device)
    s_next = _per_sample(sigma_next, b, x.device)
    if sde_type == "flow_grpo":
        s_max = _per_sample(sigma if sigma_max is None else sigma_max, b, x.device)
        dt = s_next - s
        s_safe = torch.where(s == 1, s_max, s)  # sigma == 1 at step 0: the reference substitutes sigma_max
        std_t = noise_level * torch.sqrt(s / (1 - s_safe))
        cx = 1 + std_t**2 / (2 * s) * dt
        cv = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        sd = std_t * torch.sqrt(-dt)
        k1 = 1 / (2 * n * sd**2)
        k0 = torch.log(sd) + LOG_SQRT_2PI
    else:
        std_t = s_next * math.sin(noise_level * math.pi / 2)
        root = torch.sqrt(s_next**2 - std_t**2)
        # mean = (x - s v)(1 - s') + (x + (1 - s) v) * root, regrouped by x and v
        cx = (1 - s_next) + root
        cv = (1 - s) * root - s * (1 - s_next)
        sd = std_t
        k1 = torch.full_like(s, 1 / n)
        k0 = torch.zeros_like(s)
    return torch.stack([cx, cv, sd, k1, k0], dim=1).contiguous(), std_t


# ------------------------------------------------------------------------------------------ Triton
def _tk():
    from kernels import _triton_sde

    return _triton_sde


def _finalize_block(n_chunk: int) -> int:
    return min(1024, max(16, 1 << (n_chunk - 1).bit_length()))


class _TritonImpl:
    """Launchers; every tensor argument is a contiguous [B, N] row view (see `_rows`)."""

    @staticmethod
    def sde_fwd(x, v, src, coef, sample: bool, want_mean: bool):
        k = _tk()
        b, n = x.shape
        n_chunk = triton_cdiv(n, TRITON_CHUNK)
        partial = torch.empty(b, n_chunk, dtype=torch.float32, device=x.device)
        prev = torch.empty_like(x) if sample else None
        mean = torch.empty(b, n, dtype=torch.float32, device=x.device) if want_mean else None
        log_prob = torch.empty(b, dtype=torch.float32, device=x.device)
        k.sde_fwd[(n_chunk, b)](x, v, src, coef, partial, prev if sample else x, mean if want_mean else partial,
                                   n, n_chunk, SAMPLE=sample, WRITE_MEAN=want_mean, CHUNK=TRITON_CHUNK,
                                   BLOCK=TRITON_BLOCK)
        k.row_finalize[(b,)](partial, coef, log_prob, n_chunk, COEF_STRIDE=5, SDE=True,
                                BLOCK=_finalize_block(n_chunk))
        return log_prob, prev, mean

    @staticmethod
    def sde_bwd(x, v, xn, coef, g, g_mean, need_v: bool, need_x: bool):
        b, n = x.shape
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        _tk().sde_bwd[(triton_cdiv(n, TRITON_BLOCK), b)](
            x, v, xn, coef, g, g_mean if g_mean is not None else g, gv if need_v else x, gx if need_x else x, n,
            HAS_GM=g_mean is not None, WRITE_GV=need_v, WRITE_GX=need_x, BLOCK=TRITON_BLOCK)
        return gv, gx

    @staticmethod
    def kl_fwd(m, mr, scale):
        k = _tk()
        b, n = m.shape
        n_chunk = triton_cdiv(n, TRITON_CHUNK)
        partial = torch.empty(b, n_chunk, dtype=torch.float32, device=m.device)
        out = torch.empty(b, dtype=torch.float32, device=m.device)
        k.kl_fwd[(n_chunk, b)](m, mr, partial, n, n_chunk, CHUNK=TRITON_CHUNK, BLOCK=TRITON_BLOCK)
        k.row_finalize[(b,)](partial, scale, out, n_chunk, COEF_STRIDE=1, SDE=False,
                                BLOCK=_finalize_block(n_chunk))
        return out

    @staticmethod
    def kl_bwd(m, mr, scale, g, need_m: bool, need_mr: bool):
        b, n = m.shape
        gm = torch.empty_like(m) if need_m else None
        gmr = torch.empty_like(mr) if need_mr else None
        _tk().kl_bwd[(triton_cdiv(n, TRITON_BLOCK), b)](
            m, mr, scale, g, gm if need_m else m, gmr if need_mr else m, n, WRITE_GA=need_m, WRITE_GB=need_mr,
            BLOCK=TRITON_BLOCK)
        return gm, gmr


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------ C++
class _CppImpl:
    """Allocates the outputs and calls csrc/sde_logprob.cpp (torch.ops.paco_kernels)."""

    @staticmethod
    def _ops():
        from kernels import cpp

        return cpp.ops()

    @classmethod
    def sde_fwd(cls, x, v, src, coef, sample: bool, want_mean: bool):
        log_prob = torch.empty(x.shape[0], dtype=torch.float32)
        prev = torch.empty_like(x) if sample else None
        mean = torch.empty(x.shape, dtype=torch.float32) if want_mean else None
        cls._ops().sde_fwd(x, v, src, coef, sample, log_prob, prev, mean)
        return log_prob, prev, mean

    @classmethod
    def sde_bwd(cls, x, v, xn, coef, g, g_mean, need_v: bool, need_x: bool):
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        cls._ops().sde_bwd(x, v, xn, coef, g, g_mean, gv, gx)
        return gv, gx

    @classmethod
    def kl_fwd(cls, m, mr, scale):
        out = torch.empty(m.shape[0], dtype=torch.float32)
        cls._ops().kl_fwd(m, mr, scale, out)
        return out

    @classmethod
    def kl_bwd(cls, m, mr, scale, g, need_m: bool, need_mr: bool):
        gm = torch.empty_like(m) if need_m else None
        gmr = torch.empty_like(mr) if need_mr else None
        cls._ops().kl_bwd(m, mr, scale, g, gm, gmr)
        return gm, gmr


IMPLS = {"triton": _TritonImpl, "cpp": _CppImpl}


# ------------------------------------------------------------------------------------------ autograd
class SDELogProbFn(torch.autograd.Function):
    """(log_prob [B], prev [B, N] or None, mean [B, N] or None) of one SDE transition.

    Gradients flow to x and v from log_prob and from mean; the sampled x' is not differentiable
    (rollouts run without grad, and the log-prob treats x' as data, as the reference detaches it).
    Only the inputs are saved for backward, in their own dtype.
    """

    @staticmethod
    def forward(ctx, impl, x, v, src, coef, sample: bool, want_mean: bool):
        log_prob, prev, mean = impl.sde_fwd(x, v, src, coef, sample, want_mean)
        ctx.impl = impl
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, v, prev if sample else src, coef)
        if sample:
            ctx.mark_non_differentiable(prev)
        return log_prob, prev, mean

    @staticmethod
    def backward(ctx, g_lp, _g_prev, g_mean):
        x, v, xn, coef = ctx.saved_tensors
        need_x, need_v = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if g_lp is None:
            g_lp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        gv, gx = ctx.impl.sde_bwd(x, v, xn, coef, g_lp.float().contiguous(),
                                  None if g_mean is None else g_mean.float().contiguous(), need_v, need_x)
        return None, gx, gv, None, None, None, None


class KLFn(torch.autograd.Function):
    """Per-sample scale * sum((mean - mean_ref)^2); gradients to both means."""

    @staticmethod
    def forward(ctx, impl, m, mr, scale):
        ctx.impl = impl
        ctx.save_for_backward(m, mr, scale)
        return impl.kl_fwd(m, mr, scale)

    @staticmethod
    def backward(ctx, g):
        m, mr, scale = ctx.saved_tensors
        gm, gmr = ctx.impl.kl_bwd(m, mr, scale, g.float().contiguous(), ctx.needs_input_grad[1],
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
    """The stochastic transition x -> x' of REFERENCE.md §2.1 with its per-sample log-prob.

    Exactly one of `prev_sample` (score a stored transition) or `noise` (sample one) is given.
    `backend` is "triton" or "cpp" (the dispatcher in kernels/__init__.py chooses); x and v must
    satisfy `supports`. The mean (fp32, shaped like x) is returned only when `return_mean`.
    """
    if noise_level <= 0:
        raise ValueError("the fused transition needs noise_level > 0 (an ODE step has no log-prob)")
    if (prev_sample is None) == (noise is None):
        raise ValueError("pass exactly one of `prev_sample` (score a transition) or `noise` (sample one)")
    coef, std_t = transition_coefficients(x, sigma, sigma_next, noise_level, sigma_max, sde_type)
    sample = noise is not None
    x2, v2 = _rows(x, NATIVE_DTYPES), _rows(v, NATIVE_DTYPES)
    src = _rows((noise if sample else prev_sample).detach(), (x.dtype, torch.float32))
    log_prob, prev, mean = SDELogProbFn.apply(IMPLS[backend], x2, v2, src, coef, sample, return_mean)
    return SDEStep(prev_sample=prev.view(x.shape) if sample else prev_sample, log_prob=log_prob,
                   mean=mean.view(x.shape) if return_mean else None, std=std_t)


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor, *, backend: str) -> torch.Tensor:
    """Per-sample mean((mean - mean_ref)^2) / (2 std^2), accumulated in fp32."""
    b = mean.shape[0]
    work = mean.dtype if mean.dtype == mean_ref.dtype and mean.dtype in NATIVE_DTYPES else torch.float32
    m2 = mean.reshape(b, -1).to(work).contiguous()
    mr2 = mean_ref.reshape(b, -1).to(work).contiguous()
    scale = (1 / (2 * m2.shape[1] * std.reshape(b).float() ** 2)).contiguous()
    return KLFn.apply(IMPLS[backend], m2, mr2, scale)
