"""Float64 reference of the first_token_weight loss and checks shared by the CPU, interpreter and GPU tests."""
from __future__ import annotations

import torch

IGNORE = -100


# Supervised label spans [start, stop) of 4 sequences of 12 tokens: after the shift they have 6
# supervised tokens, a single one, none, and 11.
SPANS = [(3, 9), (5, 6), (0, 0), (1, 12)]
N_FIRST = 6


def make_case(spans: list[tuple[int, int]], t: int, h: int, v: int, dtype, seed: int = 0, device="cpu"):
    """hidden [B, T, H], weight [V, H] and unshifted labels [B, T] supervised on [start, stop) of each
    row (a span of length 1 gives a single supervised token after the shift)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(spans), t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    labels = torch.full((len(spans), t), IGNORE, dtype=torch.int64)
    for i, (a, b) in enumerate(spans):
        labels[i, a:b] = torch.randint(0, v, (b - a,), generator=g)
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(device)


def loss64(hidden, weight, labels, alpha, mode="exact"):
    """The first_token_weight formula
    (PaCo-RL/PaCo-Reward/LLaMA-Factory/src/llamafactory/train/sft/trainer.py) written out per sequence
    and token, in float64."""
    logits = hidden.double() @ weight.double().t()
    total = torch.zeros((), dtype=torch.float64)
    n_all = 0
    for i in range(labels.shape[0]):
        pos = [t for t in range(labels.shape[1] - 1) if labels[i, t + 1] != IGNORE]
        n = len(pos)
        n_all += n
        for k, t in enumerate(pos):
            ce = torch.logsumexp(logits[i, t], 0) - logits[i, t, labels[i, t + 1]]
            if alpha is None:
                w = 1.0
            elif k == 0:
                w = alpha * (n if mode == "share" else 1)
            else:
                w = n * (1 - alpha) / max(n - 1, 1e-8)
            total = total + w * ce
    return total / max(n_all, 1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_float64(backend, dtype, alpha, mode="exact", device="cpu", v=97, chunk_size=5, seed=0):
    """Value and gradients (hidden and weight) of the fused loss against loss64 on the same inputs."""
    from kernel_checks import require_backend
    from paco_ds.sft.loss import naive_weighted_ce, sft_loss

    require_backend("weighted_linear_ce", backend, device)  # "triton" must run Triton, not the torch rows
    spans = SPANS
    hidden, weight, labels = make_case(spans, 12, 16, v, dtype, seed, device)
    hk, wk = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = sft_loss(hk, wk, labels, alpha, mode, chunk_size=chunk_size, backend=backend)
    out.loss.backward()
    h64, w64 = hidden.detach().cpu().double().requires_grad_(True), weight.detach().cpu().double().requires_grad_(True)
    ref = loss64(h64, w64, labels.cpu(), alpha, mode)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.item()) <= tol * max(1.0, abs(ref.item())), (out.loss.item(), ref.item())
    assert rel(hk.grad, h64.grad) < tol and rel(wk.grad, w64.grad) < tol
    assert hk.grad.dtype == dtype and wk.grad.dtype == dtype
    if dtype != torch.float32:  # the same rounding as the materialised path in that dtype
        hn, wn = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        naive_weighted_ce(hn @ wn.t(), labels, alpha, mode).backward()
        assert rel(hk.grad, hn.grad) < 1e-3 and rel(wk.grad, wn.grad) < 1e-3
    # rows without a label get exactly zero gradient
    no_label = torch.ones(labels.shape, dtype=torch.bool, device=labels.device)
    for i, (a, b) in enumerate(spans):
        no_label[i, max(a - 1, 0):max(b - 1, 0)] = False
    assert (hk.grad[no_label] == 0).all()
    # per-token CE and argmax at the supervised positions, as the materialised logits give them
    logits = hidden.double() @ weight.double().t()
    mask = out.shifted != IGNORE
    ce_ref = torch.logsumexp(logits, -1) - logits.gather(-1, out.shifted.clamp_min(0)[..., None]).squeeze(-1)
    assert rel(out.token_loss[mask], ce_ref[mask]) < tol and (out.token_loss[~mask] == 0).all()
    top2 = logits.topk(2, dim=-1).values
    margin = 1e-4 if dtype == torch.float32 else 0.1  # bf16 logits are rounded: near-ties may swap
    clear = mask & ((top2[..., 0] - top2[..., 1]) > margin)
    assert torch.equal(out.predictions[clear], logits.argmax(-1)[clear]) and (out.predictions[~mask] == IGNORE).all()
