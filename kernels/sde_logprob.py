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

from kernels import geometry as G
from kernels.sde_reference import SDEStep

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SDE_TYPES = {"flow_grpo": 0, "cps": 1}

# Triton launch geometry (kernels/geometry.py): TRITON_CHUNK elements per program fix a row's reduction tree.
TRITON_CHUNK = G.SDE_CHUNK
TRITON_BLOCK = G.SDE_BLOCK


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


_cdiv = G.cdiv


# ------------------------------------------------------------------------------------------ backends
class _TritonImpl:
    """Launchers of kernels/_triton_sde.py, imported at the first launch (see its docstring).
    Every tensor argument is a contiguous [B, N] row view (see `_rows`)."""

    @staticmethod
    def _coefficients(k, x, sig, a: float, sde_type: int):
        coef = torch.empty(x.shape[0], 6, dtype=torch.float32, device=x.device)
        k.sde_coefficients[(x.shape[0],)](sig, a, coef, x.shape[1], SDE_TYPE=sde_type)
        return coef

    @classmethod
    def sde_fwd(cls, x, v, src, sig, a: float, sde_type: int, sample: bool, want_mean: bool):
        from kernels import _triton_sde as k

        b, n = x.shape
        n_chunk = _cdiv(n, TRITON_CHUNK)
        coef = cls._coefficients(k, x, sig, a, sde_type)
        partial = torch.empty(b, n_chunk, dtype=torch.float32, device=x.device)
        prev = torch.empty_like(x) if sample else None
        mean = torch.empty(b, n, dtype=torch.float32, device=x.device) if want_mean else None
        log_prob = torch.empty(b, dtype=torch.float32, device=x.device)
        std = torch.empty_like(log_prob)
        # unused pointer arguments get any tensor: the constexpr flags compile their use away
        k.sde_fwd[(n_chunk, b)](x, v, src, coef, partial, prev if sample else x, mean if want_mean else partial,
                                n, n_chunk, SAMPLE=sample, WRITE_MEAN=want_mean, CHUNK=TRITON_CHUNK,
                                BLOCK=TRITON_BLOCK)
        k.sde_finalize[(b,)](partial, coef, log_prob, std, n_chunk, BLOCK=G.finalize_block(n_chunk))
        return log_prob, std, prev, mean

    @classmethod
    def sde_bwd(cls, x, v, xn, sig, a: float, sde_type: int, g, g_mean, need_v: bool, need_x: bool):
        from kernels import _triton_sde as k

        b, n = x.shape
        coef = cls._coefficients(k, x, sig, a, sde_type)
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        k.sde_bwd[(_cdiv(n, TRITON_BLOCK), b)](x, v, xn, coef, g, g if g_mean is None else g_mean,
                                               gv if need_v else x, gx if need_x else x, n,
                                               HAS_GM=g_mean is not None, WRITE_GV=need_v, WRITE_GX=need_x,
                                               BLOCK=TRITON_BLOCK)
        return gv, gx

    @classmethod
    def sde_kl_fwd(cls, x, v, vr, xn, sig, a: float, sde_type: int):
        from kernels import _triton_sde as k

        b, n = x.shape
        n_chunk = _cdiv(n, TRITON_CHUNK)
        coef = cls._coefficients(k, x, sig, a, sde_type)
        partial = torch.empty(2, b, n_chunk, dtype=torch.float32, device=x.device)
        log_prob, std, kl = (torch.empty(b, dtype=torch.float32, device=x.device) for _ in range(3))
        k.sde_kl_fwd[(n_chunk, b)](x, v, vr, xn, coef, partial[0], partial[1], n, n_chunk, CHUNK=TRITON_CHUNK,
                                   BLOCK=TRITON_BLOCK)
        k.sde_kl_finalize[(b,)](partial[0], partial[1], coef, log_prob, std, kl, n, n_chunk,
                                BLOCK=G.finalize_block(n_chunk))
        return log_prob, std, kl

    @classmethod
    def sde_kl_bwd(cls, x, v, vr, xn, sig, a: float, sde_type: int, g, g_kl, need_v: bool, need_x: bool):
        from kernels import _triton_sde as k

        b, n = x.shape
        coef = cls._coefficients(k, x, sig, a, sde_type)
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        k.sde_kl_bwd[(_cdiv(n, TRITON_BLOCK), b)](x, v, vr, xn, coef, g, g_kl, gv if need_v else x,
                                                  gx if need_x else x, n, WRITE_GV=need_v, WRITE_GX=need_x,
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
        k.kl_finalize[(b,)](partial, std, out, n, n_chunk, BLOCK=G.finalize_block(n_chunk))
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
    def sde_kl_fwd(cls, x, v, vr, xn, sig, a: float, sde_type: int):
        log_prob, std, kl = (torch.empty(x.shape[0], dtype=torch.float32) for _ in range(3))
        cls._ops().sde_kl_fwd(x, v, vr, xn, sig, a, sde_type, log_prob, std, kl)
        return log_prob, std, kl

    @classmethod
    def sde_kl_bwd(cls, x, v, vr, xn, sig, a: float, sde_type: int, g, g_kl, need_v: bool, need_x: bool):
        gv = torch.empty_like(v) if need_v else None
        gx = torch.empty_like(x) if need_x else None
        cls._ops().sde_kl_bwd(x, v, vr, xn, sig, a, sde_type, g, g_kl, gv, gx)
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


# ------------------------------------------------------------------------------------------ torch custom ops
# The fused ops are torch.library custom ops: FakeTensorMode, meta tensors and torch.compile see a
# fake implementation that only allocates the outputs (no kernel runs on a fake tensor), and
# torch.compile(fullgraph=True) keeps them in one graph. Outputs an op does not compute are empty
# [0] tensors (a custom op returns tensors, not None). `backend` names the kernels: "triton", "cpp".
_EMPTY = (0,)


def check_devices(op, *tensors) -> None:
    """Inputs on more than one device raise, as torch's own ops do under FakeTensorMode (and a
    kernel would fault on a GPU): a fake implementation must not hide a host tensor in a CUDA op."""
    devices = [t.device for t in tensors if isinstance(t, torch.Tensor)]
    other = next((d for d in devices if d != devices[0]), None)
    if other is not None:
        from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

        raise FakeTensorDeviceMismatchError(func=op, common_device=devices[0], device=other)


def _empty_like_row(x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return x.new_empty(_EMPTY, dtype=dtype)


@torch.library.custom_op("paco::sde_logprob", mutates_args=())
def _sde_logprob_op(x: torch.Tensor, v: torch.Tensor, src: torch.Tensor, sig: torch.Tensor, a: float, sde_type: int,
                    sample: bool, want_mean: bool, backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob [B], std_t [B], x' [B, N] or [0], mean [B, N] fp32 or [0]) of one SDE transition."""
    log_prob, std, prev, mean = IMPLS[backend].sde_fwd(x, v, src, sig, a, sde_type, sample, want_mean)
    return (log_prob, std, _empty_like_row(x, x.dtype) if prev is None else prev,
            _empty_like_row(x) if mean is None else mean)


@_sde_logprob_op.register_fake
def _(x, v, src, sig, a, sde_type, sample, want_mean, backend):
    check_devices(torch.ops.paco.sde_logprob.default, x, v, src, sig)
    b = x.shape[0]
    return (x.new_empty((b,), dtype=torch.float32), x.new_empty((b,), dtype=torch.float32),
            torch.empty_like(x) if sample else _empty_like_row(x, x.dtype),
            x.new_empty(x.shape, dtype=torch.float32) if want_mean else _empty_like_row(x))


@torch.library.custom_op("paco::sde_logprob_backward", mutates_args=())
def _sde_logprob_bwd_op(x: torch.Tensor, v: torch.Tensor, xn: torch.Tensor, sig: torch.Tensor, a: float,
                        sde_type: int, g: torch.Tensor, g_mean: torch.Tensor | None, need_v: bool, need_x: bool,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/dv, d/dx) of log_prob (and of the mean, through g_mean); [0] where not needed."""
    gv, gx = IMPLS[backend].sde_bwd(x, v, xn, sig, a, sde_type, g, g_mean, need_v, need_x)
    return (_empty_like_row(v, v.dtype) if gv is None else gv, _empty_like_row(x, x.dtype) if gx is None else gx)


@_sde_logprob_bwd_op.register_fake
def _(x, v, xn, sig, a, sde_type, g, g_mean, need_v, need_x, backend):
    return (torch.empty_like(v) if need_v else _empty_like_row(v, v.dtype),
            torch.empty_like(x) if need_x else _empty_like_row(x, x.dtype))


def _sde_setup_context(ctx, inputs, output):
    x, v, src, sig, a, sde_type, sample, _want_mean, backend = inputs
    ctx.a, ctx.sde_type, ctx.backend = a, sde_type, backend
    # Only the inputs are saved for backward, in their own dtype; the mean is recomputed there.
    ctx.save_for_backward(x, v, output[2] if sample else src, sig)


def _sde_backward(ctx, g_lp, _g_std, _g_prev, g_mean):
    # Gradients flow to x and v from log_prob and from the mean; x' is data (rollouts run without
    # grad, and the reference detaches it), so its gradient and the std's are dropped.
    x, v, xn, sig = ctx.saved_tensors
    need_x, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gm = None if g_mean is None or g_mean.numel() == 0 else g_mean.float().contiguous()
    g = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device) if g_lp is None else g_lp.float().contiguous()
    gv, gx = _sde_logprob_bwd_op(x, v, xn, sig, ctx.a, ctx.sde_type, g, gm, need_v, need_x, ctx.backend)
    return gx if need_x else None, gv if need_v else None, None, None, None, None, None, None, None


_sde_logprob_op.register_autograd(_sde_backward, setup_context=_sde_setup_context)


@torch.library.custom_op("paco::kl_to_reference", mutates_args=())
def _kl_op(m: torch.Tensor, mr: torch.Tensor, std: torch.Tensor, backend: str) -> torch.Tensor:
    """Per-sample sum((mean - mean_ref)^2) / (2 N std^2)."""
    return IMPLS[backend].kl_fwd(m, mr, std)


@_kl_op.register_fake
def _(m, mr, std, backend):
    check_devices(torch.ops.paco.kl_to_reference.default, m, mr, std)
    return m.new_empty((m.shape[0],), dtype=torch.float32)


@torch.library.custom_op("paco::kl_to_reference_backward", mutates_args=())
def _kl_bwd_op(m: torch.Tensor, mr: torch.Tensor, std: torch.Tensor, g: torch.Tensor, need_m: bool, need_mr: bool,
               backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    gm, gmr = IMPLS[backend].kl_bwd(m, mr, std, g, need_m, need_mr)
    return (_empty_like_row(m, m.dtype) if gm is None else gm, _empty_like_row(mr, mr.dtype) if gmr is None else gmr)


@_kl_bwd_op.register_fake
def _(m, mr, std, g, need_m, need_mr, backend):
    return (torch.empty_like(m) if need_m else _empty_like_row(m, m.dtype),
            torch.empty_like(mr) if need_mr else _empty_like_row(mr, mr.dtype))


def _kl_setup_context(ctx, inputs, output):
    m, mr, std, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(m, mr, std)


def _kl_backward(ctx, g):
    m, mr, std = ctx.saved_tensors
    need_m, need_mr = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gm, gmr = _kl_bwd_op(m, mr, std, g.float().contiguous(), need_m, need_mr, ctx.backend)
    return gm if need_m else None, gmr if need_mr else None, None, None


_kl_op.register_autograd(_kl_backward, setup_context=_kl_setup_context)


@torch.library.custom_op("paco::sde_logprob_kl", mutates_args=())
def _sde_kl_op(x: torch.Tensor, v: torch.Tensor, vr: torch.Tensor, xn: torch.Tensor, sig: torch.Tensor, a: float,
               sde_type: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob [B], std_t [B], kl [B]) of a scored transition and its KL surrogate to the reference
    velocity vr, in one pass (kernels/_triton_sde.py sde_kl_fwd)."""
    return IMPLS[backend].sde_kl_fwd(x, v, vr, xn, sig, a, sde_type)


@_sde_kl_op.register_fake
def _(x, v, vr, xn, sig, a, sde_type, backend):
    check_devices(torch.ops.paco.sde_logprob_kl.default, x, v, vr, xn, sig)
    return tuple(x.new_empty((x.shape[0],), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("paco::sde_logprob_kl_backward", mutates_args=())
def _sde_kl_bwd_op(x: torch.Tensor, v: torch.Tensor, vr: torch.Tensor, xn: torch.Tensor, sig: torch.Tensor, a: float,
                   sde_type: int, g: torch.Tensor, g_kl: torch.Tensor, need_v: bool, need_x: bool,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    gv, gx = IMPLS[backend].sde_kl_bwd(x, v, vr, xn, sig, a, sde_type, g, g_kl, need_v, need_x)
    return (_empty_like_row(v, v.dtype) if gv is None else gv, _empty_like_row(x, x.dtype) if gx is None else gx)


@_sde_kl_bwd_op.register_fake
def _(x, v, vr, xn, sig, a, sde_type, g, g_kl, need_v, need_x, backend):
    return (torch.empty_like(v) if need_v else _empty_like_row(v, v.dtype),
            torch.empty_like(x) if need_x else _empty_like_row(x, x.dtype))


def _sde_kl_setup_context(ctx, inputs, output):
    x, v, vr, xn, sig, a, sde_type, backend = inputs
    ctx.a, ctx.sde_type, ctx.backend = a, sde_type, backend
    ctx.save_for_backward(x, v, vr, xn, sig)


def _sde_kl_backward(ctx, g_lp, _g_std, g_kl):
    # v_ref is the frozen reference's velocity and x' is data: neither gets a gradient
    x, v, vr, xn, sig = ctx.saved_tensors
    need_x, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    g = zeros if g_lp is None else g_lp.float().contiguous()
    gk = zeros if g_kl is None else g_kl.float().contiguous()
    gv, gx = _sde_kl_bwd_op(x, v, vr, xn, sig, ctx.a, ctx.sde_type, g, gk, need_v, need_x, ctx.backend)
    return gx if need_x else None, gv if need_v else None, None, None, None, None, None, None


_sde_kl_op.register_autograd(_sde_kl_backward, setup_context=_sde_kl_setup_context)


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
    log_prob, std, prev, mean = _sde_logprob_op(_rows(x, NATIVE_DTYPES), _rows(v, NATIVE_DTYPES), src,
                                                _sigmas(x, sigma, sigma_next, sigma_max), float(noise_level),
                                                SDE_TYPES[sde_type], sample, return_mean, backend)
    # x' and std_t carry no gradient (the op's backward drops theirs): detached, as the reference's are
    return SDEStep(prev_sample=prev.detach().view(x.shape) if sample else prev_sample, log_prob=log_prob,
                   mean=mean.view(x.shape) if return_mean else None, std=std.detach())


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor, *, backend: str) -> torch.Tensor:
    """Per-sample mean((mean - mean_ref)^2) / (2 std^2), accumulated in fp32."""
    work = mean.dtype if mean.dtype == mean_ref.dtype and mean.dtype in NATIVE_DTYPES else torch.float32
    return _kl_op(_rows(mean, (work,)), _rows(mean_ref, (work,)), std.detach().reshape(-1).float().contiguous(),
                  backend)


def sde_logprob_kl(x: torch.Tensor, v: torch.Tensor, v_ref: torch.Tensor, sigma, sigma_next, noise_level: float,
                   sigma_max=None, *, prev_sample: torch.Tensor, sde_type: str = "flow_grpo",
                   backend: str) -> tuple[SDEStep, torch.Tensor]:
    """The scored transition x -> prev_sample with its log-prob (as `sde_logprob`) and the KL surrogate
    mean((mean - mean_ref)^2) / (2 std_t^2) to the transition of the reference velocity `v_ref` from the
    same x, in one pass that keeps neither mean. x, v and v_ref share a dtype (`supports`); v_ref is the
    frozen reference's and must not require a gradient (its gradient would be dropped)."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r} (flow_grpo or cps)")
    if noise_level <= 0:
        raise ValueError("the fused transition needs noise_level > 0 (an ODE step has no log-prob)")
    if v_ref.requires_grad:
        raise ValueError("v_ref must not require a gradient: the KL's reference is frozen (compute it under no_grad)")
    log_prob, std, kl = _sde_kl_op(_rows(x, NATIVE_DTYPES), _rows(v, NATIVE_DTYPES), _rows(v_ref, NATIVE_DTYPES),
                                   _rows(prev_sample.detach(), (x.dtype, torch.float32)),
                                   _sigmas(x, sigma, sigma_next, sigma_max), float(noise_level), SDE_TYPES[sde_type],
                                   backend)
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=None, std=std.detach()), kl
