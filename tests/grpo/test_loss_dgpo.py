"""DGPO (paco_ds/grpo/losses/dgpo.py): the loss against the authors' own function on the same tensors
(one rank, and a group split over two ranks), the loss of a micro-batch by hand, its limiting case
and the direction of its gradient, the noise a group shares and a resume draws again, and the
recipe's cross-checks."""
import math
from types import SimpleNamespace

import pytest
import torch

from stub_policy import grouped_batch, stub_loss
from paco_ds.grpo.losses.dgpo import DGPO, clip_dsm, dgpo_loss, old_policy_decay, preference_terms
from paco_ds.grpo.plan import load_config
from paco_ds.sampling.trajectory import make_generator

pytestmark = pytest.mark.fast

RECIPE = "configs/tiny/t2is_dgpo.yaml"


# ----------------------------------------------------------------- the authors' function, verbatim
# Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py, `compute_group_dgpo_loss_allreduce` (its body as
# published; `dist` below stands for torch.distributed: its all_reduce adds the other ranks' sums).
def compute_group_dgpo_loss_allreduce(
    model_v, ref_old_v, target_v, advantages,
    group_info, accelerator, beta_dpo, group_size = 24, dsm_loss = None,
):
    """AllReduce实现的梯度等价版本"""
    batch_size = model_v.shape[0]
    device = model_v.device

    if dsm_loss is None:
        dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)

    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size

    local_group_indices = group_info['local_group_indices']
    num_groups = group_info['num_groups']

    local_group_sums = torch.zeros(num_groups, device=device, dtype=per_sample_term.dtype)
    local_group_sums.scatter_add_(0, local_group_indices, per_sample_term)

    global_group_sums = local_group_sums.clone().detach()
    dist.all_reduce(global_group_sums, op=dist.ReduceOp.SUM)

    # group_weights = 1 - torch.sigmoid(global_group_sums)
    group_weights = torch.sigmoid(global_group_sums)
    local_weights = group_weights[local_group_indices]

    loss = (local_weights.detach() * advantages * dsm_loss).mean()

    return loss


class _OtherRanks:
    """torch.distributed for the function above: all_reduce adds the other ranks' partial sums."""
    ReduceOp = SimpleNamespace(SUM="sum")

    def __init__(self):
        self.others = None

    def all_reduce(self, tensor, op):
        if self.others is not None:
            tensor += self.others


dist = _OtherRanks()


def _group_info(group_ids):
    """The authors' precompute_group_info: a dense index per group of the micro-batch."""
    _, inverse = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    return {"local_group_indices": inverse, "num_groups": int(inverse.max()) + 1}


def _tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64)
    model_v = (target + 0.5 * torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    ref_v = target + 0.5 * torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64)
    return model_v, ref_v, target


def _ours(model_v, ref_v, target, adv, groups, beta, k, all_groups=None, all_terms=None):
    dsm = (model_v - target).pow(2).flatten(1).mean(1)
    ref = (ref_v - target).pow(2).flatten(1).mean(1)
    terms = preference_terms(dsm, ref, adv, beta, k)
    if all_groups is None:
        all_groups, all_terms = list(groups), terms
    return dgpo_loss(dsm, adv, list(groups), all_groups, all_terms), terms


def test_equals_the_authors_function_on_one_rank():
    model_v, ref_v, target = _tensors(8)
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.9, -0.9, 0.1, -0.1], dtype=torch.float64)
    groups = [5, 5, 5, 5, 2, 2, 2, 2]
    dist.others = None
    theirs = compute_group_dgpo_loss_allreduce(model_v, ref_v, target, adv, _group_info(groups), None, 100.0,
                                               group_size=4)
    (their_grad,) = torch.autograd.grad(theirs, model_v)
    (loss, weight, z), _ = _ours(model_v, ref_v, target, adv, groups, 100.0, 4)
    (our_grad,) = torch.autograd.grad(loss, model_v)
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert torch.allclose(our_grad, their_grad, rtol=1e-12, atol=0)
    assert 0 < weight.min() < weight.max() < 1  # the two groups have different weights


def test_a_group_split_over_two_ranks_sums_as_the_authors_all_reduce():
    model_v, ref_v, target = _tensors(8, seed=1)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.4, -0.2, 0.6, -0.8], dtype=torch.float64)
    groups = [3, 7, 3, 7, 3, 7, 3, 7]  # rows 0-3 on rank 0, 4-7 on rank 1: each group on both
    rank0, rank1 = slice(0, 4), slice(4, 8)
    beta, k = 50.0, 4
    (_, terms) = _ours(model_v, ref_v, target, adv, groups, beta, k)
    # the authors' all_reduce, seen from rank 0: rank 1's per-group sums come in
    info0 = _group_info(groups[rank0])
    other = torch.zeros(2, dtype=torch.float64).scatter_add_(0, _group_info(groups[rank1])["local_group_indices"],
                                                              terms[rank1].detach())
    dist.others = other
    try:
        theirs = compute_group_dgpo_loss_allreduce(model_v[rank0], ref_v[rank0], target[rank0], adv[rank0], info0,
                                                   None, beta, group_size=k)
    finally:
        dist.others = None
    (their_grad,) = torch.autograd.grad(theirs, model_v)
    # ours: rank 0's rows, the group sums over both ranks' gathered (group, term) rows
    (loss, _, z), _ = _ours(model_v[rank0], ref_v[rank0], target[rank0], adv[rank0], groups[rank0], beta, k,
                            groups, terms.detach())
    (our_grad,) = torch.autograd.grad(loss, model_v)
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert torch.allclose(our_grad, their_grad, rtol=1e-12, atol=0)
    assert z[0].item() == pytest.approx(float(terms[[0, 2, 4, 6]].sum()), rel=1e-12)  # all of group 3


# ------------------------------------------------------------------------------------ the loss


def _loss(w=0.3, base=0.3, *sets):
    return stub_loss(DGPO, RECIPE, w, base, "train.dgpo.beta=10", "sample.group_size=4", *sets)


def test_a_micro_batch_matches_the_formula_by_hand():
    loss, policy, module, cfg = _loss(0.4, 0.1)
    adv = [1.0, -1.0, 0.5, 2.0, -2.5, 7.0]
    groups = [0, 0, 0, 1, 1, 1]
    batch = grouped_batch(adv, groups)
    value, stats = loss(module, batch, 1)
    assert module.forwards == 2  # the reference (adapter disabled) and the policy
    step = loss.step_of_slot(1)
    sigma = float(torch.linspace(1.0, 0.0, cfg.sample.num_steps + 1)[step])
    a = [min(max(x, -5.0), 5.0) for x in adv]  # adv_clip_max 5
    dsm, ref = [], []
    for i, g in enumerate(groups):
        eps = torch.randn(4, 2, generator=make_generator(cfg.seed, "dgpo", 0, g, 1, 0))
        x0 = batch.x_final[i]
        x_t = (1 - sigma) * x0 + sigma * eps
        dsm.append(float(((0.4 * x_t - (eps - x0)) ** 2).mean()))
        ref.append(float(((0.1 * x_t - (eps - x0)) ** 2).mean()))
    z = {g: sum(a[i] * 10.0 * (dsm[i] - ref[i]) / 4 for i in range(6) if groups[i] == g) for g in (0, 1)}
    expected = sum(1 / (1 + math.exp(-z[groups[i]])) * a[i] * dsm[i] for i in range(6)) / 6
    assert value.item() == pytest.approx(expected, rel=1e-5)
    assert stats["dgpo_sigma"] == pytest.approx(sigma) and stats["dgpo_group_coverage"] == pytest.approx(3 / 4)
    # a group's members share their noise: x_t - (1 - sigma) x0 is the same eps times sigma
    x_t, sig = policy.seen[-1]
    shared = x_t - (1 - sigma) * batch.x_final
    assert torch.allclose(shared[0], shared[2], atol=1e-6) and not torch.allclose(shared[0], shared[3], atol=1e-3)
    assert sig.tolist() == pytest.approx([sigma] * 6)


def test_the_policy_equal_to_the_reference_weighs_every_group_one_half():
    loss, _, module, _ = _loss(0.3, 0.3)  # the adapter starts at zero: policy = reference
    _, stats = loss(module, grouped_batch([1.0, -1.0, 0.4, -0.4], [4, 4, 9, 9]), 0)
    assert stats["dgpo_weight"] == 0.5 and stats["dgpo_z"] == 0.0


def test_a_gradient_step_lowers_the_preferred_samples_error_against_the_rejected():
    loss, _, module, cfg = _loss(0.3, 0.3)
    batch = grouped_batch([1.0, -1.0, 0.2, -0.2], [0, 0, 0, 0])

    def margin():  # sum_i A_i dsm_i: lower when the preferred samples' errors fall against the rejected ones'
        loss.begin_epoch(0)
        value, _ = loss(module, batch, 0)
        return value

    before = margin()
    before.backward()
    assert float(module.w.grad) != 0
    with torch.no_grad():
        module.w -= 1e-2 * module.w.grad
    after = margin()
    assert after.item() < before.item()
    loss.begin_epoch(0)
    _, stats = loss(module, batch, 0)
    assert stats["dgpo_z"] < 0 and stats["dgpo_weight"] < 0.5  # the group now prefers as the rewards do


def test_fillers_add_nothing():
    loss, _, module, _ = _loss(0.5, 0.1)
    x = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(1))
    full, _ = loss(module, grouped_batch([1.0, -1.0], [0, 0], x_final=x[:2]), 0)
    loss.begin_epoch(0)
    padded, stats = loss(module, grouped_batch([1.0, -1.0, 3.0], [0, 0, 0], x_final=x, keep=[True, True, False]), 0)
    # the same two live rows; the filler's row adds no term to the group and no loss (mean over 3 rows)
    assert padded.item() * 3 == pytest.approx(full.item() * 2, rel=1e-6)
    assert stats["dgpo_group_coverage"] == pytest.approx(2 / 4)


def test_a_resumed_epoch_draws_the_same_noise():
    loss, _, module, _ = _loss(0.5, 0.1)
    batch = grouped_batch([1.0, -1.0, 0.5, -0.5], [0, 0, 1, 1])
    loss(module, batch, 0)
    state = loss.epoch_state()
    first, _ = loss(module, batch, 0)
    again, _ = loss(module, batch, 0)  # the next micro-step: fresh noise
    assert first.item() != again.item()
    resumed, _, module2, _ = _loss(0.5, 0.1)
    resumed.load_epoch_state(state)
    assert resumed(module2, batch, 0)[0].item() == first.item()


def test_truncated_draws_distinct_early_steps_per_epoch():
    loss, _, _, cfg = _loss(0.3, 0.3, "train.dgpo.num_timesteps=3", "train.dgpo.trunc_steps=4")
    assert cfg.train_timesteps == [0, 1, 2]
    per_epoch = []
    for epoch in range(6):
        loss.begin_epoch(epoch)
        steps = [loss.step_of_slot(t) for t in range(3)]
        assert len(set(steps)) == 3 and all(0 <= s <= 4 for s in steps)
        per_epoch.append(steps)
    assert len({tuple(s) for s in per_epoch}) > 1
    fixed, _, _, _ = _loss(0.3, 0.3, "train.dgpo.timestep_sampling=fixed", "train.timesteps=[2, 4]")
    assert [fixed.step_of_slot(t) for t in range(2)] == [2, 4]


# ------------------------------------------------------------------------------------ config
def test_recipe_validates():
    cfg = load_config(RECIPE)
    assert cfg.train.loss == "dgpo" and cfg.train_timesteps == [0, 1] and cfg.train.batch_size == 8
    assert cfg.sample.noise_level == 0 and cfg.train.loss_section is cfg.train.dgpo


@pytest.mark.parametrize("sets, key", [
    (["train.ppo.ratio_norm=true"], "train.ppo.ratio_norm"),
    (["sample.same_latent=true"], "sample.same_latent"),
    (["train.timesteps=[1]"], "train.timesteps"),  # only with fixed
    (["train.dgpo.timestep_sampling=fixed", "train.timesteps=[6]"], "train.timesteps"),
    (["train.dgpo.trunc_steps=6"], "train.dgpo.trunc_steps"),
    (["train.dgpo.num_timesteps=5"], "train.dgpo.num_timesteps"),
    (["train.dgpo.beta=0"], "train.dgpo.beta"),
    (["train.dgpo.bta=1"], "train.dgpo.bta"),
])
def test_bad_dgpo_config_names_the_key(sets, key):
    from paco_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(RECIPE, sets)


# ------------------------------------------------------------------------------------------------
# clip_dsm and the old policy (the authors' ema_ref), against their lines in scripts/train_sd3_dgpo.py
# ------------------------------------------------------------------------------------------------
def test_clip_dsm_cuts_the_gradient_of_the_rows_the_authors_clip():
    g = torch.Generator().manual_seed(0)
    dsm = torch.rand(64, generator=g, dtype=torch.float64).requires_grad_()
    old = dsm.detach() + 0.1 * torch.randn(64, generator=g, dtype=torch.float64)
    advantages = torch.randn(64, generator=g, dtype=torch.float64)
    clip_range = 5e-2
    # the authors' lines (`if use_old:` ... `if config.clip_dsm:`), verbatim but for the names of the inputs
    dsm_loss, old_dsm_loss = dsm * 1, old
    ratio = torch.exp(-dsm_loss + old_dsm_loss)
    should_clip = torch.where(
        advantages > 0,
        ratio > 1.0 + clip_range,
        ratio < 1.0 - clip_range,
    )
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    ours, cut = clip_dsm(dsm, old, advantages, clip_range)
    assert torch.equal(cut, should_clip) and 0 < int(cut.sum()) < 64
    assert torch.equal(ours, dsm_loss)
    (g_ours,) = torch.autograd.grad((ours * advantages).sum(), dsm)
    (g_ref,) = torch.autograd.grad((dsm_loss * advantages).sum(), dsm)
    assert torch.equal(g_ours, g_ref) and torch.all(g_ours[cut] == 0) and torch.all(g_ours[~cut] != 0)


def test_the_old_policy_follows_the_authors_ema_ref_and_clips_a_third_forward():
    loss, policy, module, _ = _loss(0.3, 0.3, "train.dgpo.clip_dsm=true", "train.dgpo.sample_with_old_after=2")
    loss.setup([module.w])
    ema = module.w.detach().clone()  # their EMAModuleWrapper's copy, made when training starts
    for global_step in range(1, 5):  # optimizer steps 1..4 (their global_step 0..3 at the update)
        with torch.no_grad():
            module.w += 0.05 * global_step
        decay = min(0.3, 0.001 * (global_step - 1))  # ema_ref_decay = min(0.3, 0.001 * global_step), theirs
        ema.add_((1 - decay) * (module.w.detach() - ema))  # EMAModuleWrapper.step with that decay
        loss.after_optimizer_step(global_step)
        assert torch.allclose(loss.old.shadow[0], ema.float(), rtol=0, atol=1e-6)
        current = float(module.w.detach())
        with loss.sampling():  # their switch_ema_ref: sampling with the old weights after that many steps
            inside = float(module.w.detach())
        assert float(module.w.detach()) == current  # and back after it
        old = float(loss.old.shadow[0])
        if global_step == 1:  # decay 0: the old policy is a copy of the weights after the first step
            assert inside == current == old
        elif global_step == 2:  # not yet past sample_with_old_after: the current weights sample
            assert inside == current != old
        else:
            assert inside == old != current
    assert old_policy_decay(1) == 0.0 and old_policy_decay(301) == 0.3 == old_policy_decay(5000)
    module.forwards = 0
    _, stats = loss(module, grouped_batch([1.0, -1.0, 0.5, -0.5], [0, 0, 1, 1]), 0)
    assert module.forwards == 3 and 0.0 <= stats["dgpo_clipfrac"] <= 1.0  # reference, old, policy
    saved = loss.state_dict()
    again, _, module2, _ = _loss(0.3, 0.3, "train.dgpo.clip_dsm=true", "train.dgpo.sample_with_old_after=2")
    again.setup([module2.w])
    again.load_state_dict(saved)
    assert torch.equal(again.old.shadow[0], loss.old.shadow[0]) and again.global_step == 4
