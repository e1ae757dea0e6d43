"""GRPO advantages and the PPO-clip loss as tensor ops: torch and Triton (the stat tracker of
PaCo-RL/PaCo-GRPO/paco_grpo/stat_tracking.py; compute_ppo_loss of PaCo-RL/PaCo-GRPO/scripts/train_flux.py).

Why: on GPU the advantage step of an epoch is one Triton launch over the gathered [K, N] rewards,
and the PPO-clip loss with its statistics is one launch forward and one backward. The stat tracker
(`paco_ds.grpo.advantages`) aggregates the rewards itself (`paco_ds.rewards.aggregate`, in torch)
and normalises the result through this op, one reward type.

`grpo_advantages` implements the centred path of the reference: optional log-tame of the reward
types (coefficient of variation over the batch above a threshold -> log(1 + r)), the weighted sum,
then (R - group mean) / std with a global or per-group std floored at `std_floor`, then the clip.
It computes in fp64, as the reference does; the torch version below is also the CPU path.

`ppo_clip_loss_torch` is the torch reference of the PPO-clip loss (the ground truth, and the
"torch" and "cpp" backends: there is no C++ kernel for [B] vectors); `ppo_clip_loss_triton`
returns the same, with the gradient of autograd's own rule (see `_triton_grpo.ppo_bwd`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import geometry as G

STATS = ("unclipped_loss", "clipped_loss", "ratio", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one")
_TAME = {None: 0, "mean": 1, "median": 2}
ADV_BLOCK = G.ADV_BLOCK  # samples per program of the advantage kernel (and the tile edge of its group search)
PPO_BLOCK = G.PPO_BLOCK
MAX_REWARD_TYPES = G.MAX_REWARD_TYPES


class LogTameDomainError(ValueError):
    """A reward type chosen for log(1 + r) has values <= -1; `index` is its row in the rewards."""

    def __init__(self, index: int, minimum: float):
        super().__init__(f"log_tame: reward type {index} has values <= -1 (min {minimum:.4g}); "
                         "log(1+r) is undefined")
        self.index, self.minimum = index, minimum


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [N] fp64
    combined: torch.Tensor  # [N] fp64: the aggregated reward of each sample
    cv: torch.Tensor | None  # [K] fp64: coefficient of variation of each reward type (log-tame only)
    tamed: torch.Tensor | None  # [K] bool: the reward types that were log-tamed
    threshold: torch.Tensor | None  # fp64 scalar: the log-tame threshold that was applied


def _tame_code(log_tame) -> int:
    if isinstance(log_tame, str) or log_tame is None:
        if log_tame not in _TAME:
            raise ValueError(f"log_tame must be None, 'mean', 'median' or a number, not {log_tame!r}")
        return _TAME[log_tame]
    return 3


def _check_tamed(rewards: torch.Tensor, tamed: torch.Tensor | None) -> None:
    if tamed is None:
        return
    bad = tamed & (rewards.amin(dim=1) <= -1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise LogTameDomainError(k, rewards[k].min().item())


def advantages_torch(rewards: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor, *, log_tame=None,
                     global_std: bool = True, std_floor: float = 1e-6, clip: float = 5.0) -> Advantages:
    """The torch version (fp64 on CPU: index_add_ is deterministic there), results on the input device."""
    device = rewards.device
    r = rewards.detach().to("cpu", torch.float64)
    w = weights.to("cpu", torch.float64)
    cv = tamed = tau = None
    code = _tame_code(log_tame)
    if code:
        cv = r.std(dim=1, unbiased=False) / (r.mean(dim=1) + 1e-6)
        tau = cv.mean() if code == 1 else cv.quantile(0.5) if code == 2 else torch.tensor(float(log_tame),
                                                                                            dtype=torch.float64)
        tamed = cv > tau
        _check_tamed(r, tamed)
        r = torch.where(tamed[:, None], torch.log1p(r), r)
    combined = (w[:, None] * r).sum(dim=0)
    _, inverse = torch.unique(group_ids.to("cpu"), return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.bincount(inverse, minlength=n_groups).double()
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, combined) / count
    centred = combined - mean[inverse]
    if global_std:
        std = combined.std(unbiased=False).clamp_min(std_floor)
    else:
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
        std = var.sqrt().clamp_min(std_floor)[inverse]
    adv = (centred / std).clamp(-clip, clip)
    to = (lambda t: None if t is None else t.to(device))
    return Advantages(adv.to(device), combined.to(device), to(cv), to(tamed), to(tau))


@torch.library.custom_op("paco::grpo_advantages", mutates_args=())
def _advantages_op(r: torch.Tensor, w: torch.Tensor, g: torch.Tensor, params: torch.Tensor, tame: int,
                   global_std: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages [N], combined [N], cv [K], tamed [K] int32, threshold []) of fp64 rewards r [K, N],
    weights w [K], int64 group ids g [N], params fp64 (tau_fixed, std_floor, clip): one launch."""
    from kernels import _triton_grpo

    k, n = r.shape
    adv = torch.empty(n, dtype=torch.float64, device=r.device)
    combined = torch.empty_like(adv)
    cv = torch.empty(k, dtype=torch.float64, device=r.device)
    tamed = torch.empty(k, dtype=torch.int32, device=r.device)
    tau = torch.empty((), dtype=torch.float64, device=r.device)
    _triton_grpo.grpo_advantages[(G.cdiv(n, ADV_BLOCK),)](r, w, g, params, adv, combined, cv, tamed, tau, k, n,
                                                          TAME=tame, GLOBAL_STD=global_std, BLOCK_K=G.adv_block_k(k),
                                                          BLOCK=ADV_BLOCK, num_warps=G.ADV_WARPS)
    return adv, combined, cv, tamed, tau


@_advantages_op.register_fake
def _(r, w, g, params, tame, global_std):
    k, n = r.shape
    f64 = dict(dtype=torch.float64)
    return (r.new_empty((n,), **f64), r.new_empty((n,), **f64), r.new_empty((k,), **f64),
            r.new_empty((k,), dtype=torch.int32), r.new_empty((), **f64))


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def advantages_triton(rewards: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor, *, log_tame=None,
                      global_std: bool = True, std_floor: float = 1e-6, clip: float = 5.0) -> Advantages:
    code = _tame_code(log_tame)
    dev = rewards.device
    r = rewards.detach().to(torch.float64).contiguous()
    w = weights.to(dev, torch.float64).contiguous()
    g = group_ids.to(dev, torch.int64).contiguous()
    params = torch.tensor([float(log_tame) if code == 3 else 0.0, std_floor, clip], dtype=torch.float64, device=dev)
    adv, combined, cv, tamed, tau = _advantages_op(r, w, g, params, code, global_std)
    if not code:
        return Advantages(adv, combined, None, None, None)
    if not _is_fake(r):  # the domain check reads values, which a fake tensor has none of
        _check_tamed(r, tamed.bool())
    return Advantages(adv, combined, cv, tamed.bool(), tau)


def ppo_clip_loss_torch(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        clip_range: float, adv_clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-clip policy loss on per-sample log-probs: (scalar loss, detached statistics).

    ratio = exp(log pi_theta - log pi_old); with A clipped to +-adv_clip,
    loss = mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))). Log-probs are per-element
    means over the latent, so ratios stay very close to 1 and eps is tiny (1e-4).
    """
    adv = advantages.float().clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob.float() - old_log_prob.float())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": loss.detach(),
            "unclipped_loss": unclipped.mean(),
            "clipped_loss": clipped.mean(),
            "ratio": ratio.mean(),
            "clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
            "clipfrac_gt_one": (ratio - 1 > clip_range).float().mean(),
            "clipfrac_lt_one": (1 - ratio > clip_range).float().mean(),
        }
    return loss, stats


# The Triton PPO-clip loss as a torch custom op (see kernels/sde_logprob.py for why): forward
# returns [loss, unclipped, clipped, ratio, clipfrac, clipfrac_gt_one, clipfrac_lt_one].
@torch.library.custom_op("paco::ppo_clip", mutates_args=())
def _ppo_op(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
            adv_clip: float) -> torch.Tensor:
    from kernels import _triton_grpo

    b = log_prob.shape[0]
    out = torch.empty(7, dtype=torch.float32, device=log_prob.device)
    _triton_grpo.ppo_fwd[(1,)](log_prob, old_log_prob, adv, out, b, 1 - clip_range, 1 + clip_range, clip_range,
                               adv_clip, BLOCK=G.ppo_fwd_block(b))
    return out


@_ppo_op.register_fake
def _(log_prob, old_log_prob, adv, clip_range, adv_clip):
    from kernels.sde_logprob import check_devices

    check_devices(torch.ops.paco.ppo_clip.default, log_prob, old_log_prob, adv)
    return log_prob.new_empty((7,), dtype=torch.float32)


@torch.library.custom_op("paco::ppo_clip_backward", mutates_args=())
def _ppo_bwd_op(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, g_loss: torch.Tensor,
                clip_range: float, adv_clip: float) -> torch.Tensor:
    """d loss / d log_prob (= -d loss / d old_log_prob), [B] fp32."""
    from kernels import _triton_grpo

    b = log_prob.shape[0]
    grad = torch.empty(b, dtype=torch.float32, device=log_prob.device)
    _triton_grpo.ppo_bwd[(G.cdiv(b, PPO_BLOCK),)](log_prob, old_log_prob, adv, g_loss, grad, b, 1 - clip_range,
                                                  1 + clip_range, adv_clip, BLOCK=PPO_BLOCK)
    return grad


@_ppo_bwd_op.register_fake
def _(log_prob, old_log_prob, adv, g_loss, clip_range, adv_clip):
    return torch.empty_like(log_prob)


def _ppo_setup_context(ctx, inputs, output):
    log_prob, old_log_prob, adv, clip_range, adv_clip = inputs
    ctx.save_for_backward(log_prob, old_log_prob, adv)
    ctx.clip = (clip_range, adv_clip)


def _ppo_backward(ctx, g_out):
    log_prob, old_log_prob, adv = ctx.saved_tensors
    # only the loss (element 0) is differentiable; the statistics are reported detached
    grad = _ppo_bwd_op(log_prob, old_log_prob, adv, g_out[:1].float().contiguous(), *ctx.clip)
    need_lp, need_old = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    return grad if need_lp else None, -grad if need_old else None, None, None, None


_ppo_op.register_autograd(_ppo_backward, setup_context=_ppo_setup_context)


def ppo_clip_loss_triton(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """(scalar loss, detached statistics) with the keys of the torch reference."""
    flat = [t.reshape(-1).float().contiguous() for t in (log_prob, old_log_prob, advantages)]
    out = _ppo_op(*flat, float(clip_range), float(adv_clip))
    loss, stats = out[0], out[1:].detach()
    return loss, {"policy_loss": loss.detach(), **dict(zip(STATS, stats.unbind(0)))}
