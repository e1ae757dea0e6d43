"""One typed schema for every recipe, YAML loading with `extends:` and `--set`, and derived values.

A recipe is a YAML file validated against `Config` (pydantic v2, unknown keys forbidden).
`extends: base.yaml` (a path relative to the file, or a list of them) merges the base first;
`--set a.b=c` overrides apply last, values parsed as YAML. Every key remembers the file:line it
came from, so a mistake is reported as one line that names the place and the key.

Values that depend on the number of processes (prompts per epoch rounded to fit the world size,
gradient accumulation) are not part of the schema: `derive(cfg, world_size)` computes them from
the real world size at run time.
"""
from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from paco_ds.errors import ConfigError
from paco_ds.serving.config import ServersConfig

REPO_ROOT = Path(__file__).resolve().parents[1]

# LoRA targets of the reference (attention and MLP of both streams of FLUX's double blocks; the
# names that also exist in single blocks match there too).
FLUX_LORA_TARGETS = [
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
class LoraConfig(Section):
    rank: int = Field(64, gt=0)
    alpha: float = Field(128, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    init: Literal["gaussian", "default"] = "gaussian"
    target_modules: list[str] = Field(default_factory=lambda: list(FLUX_LORA_TARGETS))
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
    latent_scaling: float = 4.0  # the autoencoder's scaling_factor (the decoder sees latents / this)


class ModelConfig(Section):
    family: Literal["flux", "flux_kontext", "qwen_image_edit"] = "flux"
    path: str = "black-forest-labs/FLUX.1-dev"  # hub id or local directory
    revision: str | None = None
    tiny: bool = False
    tiny_spec: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    lora: LoraConfig = Field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    max_sequence_length: int = Field(512, gt=0)
    allow_tf32: bool = True


class DataConfig(Section):
    format: Literal["t2is", "text"] = "t2is"
    train_file: str
    test_file: str | None = None
    max_test_prompts: int | None = Field(None, gt=0)


class SampleConfig(Section):
    num_steps: int = Field(10, ge=1)
    guidance_scale: float = 3.5
    batch_size: int = Field(1, ge=1)
    group_size: int = Field(16, ge=1)  # k: images per prompt
    prompts_per_epoch: int = Field(42, ge=1)  # m: unique prompts per epoch (rounded up, see derive)
    round_prompts_per_epoch: bool = True
    noise_level: float = Field(0.7, ge=0)
    noise_steps: list[int] = Field(default_factory=lambda: [1])
    sde_type: Literal["flow_grpo", "cps"] = "flow_grpo"
    same_latent: bool = False  # one initial noise per group

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
    resolution: int = Field(512, gt=0)  # fallback when an item has no height/width
    num_epochs: int = Field(1000, ge=1)
    batch_size: int = Field(1, ge=1)
    learning_rate: float = Field(3e-4, gt=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float = Field(1.0, ge=0)  # DeepSpeed gradient_clipping (0 disables)
    optimizer_steps_per_epoch: int = Field(2, ge=1)
    num_inner_epochs: int = Field(1, ge=1)
    loss: Literal["ppo"] = "ppo"
    clip_range: float = Field(1e-4, gt=0)
    beta: float = Field(0.0, ge=0)  # KL weight; the reference forward runs only when > 0
    timesteps: list[int] | None = None  # trained step indices; default: sample.noise_steps
    ema: EMAConfig = Field(default_factory=EMAConfig)
    max_consecutive_nonfinite: int = Field(3, ge=1)


class TestConfig(Section):
    __test__ = False  # not a pytest class
    resolution: int = Field(1024, gt=0)
    num_steps: int = Field(20, ge=1)
    batch_size: int = Field(5, ge=1)
    eval_freq: int = Field(10, ge=0)  # epochs; 0 disables
    save_images: bool = True


class AggregationConfig(Section):
    """How several rewards become one advantage (see paco_ds/rewards/aggregate.py)."""

    fn: str = "weighted_sum"  # a built-in name or "module:function"
    threshold: Union[Literal["mean", "median"], float] = "mean"  # log_tame
    center: bool = True  # False: the reference's uncentred use of aggregated rewards

    @field_validator("fn")
    @classmethod
    def _known_fn(cls, v: str) -> str:
        from paco_ds.rewards.aggregate import BUILTIN

        if v not in BUILTIN and ":" not in v:
            raise ValueError(f"unknown aggregation '{v}'{_suggest(v, BUILTIN)}; built-ins: {', '.join(BUILTIN)} "
                             "or 'module:function'")
        return v


class RewardTerm(BaseModel):
    """One reward: its weight, plus keyword arguments for the reward's constructor."""

    model_config = ConfigDict(extra="allow")
    weight: float = 1.0

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RewardSet(Section):
    terms: dict[str, RewardTerm]
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    on_failure: Literal["raise", "mask"] = "raise"

    @field_validator("terms")
    @classmethod
    def _known_rewards(cls, v: dict[str, RewardTerm]) -> dict[str, RewardTerm]:
        from paco_ds.rewards.registry import REWARDS

        if not v:
            raise ValueError("at least one reward is needed")
        for name in v:
            if name not in REWARDS:
                raise ValueError(f"unknown reward '{name}'{_suggest(name, REWARDS)}; known: {', '.join(sorted(REWARDS))}")
        return v


class RewardsConfig(Section):
    train: RewardSet
    test: RewardSet | None = None  # None: the train set (decoupled when given)
    overlap: bool = True  # score each rollout batch while the next one samples (False: score in line)

    @property
    def eval(self) -> RewardSet:
        return self.test or self.train


class AdvantageConfig(Section):
    method: Literal["grpo", "rank_grpo"] = "grpo"
    global_std: bool = True
    std_floor: float = Field(1e-6, gt=0)
    clip: float = Field(5.0, gt=0)
    drop_zero_std_groups: bool = False


class DeepSpeedSection(Section):
    config: str = "configs/deepspeed/zero3.json"  # engine config (relative to the repo or the recipe)
    zero_stage: int | None = Field(None, ge=0, le=3)  # overrides the file when set
    overrides: dict[str, Any] = Field(default_factory=dict)
    # ZeRO-3 rollouts: gather the transformer once for the whole sampling phase ("once"), or let
    # every denoising step gather and release it as a training forward does ("per_step").
    rollout_gather: Literal["once", "per_step"] = "once"


class LoggingConfig(Section):
    tensorboard: bool = True
    wandb: bool = False
    project: str = "paco_ds"
    num_train_images: int = Field(16, ge=0)  # sample images kept per epoch for the report


class CheckpointConfig(Section):
    save_freq: int = Field(10, ge=0)  # epochs; 0 disables
    keep_last: int = Field(3, ge=1)


class KernelsConfig(Section):
    backend: Literal["auto", "triton", "cpp", "torch"] = "auto"


class Recipe(Section):
    """A top-level recipe (GRPO or reward SFT): where it came from, and the paths it implies.
    Subclasses define `run_name` and `output_dir`."""

    # Where the recipe came from; paths inside it resolve against this directory.
    source: str | None = None

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
    run_name: str = "run"
    seed: int = 42
    output_dir: str = "runs"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    sample: SampleConfig = Field(default_factory=SampleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    test: TestConfig = Field(default_factory=TestConfig)
    rewards: RewardsConfig
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    reward_servers: ServersConfig | None = None  # judge servers the run starts and stops itself

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        steps = self.train_timesteps
        bad = [j for j in steps if j >= self.sample.num_steps]
        if bad:
            raise ValueError(f"train.timesteps {bad} must be < sample.num_steps={self.sample.num_steps}")
        if self.sample.noise_level > 0:
            quiet = [j for j in steps if j not in self.sample.noise_steps]
            if quiet:
                raise ValueError(f"train.timesteps {quiet} are not in sample.noise_steps {self.sample.noise_steps}: "
                                 "an ODE step has no log-probability")
        return self

    @property
    def train_timesteps(self) -> list[int]:
        # The reference bound train.timesteps to noise_steps before editing configs changed them
        # (REFERENCE.md §12.3); here the default is read at use time.
        return sorted(set(self.train.timesteps)) if self.train.timesteps is not None else list(self.sample.noise_steps)


# --------------------------------------------------------------------------------------------
# Loading: extends, --set, file:line tracking
# --------------------------------------------------------------------------------------------
def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _locations(text: str, file: str) -> dict[tuple, str]:
    """Map each key path of a YAML document to 'file:line'."""
    out: dict[tuple, str] = {}

    def walk(node, prefix: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for knode, vnode in node.value:
                key = prefix + (knode.value,)
                out[key] = f"{file}:{knode.start_mark.line + 1}"
                walk(vnode, key)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not v.get("_replace", False):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
            if isinstance(v, dict):
                out[k].pop("_replace", None)
    return out


def _strip_markers(data):
    """Drop merge markers (`_replace: true`) left where nothing was merged."""
    if isinstance(data, dict):
        return {k: _strip_markers(v) for k, v in data.items() if k != "_replace"}
    return data


def _read_yaml(path: Path, stack: tuple = ()) -> tuple[dict, dict[tuple, str]]:
    if not path.is_file():
        where = f" (extended from {stack[-1]})" if stack else ""
        raise ConfigError(f"config file not found: {path}{where}")
    if path.resolve() in stack:
        raise ConfigError(f"{path}: circular 'extends'")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
        locs = _locations(text, _display(path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{_display(path)}{line}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{_display(path)}: a recipe must be a mapping of keys")
    extends = data.pop("extends", None)
    if extends is None:
        return data, locs
    merged: dict = {}
    merged_locs: dict[tuple, str] = {}
    for base in [extends] if isinstance(extends, str) else list(extends):
        bdata, blocs = _read_yaml((path.parent / base), stack + (path.resolve(),))
        merged = _deep_merge(merged, bdata)
        merged_locs.update(blocs)
    merged_locs.update(locs)
    return _deep_merge(merged, data), merged_locs


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str], locs: dict[tuple, str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
        for n in range(1, len(keys) + 1):
            if n == len(keys) or tuple(keys[:n]) not in locs:
                locs[tuple(keys[:n])] = f"--set {item}"
    return data


def _model_fields(model: type[BaseModel], path: tuple) -> list[str]:
    """Valid keys at a path of the schema (for 'did you mean')."""
    for key in path:
        field = model.model_fields.get(key)
        if field is None:
            return []
        ann = field.annotation
        sub = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _format_validation_error(err: ValidationError, locs: dict[tuple, str], source: str,
                             schema: type[BaseModel]) -> str:
    e = err.errors()[0]
    loc = tuple(str(x) for x in e["loc"])
    dotted = ".".join(loc)
    # The most specific location we know.
    where = source
    for n in range(len(loc), 0, -1):
        if loc[:n] in locs:
            where = locs[loc[:n]]
            break
    # A validator on a mapping (e.g. reward names) names the bad entry in its message: point at it.
    named = [(e["msg"].find(f"'{k[len(loc)]}'"), place) for k, place in locs.items()
             if len(k) == len(loc) + 1 and k[:len(loc)] == loc and f"'{k[len(loc)]}'" in e["msg"]]
    if named:
        where = min(named)[1]
    if e["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _model_fields(schema, loc[:-1]), n=1, cutoff=0.6)
        hint = f" (did you mean '{'.'.join(loc[:-1] + (close[0],))}'?)" if close else ""
        return f"{where}: unknown config key '{dotted}'{hint}"
    if e["type"] == "missing":
        return f"{where}: missing required config key '{dotted}'"
    msg = e["msg"].removeprefix("Value error, ")
    got = e.get("input")
    got_s = "" if isinstance(got, (dict, list)) or e["type"].startswith("value_error") else f" (got {got!r})"
    return f"{where}: config key '{dotted}': {msg}{got_s}"


def add_recipe_arguments(parser) -> None:
    """The arguments every entry point that runs a recipe shares: --config, --set, and the launcher's rank."""
    import argparse
    import os

    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set train.learning_rate=1e-4")
    # the deepspeed launcher passes --local_rank; the rank itself is read from LOCAL_RANK
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")),
                        help=argparse.SUPPRESS)


def load_config(path: str | Path, overrides: list[str] | None = None, schema: type[BaseModel] | None = None):
    """Load a recipe, apply `extends` and `--set` overrides, and validate it against `schema`
    (the GRPO `Config` by default; the reward SFT passes its own). The schema needs a `source` field."""
    schema = schema or Config
    path = Path(path)
    data, locs = _read_yaml(path)
    data = _strip_markers(apply_overrides(data, overrides or [], locs))
    data["source"] = str(path.resolve())
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, locs, _display(path), schema)) from None


def config_to_yaml(cfg: Config) -> str:
    data = cfg.model_dump(mode="json", exclude={"source"})
    return yaml.safe_dump(data, sort_keys=False)


# --------------------------------------------------------------------------------------------
# Derived values (need the real world size)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EpochPlan:
    """Batch arithmetic of one GRPO epoch for a given number of training processes."""

    world_size: int
    group_size: int  # k
    prompts_per_epoch: int  # m, after rounding
    samples_per_epoch: int  # m * k, over all ranks
    samples_per_rank: int
    sample_batches_per_rank: int  # rollout batches of sample.batch_size
    train_timesteps: tuple[int, ...]
    micro_steps_per_rank: int  # (train micro-batches) x (trained timesteps) x inner epochs
    grad_accum_steps: int  # micro-steps per optimizer step
    optimizer_steps_per_epoch: int


def derive(cfg: Config, world_size: int, dataset_size: int | None = None) -> EpochPlan:
    """Round m so that every rank gets whole rollout and training batches, and derive GA.

    The reference rounds m up to a multiple of P*bs/gcd(k, P*bs) with P read from
    CUDA_VISIBLE_DEVICES at load time; here P is the real world size, and the unit also makes
    the per-rank training micro-batches split evenly into the optimizer steps of an epoch.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1 (got {world_size})")
    k, m = cfg.sample.group_size, cfg.sample.prompts_per_epoch
    steps = cfg.train.optimizer_steps_per_epoch
    unit = math.lcm(world_size * cfg.sample.batch_size, world_size * cfg.train.batch_size * steps)
    step = unit // math.gcd(k, unit)  # m must be a multiple of this
    if m % step:
        if not cfg.sample.round_prompts_per_epoch:
            raise ConfigError(
                f"sample.group_size={k} x sample.prompts_per_epoch={m} = {k * m} samples cannot be split evenly "
                f"over world size {world_size} (sample.batch_size={cfg.sample.batch_size}, train.batch_size="
                f"{cfg.train.batch_size}, {steps} optimizer steps per epoch): use prompts_per_epoch a multiple "
                f"of {step}, or set sample.round_prompts_per_epoch: true")
        m = math.ceil(m / step) * step
    if dataset_size is not None and m > dataset_size:
        raise ConfigError(
            f"sample.prompts_per_epoch={m} (rounded for world size {world_size} and group size {k}) exceeds the "
            f"{dataset_size} prompts in data.train_file: lower it or use more prompts")
    samples = m * k
    per_rank = samples // world_size
    timesteps = tuple(cfg.train_timesteps)
    micro = (per_rank // cfg.train.batch_size) * len(timesteps) * cfg.train.num_inner_epochs
    ga = micro // (steps * cfg.train.num_inner_epochs)
    return EpochPlan(
        world_size=world_size, group_size=k, prompts_per_epoch=m, samples_per_epoch=samples,
        samples_per_rank=per_rank, sample_batches_per_rank=per_rank // cfg.sample.batch_size,
        train_timesteps=timesteps, micro_steps_per_rank=micro, grad_accum_steps=ga,
        optimizer_steps_per_epoch=steps * cfg.train.num_inner_epochs,
    )
