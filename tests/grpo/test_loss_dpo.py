"""Online Diffusion-DPO (paco_ds/grpo/losses/dpo.py): the pairing inside a micro-batch, the loss
against the paper's formula computed here another way and against Flow-Factory's code on the same
tensors, its limiting cases and the direction of its gradient, the seeded noise a resume draws
again, and the recipe's cross-checks."""
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stub_policy import LinearVelocity, grouped_batch, stub_loss
from paco_ds.grpo.losses.dpo import DPO, best_worst_pairs, dpo_loss
from paco_ds.grpo.plan import load_config
from paco_ds.sampling.trajectory import make_generator

pytestmark = pytest.mark.fast

RECIPE = "configs/tiny/t2is_dpo.yaml"
logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ pairing
def test_best_against_worst_of_each_group_present():
    groups = [7, 3, 7, 3, 7, 5, 3]
    adv = [0.5, -1.0, 2.0, 1.0, -0.3, 9.0, 0.0]
    assert best_worst_pairs(groups, adv, [True] * 7) == [(2, 4), (3, 1)]  # group 5 alone: no pair
    # a filler or a dropped sample never pairs; the group's best among the kept ones wins
    assert best_worst_pairs(groups, adv, [True, True, False, True, True, True, True]) == [(0, 4), (3, 1)]
    # the gaps are 2.3 (group 7) and 2.0 (group 3): a pair needs more than the margin
    assert best_worst_pairs(groups, adv, [True] * 7, margin=1.5) == [(2, 4), (3, 1)]
    assert best_worst_pairs(groups, adv, [True] * 7, margin=2.0) == [(2, 4)]
    assert best_worst_pairs([1, 1, 1], [0.0, 0.0, 0.0], [True] * 3) == []  # a tie is no preference


# ------------------------------------------------------------------------------------ the loss
def _paper(err_w, err_l, ref_w, ref_l, beta):
    """Diffusion-DPO (arXiv 2311.12908, Eq. 14 with the authors' -beta/2 scale), one pair at a time:
    -log sigmoid(z) written as log(1 + exp(-z))."""
    out = []
    for ew, el, rw, rl in zip(err_w, err_l, ref_w, ref_l):
        z = -beta / 2 * ((ew - rw) - (el - rl))
        out.append(math.log1p(math.exp(-z)))
    return out


def test_dpo_loss_is_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    e = [torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4)]
    per_pair, stats = dpo_loss(*e, beta=3.0)
    assert per_pair.tolist() == pytest.approx(_paper(*(x.tolist() for x in e), 3.0), rel=1e-12)
    inside = -1.5 * ((e[0] - e[2]) - (e[1] - e[3]))
    assert float(stats["dpo_accuracy"]) == pytest.approx(float((inside > 0).double().mean()))
    # equal errors (or errors equal to the reference's): no preference yet, log 2
    same, _ = dpo_loss(e[0], e[0], e[2], e[2], beta=1000.0)
    assert same.tolist() == pytest.approx([math.log(2)] * 5)


def _loss(w=0.3, base=0.3, *sets):
    return stub_loss(DPO, RECIPE, w, base, "train.dpo.beta=10", *sets)


def test_the_loss_on_a_micro_batch_matches_the_formula_by_hand():
    loss, policy, module, cfg = _loss(0.4, 0.1)
    batch = grouped_batch([1.0, -1.0, 0.5, 2.0, -2.0], [0, 0, 1, 1, 2])
    value, stats = loss(module, batch, 1)
    assert module.forwards == 2 and stats["dpo_pairs"] == 2.0  # group 2 alone
    sigma = float(torch.linspace(1.0, 0.0, cfg.sample.num_steps + 1)[cfg.train_timesteps[1]])
    errs = {}
    for w, l in ((0, 1), (3, 2)):  # each group's (winner, loser), in rows of the batch
        eps = torch.randn(4, 2, generator=make_generator(cfg.seed, "dpo", 0, 10 + w, 10 + l, 1, 0))
        for i, who in ((w, "w"), (l, "l")):
            x0 = batch.x_final[i]
            x_t = (1 - sigma) * x0 + sigma * eps
            target = eps - x0
            errs.setdefault(who, []).append(float(((0.4 * x_t - target) ** 2).mean()))
            errs.setdefault("r" + who, []).append(float(((0.1 * x_t - target) ** 2).mean()))
    expected = sum(_paper(errs["w"], errs["l"], errs["rw"], errs["rl"], 10.0)) / 2
    assert value.item() == pytest.approx(expected, rel=1e-5)
    # the pair shares its noise level and its noise: rows w1 w2 l1 l2
    x_t, sig = policy.seen[-1]
    assert sig.tolist() == pytest.approx([sigma] * 4)
    assert torch.allclose(x_t[0] - (1 - sigma) * batch.x_final[0], x_t[2] - (1 - sigma) * batch.x_final[1], atol=1e-6)


# ------------------------------------------------- Flow-Factory's online DPO on the same tensors
# X-GenGroup/Flow-Factory, src/flow_factory/trainers/dpo.py: `_form_pairs_from_advantages` (its body as
# published) and the loss lines of `optimize`, from the noised latents to `loss`, verbatim; the
# adapter's forward is the stub module, the reference forward the module with its base weight.
class BaseSample(SimpleNamespace):
    pass


class DPOTrainer:
    @staticmethod
    def _get_advantage(sample: BaseSample) -> float:
        """Extract scalar advantage from a sample."""
        adv = sample.extra_kwargs['advantage']
        return adv.item() if hasattr(adv, 'item') else float(adv)

    @staticmethod
    def _form_pairs_from_advantages(samples):
        # Build group mapping from unique_id
        unique_ids = np.array([s.unique_id for s in samples], dtype=np.int64)
        _, group_indices = np.unique(unique_ids, return_inverse=True)

        # Extract advantage values
        advantages = np.array(
            [DPOTrainer._get_advantage(s) for s in samples],
            dtype=np.float64,
        )

        pairs = []
        for gid in np.unique(group_indices):
            mask = np.where(group_indices == gid)[0]
            if len(mask) < 2:
                logger.warning(f"Group {gid} has less than 2 samples, skipping pair formation.")
                continue
            group_adv = advantages[mask]
            best = mask[np.argmax(group_adv)]
            worst = mask[np.argmin(group_adv)]
            pairs.append((samples[best], samples[worst]))
        return pairs


def to_broadcast_tensor(value, like):
    return value.reshape(-1, *([1] * (like.dim() - 1)))


def flow_factory_dpo_loss(chosen_latents, rejected_latents, sigma, noise, forward, ref_forward, beta):
    sigma_broadcast = to_broadcast_tensor(sigma, chosen_latents)

    # Noise both at same σ: x_t = (1 - σ) * x_0 + σ * noise
    noised_chosen = (1 - sigma_broadcast) * chosen_latents + sigma_broadcast * noise
    noised_rejected = (1 - sigma_broadcast) * rejected_latents + sigma_broadcast * noise

    # Policy forward
    theta_w_pred = forward(noised_chosen)
    theta_l_pred = forward(noised_rejected)

    # Reference forward (frozen)
    with torch.no_grad():
        ref_w_pred = ref_forward(noised_chosen)
        ref_l_pred = ref_forward(noised_rejected)

    # MSE errors per sample — target is flow-matching velocity (noise - x_0), same as
    # flow_grpo train_sd3_dpo.py: target = noise - model_input
    target_w = noise - chosen_latents
    target_l = noise - rejected_latents
    spatial_dims = tuple(range(1, theta_w_pred.ndim))
    theta_w_err = ((theta_w_pred.float() - target_w.float()) ** 2).mean(dim=spatial_dims)
    theta_l_err = ((theta_l_pred.float() - target_l.float()) ** 2).mean(dim=spatial_dims)
    ref_w_err = ((ref_w_pred.float() - target_w.float()) ** 2).mean(dim=spatial_dims)
    ref_l_err = ((ref_l_pred.float() - target_l.float()) ** 2).mean(dim=spatial_dims)

    # DPO loss
    w_diff = theta_w_err - ref_w_err
    l_diff = theta_l_err - ref_l_err
    w_l_diff = w_diff - l_diff
    inside_term = -0.5 * beta * w_l_diff
    loss = -F.logsigmoid(inside_term).mean()
    return loss


def test_pairs_loss_and_gradient_equal_flow_factorys_on_the_same_tensors():
    adv = [0.8, -1.3, 0.1, 2.0, -0.7, 0.4, 1.1, -0.2]
    groups = [3, 3, 3, 1, 1, 1, 8, 8]
    batch = grouped_batch(adv, groups)
    samples = [BaseSample(unique_id=g, extra_kwargs={"advantage": torch.tensor(a)}, row=i)
               for i, (g, a) in enumerate(zip(groups, adv))]
    theirs = {(w.row, l.row) for w, l in DPOTrainer._form_pairs_from_advantages(samples)}
    pairs = best_worst_pairs(groups, adv, [True] * len(adv))
    assert set(pairs) == theirs and len(pairs) == 3
    # a tie: Flow-Factory pairs a sample with itself (inside term 0, loss log 2, no gradient); here no pair
    tie = [BaseSample(unique_id=0, extra_kwargs={"advantage": 0.0}, row=i) for i in range(2)]
    assert [(w.row, l.row) for w, l in DPOTrainer._form_pairs_from_advantages(tie)] == [(0, 0)]
    assert best_worst_pairs([0, 0], [0.0, 0.0], [True, True]) == []

    loss, _, module, cfg = _loss(0.45, 0.15)
    ours, _ = loss(module, batch, 1)
    (our_grad,) = torch.autograd.grad(ours, module.w)
    sigma = float(torch.linspace(1.0, 0.0, cfg.sample.num_steps + 1)[cfg.train_timesteps[1]])
    noise = torch.stack([torch.randn(4, 2, generator=make_generator(cfg.seed, "dpo", 0, 10 + w, 10 + l, 1, 0))
                         for w, l in pairs])  # the pair's shared noise, as the loss draws it
    ref = LinearVelocity(0.15)
    value = flow_factory_dpo_loss(batch.x_final[[w for w, _ in pairs]], batch.x_final[[l for _, l in pairs]],
                                  torch.full((len(pairs),), sigma), noise, module, ref, beta=10.0)
    (their_grad,) = torch.autograd.grad(value, module.w)
    assert ours.item() == pytest.approx(value.item(), rel=1e-6)
    assert our_grad.item() == pytest.approx(their_grad.item(), rel=1e-5)


def test_policy_equal_to_the_reference_or_equal_samples_give_log_2():
    loss, _, module, _ = _loss(0.3, 0.3)  # the adapter starts at zero: policy = reference
    value, stats = loss(module, grouped_batch([1.0, -1.0], [4, 4]), 0)
    assert value.item() == pytest.approx(math.log(2)) and stats["dpo_accuracy"] == 0.0
    loss, _, module, _ = _loss(0.7, 0.1)
    twins = torch.ones(2, 4, 2)
    value, _ = loss(module, grouped_batch([1.0, -1.0], [4, 4], x_final=twins), 0)
    assert value.item() == pytest.approx(math.log(2))


def test_a_gradient_step_lowers_the_winners_error_against_the_losers():
    loss, _, module, _ = _loss(0.3, 0.3)
    batch = grouped_batch([1.0, -1.0, 0.2], [0, 0, 0])
    value, before = loss(module, batch, 0)
    value.backward()
    assert module.w.grad is not None and float(module.w.grad) != 0
    with torch.no_grad():
        module.w -= 1e-3 * module.w.grad
    loss.begin_epoch(0)  # the same draw again
    after_value, after = loss(module, batch, 0)
    assert after["dpo_err_w"] - after["dpo_err_l"] < before["dpo_err_w"] - before["dpo_err_l"]
    assert after_value.item() < math.log(2) and after["dpo_accuracy"] == 1.0


def test_without_a_pair_the_step_runs_both_forwards_and_trains_nothing():
    loss, _, module, _ = _loss(0.5, 0.1)
    # a group of one, and a group whose other sample is a filler
    batch = grouped_batch([1.0, 2.0, -2.0], [0, 1, 1], keep=[True, True, False])
    value, stats = loss(module, batch, 0)
    value.backward()
    assert module.forwards == 2 and stats["dpo_pairs"] == 0.0
    assert value.item() == 0.0 and float(module.w.grad) == 0.0


def test_kl_reuses_the_two_forwards():
    loss, _, module, _ = _loss(0.5, 0.1, "train.kl_beta=0.5")
    _, stats = loss(module, grouped_batch([1.0, -1.0], [0, 0]), 0)
    assert module.forwards == 2 and stats["kl"] > 0


def test_a_resumed_epoch_draws_the_same_noise():
    loss, policy, module, _ = _loss(0.5, 0.1, "train.dpo.timestep_sampling=uniform", "train.timesteps=null",
                                    "train.dpo.num_timesteps=2", "train.dpo.t_min=0.2", "train.dpo.t_max=0.8")
    batch = grouped_batch([1.0, -1.0, 0.5, -0.5], [0, 0, 1, 1])
    loss(module, batch, 0)
    state = loss.epoch_state()
    first, _ = loss(module, batch, 1)
    again, _ = loss(module, batch, 1)  # a second visit of the same pair and slot: fresh noise
    assert first.item() != again.item()
    resumed, policy2, module2, _ = _loss(0.5, 0.1, "train.dpo.timestep_sampling=uniform", "train.timesteps=null",
                                         "train.dpo.num_timesteps=2", "train.dpo.t_min=0.2", "train.dpo.t_max=0.8")
    resumed.load_epoch_state(state)
    value, _ = resumed(module2, batch, 1)
    assert value.item() == first.item()
    levels = policy.seen[-1][1].tolist()
    assert all(0.2 <= s <= 0.8 for s in levels) and levels[:2] == levels[2:]


# ------------------------------------------------------------------------------------ config
def test_recipe_validates():
    cfg = load_config(RECIPE)
    assert cfg.train.loss == "dpo" and cfg.train_timesteps == [1, 3] and cfg.train.batch_size == 8
    assert cfg.sample.noise_level == 0 and cfg.train.loss_section is cfg.train.dpo
    uniform = load_config(RECIPE, ["train.dpo.timestep_sampling=uniform", "train.timesteps=null",
                                   "train.dpo.num_timesteps=3"])
    assert uniform.train_timesteps == [0, 1, 2]


@pytest.mark.parametrize("sets, key", [
    (["train.batch_size=1"], "train.batch_size"),  # a micro-batch of one holds no pair
    (["train.ppo.ratio_norm=true"], "train.ppo.ratio_norm"),
    (["sample.sde_window={size: 2, range: [0, 3]}", "train.timesteps=null"], "sample.sde_window"),
    (["sample.same_latent=true"], "sample.same_latent"),
    (["train.timesteps=[6]"], "train.timesteps"),
    (["train.dpo.timestep_sampling=uniform"], "train.timesteps"),  # only with fixed
    (["train.dpo.t_min=0.9", "train.dpo.t_max=0.5"], "train.dpo.t_min"),
    (["train.dpo.beta=0"], "train.dpo.beta"),
    (["train.dpo.margn=0.1"], "train.dpo.margn"),
])
def test_bad_dpo_config_names_the_key(sets, key):
    from paco_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(RECIPE, sets)


def test_the_epochs_pair_statistics_are_per_pair_not_per_micro_step():
    """A micro-step without a pair adds no pair: the epoch's accuracy is over the pairs it had."""
    import numpy as np

    loss, _, module, _ = _loss(0.5, 0.1)
    two = loss(module, grouped_batch([1.0, -1.0, 0.5, -0.5], [0, 0, 1, 1]), 0)[1]
    none = loss(module, grouped_batch([1.0, 2.0, -2.0], [0, 1, 1], keep=[True, True, False]), 0)[1]
    assert two["dpo_pairs"] == 2.0 and none["dpo_pairs"] == 0.0
    per_pair_inside = two["dpo_inside"] / 2
    out = {f"train/{k}": float(np.mean([two[k], none[k]])) for k in two}  # as the trainer averages micro-steps
    out = loss.epoch_metrics(out)
    assert out["train/dpo_pairs"] == 1.0  # the mean count per micro-step
    assert out["train/dpo_inside"] == pytest.approx(per_pair_inside)
    assert out["train/dpo_accuracy"] == pytest.approx(two["dpo_accuracy"] / 2) and 0 <= out["train/dpo_accuracy"] <= 1
