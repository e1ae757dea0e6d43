"""Triton kernels of the fused SDE log-prob and KL ops (launched from kernels/sde_logprob.py).

This module is imported on the first Triton launch, not with `kernels`: `@triton.jit` reads
TRITON_INTERPRET when a kernel is defined, so setting it any time before that first launch makes
the kernels run in the interpreter (CPU tests).
"""
import triton
import triton.language as tl


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
def sde_fwd(x_ptr, v_ptr, src_ptr, coef_ptr, partial_ptr, prev_ptr, mean_ptr, N, n_chunk,
            SAMPLE: tl.constexpr, WRITE_MEAN: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 5)
    cv = tl.load(coef_ptr + b * 5 + 1)
    sd = tl.load(coef_ptr + b * 5 + 2)
    row = b.to(tl.int64) * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.static_range(0, CHUNK, BLOCK):
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
def row_finalize(partial_ptr, coef_ptr, out_ptr, n_chunk, COEF_STRIDE: tl.constexpr, SDE: tl.constexpr,
                 BLOCK: tl.constexpr):
    # out[b] = -k1 * S - k0 (log-prob) or scale * S (KL), S = the row's chunk partials in a fixed tree
    b = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_chunk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + b * n_chunk + offs, mask=offs < n_chunk, other=0.0)
    total = tl.sum(acc, axis=0)
    if SDE:
        out = -tl.load(coef_ptr + b * COEF_STRIDE + 3) * total - tl.load(coef_ptr + b * COEF_STRIDE + 4)
    else:
        out = tl.load(coef_ptr + b * COEF_STRIDE) * total
    tl.store(out_ptr + b, out)


@triton.jit
def sde_bwd(x_ptr, v_ptr, xn_ptr, coef_ptr, g_ptr, gm_ptr, gv_ptr, gx_ptr, N,
            HAS_GM: tl.constexpr, WRITE_GV: tl.constexpr, WRITE_GX: tl.constexpr, BLOCK: tl.constexpr):
    # d lp / d v = cv * e, d lp / d x = cx * e, e = 2 k1 g (x' - mean) (+ g_mean); mean recomputed
    pid = tl.program_id(0)
    b = tl.program_id(1)
    cx = tl.load(coef_ptr + b * 5)
    cv = tl.load(coef_ptr + b * 5 + 1)
    gd = 2.0 * tl.load(coef_ptr + b * 5 + 3) * tl.load(g_ptr + b)
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
    for start in tl.static_range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + tl.arange(0, BLOCK)
        m = offs < N
        d = (tl.load(a_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
             - tl.load(b_ptr + row + offs, mask=m, other=0.0).to(tl.float32))
        acc += d * d
    tl.store(partial_ptr + b * n_chunk + c, tl.sum(acc, axis=0))


@triton.jit
def kl_bwd(a_ptr, b_ptr, scale_ptr, g_ptr, ga_ptr, gb_ptr, N,
           WRITE_GA: tl.constexpr, WRITE_GB: tl.constexpr, BLOCK: tl.constexpr):
    # d kl / d mean = 2 scale g (mean - mean_ref) = -d kl / d mean_ref
    pid = tl.program_id(0)
    b = tl.program_id(1)
    k = 2.0 * tl.load(scale_ptr + b) * tl.load(g_ptr + b)
    row = b.to(tl.int64) * N
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    d = (tl.load(a_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
         - tl.load(b_ptr + row + offs, mask=m, other=0.0).to(tl.float32))
    if WRITE_GA:
        tl.store(ga_ptr + row + offs, narrow(k * d, ga_ptr.dtype.element_ty), mask=m)
    if WRITE_GB:
        tl.store(gb_ptr + row + offs, narrow(-(k * d), gb_ptr.dtype.element_ty), mask=m)
