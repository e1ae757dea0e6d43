"""Triton row kernel of the fused linear + weighted cross-entropy (launched from kernels/weighted_ce.py).

Imported on the first Triton launch, not with `kernels` (see kernels/_triton_sde.py for why).
"""
import triton
import triton.language as tl

from ._triton_sde import narrow


@triton.jit
def ce_rows(logits_ptr, stride, labels_ptr, coef_ptr, ce_ptr, pred_ptr, V,
            WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row of the logits chunk per program.

    Pass 1 streams the row once: online max and sum of exponentials (fp32), and the argmax (the
    first index of the maximum, as torch.argmax). ce = logsumexp - logit[label].
    Pass 2 (WRITE_GRAD) overwrites the row with coef * (softmax - onehot(label)) in the logits'
    dtype, rounded to nearest even (the same bits as torch's cast, also in the interpreter).
    """
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, axis=0)
        bi = tl.argmax(x, axis=0)
        best_i = tl.where(bm > best, start + bi, best_i)
        best = tl.maximum(best, bm)
        new_m = tl.maximum(m, bm)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    target = tl.load(base + label).to(tl.float32)
    tl.store(ce_ptr + row, lse - target)
    tl.store(pred_ptr + row, best_i.to(tl.int64))
    if WRITE_GRAD:
        c = tl.load(coef_ptr + row)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where(offs == label, p - 1.0, p) * c
            tl.store(base + offs, narrow(g, logits_ptr.dtype.element_ty), mask=mask)
