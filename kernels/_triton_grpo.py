"""Triton kernels of the GRPO advantage and PPO-clip ops (launched from kernels/grpo.py).

Imported on the first Triton launch (see kernels/_triton_sde.py for why).
"""
import triton
import triton.language as tl


@triton.jit
def _log1p(x):
    # log(1 + x) without losing x near 0 (Kahan): u = 1 + x is rounded, and x / (u - 1) undoes that
    # rounding to first order. u == 1 means |x| is below half an ulp of 1, where log1p(x) == x.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _combined(r_ptr, w, tamed, ks, kmask, js, jmask, N):
    # sum_k w_k * r~_kj for the samples js, with r~ = log(1 + r) on the tamed reward types
    r = tl.load(r_ptr + ks[:, None] * N + js[None, :], mask=kmask[:, None] & jmask[None, :], other=0.0)
    r = tl.where(tamed[:, None], _log1p(r), r)
    return tl.sum(w[:, None] * r, axis=0)


@triton.jit
def grpo_advantages(r_ptr, w_ptr, g_ptr, param_ptr, adv_ptr, comb_ptr, cv_ptr, tamed_ptr, tau_ptr, K, N,
                    TAME: tl.constexpr, GLOBAL_STD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    """Advantages of the samples [pid * BLOCK, (pid + 1) * BLOCK), all in fp64, in one launch.

    Every program recomputes the batch-wide statistics (log-tame decision, global std) itself, in the
    same order, instead of synchronising with the others; they cost O(K N) against the O(BLOCK N)
    of the program's own group statistics. Groups are found by comparing group ids tile by tile, so
    ids need not be contiguous or sorted, and no atomics are used anywhere.
    param_ptr: fp64 (tau_fixed, std_floor, clip). TAME: 0 off, 1 the threshold is the mean of the
    coefficients of variation, 2 their median, 3 tau_fixed.
    """
    pid = tl.program_id(0)
    tau_fixed = tl.load(param_ptr)
    std_floor = tl.load(param_ptr + 1)
    clip = tl.load(param_ptr + 2)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    w = tl.load(w_ptr + ks, mask=kmask, other=0.0)
    tamed = ks < 0
    if TAME != 0:
        # coefficient of variation h_k = std(r_k) / (mean(r_k) + 1e-6) over the batch (two passes)
        s1 = tl.zeros([BLOCK_K], dtype=tl.float64)
        for start in range(0, N, BLOCK):
            js = start + tl.arange(0, BLOCK)
            s1 += tl.sum(tl.load(r_ptr + ks[:, None] * N + js[None, :], mask=kmask[:, None] & (js < N)[None, :],
                                 other=0.0), axis=1)
        mean_k = s1 / N
        s2 = tl.zeros([BLOCK_K], dtype=tl.float64)
        for start in range(0, N, BLOCK):
            js = start + tl.arange(0, BLOCK)
            m2 = kmask[:, None] & (js < N)[None, :]
            d = tl.where(m2, tl.load(r_ptr + ks[:, None] * N + js[None, :], mask=m2, other=0.0) - mean_k[:, None], 0.0)
            s2 += tl.sum(d * d, axis=1)
        cv = tl.sqrt(s2 / N) / (mean_k + 1e-6)
        if TAME == 1:
            tau = tl.sum(tl.where(kmask, cv, 0.0), axis=0) / K
        elif TAME == 2:
            # median: rank every h_k (ties broken by index), average the two middle ranks (numpy's rule)
            before = (cv[None, :] < cv[:, None]) | ((cv[None, :] == cv[:, None]) & (ks[None, :] < ks[:, None]))
            rank = tl.sum(tl.where(before & kmask[None, :], 1, 0), axis=1)
            lo = tl.sum(tl.where(kmask & (rank == (K - 1) // 2), cv, 0.0), axis=0)
            hi = tl.sum(tl.where(kmask & (rank == K // 2), cv, 0.0), axis=0)
            tau = (lo + hi) / 2
        else:
            tau = tau_fixed
        tamed = kmask & (cv > tau)
        if pid == 0:
            tl.store(cv_ptr + ks, cv, mask=kmask)
            tl.store(tamed_ptr + ks, tamed.to(tl.int32), mask=kmask)
            tl.store(tau_ptr, tau)

    if GLOBAL_STD:
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, N, BLOCK):
            js = start + tl.arange(0, BLOCK)
            acc += _combined(r_ptr, w, tamed, ks, kmask, js, js < N, N)  # 0 on masked lanes
        mean_all = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, N, BLOCK):
            js = start + tl.arange(0, BLOCK)
            d = tl.where(js < N, _combined(r_ptr, w, tamed, ks, kmask, js, js < N, N) - mean_all, 0.0)
            acc += d * d
        std_all = tl.maximum(tl.sqrt(tl.sum(acc, axis=0) / N), std_floor)

    i = pid * BLOCK + tl.arange(0, BLOCK)
    imask = i < N
    r_i = _combined(r_ptr, w, tamed, ks, kmask, i, imask, N)
    g_i = tl.load(g_ptr + i, mask=imask, other=0)
    count = tl.zeros([BLOCK], dtype=tl.float64)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, N, BLOCK):
        js = start + tl.arange(0, BLOCK)
        jmask = js < N
        same = (g_i[:, None] == tl.load(g_ptr + js, mask=jmask, other=0)[None, :]) & jmask[None, :]
        r_j = _combined(r_ptr, w, tamed, ks, kmask, js, jmask, N)
        count += tl.sum(tl.where(same, 1.0, 0.0), axis=1)
        total += tl.sum(tl.where(same, r_j[None, :], 0.0), axis=1)
    mean_i = total / tl.where(imask, count, 1.0)
    if GLOBAL_STD:
        std_i = std_all
    else:
        sq = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, N, BLOCK):
            js = start + tl.arange(0, BLOCK)
            jmask = js < N
            same = (g_i[:, None] == tl.load(g_ptr + js, mask=jmask, other=0)[None, :]) & jmask[None, :]
            d = _combined(r_ptr, w, tamed, ks, kmask, js, jmask, N)[None, :] - mean_i[:, None]
            sq += tl.sum(tl.where(same, d * d, 0.0), axis=1)
        std_i = tl.maximum(tl.sqrt(sq / tl.where(imask, count, 1.0)), std_floor)
    adv = tl.minimum(tl.maximum((r_i - mean_i) / std_i, -clip), clip)
    tl.store(adv_ptr + i, adv, mask=imask)
    tl.store(comb_ptr + i, r_i, mask=imask)


@triton.jit
def _ppo_terms(lp_ptr, old_ptr, adv_ptr, offs, mask, lo, hi, adv_clip):
    a = tl.minimum(tl.maximum(tl.load(adv_ptr + offs, mask=mask, other=0.0).to(tl.float32), -adv_clip), adv_clip)
    ratio = tl.exp(tl.load(lp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                   - tl.load(old_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    unclipped = -a * ratio
    clipped = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    return a, ratio, unclipped, clipped


@triton.jit
def ppo_fwd(lp_ptr, old_ptr, adv_ptr, out_ptr, B, lo, hi, clip_range, adv_clip, BLOCK: tl.constexpr):
    """One program: out = [loss, unclipped, clipped, ratio, clipfrac, clipfrac_gt_one, clipfrac_lt_one] (means)."""
    loss = tl.zeros([BLOCK], dtype=tl.float32)
    unc = tl.zeros([BLOCK], dtype=tl.float32)
    clp = tl.zeros([BLOCK], dtype=tl.float32)
    rat = tl.zeros([BLOCK], dtype=tl.float32)
    gt = tl.zeros([BLOCK], dtype=tl.float32)
    lt = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < B
        _, ratio, u, c = _ppo_terms(lp_ptr, old_ptr, adv_ptr, offs, m, lo, hi, adv_clip)
        loss += tl.where(m, tl.maximum(u, c), 0.0)
        unc += tl.where(m, u, 0.0)
        clp += tl.where(m, c, 0.0)
        rat += tl.where(m, ratio, 0.0)
        gt += tl.where(m & (ratio - 1 > clip_range), 1.0, 0.0)
        lt += tl.where(m & (1 - ratio > clip_range), 1.0, 0.0)
    n_gt = tl.sum(gt, axis=0)
    n_lt = tl.sum(lt, axis=0)
    tl.store(out_ptr, tl.sum(loss, axis=0) / B)
    tl.store(out_ptr + 1, tl.sum(unc, axis=0) / B)
    tl.store(out_ptr + 2, tl.sum(clp, axis=0) / B)
    tl.store(out_ptr + 3, tl.sum(rat, axis=0) / B)
    tl.store(out_ptr + 4, (n_gt + n_lt) / B)  # |r - 1| > eps is exactly one of the two one-sided tests
    tl.store(out_ptr + 5, n_gt / B)
    tl.store(out_ptr + 6, n_lt / B)


@triton.jit
def ppo_bwd(lp_ptr, old_ptr, adv_ptr, g_ptr, grad_ptr, B, lo, hi, adv_clip, BLOCK: tl.constexpr):
    # loss = mean(max(u, c)), u = -a r, c = -a clamp(r, lo, hi), r = exp(lp - old), so
    # d loss / d lp = g / B * (-a) * r * (w_u + w_c * inside). As in autograd, torch.maximum gives the
    # gradient to the larger input and half to each on a tie (inside the clip range u == c, so the
    # halves add up), and the clamp passes it only for lo <= r <= hi.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < B
    a, ratio, u, c = _ppo_terms(lp_ptr, old_ptr, adv_ptr, offs, m, lo, hi, adv_clip)
    w_u = tl.where(u > c, 1.0, tl.where(u == c, 0.5, 0.0))
    w_c = tl.where(c > u, 1.0, tl.where(u == c, 0.5, 0.0)) * tl.where((ratio >= lo) & (ratio <= hi), 1.0, 0.0)
    grad = tl.load(g_ptr) / B * (-a) * ratio * (w_u + w_c)
    tl.store(grad_ptr + offs, grad, mask=m)
