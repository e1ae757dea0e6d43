"""Triton kernels of the fused SDE log-prob and KL ops (launched from kernels/sde_logprob.py).

This module is imported on the first Triton launch, not with `kernels`: `@triton.jit` reads
TRITON_INTERPRET when a kernel is defined, so setting it any time before that first launch makes
the kernels run in the interpreter (CPU tests).
"""
import math

import triton
import triton.language as tl

# tl.constexpr: a @jit function may read a global only as a compile-time constant (the compiler
# refuses a plain float, which the interpreter accepts).
LOG_SQRT_2PI = tl.constexpr(0.5 * math.log(2 * math.pi))
HALF_PI = tl.constexpr(0.5 * math.pi)


@triton.jit
def narrow(y, DST: tl.constexpr):
    # fp32 -> DST. bf16 is rounded to nearest even by hand: torch's rounding, and the same bits
    # on the GPU and in the interpreter (whose own bf16 cast truncates).
    if DST == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(DST)

@triton.jit
def coefficients(sig_ptr, b, a, N, SDE_TYPE: tl.constexpr):
    """(cx, cv, sd, k1, k0, std_t) of sample b, computed in fp64, returned in fp32 (csrc/ has the
    same function and the formulas' derivation). sig_ptr: [B, 3] (sigma, sigma_next, sigma_max)."""
    s = tl.load(sig_ptr + b * 3).to(tl.float64)
    sn = tl.load(sig_ptr + b * 3 + 1).to(tl.float64)
    a = tl.cast(a, tl.float64)
    if SDE_TYPE == 0:
        s_max = tl.load(sig_ptr + b * 3 + 2).to(tl.float64)
        dt = sn - s
        s_safe = tl.where(s == 1.0, s_max, s)  # sigma == 1 at step 0: the reference substitutes sigma_max
        std_t = a * tl.sqrt(s / (1.0 - s_safe))
        cx = 1.0 + std_t * std_t / (2.0 * s) * dt
        cv = (1.0 + std_t * std_t * (1.0 - s) / (2.0 * s)) * dt
        sd = std_t * tl.sqrt(-dt)
        k1 = 1.0 / (2.0 * tl.cast(N, tl.float64) * sd * sd)
        k0 = tl.log(sd) + LOG_SQRT_2PI
    else:
        std_t = sn * tl.sin(a * HALF_PI)
        root = tl.sqrt(sn * sn - std_t * std_t)
        cx = (1.0 - sn) + root
        cv = (1.0 - s) * root - s * (1.0 - sn)
        sd = std_t
        k1 = 1.0 / tl.cast(N, tl.float64)
        k0 = tl.full([], 0.0, tl.float64)
    return (cx.to(tl.float32), cv.to(tl.float32), sd.to(tl.float32), k1.to(tl.float32), k0.to(tl.float32),
            std_t.to(tl.float32))



@triton.jit
def sde_coefficients(sig_ptr, a, coef_ptr, N, SDE_TYPE: tl.constexpr):
    """coef[b] = (cx, cv, sd, k1, k0, std_t), one program per sample.

    Apart from the streaming kernels: the fp64 divisions, roots, log and sine go through ptxas's
    subroutines, which spill a few bytes per thread; here they run once per sample, and the
    kernels that stream the latent read six floats. Rollout and training read the same values."""
    b = tl.program_id(0)
    cx, cv, sd, k1, k0, std_t = coefficients(sig_ptr, b, a, N, SDE_TYPE)
    base = coef_ptr + b * 6
    tl.store(base, cx)
    tl.store(base + 1, cv)
    tl.store(base + 2, sd)
    tl.store(base + 3, k1)
    tl.store(base + 4, k0)
    tl.store(base + 5, std_t)


@triton.jit
def sde_fwd(x_ptr, v_ptr, src_ptr, coef_ptr, partial_ptr, prev_ptr, mean_ptr, N, n_chunk,
            SAMPLE: tl.constexpr, WRITE_MEAN: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # one chunk of one row: partial[b, c] = sum over the chunk of (x' - mean)^2
    c = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 6)
    cv = tl.load(coef_ptr + b * 6 + 1)
    sd = tl.load(coef_ptr + b * 6 + 2)
    row = b.to(tl.int64) * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # a loop, not tl.static_range: unrolled, the fp16 forward spilled under triton 3.6.0
    for start in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + tl.arange(0, BLOCK)
        m = offs < N  # masked lanes load zeros everywhere, so their residual is exactly 0
        x = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        mu = cx * x + cv * v
        if SAMPLE:
            noise = tl.load(src_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
            stored = narrow(mu + sd * noise, prev_ptr.dtype.element_ty)
            tl.store(prev_ptr + row + offs, stored, mask=m)
            xn = stored.to(tl.float32)  # the log-prob is that of the stored (rounded) transition
        else:
            xn = tl.load(src_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        if WRITE_MEAN:
            tl.store(mean_ptr + row + offs, mu, mask=m)
        d = xn - mu
        acc += d * d
    tl.store(partial_ptr + b * n_chunk + c, tl.sum(acc, axis=0))


@triton.jit
def row_sum(partial_ptr, b, n_chunk, BLOCK: tl.constexpr):
    # the row's chunk partials, summed in a fixed tree
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_chunk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + b * n_chunk + offs, mask=offs < n_chunk, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def sde_finalize(partial_ptr, coef_ptr, lp_ptr, std_ptr, n_chunk, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    k1 = tl.load(coef_ptr + b * 6 + 3)
    k0 = tl.load(coef_ptr + b * 6 + 4)
    tl.store(lp_ptr + b, -k1 * row_sum(partial_ptr, b, n_chunk, BLOCK) - k0)
    tl.store(std_ptr + b, tl.load(coef_ptr + b * 6 + 5))


@triton.jit
def kl_finalize(partial_ptr, std_ptr, out_ptr, N, n_chunk, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    tl.store(out_ptr + b, kl_scale(std_ptr, b, N) * row_sum(partial_ptr, b, n_chunk, BLOCK))


@triton.jit
def kl_scale(std_ptr, b, N):
    # 1 / (2 N std^2), in fp64 as in csrc/
    sd = tl.load(std_ptr + b).to(tl.float64)
    return (1.0 / (2.0 * tl.cast(N, tl.float64) * sd * sd)).to(tl.float32)


@triton.jit
def sde_bwd(x_ptr, v_ptr, xn_ptr, coef_ptr, g_ptr, gm_ptr, gv_ptr, gx_ptr, N,
            HAS_GM: tl.constexpr, WRITE_GV: tl.constexpr, WRITE_GX: tl.constexpr, BLOCK: tl.constexpr):
    # d lp / d v = cv * e, d lp / d x = cx * e, e = 2 k1 g (x' - mean) (+ g_mean); mean recomputed
    pid = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 6)
    cv = tl.load(coef_ptr + b * 6 + 1)
    k1 = tl.load(coef_ptr + b * 6 + 3)
    gd = 2.0 * k1 * tl.load(g_ptr + b)
    row = b.to(tl.int64) * N
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    xn = tl.load(xn_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    e = gd * (xn - (cx * x + cv * v))
    if HAS_GM:
        e += tl.load(gm_ptr + row + offs, mask=m, other=0.0)
    if WRITE_GV:
        tl.store(gv_ptr + row + offs, narrow(cv * e, gv_ptr.dtype.element_ty), mask=m)
    if WRITE_GX:
        tl.store(gx_ptr + row + offs, narrow(cx * e, gx_ptr.dtype.element_ty), mask=m)


@triton.jit
def kl_fwd(a_ptr, b_ptr, partial_ptr, N, n_chunk, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    row = b.to(tl.int64) * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + tl.arange(0, BLOCK)
        m = offs < N
        d = (tl.load(a_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
             - tl.load(b_ptr + row + offs, mask=m, other=0.0).to(tl.float32))
        acc += d * d
    tl.store(partial_ptr + b * n_chunk + c, tl.sum(acc, axis=0))


@triton.jit
def kl_bwd(a_ptr, b_ptr, std_ptr, g_ptr, ga_ptr, gb_ptr, N,
           WRITE_GA: tl.constexpr, WRITE_GB: tl.constexpr, BLOCK: tl.constexpr):
    # d kl / d mean = 2 scale g (mean - mean_ref) = -d kl / d mean_ref
    pid = tl.program_id(0)
    b = tl.program_id(1)
    k = 2.0 * kl_scale(std_ptr, b, N) * tl.load(g_ptr + b)
    row = b.to(tl.int64) * N
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    d = (tl.load(a_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
         - tl.load(b_ptr + row + offs, mask=m, other=0.0).to(tl.float32))
    if WRITE_GA:
        tl.store(ga_ptr + row + offs, narrow(k * d, ga_ptr.dtype.element_ty), mask=m)
    if WRITE_GB:
        tl.store(gb_ptr + row + offs, narrow(-(k * d), gb_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------ log-prob and KL in one pass (training)
# The KL surrogate's two means share x: mean - mean_ref = cv (v - v_ref), so
#     kl = cv^2 / (2 N std_t^2) * sum((v - v_ref)^2)
# needs neither mean in memory. One pass reads x, v, v_ref and the stored x' and writes two fp32
# partials per chunk; the log-prob partial is sde_fwd's scoring arithmetic, so the log-prob is
# bitwise the one the rollout stored.
@triton.jit
def kl_factor(coef_ptr, b, N):
    # cv^2 / (2 N std_t^2), in fp64 as kl_scale
    cv = tl.load(coef_ptr + b * 6 + 1).to(tl.float64)
    sd = tl.load(coef_ptr + b * 6 + 5).to(tl.float64)
    return (cv * cv / (2.0 * tl.cast(N, tl.float64) * sd * sd)).to(tl.float32)


@triton.jit
def sde_kl_fwd(x_ptr, v_ptr, vr_ptr, xn_ptr, coef_ptr, partial_ptr, kl_partial_ptr, N, n_chunk,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 6)
    cv = tl.load(coef_ptr + b * 6 + 1)
    row = b.to(tl.int64) * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_kl = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        xn = tl.load(xn_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        d = xn - (cx * x + cv * v)
        acc += d * d
        dv = v - tl.load(vr_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        acc_kl += dv * dv
    tl.store(partial_ptr + b * n_chunk + c, tl.sum(acc, axis=0))
    tl.store(kl_partial_ptr + b * n_chunk + c, tl.sum(acc_kl, axis=0))


@triton.jit
def sde_kl_finalize(partial_ptr, kl_partial_ptr, coef_ptr, lp_ptr, std_ptr, kl_ptr, N, n_chunk,
                    BLOCK: tl.constexpr):
    b = tl.program_id(0)
    k1 = tl.load(coef_ptr + b * 6 + 3)
    k0 = tl.load(coef_ptr + b * 6 + 4)
    tl.store(lp_ptr + b, -k1 * row_sum(partial_ptr, b, n_chunk, BLOCK) - k0)
    tl.store(std_ptr + b, tl.load(coef_ptr + b * 6 + 5))
    tl.store(kl_ptr + b, kl_factor(coef_ptr, b, N) * row_sum(kl_partial_ptr, b, n_chunk, BLOCK))


@triton.jit
def sde_kl_bwd(x_ptr, v_ptr, vr_ptr, xn_ptr, coef_ptr, g_ptr, gk_ptr, gv_ptr, gx_ptr, N,
               WRITE_GV: tl.constexpr, WRITE_GX: tl.constexpr, BLOCK: tl.constexpr):
    # d lp / d v = cv e, d lp / d x = cx e with e = 2 k1 g (x' - mean); d kl / d v = 2 f g_kl (v - v_ref)
    pid = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 6)
    cv = tl.load(coef_ptr + b * 6 + 1)
    gd = 2.0 * tl.load(coef_ptr + b * 6 + 3) * tl.load(g_ptr + b)
    gk = 2.0 * kl_factor(coef_ptr, b, N) * tl.load(gk_ptr + b)
    row = b.to(tl.int64) * N
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    xn = tl.load(xn_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    e = gd * (xn - (cx * x + cv * v))
    if WRITE_GV:
        vr = tl.load(vr_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(gv_ptr + row + offs, narrow(cv * e + gk * (v - vr), gv_ptr.dtype.element_ty), mask=m)
    if WRITE_GX:
        tl.store(gx_ptr + row + offs, narrow(cx * e, gx_ptr.dtype.element_ty), mask=m)
