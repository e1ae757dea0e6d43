"""Tree rollouts (sample.tree, BranchGRPO): the tree's leaves equal their unshared paths for the same
noise, every node is computed once, the advantages equal BranchGRPO's node rewards and depth-wise
normalisation (its functions transcribed below), and what cannot run is one line naming the key."""
import math

import numpy as np
import pytest
import torch
from conftest import REPO, TINY

from paco_ds.data import PromptItem
from paco_ds.errors import ConfigError
from paco_ds.grpo.epoch import EpochSamples
from paco_ds.grpo.losses.base import RolloutNeeds
from paco_ds.grpo.plan import load_config
from paco_ds.sampling.rollouts import Pick, Rollouts
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, step_advantages, transition_log_prob
from paco_ds.sampling.tree import ancestor, calls_per_tree, group_members, tree_advantages, tree_noise

pytestmark = pytest.mark.fast

TREE = REPO / "configs/tiny/t2is_tree.yaml"
SIZE = 64


# ------------------------------------------------------------------------------------ sampling
def leaves(group: int, members, item=PromptItem("a red fox in snow")):
    return [Pick(item, group, 100 + m, m) for m in members]


def unshared(policy, cfg, picks, epoch):
    """Each leaf sampled alone by the plain sampler, its SDE noise at each split the tree's for that node."""
    s = cfg.sample
    levels = len(s.noise_steps)
    out = []
    for p in picks:
        x0 = policy.initial_latents(1, SIZE, SIZE, [make_generator(cfg.seed, "latent", epoch, p.group)])

        def noise(r, i, p=p, shape=x0.shape[1:]):
            depth = s.noise_steps.index(i) + 1
            node = ancestor(p.member, depth, s.tree.branches, levels)
            return tree_noise(cfg.seed, epoch, p.group, depth, node, shape)
        spec = SamplingSpec(num_steps=s.num_steps, guidance=s.guidance_scale, noise_level=s.noise_level)
        out.append(sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
            prompts=[p.item.prompt], embeds=policy.encode_prompts([p.item.prompt]), height=SIZE, width=SIZE,
            initial_latents=x0, noise_steps=s.noise_steps, train_steps=s.noise_steps, noise_fn=noise)))
    return out


def test_the_leaves_equal_their_unshared_paths_and_every_node_is_computed_once(tiny_policy):
    cfg = load_config(TREE)
    rollouts = Rollouts(cfg, tiny_policy, needs=RolloutNeeds(log_probs=True))
    picks = leaves(0, range(8))
    # two rollout batches of the same tree on one rank: the second reuses the first's shared nodes
    a = rollouts.sample(tiny_policy.transformer, picks[:3], SIZE, SIZE, epoch=0)
    b = rollouts.sample(tiny_policy.transformer, picks[3:], SIZE, SIZE, epoch=0)
    assert rollouts.transformer_calls == calls_per_tree(6, [0, 2, 4], 2) == 21  # 8 unshared leaves: 48
    ref = unshared(tiny_policy, cfg, picks, 0)
    for traj, first in ((a, 0), (b, 3)):
        for r in range(len(traj)):
            one = ref[first + r]
            assert traj.steps[r].tolist() == [0, 2, 4]
            for name in ("x_t", "x_next", "log_prob", "sigma", "sigma_next"):
                torch.testing.assert_close(getattr(traj, name)[r], getattr(one, name)[0], rtol=1e-4, atol=1e-5)
            assert (traj.images[r].int() - one.images[0].int()).abs().max() <= 1
    # siblings share everything before their split and nothing after it
    assert torch.equal(a.x_t[0, 2], a.x_t[1, 2]) and not torch.equal(a.x_next[0, 2], a.x_next[1, 2])
    assert torch.equal(a.x_next[0, 0], b.x_next[0, 0])  # leaf 3 and leaf 0 share the first split's node
    assert not torch.equal(a.images[0], a.images[1])
    # training recomputes each leaf's stored log pi_old exactly
    with torch.no_grad():
        step = transition_log_prob(tiny_policy, tiny_policy.transformer, b, 1, slice(None), spec=rollouts.spec(0))
    torch.testing.assert_close(step.log_prob.float(), b.log_prob[:, 1], rtol=1e-5, atol=1e-5)


def test_a_leaf_does_not_depend_on_the_batch_or_rank_that_samples_it(tiny_policy):
    cfg = load_config(TREE)
    alone = Rollouts(cfg, tiny_policy, needs=RolloutNeeds(log_probs=True))
    together = Rollouts(cfg, tiny_policy, needs=RolloutNeeds(log_probs=True))
    one = alone.sample(tiny_policy.transformer, leaves(1, [5]), SIZE, SIZE, epoch=3)
    many = together.sample(tiny_policy.transformer, leaves(1, [5, 4, 0]), SIZE, SIZE, epoch=3)
    torch.testing.assert_close(one.log_prob[0], many.log_prob[0], rtol=1e-5, atol=1e-6)
    assert (one.images[0].int() - many.images[0].int()).abs().max() <= 1
    # a new epoch draws new noise
    other = alone.sample(tiny_policy.transformer, leaves(1, [5]), SIZE, SIZE, epoch=4)
    assert not torch.allclose(other.log_prob, one.log_prob)


def test_calls_per_tree_counts_each_node_once():
    # 2 branches at steps 0, 2, 4 of 6: 1 call at step 0, then 2 nodes x 1 ODE step, 2 parents at step 2,
    # 4 x 1, 4 parents at step 4, 8 leaves x 1
    assert calls_per_tree(6, [0, 2, 4], 2) == 1 + 2 + 2 + 4 + 4 + 8
    assert calls_per_tree(10, [1], 16) == 1 + 1 + 16 * 8  # today's shared prefix: one split of k
    assert calls_per_tree(10, [0, 2, 3, 5], 2) == 89  # configs/flux_t2is_tree.yaml, against 16 x 10


# ------------------------------------------------------------------------------------ advantages
class TreeNode:
    """BranchGRPO's node (Fredreic1849/BranchGRPO @ ffc3c90, fastvideo/train_branchgrpo_flux.py), the
    fields its advantage functions read."""

    def __init__(self, node_id, parent=None):
        self.node_id, self.parent, self.children = node_id, parent, []
        self.reward = self.advantage = None
        self.depth = 0 if parent is None else parent.depth + 1

    def add_child(self, child):
        self.children.append(child)
        child.depth = self.depth + 1

    def is_leaf(self):
        return len(self.children) == 0

    def get_all_leaf_descendants(self):
        if self.is_leaf():
            return [self]
        leaves = []
        for child in self.children:
            leaves.extend(child.get_all_leaf_descendants())
        return leaves


def compute_node_rewards_from_leaves(root_node, leaf_rewards, leaf_nodes):
    """The reference's function of that name, its mean fusion (use_prob_weighted=False), without its prints."""
    for i, leaf_node in enumerate(leaf_nodes):
        leaf_node.reward = leaf_rewards[i]
    all_nodes = []

    def collect_nodes(node):
        all_nodes.append(node)
        for child in node.children:
            collect_nodes(child)
    collect_nodes(root_node)
    max_depth = max(node.depth for node in all_nodes)
    nodes_by_depth = {depth: [] for depth in range(max_depth + 1)}
    for node in all_nodes:
        nodes_by_depth[node.depth].append(node)
    for depth in reversed(range(max_depth)):
        for node in nodes_by_depth[depth]:
            if not node.is_leaf():
                leaf_descendants = node.get_all_leaf_descendants()
                descendant_rewards = [leaf.reward for leaf in leaf_descendants]
                node.reward = torch.stack(descendant_rewards).mean()
    return all_nodes, nodes_by_depth


def compute_hierarchical_advantages_by_depth(nodes_by_depth):
    """The reference's function of that name, without its prints."""
    node_advantages = {}
    for depth, nodes in nodes_by_depth.items():
        if len(nodes) <= 1:
            for node in nodes:
                node.advantage = torch.tensor(0.0)
                node_advantages[node.node_id] = node.advantage
        else:
            rewards = torch.stack([node.reward for node in nodes])
            mean_reward = rewards.mean()
            std_reward = rewards.std()
            if std_reward < 1e-6:
                advantages = torch.zeros_like(rewards)
            else:
                advantages = (rewards - mean_reward) / (std_reward + 1e-8)
            for i, node in enumerate(nodes):
                node.advantage = advantages[i]
                node_advantages[node.node_id] = node.advantage
    return node_advantages


def reference_advantages(rewards: torch.Tensor, branches: int, levels: int) -> torch.Tensor:
    """[leaves, levels] from the reference: each leaf's path, the advantage of the node each split created."""
    root = TreeNode("root")
    frontier = [root]
    for _ in range(levels):
        nxt = []
        for node in frontier:
            for c in range(branches):
                child = TreeNode(f"{node.node_id}_{c}", node)
                node.add_child(child)
                nxt.append(child)
        frontier = nxt
    _, by_depth = compute_node_rewards_from_leaves(root, rewards, frontier)
    adv = compute_hierarchical_advantages_by_depth(by_depth)
    out = torch.zeros(len(frontier), levels, dtype=torch.float64)
    for leaf_index, leaf in enumerate(frontier):
        node = leaf
        while node.parent is not None:
            out[leaf_index, node.depth - 1] = adv[node.node_id]
            node = node.parent
    return out


@pytest.mark.parametrize("branches, levels", [(2, 3), (3, 2), (4, 1)])
def test_advantages_equal_branchgrpo_node_rewards_normalised_per_depth(branches, levels):
    k = branches ** levels
    g = torch.Generator().manual_seed(branches)
    rewards = torch.randn(2 * k, generator=g, dtype=torch.float64)
    # two trees, their leaves interleaved in the epoch's order: each group's own order gives its leaves
    groups = np.array([7, 3] * k)
    ours = tree_advantages(rewards.numpy(), groups, group_members(groups), branches, levels, clip=math.inf)
    for group, rows in ((7, slice(0, None, 2)), (3, slice(1, None, 2))):
        ref = reference_advantages(rewards[rows], branches, levels)
        np.testing.assert_allclose(ours[rows], ref.numpy(), rtol=1e-12, atol=1e-12)
    # the last depth is the leaves normalised within their tree; a split's children are ranked by what grew below them
    assert np.all(ours[:, -1] != 0) and np.abs(ours).max() > 0.5


def test_a_failed_leaf_trains_nothing_and_its_node_is_the_scored_leaves_mean():
    groups = np.zeros(4, dtype=np.int64)
    combined = np.array([1.0, np.nan, 3.0, 5.0])
    adv = tree_advantages(combined, groups, group_members(groups), 2, 2, clip=math.inf)
    # depth 1: nodes {0, 1} -> 1.0 (its scored leaf), {2, 3} -> 4.0: normalised to -/+ 1/sqrt(2)
    np.testing.assert_allclose(adv[:, 0], [-0.5 ** 0.5] * 2 + [0.5 ** 0.5] * 2, rtol=1e-6)
    # depth 2: the three scored leaves normalised; the failed one's node has no value
    v = np.array([1.0, 3.0, 5.0])
    np.testing.assert_allclose(adv[[0, 2, 3], 1], (v - v.mean()) / (v.std(ddof=1) + 1e-8))
    assert adv[1, 1] == 0.0
    # equal rewards at a depth carry no signal; the clip bounds what is left
    assert not tree_advantages(np.ones(4), groups, group_members(groups), 2, 2, clip=5.0).any()
    assert np.abs(tree_advantages(np.array([0.0, 0, 0, 9]), groups, group_members(groups), 2, 2, clip=0.5)).max() == 0.5


def test_the_training_batch_carries_one_advantage_per_trained_step():
    from paco_ds.sampling.trajectory import Trajectory
    from paco_ds.models.base import TextEmbeds

    traj = Trajectory(prompts=["a", "b"], metadata=[{}, {}], positions=[0, 1], group_ids=[0, 0], height=8, width=8,
                      embeds=TextEmbeds(torch.zeros(2, 1, 1)), images=torch.zeros(2, 3, 8, 8, dtype=torch.uint8),
                      log_prob=torch.zeros(2, 3))
    samples = EpochSamples(trajectories=[traj], advantages=[torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])],
                           keep=[torch.tensor([True, True])])
    batch = samples.batch([(0, 1), (0, 0)], [False, True])  # the second is a filler: trains nothing
    assert batch.advantages.tolist() == [[4.0, 5.0, 6.0], [0.0, 0.0, 0.0]]
    assert step_advantages(batch, 2).tolist() == [6.0, 0.0]
    assert batch.keep.tolist() == [True, False]


# ------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("sets, key", [
    (["sample.group_size=4"], "sample.tree: sample.group_size 4 must be the tree's leaves"),
    (["train.loss=dpo", "train.batch_size=2"], "train.loss with sample.tree"),
    (["sample.same_latent=false"], "sample.same_latent with sample.tree"),
    (["sample.sde_window={size: 2, range: [0, 6]}"], "sample.sde_window with sample.tree"),
    (["sample.ode_steps=1"], "sample.ode_steps with sample.tree"),
    (["train.timesteps=[0]"], "train.timesteps with sample.tree"),
])
def test_what_a_tree_cannot_do_is_one_line_naming_the_key(sets, key):
    with pytest.raises(ConfigError) as e:
        load_config(TREE, sets)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_per_step_gathering_under_zero3_is_refused_before_anything_loads():
    from paco_ds.grpo.preflight import check_tree

    cfg = load_config(TREE, ["deepspeed.rollout_gather=per_step"])
    with pytest.raises(ConfigError, match="sample.tree.*rollout_gather: once under ZeRO stage 3"):
        check_tree(cfg)
    check_tree(load_config(TREE))  # the recipe gathers once
    assert load_config(TINY).sample.tree is None
