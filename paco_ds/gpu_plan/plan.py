"""A full-scale plan of one GRPO epoch's device memory and FLOPs, from the real code path.

`gpu_plan(cfg, world_size, gpu_gib)` builds the recipe's full-size models (the policy's
`full_size`, each local reward's `Reward.full_size`) as fake CUDA tensors (fake.py), with the
recipe's dtype, LoRA and gradient checkpointing, and runs the trainer's own code on them with device
"cuda": one rollout batch (`Rollouts.sample`: the prompt and condition encoding, ODE steps and the
SDE step with its log-prob, the decode), the local reward models on that batch, and one trained
micro-step (the recipe's loss, then backward). Any host/device mix or dtype mismatch on that path
raises there, as on a GPU.

What the pass measures: the live device bytes of every tensor the code creates (activations,
caches, outputs), the frozen models' weights, and FLOPs (torch.utils.flop_counter). What it adds
from the engine config, since DeepSpeed itself does not run here: the ZeRO-3 shards of the
transformer, the LoRA's gradients, AdamW and EMA state (fp32, 1/world each), the gathered
transformer of the sampling phase (`deepspeed.rollout_gather: once`), and the engine's buffers
(`stage3_max_live_parameters` gathered for a training forward, `reduce_bucket_size` for gradients).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from paco_ds.recipe.schema import Config
from paco_ds.sampling.solver import plan_for

GiB = 2 ** 30
CUDA_CONTEXT = 1 * GiB  # CUDA context, cuBLAS workspaces and allocator slack, per rank
SAMPLING, SCORING, TRAINING = "sampling", "scoring", "training"
PHASES = (SAMPLING, SCORING, TRAINING)


class DevicePathError(RuntimeError):
    """A host/device mix or dtype mismatch on the device path, found by the fake-CUDA pass."""


@dataclass
class GpuPlan:
    recipe: str
    family: str
    world_size: int
    gpu_gib: float
    image_size: tuple[int, int]
    dtype: str
    gradient_checkpointing: bool
    params: dict[str, int]  # transformer / lora / text encoders / vae / reward models
    memory: dict[str, dict[str, int]]  # phase -> category -> bytes per rank
    flops: dict[str, float]  # phase -> model FLOPs per image
    flops_detail: dict[str, float]  # per call: transformer forward, encode, decode, reward, micro-step
    counts: dict[str, float]  # calls per image: forwards, micro-steps, ...
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    rollout_batch: int = 1  # sample.batch_size the pass sampled and scored with
    sequence: int = 1  # parallel.sequence the pass ran with
    advice: list[str] = field(default_factory=list)  # further plans' findings the verdict names (gpu_plan/sequence.py)
    rollout_bytes: int = 0  # one image's rollout as training keeps it (what an async run's samplers hand over)

    def total(self, phase: str) -> int:
        return sum(self.memory[phase].values())

    @property
    def capacity(self) -> int:
        return int(self.gpu_gib * GiB)

    @property
    def fits(self) -> bool:
        return all(self.total(p) <= self.capacity for p in PHASES)

    def to_json(self) -> dict:
        return {"recipe": self.recipe, "family": self.family, "world_size": self.world_size, "gpu_gib": self.gpu_gib,
                "image_size": list(self.image_size), "dtype": self.dtype,
                "gradient_checkpointing": self.gradient_checkpointing, "params": self.params,
                "memory_gib": {p: {k: round(v / GiB, 3) for k, v in m.items()} for p, m in self.memory.items()},
                "peak_gib": {p: round(self.total(p) / GiB, 3) for p in PHASES}, "fits": self.fits,
                "flops_per_image": self.flops, "flops_detail": self.flops_detail, "counts": self.counts,
                "seconds": round(self.seconds, 1), "rollout_batch": self.rollout_batch, "sequence": self.sequence,
                "largest_rollout_batch": largest_rollout_batch(self), "verdict": verdict(self)}


# ------------------------------------------------------------------------------------ counting
class _Counter:
    """FLOPs (torch.utils.flop_counter) and collective bytes per labelled call, summed over calls."""

    def __init__(self, mode):
        self.mode = mode
        self.flops: dict[str, float] = {}
        self.collective: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, label: str, fn):
        def run(*args, **kwargs):
            before, sent = self.mode.flops, self.mode.collective_bytes
            out = fn(*args, **kwargs)
            self.flops[label] = self.flops.get(label, 0.0) + self.mode.flops - before
            self.collective[label] = self.collective.get(label, 0) + self.mode.collective_bytes - sent
            self.calls[label] = self.calls.get(label, 0) + 1
            return out
        return run

    def per_call(self, label: str) -> float:
        return self.flops.get(label, 0.0) / max(self.calls.get(label, 0), 1)

    def collective_per_call(self, label: str) -> float:
        return self.collective.get(label, 0) / max(self.calls.get(label, 0), 1)


def _pass_config(cfg: Config) -> tuple[Config, int]:
    """The recipe as the pass runs it: one noised and trained step (the first), reached through an
    ODE step, plus one more step (every trained step is the same forward and backward at the same
    shapes; the counts multiply); the torch kernels unless the fused ones run on fake tensors."""
    steps = cfg.sample.num_steps
    update: dict = {}
    section = cfg.train.loss_section  # a loss that draws its own trained steps (AWM) is planned as it is
    own_steps = section is not None and section.checks_own_timesteps
    plain = cfg.sample.sde_window is None and not own_steps and cfg.sample.noise_steps
    if plain:
        first = min(cfg.train_timesteps or cfg.sample.noise_steps)
        steps = min(cfg.sample.num_steps, first + 2)
        update["sample"] = cfg.sample.model_copy(update={"num_steps": steps, "noise_steps": [first]})
        if cfg.train.timesteps is not None:
            update["train"] = cfg.train.model_copy(update={"timesteps": [first]})
    if not _fused_ops_run_fake(cfg.kernels.backend):
        update["kernels"] = cfg.kernels.model_copy(update={"backend": "torch"})
    if cfg.model.compile:  # the compiled blocks do the eager blocks' arithmetic: nothing to compile on fake tensors
        update["model"] = cfg.model.model_copy(update={"compile": False})
    return cfg.model_copy(update=update), steps


def _fused_ops_run_fake(backend: str) -> bool:
    """Whether the recipe's kernel backend runs on fake CUDA tensors (ops registered with fake
    implementations do; a bare Triton launch does not): tried on a small SDE step and PPO loss."""
    if backend == "torch":
        return True
    import kernels

    from paco_ds.gpu_plan.fake import FakeCuda

    try:
        with FakeCuda():
            x = torch.zeros(1, 16, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            step = kernels.sde_step(x, x, 0.9, 0.8, 0.7, 0.9, noise=torch.zeros(1, 16, 4, device="cuda"),
                                    backend=backend)
            lp = torch.zeros(1, device="cuda")
            kernels.ppo_clip_loss(step.log_prob, lp, lp, 1e-4, 5.0, backend=backend)
        return True
    except Exception:  # noqa: BLE001 - any failure means: plan with the torch reference
        return False


def _zero(ds: dict) -> dict:
    return ds.get("zero_optimization", {})


# ------------------------------------------------------------------------------------ the pass
def gpu_plan(cfg: Config, world_size: int, gpu_gib: float) -> GpuPlan:
    """Run the fake-CUDA pass for `cfg` and account one rank of `world_size` with `gpu_gib` GiB. The
    policy, the loss and the rollouts are the trainer's own (paco_ds/grpo/build.py), built from the
    full-size model on the fake device (source.py). Under parallel.sequence: N the pass is one rank of
    a sequence group of N in this process alone (runtime/sequence.py, `emulated_group`): the
    transformer runs its sharded code, so the activations counted are that rank's."""
    from paco_ds.runtime.sequence import data_world, emulated_group

    n = cfg.parallel.sequence
    if n == 1:
        return _pass(cfg, world_size, gpu_gib, None)
    data_world(world_size, n)
    with emulated_group(n) as mesh:
        return _pass(cfg, world_size, gpu_gib, mesh)


def _pass(cfg: Config, world_size: int, gpu_gib: float, sequence_mesh) -> GpuPlan:
    from paco_ds.grpo import build
    from paco_ds.grpo.losses import build_loss
    from paco_ds.gpu_plan.fake import FakeCuda
    from paco_ds.gpu_plan.source import FullSizeOnFakeCuda
    from paco_ds.models import policy_class
    from paco_ds.models.full_size import count
    from paco_ds.runtime.dtypes import resolve_dtype
    from paco_ds.runtime.engine import gathers_per_step, load_ds_config
    from paco_ds.sampling.rollouts import Pick
    from paco_ds.sampling.trajectory import training_batch

    t0 = time.perf_counter()
    if cfg.model.tiny:
        raise ValueError("model.tiny: true builds the tiny offline model; a GPU plan is for the full-size one")
    run_cfg, pass_steps = _pass_config(cfg)
    if run_cfg.kernels.backend != cfg.kernels.backend:
        notes_kernels = [f"kernels.backend {cfg.kernels.backend!r} does not run on fake tensors here: the pass "
                         "used the torch reference (same shapes, FLOPs within the fused ops' arithmetic)"]
    else:
        notes_kernels = []
    device = torch.device("cuda", 0)
    dtype = resolve_dtype(cfg.model.dtype, device)
    family = cfg.model.family
    policy_cls = policy_class(family)
    if getattr(policy_cls, "full_size", None) is None:
        raise ValueError(f"{policy_cls.__name__} describes no full-size model (its `full_size`)")
    mode = FakeCuda()
    notes: list[str] = list(notes_kernels)

    # The policy as the trainer builds it: the recipe's LoRA, attention backend and gradient
    # checkpointing on the full-size transformer, the frozen parts on the fake device in the dtypes
    # the policy holds them in; then the adapted transformer on the device.
    source = FullSizeOnFakeCuda(mode)
    policy = build.adapted_policy(run_cfg, device, {}, source, sequence_mesh=sequence_mesh)
    source.place_adapted(policy.transformer, dtype)
    transformer = policy.transformer
    lora = [p for p in transformer.parameters() if p.requires_grad]
    base = [p for p in transformer.parameters() if not p.requires_grad]
    encoders = policy.text_encoders()

    loss = build_loss(run_cfg, policy)
    # as the trainer: a loss may keep weights of its own (DiffusionNFT's old policy, AWM's anchor)
    with mode:
        loss.setup(lora)
    # the trainer's own rollouts, without an engine: the transformer samples (gathered, under ZeRO-3)
    rollouts = build.rollouts(run_cfg, policy, loss, None, {})

    counter = _Counter(mode)
    for name in ("encode_prompts", "encode_condition", "velocity", "decode"):
        setattr(policy, name, counter.wrap(name, getattr(policy, name)))

    from paco_ds.data import load_prompts

    items = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
    picks = [Pick(it, i, i) for i, it in enumerate(items)]
    groups = rollouts.by_size(picks, cfg.train.resolution)
    (h, w), group = max(groups, key=lambda g: g[0][0] * g[0][1])  # the largest images of the data
    bs = cfg.sample.batch_size
    batch_picks = [group[j % len(group)]._replace(position=j) for j in range(bs)]

    from paco_ds.gpu_plan.rewards import local_rewards

    rewards = list(local_rewards(cfg, mode))  # built before the pass: their constructors run on meta
    try:
        with mode:
            # ---------------------------------------------------------------- sampling
            transformer.eval()
            with mode.measure(SAMPLING) as sampling:
                traj = rollouts.sample(transformer, batch_picks, h, w, epoch=0)
            live_sampling = dict(mode.live)
            _park_text_encoders(mode, policy)  # what the trainer does once the epoch is sampled
            # ---------------------------------------------------------------- scoring
            # host images (or videos, [B, F, 3, H, W]) as decode hands them over
            images = torch.zeros(tuple(traj.images.shape), dtype=torch.uint8)
            with mode.measure(SCORING) as scoring, mode.tagged("reward activations"):
                reward_flops = _score(rewards, traj, images, counter, rollouts.references(traj))
            # ---------------------------------------------------------------- training
            # On fake "meta" tensors: autograd needs a real CUDA context for CUDA tensors.
            from paco_ds.gpu_plan.fake import move_fake

            mode.device = torch.device("meta")
            policy.to_device(mode.device)  # what the policy copied to "cuda" (CFG's negative prompt) is copied again
            move_fake(mode, transformer, mode.device)
            lora = [p for p in transformer.parameters() if p.requires_grad]
            transformer.train()
            n = min(cfg.train.batch_size, len(traj))
            batch = training_batch([(traj, i) for i in range(n)], torch.ones(n), torch.ones(n, dtype=torch.bool))
            for p in lora:
                p.register_post_accumulate_grad_hook(lambda p: mode.retag(p.grad, "full grads"))
            step = counter.wrap("micro_step", _micro_step)
            with mode.measure(TRAINING) as training:
                step(loss, transformer, batch)
    except RuntimeError as err:
        if "FakeTensorDeviceMismatch" in type(err).__name__ or "found at least two devices" in str(err) \
                or "same device" in str(err):
            raise DevicePathError(f"device mix on the GPU path: {err}".splitlines()[0]) from err
        if "dtype" in str(err) and ("expected" in str(err).lower() or "mismatch" in str(err).lower()):
            raise DevicePathError(f"dtype mismatch on the GPU path: {err}".splitlines()[0]) from err
        raise

    # ---------------------------------------------------------------------------- accounting
    ds = load_ds_config(cfg.resolve_path(cfg.deepspeed.config))
    zero = _zero(ds) | cfg.deepspeed.overrides.get("zero_optimization", {})
    stage = cfg.deepspeed.zero_stage if cfg.deepspeed.zero_stage is not None else int(zero.get("stage", 0))
    n = world_size
    el = torch.finfo(dtype).bits // 8
    n_base, n_lora = sum(p.numel() for p in base), sum(p.numel() for p in lora)
    persist = int(float(zero.get("stage3_param_persistence_threshold", 1e5)))
    small = sum(p.numel() for p in transformer.parameters() if p.numel() < persist) if stage == 3 else 0
    shard = (lambda x: x / n) if stage == 3 else (lambda x: x)
    base_bytes = shard((n_base - small) * el) + small * el
    lora_bytes = shard(n_lora * el)
    grads = (n_lora * 4 / n) if stage >= 2 else n_lora * 4  # fp32 gradient partitions
    optim = (n_lora * 12 / n) if stage >= 1 else n_lora * 12  # fp32 master + Adam moments
    ema = n_lora * 4 / n if (cfg.train.ema.enabled and stage == 3) else (n_lora * 4 if cfg.train.ema.enabled else 0)
    live = min(float(zero.get("stage3_max_live_parameters", 1e9)), n_base + n_lora) * el if stage == 3 else 0
    bucket = min(float(zero.get("reduce_bucket_size", 5e8)), n_lora) * el
    gathered = (n_base + n_lora) * el - base_bytes - lora_bytes if stage == 3 else 0
    rollout_once = not gathers_per_step(cfg)

    def frozen(live: dict) -> dict:
        return {"text encoders": live.get("text encoders", 0), "VAE": live.get("vae", 0),
                "reward models": live.get("reward models", 0)}

    state = {"base params (ZeRO-3 shards)" if stage == 3 else "base params": base_bytes,
             "LoRA params": lora_bytes, "grads": grads, "optimizer state": optim, "EMA": ema}
    fro_s, fro = frozen(live_sampling), frozen(mode.live)
    act_s = sampling.at_peak.get("activations", 0)
    act_r = scoring.at_peak.get("reward activations", 0)
    act_t = training.at_peak.get("activations", 0)
    judge = 0
    if cfg.cluster is not None and cfg.cluster.colocate and cfg.reward_servers is not None:
        judge = int(cfg.reward_servers.gpu_memory_utilization * gpu_gib * GiB)
        notes.append(f"cluster.colocate: the judge holds reward_servers.gpu_memory_utilization="
                     f"{cfg.reward_servers.gpu_memory_utilization} of the GPU while awake (sampling, scoring)")
    memory = {
        SAMPLING: state | {"transformer gathered for sampling": gathered if rollout_once else 0,
                           "ZeRO buffers": 0 if rollout_once else live} | fro_s | {"activations": act_s},
        SCORING: state | {"transformer gathered for sampling": gathered if (rollout_once and cfg.rewards.overlap) else 0,
                          "ZeRO buffers": 0} | (fro_s if cfg.rewards.overlap else fro) |
        {"activations": act_r + (act_s if cfg.rewards.overlap else 0)},
        TRAINING: state | {"transformer gathered for sampling": 0, "ZeRO buffers": live + bucket} | fro |
        {"activations": act_t},
    }
    for phase in PHASES:
        memory[phase]["judge (colocated, awake)"] = judge if phase != TRAINING else 0
        memory[phase]["CUDA context"] = CUDA_CONTEXT
        memory[phase] = {k: int(v) for k, v in memory[phase].items()}
    if cfg.rewards.overlap:
        notes.append("rewards.overlap: scoring runs while the next batch samples, so its peak holds both")

    b = len(traj)
    n_steps = cfg.sample.num_steps
    fwd = counter.per_call("velocity") / b
    enc = (counter.flops.get("encode_prompts", 0.0) + counter.flops.get("encode_condition", 0.0)) / b
    dec = counter.per_call("decode") / b
    micro = counter.per_call("micro_step") / len(batch)
    group = cfg.parallel.sequence  # each rank of a sequence group computes its share of a transformer call
    fwd, micro = fwd * group, micro * group
    trained = len(cfg.train_timesteps) * cfg.train.num_inner_epochs
    # transformer calls per image: fewer under sample.ode_steps (a group's shared prefix aside); a
    # sliding window (MixGRPO) moves the plan with it, so the mean over the places it visits in turn
    win = cfg.sample.sde_window
    if win is not None and win.schedule == "sliding":
        places = range(win.range[0], win.range[1] - win.size + 1)
        calls = sum(len(plan_for(cfg, at)) for at in places) / len(places)
    elif cfg.sample.tree is not None:  # a whole tree's nodes once (its leaves on one rank), per leaf
        from paco_ds.sampling.tree import calls_per_tree

        calls = calls_per_tree(n_steps, list(cfg.sample.noise_steps), cfg.sample.tree.branches) / cfg.sample.group_size
    else:
        calls = len(plan_for(cfg))
    flops = {SAMPLING: enc + calls * fwd + dec, SCORING: reward_flops / b, TRAINING: micro * trained}
    detail = {"transformer_forward": fwd, "prompt_encode": counter.per_call("encode_prompts") / b,
              "condition_encode": counter.per_call("encode_condition") / b if "encode_condition" in counter.calls
              else 0.0, "vae_decode": dec, "reward_models": reward_flops / b, "train_micro_step": micro}
    counts = {"denoising_steps": n_steps, "transformer_calls_per_image": calls, "trained_steps_per_sample": trained,
              "pass_denoising_steps": pass_steps, "rollout_batch": b}
    if pass_steps < n_steps:
        notes.append(f"the pass ran {pass_steps} of {n_steps} denoising steps and trained 1 of {trained} steps per "
                     "sample; the others are the same forward (and backward) at the same shapes, counted in the FLOPs")
    if group > 1:
        counts["collective_bytes_per_forward"] = counter.collective_per_call("velocity") / b
        counts["collective_bytes_per_micro_step"] = counter.collective_per_call("micro_step") / len(batch)
        notes.append(f"parallel.sequence={group}: the pass ran one rank of a sequence group of {group} (an emulated "
                     f"process group), so the activations are one rank's; FLOPs are the group's ({group} shares); each "
                     f"rank's all-to-alls and gathers carry {counts['collective_bytes_per_forward'] / GiB:.2f} GiB per "
                     f"image and transformer call, {counts['collective_bytes_per_micro_step'] / GiB:.2f} GiB per "
                     "sample and trained micro-step (forward and backward)")
    if mode.ignored:
        notes.append(f"{mode.ignored} data-dependent reads of large device tensors (losses, statistics) read NaN")
    params = {"transformer": n_base + n_lora, "lora": n_lora,
              "text_encoders": sum(count(m) for m in encoders), "vae": count(policy.vae)}
    params["reward_models"] = int(getattr(mode, "reward_params", 0))
    if encoders:
        notes.append(f"text encoders ({params['text_encoders']:,} parameters, "
                     f"{fro_s['text encoders'] / GiB:.1f} GiB): whole on every rank, not partitioned, while the "
                     "epoch samples (each prompt encoded once, its embeddings cached with the rollout), parked in "
                     "host memory for training (Policy.park_text_encoders); frozen and run once per prompt, they are "
                     "not worth a ZeRO-3 gather of all their weights at every encode")
    return GpuPlan(recipe=str(cfg.source), family=family, world_size=world_size, gpu_gib=gpu_gib,
                   image_size=(h, w), dtype=str(dtype).replace("torch.", ""),
                   gradient_checkpointing=cfg.model.gradient_checkpointing, params=params, memory=memory, flops=flops,
                   flops_detail=detail, counts=counts, seconds=time.perf_counter() - t0, notes=notes,
                   rollout_batch=cfg.sample.batch_size, sequence=group, rollout_bytes=tensor_bytes(traj) // b)


def tensor_bytes(obj) -> int:
    """The bytes of the tensors `obj` holds: a tensor, or a dataclass, list, tuple or dict of them."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(map(tensor_bytes, obj))
    return sum(map(tensor_bytes, obj.values())) if isinstance(obj, dict) else 0


def _park_text_encoders(mode, policy) -> None:
    """`Policy.park_text_encoders(True)` on fake modules: their tensors leave the device (a fake
    module cannot `.to()` itself: torch swaps subclass parameters, which fake ones refuse)."""
    from paco_ds.gpu_plan.fake import move_fake

    for m in policy.text_encoders():
        move_fake(mode, m, torch.device("cpu"))


def _micro_step(loss_fn, module, batch) -> None:
    """One trained micro-step as the trainer runs it (its loss, backward), first trained step."""
    loss, _ = loss_fn(module, batch, 0)
    loss.backward()


def _score(rewards, traj, images: torch.Tensor, counter: _Counter, refs) -> float:
    """The recipe's local reward models on one rollout batch (with an edit's reference images, as
    the trainer passes them; a video's frames through the reward's per-frame form); remote (judge)
    rewards run elsewhere."""
    flops = 0.0
    for name, reward in rewards:
        reward.score = counter.wrap(f"reward:{name}", reward.score)  # counted inside the reward's own call
        reward(images, list(traj.prompts), list(traj.metadata), refs)
        flops += counter.per_call(f"reward:{name}")
    return flops


# ------------------------------------------------------------------------------------ verdict
FIXES = [  # (category, phase, condition, the recipe key that cuts it)
    ("activations", TRAINING, lambda p: not p.gradient_checkpointing,
     "model.gradient_checkpointing: true (recompute activations in backward)"),
    ("activations", TRAINING, lambda p: True, "train.resolution (smaller training images)"),
    ("transformer gathered for sampling", SAMPLING, lambda p: True,
     "deepspeed.rollout_gather: per_step (gather per forward instead of once per phase)"),
    ("transformer gathered for sampling", SCORING, lambda p: True, "rewards.overlap: false, or "
     "deepspeed.rollout_gather: per_step"),
    ("judge (colocated, awake)", SAMPLING, lambda p: True, "reward_servers.gpu_memory_utilization (a smaller "
     "share for the colocated judge), or judges on their own GPUs (cluster.judges)"),
    ("judge (colocated, awake)", SCORING, lambda p: True, "reward_servers.gpu_memory_utilization"),
    ("activations", SAMPLING, lambda p: True, "sample.batch_size (fewer images per rollout batch)"),
    ("activations", SCORING, lambda p: True, "sample.batch_size"),
    ("optimizer state", TRAINING, lambda p: True, "deepspeed.config: configs/deepspeed/zero3_offload.json"),
    ("ZeRO buffers", TRAINING, lambda p: True, "deepspeed.overrides (stage3_max_live_parameters, "
     "reduce_bucket_size)"),
]


def largest_rollout_batch(plan: GpuPlan) -> int | None:
    """The largest sample.batch_size whose sampling and scoring fit: their activations scaled per
    sample from the counted pass (the rest of those phases does not grow with the batch); 0 when not
    even one sample fits; None when the pass counted no activations to scale. An estimate from the
    counted bytes, not a pass at that batch."""
    best = None
    for phase in (SAMPLING, SCORING):
        act = plan.memory[phase].get("activations", 0)
        per_sample = act / max(plan.rollout_batch, 1)
        room = plan.capacity - (plan.total(phase) - act)
        if per_sample > 0:
            fit = max(int(room // per_sample), 0)
            best = fit if best is None else min(best, fit)
    return best


def verdict(plan: GpuPlan) -> str:
    peak = max(PHASES, key=plan.total)
    over = [p for p in PHASES if plan.total(p) > plan.capacity]
    head = f"{plan.world_size} x {plan.gpu_gib:g} GiB"
    batch = largest_rollout_batch(plan)
    if batch is None:
        rollouts = "; rollouts: no activations counted, so no larger sample.batch_size is estimated"
    else:
        rollouts = (f"; rollouts: sample.batch_size: {batch} is the largest that fits (activations scaled from "
                    f"{plan.rollout_batch})" if batch else "; not one rollout sample fits")
    if not over:
        free = (plan.capacity - plan.total(peak)) / GiB
        return (f"fits on {head}: peak {plan.total(peak) / GiB:.1f} GiB per rank in {peak} ({free:.1f} GiB free)"
                + rollouts + "".join(f"; {a}" for a in plan.advice))
    lines = []
    for phase in over:
        mem = plan.memory[phase]
        top = sorted(mem.items(), key=lambda kv: -kv[1])[:3]
        need = (plan.total(phase) - plan.capacity) / GiB
        fix = next((key for cat, ph, cond, key in FIXES if ph == phase and cat == top[0][0] and cond(plan)),
                   next((key for cat, ph, cond, key in FIXES if ph == phase and cat in dict(top) and cond(plan)),
                        "a larger GPU"))
        lines.append(f"{phase} needs {plan.total(phase) / GiB:.1f} GiB ({need:.1f} over); biggest: "
                     + ", ".join(f"{k} {v / GiB:.1f}" for k, v in top) + f"; fix: {fix}")
    return f"does not fit on {head}: " + " | ".join(lines) + rollouts + "".join(f"; {a}" for a in plan.advice)


def parameters_line(params: dict[str, int]) -> str:
    """The counts, the transformer's as its base beside its LoRA (params['transformer'] holds both)."""
    shown = dict(params)
    if shown.get("lora"):
        shown["transformer (base)"] = shown.pop("transformer") - shown["lora"]
        shown = {"transformer (base)": shown.pop("transformer (base)"), **shown}
    return ", ".join(f"{k} {v:,}" for k, v in shown.items() if v)


def describe(plan: GpuPlan) -> str:
    cats = list(dict.fromkeys(k for p in PHASES for k in plan.memory[p]))
    width = max(len(c) for c in cats + ["total"])
    out = [f"GPU plan per rank ({plan.family}, {plan.image_size[0]}x{plan.image_size[1]}, {plan.dtype}, "
           f"gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}, world size {plan.world_size}"
           + (f", parallel.sequence {plan.sequence}" if plan.sequence > 1 else "") + "); "
           f"GiB:", f"  {'':<{width}}  " + "  ".join(f"{p:>9}" for p in PHASES)]
    for c in cats:
        if any(plan.memory[p].get(c, 0) for p in PHASES):
            out.append(f"  {c:<{width}}  " + "  ".join(f"{plan.memory[p].get(c, 0) / GiB:9.2f}" for p in PHASES))
    out.append(f"  {'total':<{width}}  " + "  ".join(f"{plan.total(p) / GiB:9.2f}" for p in PHASES))
    out.append("model FLOPs per image: " + ", ".join(f"{p} {plan.flops[p] / 1e12:.1f} T" for p in PHASES))
    d = plan.flops_detail
    out.append("  per call: " + ", ".join(f"{k} {v / 1e12:.2f} T" for k, v in d.items() if v))
    out.append("parameters: " + parameters_line(plan.params))
    for note in plan.notes:
        out.append(f"note: {note}")
    out.append(f"verdict: {verdict(plan)}")
    out.append(f"(fake-CUDA pass: {plan.seconds:.0f} s)")
    return "\n".join(out)
