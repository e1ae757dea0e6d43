"""Fused linear + weighted cross-entropy: the LM head and the SFT loss without the tokens x vocab logits.

Why: at Qwen2.5-VL's vocabulary (152,064 entries) the fp32 logits of 4k tokens take 2.5 GB, and
the naive path (logits = h W^T, then cross-entropy) keeps them, their log-softmax and their
gradient alive between forward and backward. Here the logits exist one chunk of rows at a time.

The op, for hidden states h [N, H], the LM-head weight W [V, H], labels y [N] (`ignore_index`
where a row has no loss) and per-row coefficients c [N]:

    loss = sum_j c_j * ce_j,    ce_j = logsumexp(W h_j) - (W h_j)[y_j]

It also returns ce_j and argmax_v (W h_j) per row, detached, for accuracy metrics. The SFT loss
(paco_ds/sft/loss.py) puts the first_token_weight formula and its normaliser into c.

How:
1. Rows whose label is `ignore_index` are dropped first. In reward-model data most positions are
   the prompt and its image tokens, which need no logits at all.
2. The remaining rows go in chunks of `chunk_size`: the logits chunk is h_c W^T (a torch matmul in
   the input dtype, as nn.Linear computes it); a row kernel computes logsumexp, ce and argmax,
   then overwrites the chunk with dL/dlogits = c_j (softmax - onehot(y_j)); the gradient of the
   hidden states is that chunk times W, and, only if W is trainable, dL/dW += chunk^T h_c (fp32).
3. The gradients are computed in forward (as Liger-Kernel's fused linear cross-entropy does), so
   backward only scales them by the incoming gradient: it needs neither the logits nor W. Under
   ZeRO-3 that means the LM-head weight is needed during forward only (see paco_ds/sft/model.py).

Row kernels: Triton on CUDA tensors (kernels/_triton_weighted_ce.py; on CPU only under
TRITON_INTERPRET=1) and torch on CPU. The "cpp" backend has no kernel for this op and runs the
torch rows. The float64 reference of the formula lives in the tests; the naive materialised path
is paco_ds.sft.loss.naive_weighted_ce.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels import geometry as G

IGNORE_INDEX = -100
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Auto chunk: the largest power of two of rows whose fp32 logits fit this budget (1 GiB: 1024 rows
# at a 152k vocabulary, 0.6 GB). Smaller chunks cost time on CPU, where small-M GEMMs are slower
# (256 rows took 4x longer than 1024 in a quiet run of the 2-core machine, 4096 x 152k x 256 fp32);
# larger ones only cost memory.
CHUNK_BUDGET_BYTES = 2**30
MIN_CHUNK, MAX_CHUNK = 16, 4096


class WeightedCE(NamedTuple):
    loss: torch.Tensor  # fp32 scalar; differentiable wrt hidden (and weight)
    token_loss: torch.Tensor  # [N] fp32 cross-entropy per row, 0 where ignored (detached)
    predictions: torch.Tensor  # [N] int64 argmax over the vocabulary, ignore_index where ignored (detached)


def auto_chunk_size(vocab: int) -> int:
    """Rows per chunk: a power of two whose fp32 logits fit CHUNK_BUDGET_BYTES."""
    rows = max(1, CHUNK_BUDGET_BYTES // (4 * vocab))
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << (rows.bit_length() - 1)))


# ------------------------------------------------------------------------------------------ row kernels
RowFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def rows_torch(logits: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, write_grad: bool):
    """(ce fp32 [C], argmax int64 [C]) of a logits chunk [C, V]; with `write_grad` the chunk is
    overwritten with coef * (softmax - onehot(labels)), in its own dtype."""
    # In place on one fp32 buffer (the chunk itself when fp32): no [C, V] temporaries.
    x = logits.float()
    rows = torch.arange(x.shape[0], device=x.device)
    target = x[rows, labels]
    top, pred = x.max(dim=1)  # the first index of the maximum, as argmax
    x.sub_(top[:, None]).exp_()
    total = x.sum(dim=1)
    ce = top + total.log() - target
    if write_grad:
        x.mul_((coef / total)[:, None])  # coef * softmax
        x[rows, labels] -= coef
        if x is not logits:
            logits.copy_(x)
    return ce, pred


def rows_triton(logits: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, write_grad: bool):
    from kernels import _triton_weighted_ce as k

    c, v = logits.shape
    ce = torch.empty(c, dtype=torch.float32, device=logits.device)
    pred = torch.empty(c, dtype=torch.int64, device=logits.device)
    block = G.ce_block(v)
    k.ce_rows[(c,)](logits, logits.stride(0), labels, coef, ce, pred, v, WRITE_GRAD=write_grad, BLOCK=block,
                    num_warps=G.ce_warps(block))
    return ce, pred


ROWS: dict[str, RowFn] = {"torch": rows_torch, "cpp": rows_torch, "triton": rows_triton}


# ------------------------------------------------------------------------------------------ the chunk loop
def fused_linear_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, *,
                    chunk_size: int, rows: RowFn, need_grad_hidden: bool, need_grad_weight: bool,
                    ignore_index: int = IGNORE_INDEX):
    """(loss, token_loss, predictions, grad_hidden | None, grad_weight | None), all detached.

    hidden [N, H] and weight [V, H] share a dtype; labels [N] int64; coef [N] fp32.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    keep = (labels != ignore_index).nonzero().squeeze(1)
    hv = hidden.index_select(0, keep)
    yv = labels.index_select(0, keep)
    cv = coef.index_select(0, keep).float().contiguous()
    nv = keep.numel()
    ce = torch.empty(nv, dtype=torch.float32, device=hidden.device)
    pred = torch.empty(nv, dtype=torch.int64, device=hidden.device)
    gh = torch.empty_like(hv) if need_grad_hidden else None
    gw = torch.zeros(v, h, dtype=torch.float32, device=weight.device) if need_grad_weight else None
    write_grad = need_grad_hidden or need_grad_weight
    # One logits buffer for all chunks (in the input dtype, as nn.Linear computes them): on CPU a
    # fresh 0.6 GB allocation per chunk costs as much in page faults as the row kernel itself.
    buf = torch.empty(min(chunk_size, nv), v, dtype=hidden.dtype, device=hidden.device)
    for s in range(0, nv, chunk_size):
        e = min(nv, s + chunk_size)
        hc = hv[s:e]
        logits = torch.matmul(hc, weight.t(), out=buf[:e - s])  # [c, V]
        ce[s:e], pred[s:e] = rows(logits, yv[s:e], cv[s:e], write_grad)
        if gh is not None:
            torch.matmul(logits, weight, out=gh[s:e])
        if gw is not None:
            gw.addmm_(logits.t().float(), hc.float())
    del buf
    loss = (ce * cv).sum()
    token_loss = torch.zeros(n, dtype=torch.float32, device=hidden.device).index_copy_(0, keep, ce)
    predictions = torch.full((n,), ignore_index, dtype=torch.int64, device=hidden.device).index_copy_(0, keep, pred)
    grad_hidden = torch.zeros_like(hidden).index_copy_(0, keep, gh) if gh is not None else None
    grad_weight = gw.to(weight.dtype) if gw is not None else None
    return loss, token_loss, predictions, grad_hidden, grad_weight


# The op as a torch custom op (see kernels/sde_logprob.py for why): FakeTensorMode and
# torch.compile see only its output shapes. Gradients are computed in forward; [0] where not asked.
@torch.library.custom_op("paco::weighted_linear_ce", mutates_args=())
def _wce_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, chunk_size: int,
            ignore_index: int, need_grad_hidden: bool, need_grad_weight: bool, backend: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, token_loss, pred, gh, gw = fused_linear_ce(hidden, weight, labels, coef, chunk_size=chunk_size,
                                                     rows=ROWS[backend], need_grad_hidden=need_grad_hidden,
                                                     need_grad_weight=need_grad_weight, ignore_index=ignore_index)
    return (loss, token_loss, pred, hidden.new_empty((0,)) if gh is None else gh,
            weight.new_empty((0,)) if gw is None else gw)


@_wce_op.register_fake
def _(hidden, weight, labels, coef, chunk_size, ignore_index, need_grad_hidden, need_grad_weight, backend):
    n = hidden.shape[0]
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((n,), dtype=torch.int64),
            torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_grad_weight else weight.new_empty((0,)))


def _wce_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[3], output[4])


def _wce_backward(ctx, g, _g_token_loss, _g_pred, _g_gh, _g_gw):
    # backward only scales the gradients forward computed: it needs neither the logits nor W
    gh, gw = ctx.saved_tensors
    scale = (lambda t, need: t * g.to(t.dtype) if need and t.numel() else None)
    return (scale(gh, ctx.needs_input_grad[0]), scale(gw, ctx.needs_input_grad[1]), None, None, None, None, None,
            None, None)


_wce_op.register_autograd(_wce_backward, setup_context=_wce_setup_context)


def weighted_linear_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       coef: torch.Tensor | None = None, *, normalizer: float | torch.Tensor | None = None,
                       ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None,
                       backend: str) -> WeightedCE:
    """sum_j coef_j * ce_j / normalizer over the rows whose label is not ignore_index.

    hidden [..., H] and labels [...] are flattened; coef defaults to 1 and normalizer to the number
    of labelled rows (so the defaults give the mean cross-entropy). `backend` is "torch", "cpp" or
    "triton" (the dispatcher in kernels/__init__.py resolves "auto").
    """
    if hidden.dtype != weight.dtype or hidden.dtype not in NATIVE_DTYPES:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one of {NATIVE_DTYPES}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(torch.int64)
    if y.numel() != h2.shape[0]:
        raise ValueError(f"{y.numel()} labels for {h2.shape[0]} rows of hidden states")
    valid = y != ignore_index
    c = valid.float() if coef is None else coef.detach().reshape(-1).float() * valid
    if normalizer is None:
        normalizer = valid.sum().clamp_min(1)
    c = (c / normalizer).contiguous()
    chunk = chunk_size or auto_chunk_size(weight.shape[0])
    w = weight.contiguous()
    grad = torch.is_grad_enabled()
    loss, token_loss, pred, _, _ = _wce_op(h2.contiguous(), w, y, c, chunk, ignore_index, grad and hidden.requires_grad,
                                           grad and weight.requires_grad, backend)
    return WeightedCE(loss, token_loss.detach().view(labels.shape), pred.view(labels.shape))
