"""The typed schema of a GRPO recipe (pydantic v2, unknown keys forbidden), and the sections the
reward-SFT recipe shares.

This is the bottom layer: it imports no model, reward or trainer code. Names that registries
above it define (model.family, train.loss, reward and aggregation names) are checked against the
tables the loader passes in the validation context (paco_ds/recipe/loader.py, paco_ds/grpo/plan.py).
Values that depend on the number of processes are not part of the schema: `derive(cfg,
world_size)` in paco_ds/grpo/plan.py computes them from the real world size at run time.
"""
from __future__ import annotations

from pathlib import Path
import functools
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from paco_ds.recipe.loader import check_name
from paco_ds.recipe.servers import ServersConfig, check_top_logprobs

REPO_ROOT = Path(__file__).resolve().parents[2]


class Section(BaseModel):
    # allow_inf_nan=False: every float of every recipe (`.inf`, `.nan`, 1e400) is finite, or the
    # load fails naming the key; a non-finite learning rate or guidance scale would only stop a
    # run later, or train on NaN.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


RUN_NAME_MAX_BYTES = 200


def check_run_name(v: str) -> str:
    """A run name is one path component: the run directory is <output_dir>/<run_name>, so '/',
    '..' or an empty name would put the run outside output_dir or make output_dir itself the run."""
    if not v or not v.strip() or v in (".", "..") or any(c in v for c in "/\\\0"):
        raise ValueError(f"a run name is one non-empty path component without '/', '\\' or NUL, "
                         f"and not '.' or '..' (got {v!r})")
    # the run directory's entries add to it (e.g. '<run>.lock', 'checkpoints/epoch_0000_step_000000.tmp-...'),
    # and a file system's names are at most 255 bytes
    if len(v.encode("utf-8", "surrogatepass")) > RUN_NAME_MAX_BYTES:
        raise ValueError(f"a run name is at most {RUN_NAME_MAX_BYTES} bytes (got {len(v.encode('utf-8', 'surrogatepass'))})")
    return v



# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
Side = Annotated[int, Field(gt=0)]
# An image or video size: one side (square), or [height, width] (a video's 480 x 832).
Resolution = Union[Side, tuple[Side, Side]]


def size_of(resolution: "int | tuple[int, int]") -> tuple[int, int]:
    """(height, width) of a `train.resolution` / `test.resolution` value."""
    return (resolution, resolution) if isinstance(resolution, int) else (int(resolution[0]), int(resolution[1]))


class LoraConfig(Section):
    rank: int = Field(64, gt=0)
    alpha: float = Field(128, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    init: Literal["gaussian", "default"] = "gaussian"
    # None: the family's own (its policy's `lora_targets`, filled in by paco_ds.models.with_family_defaults).
    # Each name must match a module of the transformer (peft's rule: the name, or a suffix after a dot).
    target_modules: list[str] | None = None
    path: str | None = None  # an adapter to start from (diffusers or peft format)


class TinyModelConfig(Section):
    """The random-weight model built offline when `model.tiny` is true. Its weights are a property
    of the model (like a checkpoint's), so they come from this seed, not from the run's seed."""

    seed: int = 0
    num_layers: int = 1
    num_single_layers: int = 1
    attention_head_dim: int = 16
    num_attention_heads: int = 2
    text_dim: int = 32
    latent_channels: int = 4
    # Random decoders mostly render their own biases; these make images follow the latents, so
    # image rewards (JPEG size) can be learned by a tiny policy in a few CPU minutes.
    decoder_gain: float = 2.0  # scales the decoder's conv weights
    encoder_gain: float = 2.0  # scales the encoder's: reference images of edits then move the latents
    latent_scaling: float = 4.0  # the autoencoder's scaling_factor (the decoder sees latents / this)


class ModelConfig(Section):
    family: str = "flux"  # a policy of paco_ds/models (POLICIES)
    path: str | None = None  # hub id or local directory; None: the family's own (its policy's `default_path`)
    revision: str | None = None
    tiny: bool = False
    tiny_spec: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    lora: LoraConfig = Field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    # torch.compile of the transformer's repeated blocks, for sampling and training (paco_ds/models/compile.py)
    compile: bool = False
    # diffusers' attention dispatcher backend of the transformer (paco_ds/models/attention.py): native
    # (PyTorch SDPA) when unset; flash, _flash_3, sage, _native_flash, ... on GPUs
    attention_backend: str | None = None
    max_sequence_length: int = Field(512, gt=0)
    allow_tf32: bool = True
    # Frames of a video family's samples (None: the family's own; an image family draws one frame
    # and takes none). The frame count a video family accepts is its own rule (Wan: 4k + 1).
    num_frames: int | None = Field(None, ge=1)

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info, "policies", "model family")


class DataConfig(Section):
    format: Literal["t2is", "text", "edit"] = "t2is"
    train_file: str
    test_file: str | None = None
    max_test_prompts: int | None = Field(None, gt=0)


class SDEWindow(Section):
    """`size` consecutive SDE steps (stochastic, log-probbed and trained; every other step is ODE)
    inside [range[0], range[1]). Flow-GRPO-Fast (`schedule: random`): the start is a seeded random
    index, drawn anew each epoch or for each prompt group; PaCo's `noise_steps: [1]` is the fixed
    size-1 case. MixGRPO (`schedule: sliding`): the start moves `stride` steps every `shift_every`
    epochs from range[0], and stays at range[1] - size (or, with `roll_back`, starts over)."""

    size: int = Field(1, ge=1)
    range: tuple[int, int] = (0, 1)  # [first, end) step indices the window lies in
    per: Literal["epoch", "group"] = "epoch"
    schedule: Literal["random", "sliding"] = "random"
    shift_every: int = Field(1, ge=1)  # sliding: epochs between moves (MixGRPO's shift interval tau)
    stride: int = Field(1, ge=1)  # sliding: steps per move (MixGRPO's window stride s)
    roll_back: bool = False  # sliding: past the end, start over at range[0] instead of staying there

    @model_validator(mode="after")
    def _sliding_is_per_epoch(self) -> "SDEWindow":
        if self.schedule == "sliding" and self.per != "epoch":
            raise ValueError("a sliding window moves with the epoch: it is the same for every group (per: epoch)")
        return self


class TreeConfig(Section):
    """Tree rollouts (BranchGRPO, arXiv 2509.06040; paco_ds/sampling/tree.py): a group is one tree that
    splits into `branches` children at each of sample.noise_steps, so sample.group_size must be
    branches ** len(noise_steps); every node is computed once, and each split step is trained with the
    advantage of the node it created (leaf rewards averaged below it, normalised per depth)."""

    branches: int = Field(2, ge=2)


class SampleConfig(Section):
    num_steps: int = Field(10, ge=1)
    guidance_scale: float = 3.5
    batch_size: int = Field(1, ge=1)
    group_size: int = Field(16, ge=2)  # k: images per prompt (one image alone has advantage 0)
    prompts_per_epoch: int = Field(42, ge=1)  # m: unique prompts per epoch (rounded up, see derive)
    round_prompts_per_epoch: bool = True
    noise_level: float = Field(0.7, ge=0)
    noise_steps: list[int] = Field(default_factory=lambda: [1])
    sde_type: Literal["flow_grpo", "cps"] = "flow_grpo"
    same_latent: bool = False  # one initial noise per group
    # ...whose k images are then equal until the group's first SDE step: those steps are walked once per
    # group and shared (paco_ds/sampling/rollouts.py; not under deepspeed.rollout_gather=per_step with ZeRO-3)
    share_prefix: bool = True
    # Host memory for each prompt's embeddings (and an edit's encoded references) across epochs: a
    # prompt that comes back is not encoded again (paco_ds/sampling/prompt_cache.py); 0 turns it off.
    prompt_cache_gib: float = Field(4.0, ge=0)
    # Fewer steps where nothing is trained (paco_ds/sampling/solver.py): each ODE-only stretch of a
    # training rollout in at most `ode_steps` steps (null: the schedule's), taken by `ode_solver`.
    ode_solver: Literal["euler", "ab2"] = "euler"
    ode_steps: int | None = Field(None, ge=1)
    sde_window: SDEWindow | None = None  # replaces noise_steps (and train.timesteps) when set
    tree: TreeConfig | None = None  # tree rollouts: the group splits at each of noise_steps

    @field_validator("noise_steps")
    @classmethod
    def _sorted_unique(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError("step indices must be >= 0")
        return sorted(set(v))


class EMAConfig(Section):
    enabled: bool = True
    decay: float = Field(0.9, gt=0, lt=1)
    update_interval: int = Field(8, ge=1)  # in optimizer steps


class TrainConfig(Section):
    resolution: Resolution = 512  # fallback when an item has no height/width: a side, or [height, width]
    num_epochs: int = Field(1000, ge=1)
    batch_size: int = Field(1, ge=1)
    learning_rate: float = Field(3e-4, gt=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    weight_decay: float = Field(1e-4, ge=0)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, ge=0)  # DeepSpeed gradient_clipping (0 disables)
    optimizer_steps_per_epoch: int = Field(2, ge=1)
    num_inner_epochs: int = Field(1, ge=1)
    # A loss of paco_ds/grpo/losses (LOSSES) or "module:Class"; its default and each loss's own section
    # (train.<loss name>) are the registry's, composed into the schema by `compose_schema`.
    loss: str
    kl_beta: float = Field(0.0, ge=0)  # KL weight; the reference forward runs only when > 0
    timesteps: list[int] | None = None  # trained step indices; default: sample.noise_steps
    ema: EMAConfig = Field(default_factory=EMAConfig)
    max_consecutive_nonfinite: int = Field(3, ge=1)

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info, "losses", "loss")

    # train.loss -> the name of its section (set by compose_schema)
    SECTION_OF: ClassVar[dict[str, str]] = {}

    @property
    def loss_section(self) -> LossSection | None:
        """The active loss's own section (None for a loss that declares none)."""
        key = self.SECTION_OF.get(self.loss)
        return getattr(self, key) if key else None


class LossSection(Section):
    """A loss's own keys, `train.<loss name>`, declared in the loss's file: its keys, defaults and
    cross-checks against the rest of the recipe. The schema takes the sections from the loss
    registry (compose_schema), so this layer names no loss."""

    # The loss checks train.timesteps itself (`check`): they need not be SDE steps with a log-prob.
    checks_own_timesteps: ClassVar[bool] = False
    # The loss reads one advantage per trained step (`step_advantages`), as tree rollouts give them.
    takes_step_advantages: ClassVar[bool] = False

    def check(self, cfg: "Config") -> None:
        """Raise ValueError, naming the keys, where the recipe contradicts this loss (only called
        when train.loss is this section's loss)."""

    def trained_slots(self, cfg: "Config") -> list[int] | None:
        """The trained step slots of a micro-batch when the loss draws its own (None: the SDE steps
        of train.timesteps / sample.noise_steps / sample.sde_window)."""
        return None


class EvalConfig(Section):
    """The recipe's `test:` section: how and how often the policy is evaluated on the test prompts."""
    resolution: Resolution = 1024  # a side, or [height, width]
    num_steps: int = Field(20, ge=1)
    batch_size: int = Field(5, ge=1)
    eval_freq: int = Field(10, ge=0)  # epochs; 0 disables
    num_images: int = Field(16, ge=0)  # test images shown in the eval grid (0: none)


class AggregationConfig(Section):
    """How several rewards become one advantage (see paco_ds/rewards/aggregate.py)."""

    fn: str = "weighted_sum"  # a built-in name or "module:function"
    threshold: Union[Literal["mean", "median"], float] = "mean"  # log_tame
    center: bool = True  # False: the reference's uncentred use of aggregated rewards

    @field_validator("fn")
    @classmethod
    def _known_fn(cls, v: str, info: ValidationInfo) -> str:
        return v if ":" in v else check_name(v, info, "aggregations", "aggregation (or 'module:function')")


class RewardTerm(BaseModel):
    """One reward: its weight, plus keyword arguments for the reward's constructor."""

    model_config = ConfigDict(extra="allow")
    weight: float = Field(1.0, allow_inf_nan=False)  # .nan or 1e400 would only stop the run later

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RewardSet(Section):
    terms: dict[str, RewardTerm]
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    on_failure: Literal["raise", "mask"] = "raise"

    @field_validator("terms")
    @classmethod
    def _known_rewards(cls, v: dict[str, RewardTerm], info: ValidationInfo) -> dict[str, RewardTerm]:
        if not v:
            raise ValueError("at least one reward is needed")
        for name in v:
            check_name(name, info, "rewards", "reward")
        return v


class RewardsConfig(Section):
    train: RewardSet
    test: RewardSet | None = None  # None: the train set (decoupled when given)
    overlap: bool = True  # score each rollout batch while the next one samples (False: score in line)
    # Rollout batches a remote judge scores at once (its requests bounded by each reward's
    # max_concurrency): a judge slower per batch than the sampler then still keeps pace.
    batches_in_flight: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _some_weight(self) -> "RewardsConfig":
        agg = self.train.aggregation
        # The reference's unweighted geometric/harmonic means (center: false) ignore the weights,
        # and a custom function decides for itself; everywhere else all-zero weights make every
        # aggregated reward, hence every advantage, 0.
        unweighted = ":" in agg.fn or (not agg.center and agg.fn in ("geometric_mean", "harmonic_mean"))
        if not unweighted and all(t.weight == 0 for t in self.train.terms.values()):
            raise ValueError("rewards.train.terms: every reward weight is 0, so every advantage would be 0; "
                             "give at least one reward a non-zero weight")
        return self

    @property
    def eval(self) -> RewardSet:
        return self.test or self.train


# The `cluster:` section: where launch/cluster.py runs the judges of a multi-node run.
class JudgePlacement(Section):
    host: str = Field(min_length=1)
    gpus: list[int] = Field(default_factory=list)  # empty: a CPU judge (hf engine) that takes no slot


class EveryNode(Section):
    gpus: list[int] = Field(default_factory=list)


class ClusterConfig(Section):
    judges: list[JudgePlacement] = Field(default_factory=list)
    every_node: EveryNode | None = None
    colocate: bool = False  # one judge per host that shares the trainers' GPUs
    judge_port: int = Field(8000, ge=1, le=65535)  # judge i on a host listens on judge_port + i
    startup_timeout: float = Field(600.0, gt=0)
    restarts: int = Field(1, ge=0)  # a judge that dies mid-run is started again this many times
    ssh_port: int | None = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def _one_placement(self) -> "ClusterConfig":
        given = [n for n, v in (("judges", bool(self.judges)), ("every_node", self.every_node is not None),
                                ("colocate", self.colocate)) if v]
        if len(given) > 1:
            raise ValueError(f"give one of judges, every_node, colocate (got {', '.join(given)})")
        return self


class RolloutConfig(Section):
    """Where rollouts are sampled (docs/async.md). `colocated`: every rank samples, then every rank
    trains. `async`: the last `samplers` ranks of the launch only sample and score, the others only
    train (ZeRO-3 among themselves), each side at its own pace; a trained sample is at most
    `max_staleness` adapter versions (optimizer steps) older than the adapter its epoch's training
    starts from, and the loss corrects for the gap with a behaviour weight capped at `behaviour_weight_cap`
    (docs/async.md)."""

    mode: Literal["colocated", "async"] = "colocated"
    samplers: int = Field(1, ge=1)  # async: ranks (the launch's last ones) that sample
    max_staleness: int = Field(1, ge=0)  # async: 0 samples each epoch with the adapter that trains it
    # async: the truncation of the behaviour weight pi_prox / pi_behaviour (verl's rollout_is_threshold)
    behaviour_weight_cap: float = Field(2.0, ge=1)
    # async: each rollout batch goes to the rewards as it finishes (streamed), or an epoch's batches
    # once the sampler has sampled them all (after_sampling: the reference's order)
    scoring: Literal["streamed", "after_sampling"] = "streamed"


class AdvantageConfig(Section):
    method: Literal["grpo", "rank_grpo"] = "grpo"
    global_std: bool = True
    std_floor: float = Field(1e-6, gt=0)
    clip: float = Field(5.0, gt=0)
    drop_zero_std_groups: bool = False


# DeepSpeed keys paco_ds fills from the recipe (paco_ds/runtime/engine.py build_ds_config): an override would be
# silently replaced, so it is refused naming the recipe key that sets it.
DS_KEYS_FROM_RECIPE = {"train_micro_batch_size_per_gpu": "train: batch_size",
                       "gradient_accumulation_steps": "train: optimizer_steps_per_epoch",
                       "train_batch_size": "train: batch_size", "gradient_clipping": "train: max_grad_norm",
                       "bf16": "model: dtype", "fp16": "model: dtype"}


class DeepSpeedSection(Section):
    config: str = "configs/deepspeed/zero3.json"  # engine config (relative to the repo or the recipe)
    zero_stage: int | None = Field(None, ge=0, le=3)  # overrides the file when set
    overrides: dict[str, Any] = Field(default_factory=dict)

    @field_validator("overrides")
    @classmethod
    def _known_meaning(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & set(DS_KEYS_FROM_RECIPE))
        if taken:
            raise ValueError(f"'{taken[0]}' is what paco_ds sets from the recipe ({DS_KEYS_FROM_RECIPE[taken[0]]}); "
                             "remove the override")
        zero = v.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError(f"zero_optimization must be a mapping (got {zero!r})")
        stage = zero.get("stage")
        if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r}; or set deepspeed.zero_stage)")
        return v


class RolloutDeepSpeedSection(DeepSpeedSection):
    # ZeRO-3 rollouts: gather the transformer once for the whole sampling phase ("once"), or let
    # every denoising step gather and release it as a training forward does ("per_step").
    rollout_gather: Literal["once", "per_step"] = "once"
    # ZeRO-3 training steps through DeepSpeed's engine.compile(): torch.compile of the whole transformer,
    # broken at every module's ZeRO-3 hooks (paco_ds/models/compile.py; docs/benchmarks.md measures it)
    engine_compile: bool = False


class WandbConfig(Section):
    """Weights & Biases beside TensorBoard: the same scalars and sample grids at the same steps, from
    rank 0 only, the run continued by `--resume` (docs/recipes.md#weights--biases). Needs `pip install wandb`."""
    project: str = "paco_ds"
    entity: str | None = None  # a W&B team or user; None: the account's default
    name: str | None = None  # the W&B run's display name; None: run_name
    # offline: written to disk, `wandb sync <dir>/wandb/offline-run-*` later; unset: W&B's choice
    # (WANDB_MODE, as clusters without network often set it, else online)
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None  # W&B's files go to <dir>/wandb/; None: the run directory
    # A resume from a checkpoint behind W&B's last step: rewind the W&B run to the checkpoint (W&B's
    # `resume_from`, which W&B enables per account) instead of keeping the rows W&B already holds.
    rewind: bool = False


def wandb_boolean_form(data: Any, project: str) -> Any:
    """A logging section's old form, `wandb: true|false` with `project` beside it, as the W&B section
    (true: its defaults and that project; false: no W&B)."""
    if isinstance(data, dict) and isinstance(data.get("wandb"), bool):
        data = dict(data)
        on, name = data.pop("wandb"), data.pop("project", project)
        data["wandb"] = {"project": name} if on else None
    elif isinstance(data, dict) and "project" in data:
        raise ValueError("'logging.project' is 'logging.wandb.project' now")
    return data


class LoggingConfig(Section):
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # off unless given (`--set logging.wandb.mode=online` turns it on)
    num_train_images: int = Field(16, ge=0)  # sample images kept per epoch for the report

    @model_validator(mode="before")
    @classmethod
    def _boolean_form(cls, data: Any) -> Any:
        return wandb_boolean_form(data, WandbConfig.model_fields["project"].default)


class CheckpointConfig(Section):
    save_freq: int = Field(10, ge=0)  # epochs; 0 disables
    keep_last: int = Field(3, ge=1)
    # Preemption (a scheduler's SIGTERM, then SIGKILL after a grace period): the ranks finish the
    # current micro-step, save a checkpoint together and exit 75, all within sigterm_grace_s.
    # Off: a SIGTERM or the launcher's end stops the run at once (docs/robustness.md).
    save_on_sigterm: bool = False
    sigterm_grace_s: float = Field(25.0, gt=0, le=86400, allow_inf_nan=False)


class KernelsConfig(Section):
    backend: Literal["auto", "triton", "cpp", "torch"] = "auto"


class ParallelConfig(Section):
    """How the ranks share one sample beside data parallelism (docs/gpu_plan.md, "Sequence parallelism")."""

    # DeepSpeed-Ulysses sequence parallelism of the policy's attention (paco_ds/models/sequence.py):
    # groups of this many consecutive ranks, each holding 1/sequence of every sample's tokens; a group
    # samples, scores and trains the same samples (one data-parallel rank). 1: off.
    sequence: int = Field(1, ge=1)


class Recipe(Section):
    """A top-level recipe (GRPO or reward SFT): where it came from, its run's name, seed and
    directory. Subclasses give `run_name` their own default."""

    # Where the recipe came from; paths inside it resolve against this directory.
    source: str | None = None
    run_name: str = "run"
    seed: int = Field(42, ge=0, lt=2 ** 32)  # numpy's seeds are 32-bit, non-negative
    output_dir: str = "runs"

    @field_validator("run_name")
    @classmethod
    def _one_component(cls, v: str) -> str:
        return check_run_name(v)

    def resolve_path(self, path: str) -> Path:
        """A path from the recipe: absolute, else relative to the recipe's directory, else the repo."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        if self.source:
            cand = Path(self.source).parent / p
            if cand.exists():
                return cand
        return REPO_ROOT / p

    @property
    def run_dir(self) -> Path:
        out = Path(self.output_dir)
        return (out if out.is_absolute() else Path.cwd() / out) / self.run_name


class Config(Recipe):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    sample: SampleConfig = Field(default_factory=SampleConfig)
    train: TrainConfig  # its defaults and loss sections come from compose_schema
    test: EvalConfig = Field(default_factory=EvalConfig)
    rewards: RewardsConfig
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    deepspeed: RolloutDeepSpeedSection = Field(default_factory=RolloutDeepSpeedSection)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    reward_servers: ServersConfig | None = None  # judge servers the run starts and stops itself
    cluster: ClusterConfig | None = None  # launch/cluster.py: where the judges run in a multi-node run

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        # A judge asked for more top_logprobs than its vocabulary fails every request (vLLM's engine dies).
        check_top_logprobs({f"rewards.{split}.terms.{name}": t.kwargs for split, rs in
                            (("train", self.rewards.train), ("test", self.rewards.test)) if rs is not None
                            for name, t in rs.terms.items()}, self.reward_servers)
        section = self.train.loss_section
        if section is not None:
            section.check(self)
        if not self.train_timesteps and self.sample.sde_window is None:
            # an epoch of zero micro-steps: DeepSpeed would stop at its own assertion (train batch size 0)
            raise ValueError("sample.noise_steps is empty and train.timesteps unset: no step would be trained")
        steps = [] if section is not None and section.checks_own_timesteps else self.train_timesteps
        late = [j for j in self.sample.noise_steps if j >= self.sample.num_steps]
        if late and self.sample.sde_window is None:
            # The sampler would never reach them: the recipe asks for noise that is silently not there.
            raise ValueError(f"sample.noise_steps {late} must be < sample.num_steps={self.sample.num_steps}")
        bad = [j for j in steps if j >= self.sample.num_steps]
        if bad:
            raise ValueError(f"train.timesteps {bad} must be < sample.num_steps={self.sample.num_steps}")
        win = self.sample.sde_window
        if win is not None:
            lo, hi = win.range
            if not 0 <= lo <= hi - win.size or hi > self.sample.num_steps:
                raise ValueError(f"sample.sde_window: size {win.size} must fit in range [{lo}, {hi}) within "
                                 f"sample.num_steps={self.sample.num_steps}")
            if self.train.timesteps is not None:
                raise ValueError("train.timesteps: leave unset with sample.sde_window (the window is trained)")
        if self.sample.sde_type == "cps" and self.sample.noise_level > 1:
            # CPS's injected noise is sigma_next * sin(noise_level * pi / 2): a fraction of the step, which
            # past 1 folds back (5 gives what 1 gives, 1.5 what 0.5 gives)
            raise ValueError(f"sample.noise_level {self.sample.noise_level:g} with sample.sde_type cps: CPS's noise is "
                             "the fraction sin(noise_level * pi / 2) of the step, so noise_level must be within [0, 1]")
        if self.sample.tree is not None:
            self._check_tree()
        if self.sample.noise_level > 0 and win is None:
            quiet = [j for j in steps if j not in self.sample.noise_steps]
            if quiet:
                raise ValueError(f"train.timesteps {quiet} are not in sample.noise_steps {self.sample.noise_steps}: "
                                 "an ODE step has no log-probability")
        return self

    def _check_tree(self) -> None:
        s, tree = self.sample, self.sample.tree
        leaves = tree.branches ** len(s.noise_steps)
        if s.group_size != leaves:
            raise ValueError(f"sample.tree: sample.group_size {s.group_size} must be the tree's leaves, branches ** "
                             f"len(sample.noise_steps) = {tree.branches} ** {len(s.noise_steps)} = {leaves}")
        for key, bad, why in (
                ("sample.sde_window", s.sde_window is not None, "the tree splits at sample.noise_steps"),
                ("sample.noise_level", s.noise_level <= 0, "a split needs noise (> 0)"),
                ("sample.same_latent", not s.same_latent, "a tree has one root per group: set it true"),
                ("sample.ode_steps", s.ode_steps is not None or s.ode_solver != "euler",
                 "the tree walks every step (leave ode_steps unset, ode_solver euler)"),
                ("train.timesteps", self.train.timesteps is not None and sorted(set(self.train.timesteps)) !=
                 list(s.noise_steps), "every split is trained: leave it unset"),
                ("train.loss", not getattr(self.train.loss_section, "takes_step_advantages", False),
                 f"its advantages are per trained step, which train.loss={self.train.loss} does not read")):
            if bad:
                raise ValueError(f"{key} with sample.tree: {why}")

    @property
    def train_timesteps(self) -> list[int]:
        section = self.train.loss_section
        slots = section.trained_slots(self) if section is not None else None
        if slots is not None:
            return slots
        # The reference bound train.timesteps to noise_steps before editing configs changed them
        # (PaCo-RL/PaCo-GRPO/config/grpo.py, qwen_editing); here the default is read at use time. With
        # an SDE window: the window at its first position (each epoch or group draws where it lies; its
        # size is what counts).
        if self.sample.sde_window is not None:
            lo = self.sample.sde_window.range[0]
            return list(range(lo, lo + self.sample.sde_window.size))
        return sorted(set(self.train.timesteps)) if self.train.timesteps is not None else list(self.sample.noise_steps)


@functools.lru_cache(maxsize=None)
def compose_schema(sections: tuple[tuple[str, str, type[LossSection]], ...], default_loss: str) -> type[Config]:
    """The GRPO schema with the losses' own sections: `sections` holds (train.loss value, section
    name, section class) for each loss that declares one, `default_loss` is train.loss unset."""
    fields: dict[str, Any] = {name: (cls, Field(default_factory=cls)) for _, name, cls in sections}
    train = create_model("TrainConfig", __base__=TrainConfig, loss=(str, default_loss), **fields)
    train.SECTION_OF = {loss: name for loss, name, _ in sections}
    return create_model("Config", __base__=Config, train=(train, Field(default_factory=train)))
