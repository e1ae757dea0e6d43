"""Tree rollouts (BranchGRPO, arXiv 2509.06040): a prompt group is one tree (`sample.tree`).

The group's k samples start from one initial latent (its root) and walk the ODE together until the
first of `sample.noise_steps`. There every node splits into `branches` children, each taking the SDE
step with its own noise, and walks the ODE to the next noise step, where each splits again. The
leaves are the group's k = branches ** len(noise_steps) samples. Every node is computed once per rank:
a leaf's steps before its last split are shared with its siblings, which is what a tree saves over k
independent rollouts (today's shared group prefix, `sample.share_prefix`, is the one-split case).

Noise is keyed by the node a step creates, (seed, epoch, group, depth, node), so a leaf's images and
log-probs are those of its unshared path with the same noise (tests/grpo/test_tree_rollouts.py),
and a node does not depend on the rank or the rollout batch that computes it.

Advantages (`tree_advantages`), as BranchGRPO's reference computes them
(Fredreic1849/BranchGRPO, fastvideo/train_branchgrpo_flux.py, `compute_node_rewards_from_leaves` and
`compute_hierarchical_advantages_by_depth`): a node's value is the mean reward of the leaves below it,
each depth's nodes are normalised within their tree (unbiased std; all 0 when it is below 1e-6), and
the step that created a node is trained with that node's advantage. Each leaf trains every split
step of its path, so a step shared by several leaves counts once per leaf below it (the reference
trains each edge once); a leaf whose reward failed trains nothing, and a node's value is the mean
over the leaves below it that were scored. Only the paper's mean fusion is here, not its
path-probability-weighted variant.
"""
from __future__ import annotations

import numpy as np
import torch

from paco_ds.models.base import Policy
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import Trajectory, make_generator

ZERO_STD = 1e-6  # the reference's threshold under which a depth's nodes all get advantage 0


def group_members(groups) -> np.ndarray:
    """Each sample's index among its group's samples, in the given order (the epoch's positions):
    which leaf of its group's tree it is."""
    seen: dict[int, int] = {}
    out = np.empty(len(groups), dtype=np.int64)
    for i, g in enumerate(np.asarray(groups).tolist()):
        out[i] = seen.get(g, 0)
        seen[g] = out[i] + 1
    return out


def ancestor(member: int, depth: int, branches: int, levels: int) -> int:
    """The index, among the nodes at `depth`, of leaf `member`'s ancestor (depth `levels`: the leaf)."""
    return member // branches ** (levels - depth)


def tree_noise(seed: int, epoch: int, group: int, depth: int, node: int, shape) -> torch.Tensor:
    """The SDE noise of the step that creates node `node` at `depth` of `group`'s tree."""
    return torch.randn(shape, generator=make_generator(seed, "tree", epoch, group, depth, node))


def tree_advantages(combined: np.ndarray, groups: np.ndarray, members: np.ndarray, branches: int, levels: int,
                    clip: float) -> np.ndarray:
    """[N, levels]: the advantage of each sample's t-th trained step (the split at depth t + 1), from
    the aggregated rewards of the epoch's samples (NaN: not scored), their groups and leaf indices."""
    combined = np.asarray(combined, dtype=np.float64)
    out = np.zeros((len(combined), levels), dtype=np.float64)
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        leaf_reward, member = combined[rows], members[rows]
        for depth in range(1, levels + 1):
            node = member // branches ** (levels - depth)
            nodes = np.unique(node)
            value = np.array([np.nanmean(leaf_reward[node == n]) if np.isfinite(leaf_reward[node == n]).any()
                              else np.nan for n in nodes])
            scored = np.isfinite(value)
            adv = np.zeros(len(nodes))
            if scored.sum() > 1:
                v = value[scored]
                std = v.std(ddof=1)
                if std >= ZERO_STD:
                    adv[scored] = (v - v.mean()) / (std + 1e-8)
            out[rows, depth - 1] = np.clip(adv[np.searchsorted(nodes, node)], -clip, clip)
    return out


def calls_per_tree(num_steps: int, splits: list[int], branches: int) -> int:
    """Transformer calls (rows x steps) of one whole tree: the root's ODE to the first split, then at
    each depth one call per parent at the split step and the children's ODE to the next split."""
    ends = list(splits[1:]) + [num_steps]
    return splits[0] + sum(branches ** d + branches ** (d + 1) * (end - j - 1)
                           for d, (j, end) in enumerate(zip(splits, ends)))


class TreeCache:
    """The epoch's nodes on this rank, keyed by (group, height, width, depth, node): the latent at the
    node's next split step (at the end of sampling for a leaf), the velocity there once a child needed
    it, and, for every node below the root, the step that created it (x_t, x_next, log pi_old and,
    when kept, the transition mean). `seed` keys the trees' latents and noise; each node splits into
    `branches` children."""

    def __init__(self, seed: int, branches: int):
        self.seed, self.branches = seed, branches
        self.nodes: dict[tuple, dict] = {}
        self.epoch = None

    def for_epoch(self, epoch: int) -> dict[tuple, dict]:
        if self.epoch != epoch:
            self.nodes, self.epoch = {}, epoch
        return self.nodes


@torch.no_grad()
def sample_tree(policy: Policy, module, spec: SamplingSpec, batch: RolloutBatch, members: list[int],
                tree: TreeCache, epoch: int) -> tuple[Trajectory, int]:
    """(the batch's leaves as a Trajectory whose trained steps are the tree's splits, the spec's
    noise steps; transformer calls made). The batch's samples are leaves: their group (`group_ids`)
    and leaf index (`members`); `tree`: the epoch's nodes, reused and extended."""
    n, splits, b = spec.num_steps, list(spec.noise_steps), tree.branches
    seed, nodes = tree.seed, tree.for_epoch(epoch)
    h, w, condition, embeds = batch.height, batch.width, batch.condition, batch.embeds
    leaves = list(zip(batch.group_ids, members))  # (group, member) of each row
    levels = len(splits)
    dev = policy.device
    sigmas = policy.sigmas(n, h, w)
    ends = splits + [n]  # a node at depth d walks the ODE up to ends[d]
    calls = 0

    def velocity(x, i, rows):
        cond = condition.select(rows).to(dev) if condition is not None else None
        return policy.velocity(module, x, torch.full((x.shape[0],), sigmas[i].item()), embeds.select(rows).to(dev),
                               h, w, spec.guidance, condition=cond)

    for depth in range(levels + 1):
        keys = [(g, h, w, depth, ancestor(m, depth, b, levels)) for g, m in leaves]
        todo: dict[tuple, int] = {}  # a node not computed yet -> a batch row whose leaf lies below it
        for r, key in enumerate(keys):
            if key not in nodes:
                todo.setdefault(key, r)
        if not todo:
            continue
        rows, made = list(todo.values()), list(todo)
        if depth == 0:
            x = policy.initial_latents(len(rows), h, w, [make_generator(seed, "latent", epoch, k[0]) for k in made])
            x = x.to(dev)
            created, start = [{} for _ in rows], 0
        else:
            j = splits[depth - 1]
            parent_keys = [(g, h, w, depth - 1, node // b) for g, _, _, _, node in made]
            unique = list(dict.fromkeys(parent_keys))  # siblings share their parent's velocity at the split...
            fresh = [k for k in unique if "v" not in nodes[k]]  # ...also across rollout batches
            if fresh:
                x_fresh = torch.stack([nodes[k]["end"] for k in fresh]).to(dev)
                v_fresh = velocity(x_fresh, j, [rows[parent_keys.index(k)] for k in fresh])
                calls += len(fresh)
                for q, k in enumerate(fresh):
                    nodes[k]["v"] = v_fresh[q]
            x_parent = torch.stack([nodes[k]["end"] for k in unique]).to(dev)
            v = torch.stack([nodes[k]["v"] for k in unique])
            at = torch.tensor([unique.index(k) for k in parent_keys])
            x_t, v = x_parent[at], v[at]
            noise = torch.stack([tree_noise(seed, epoch, g, depth, node, x_t.shape[1:])
                                 for g, _, _, _, node in made]).to(dev)
            step = spec.sde_fn(x_t, v, sigmas[j].item(), sigmas[j + 1].item(), spec.noise_level, sigmas[1].item(),
                               noise=noise, sde_type=spec.sde_type)
            x = step.prev_sample.to(x_t.dtype)
            created = [dict(x_t=x_t[q].cpu(), x_next=x[q].cpu(), log_prob=step.log_prob[q].float().cpu(),
                            mean=step.mean[q].float().cpu() if spec.keep_mean else None) for q in range(len(rows))]
            start = j + 1
        for i in range(start, ends[depth]):  # the ODE to the next split (or to the end)
            v = velocity(x, i, rows)
            calls += len(rows)
            x = spec.sde_fn(x, v, sigmas[i].item(), sigmas[i + 1].item(), 0.0, sigmas[1].item(),
                            sde_type=spec.sde_type).prev_sample.to(x.dtype)
        for q, key in enumerate(made):
            nodes[key] = dict(created[q], end=x[q].cpu())

    path = [[nodes[(g, h, w, d, ancestor(m, d, b, levels))] for d in range(1, levels + 1)] for g, m in leaves]
    final = torch.stack([nodes[(g, h, w, levels, m)]["end"] for g, m in leaves])
    bsz = len(leaves)
    trained = dict(
        steps=torch.tensor([splits] * bsz, dtype=torch.int64),
        x_t=torch.stack([torch.stack([e["x_t"] for e in es]) for es in path]),
        x_next=torch.stack([torch.stack([e["x_next"] for e in es]) for es in path]),
        log_prob=torch.stack([torch.stack([e["log_prob"] for e in es]) for es in path]),
        mean_old=torch.stack([torch.stack([e["mean"] for e in es]) for es in path]) if spec.keep_mean else None,
        sigma=sigmas[splits].expand(bsz, -1).clone(),
        sigma_next=sigmas[[j + 1 for j in splits]].expand(bsz, -1).clone(),
        sigma_max=sigmas[1].expand(bsz).clone())
    traj = Trajectory(prompts=list(batch.prompts), metadata=list(batch.metadata), positions=list(batch.positions),
                      group_ids=list(batch.group_ids), height=h, width=w,
                      embeds=embeds.to("cpu"), images=policy.decode(final.to(dev), h, w),
                      condition=condition.to("cpu") if condition is not None else None,
                      x_final=final if spec.keep_final else None, **trained)
    return traj, calls
