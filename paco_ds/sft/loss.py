"""The first_token_weight loss of PaCo-Reward
(PaCo-RL/PaCo-Reward/LLaMA-Factory/src/llamafactory/train/sft/trainer.py) and the SFT accuracies.

With logits shifted against labels (position t predicts token t+1), per-token cross-entropy l,
mask M = [label != -100], n_i = sum_t M_it, f_i the first supervised position of sequence i and
alpha = first_token_weight, the reference computes

    w_if = alpha,   w_it = n_i (1 - alpha) / max(n_i - 1, 1e-8) for the other supervised t,
    L = sum_it w_it l_it M_it / sum_it M_it        (normalised by the valid tokens of the micro-batch)

`mode="exact"` reproduces that. Note what it means: the decision token gets weight alpha and
every reasoning token about (1 - alpha) n / (n - 1), so alpha = 0.1 weights the Yes/No token about
9x *less* than a reasoning token, and alpha = 1/n does not give uniform CE (the first token gets
1/n, the others 1). The code comment in the reference reads "alpha share of the sequence";
`mode="share"` implements that reading: w_if = n_i alpha (the other weights unchanged), so each
sequence contributes n_i (alpha l_f + (1 - alpha) mean_{t != f} l_t), and alpha = 1/n is uniform CE.
With one supervised token both modes give alpha * l_f; alpha = None is plain mean CE.

`sft_loss` computes it through the fused linear + cross-entropy op (kernels/weighted_ce.py), which
never materialises the logits; `naive_weighted_ce` is the reference's own computation on
materialised logits (the ground truth in tests and the baseline of benchmarks/weighted_ce.py).
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

import kernels

IGNORE_INDEX = -100
Mode = Literal["exact", "share"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] labels aligned with the positions that predict them: out[:, t] = labels[:, t + 1]."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def first_token_weights(shifted: torch.Tensor, alpha: float | None, mode: Mode = "exact",
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-position weights w [B, T] (0 where the label is ignored) of the formula above."""
    mask = shifted != IGNORE_INDEX
    if alpha is None:
        return mask.to(dtype)
    if mode not in ("exact", "share"):
        raise ValueError(f"mode must be 'exact' or 'share', not {mode!r}")
    m = mask.to(dtype)
    n = m.sum(dim=1, keepdim=True)
    first = mask & (mask.cumsum(dim=1) == 1)
    w_other = n * (1.0 - alpha) / torch.clamp(n - 1, min=1e-8)
    w_first = alpha * (n if mode == "share" else torch.ones_like(n))
    return torch.where(first, w_first, w_other) * m


def naive_weighted_ce(logits: torch.Tensor, labels: torch.Tensor, alpha: float | None, mode: Mode = "exact"):
    """The reference computation on materialised logits [B, T, V] with unshifted labels [B, T]
    (upcast to fp32 as the reference does; float64 stays float64)."""
    shifted = shift_labels(labels)
    x = logits if logits.dtype == torch.float64 else logits.float()
    ce = F.cross_entropy(x.flatten(0, 1), shifted.flatten(), reduction="none",
                         ignore_index=IGNORE_INDEX).view(shifted.shape)
    w = first_token_weights(shifted, alpha, mode, x.dtype)
    return (ce * w).sum() / (shifted != IGNORE_INDEX).sum().clamp_min(1)


class SFTLoss(NamedTuple):
    loss: torch.Tensor  # the scalar of the formula
    shifted: torch.Tensor  # [B, T] labels aligned with the predicting positions
    token_loss: torch.Tensor  # [B, T] per-position CE (0 where ignored), detached
    predictions: torch.Tensor  # [B, T] argmax at each supervised position, detached


def sft_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, alpha: float | None,
             mode: Mode = "exact", *, chunk_size: int | None = None, backend: str = "auto") -> SFTLoss:
    """The formula from the last hidden states [B, T, H] and the LM-head weight [V, H], fused."""
    shifted = shift_labels(labels)
    w = first_token_weights(shifted, alpha, mode)
    out = kernels.weighted_linear_ce(hidden, lm_head_weight, shifted, w,
                                     normalizer=(shifted != IGNORE_INDEX).sum().clamp_min(1),
                                     chunk_size=chunk_size, backend=backend)
    return SFTLoss(out.loss, shifted, out.token_loss, out.predictions)


def sequence_stats(shifted: torch.Tensor, predictions: torch.Tensor,
                   token_loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sequence: token accuracy (mean over its supervised tokens), first-token correctness and
    first-token CE, and its number of supervised tokens; as the reference's ComputeAccuracy, the
    accuracies are averaged over sequences, not tokens."""
    mask = shifted != IGNORE_INDEX
    n = mask.sum(dim=1)
    correct = (predictions == shifted) & mask
    first = mask & (mask.cumsum(dim=1) == 1)
    return {"token_acc": correct.sum(dim=1).float() / n.clamp_min(1),
            "first_correct": (correct & first).any(dim=1).float(),
            "first_loss": (token_loss * first).sum(dim=1), "n_tokens": n.float()}
