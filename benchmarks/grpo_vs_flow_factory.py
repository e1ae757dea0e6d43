"""paco_ds's GRPO trainer against Flow-Factory's own GRPO trainer: the same work, epochs in turns.

Both sides are the trainers as a user runs them, each in its own process on this machine:

  paco_ds       `deepspeed --num_gpus 1 launch/train.py --config RECIPE` (the README's launcher with one
                process; `--paco-launcher python` runs plain `python launch/train.py`). RECIPE is written to
                a temporary folder and `extends:` configs/flux_t2is.yaml, the paper's recipe (its ZeRO-3
                engine config, LoRA r64/alpha 128, noise 0.7 at step 1, EMA, clip 1e-4), with the shape below.
  Flow-Factory  its `GRPOTrainer` from `python -m flow_factory.train CONFIG` (what `ff-train CONFIG` runs
                with one process), in its own interpreter (`--ff-python`), through
                benchmarks/flow_factory_shim.py: the patches an offline fp32 CPU run and the timing need
                (listed there and in docs/benchmarks.md). CONFIG follows its
                examples/grpo/lora/flux1/default.yaml with the shape below.

The same work on both: one local FluxPipeline folder (`paco_ds.models.tiny.flux.save_flux_folder`, the
reduced-depth, full-width FLUX.1: 24 heads x 128, T5 width 4096, 1 double + 2 single blocks, ~0.67B
parameters, plus a model_index.json for diffusers' FluxPipeline), the same 2 prompts (a train.txt both
read), 128 px, 6 steps with SDE noise 0.7 on step 1 only (the trained step), guidance 3.5 as an input (no
CFG), groups of 2 (4 images per epoch, sampled one at a time), 128 T5 tokens, the JPEG-compressibility
reward, LoRA r64/alpha 128 on the same FLUX modules, AdamW lr 3e-4 with 2 optimizer steps per epoch and
clip 1.0, fp32 on the CPU with one torch thread. Per epoch each side makes 24 sampling calls and 4
training forwards of the transformer (counted, not assumed).

Timing: both processes start once (the second after the first has loaded) and wait at a gate before
every epoch; the benchmark lets one epoch run at a time: a warm-up epoch each (untimed), then
`--repeats` timed epochs each in ABBA order (A B, B A, A B, ...). Per epoch each side records (the same
code: `flow_factory_shim.EpochClock`): the epoch's seconds, its sampling / reward (+ advantage) /
training phases (paco_ds: GRPOTrainer.sample_epoch / score_epoch / train_epoch; Flow-Factory:
GRPOTrainer.sample / prepare_feedback / optimize), seconds and calls inside the transformer's forward
(forward pre/post hooks on the FluxTransformer2DModel), VAE decoding and prompt encoding (paco_ds
encodes each rollout batch's prompts while sampling; Flow-Factory encodes its prompt set once while
loading, reported as startup). images/s = 4 / median epoch seconds.

    python benchmarks/grpo_vs_flow_factory.py --ff-python /work/ff/venv/bin/python --ff-root /work/ff/Flow-Factory
    python benchmarks/grpo_vs_flow_factory.py --quick --paco-only        # tiny model, 1 epoch, seconds (the test)
    python benchmarks/grpo_vs_flow_factory.py --profile-dir DIR ...       # py-spy each side's timed epochs
    python benchmarks/grpo_vs_flow_factory.py --paco-set deepspeed.zero_stage=2 ...   # paco_ds on a ZeRO-2 engine

The benchmark does not install Flow-Factory: point --ff-python at the interpreter of an environment where
it is installed per its README (`pip install -e <checkout>`), and --ff-root at that checkout (its commit is
recorded). Writes benchmarks/results/grpo_vs_flow_factory_cpu.json (`--quick`: ..._cpu_quick.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, git_state, machine, write_report  # noqa: E402  (puts the repository on sys.path)

SHIM = Path(__file__).resolve().parent / "flow_factory_shim.py"
MODEL_DIR = REPO / "runs" / "grpo_vs_flow_factory"  # git-ignored; the folders are written once
BASE_RECIPE = REPO / "configs" / "flux_t2is.yaml"
SIDES = ("paco_ds", "flow_factory")
PROMPTS = ["a red fox in fresh snow, watercolor", "a lighthouse on a cliff at dusk, oil painting"]
GROUP, STEPS, NOISE_LEVEL, NOISE_STEP, GUIDANCE = 2, 6, 0.7, 1, 3.5
LR, CLIP_RANGE, ADV_CLIP, OPT_STEPS = 3e-4, 1e-4, 5.0, 2
LORA_RANK, LORA_ALPHA = 64, 128
# the tiny FLUX of --quick (a FluxPipeline folder too, so both sides load the same way)
TINY_TRANSFORMER = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                    "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
MODEL_INDEX = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
               "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
               "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
               "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
               "image_encoder": [None, None], "feature_extractor": [None, None]}
EPOCH_TIMEOUT_S = 3600
START_TIMEOUT_S = 1800
CHOICES = [  # what each side is configured with beyond the shared shape, and why (also in the JSON)
    "paco_ds: the paper's recipe (configs/flux_t2is.yaml) as a user runs it: ZeRO-3 engine config, EMA "
    "(decay 0.9 every 8 optimizer steps), TensorBoard and the sample grid of each epoch (logging defaults), "
    "rewards scored while sampling goes on (RewardRunner overlap); no evaluation, no checkpoints",
    "Flow-Factory: examples/grpo/lora/flux1/default.yaml's settings where they apply (gdpo aggregation, EMA "
    "decay 0.9 every 4 epochs, clip 1e-4, v-based KL off), global_std true (as paco_ds's t2is recipe), "
    "latent_storage_dtype fp32 (its default fp16 would store the trajectory in half precision), "
    "master_weight_dtype fp32, logging_backend tensorboard (the paco_ds side writes TensorBoard too), "
    "dataloader_num_workers 0 (its default 16 worker processes on a 2-core machine), reward synchronous "
    "after sampling (async_reward's default false); no eval, no checkpoints",
]


# ---------------------------------------------------------------------------------------------- inputs
def model_folder(quick: bool) -> Path:
    """The FluxPipeline folder both sides load: written once, with a model_index.json for diffusers."""
    from paco_ds.models.tiny.flux import save_flux_folder

    path = MODEL_DIR / ("flux_tiny" if quick else "flux_reduced")
    save_flux_folder(path, transformer=TINY_TRANSFORMER if quick else None)
    index = path / "model_index.json"
    if not index.is_file():
        import diffusers

        index.write_text(json.dumps({**MODEL_INDEX, "_diffusers_version": diffusers.__version__}, indent=1))
    return path


def write_inputs(tmp: Path, folder: Path, args, epochs: int) -> tuple[Path, Path]:
    """The prompt file, paco_ds's recipe and Flow-Factory's config; returns (recipe, config)."""
    import yaml

    data = tmp / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    recipe = {
        "extends": str(BASE_RECIPE), "run_name": "grpo_vs_flow_factory", "output_dir": str(tmp / "paco_runs"),
        "model": {"path": str(folder), "dtype": "auto", "max_sequence_length": args.max_sequence_length,
                  "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA}},
        "data": {"format": "text", "train_file": str(data / "train.txt"), "test_file": None},
        "sample": {"num_steps": STEPS, "guidance_scale": GUIDANCE, "batch_size": 1, "group_size": GROUP,
                   "prompts_per_epoch": len(PROMPTS), "noise_level": NOISE_LEVEL, "noise_steps": [NOISE_STEP]},
        "train": {"resolution": args.resolution, "num_epochs": epochs, "batch_size": 1, "learning_rate": LR,
                  "max_grad_norm": 1.0, "optimizer_steps_per_epoch": OPT_STEPS, "ppo": {"clip_range": CLIP_RANGE},
                  "kl_beta": 0.0},
        "advantage": {"clip": ADV_CLIP, "global_std": True},
        "test": {"eval_freq": 0},
        "rewards": {"train": {"terms": {"_replace": True, "jpeg_compressibility": {"weight": 1.0}}},
                    "test": {"terms": {"_replace": True, "jpeg_compressibility": {"weight": 1.0}}}},
        "checkpoint": {"save_freq": 0},
    }
    ff = {
        "launcher": "accelerate", "config_file": None, "num_processes": 1, "mixed_precision": "no",
        "data": {"dataset_dir": str(data), "preprocessing_batch_size": 8, "dataloader_num_workers": 0,
                 "force_reprocess": True, "cache_dir": str(tmp / "ff_cache"), "sampler_type": "auto"},
        "model": {"finetune_type": "lora", "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
                  "target_modules": "default", "model_name_or_path": str(folder), "model_type": "flux1",
                  "master_weight_dtype": "fp32"},
        "log": {"run_name": "grpo_vs_flow_factory", "project": "Flow-Factory", "logging_backend": "tensorboard",
                "save_dir": str(tmp / "ff_saves"), "save_freq": 0, "save_model_only": True},
        "train": {"trainer_type": "grpo", "advantage_aggregation": "gdpo", "clip_range": CLIP_RANGE,
                  "adv_clip_range": ADV_CLIP, "kl_type": "v-based", "kl_beta": 0, "resolution": args.resolution,
                  "num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "per_device_batch_size": 1,
                  "group_size": GROUP, "global_std": True, "unique_sample_num_per_epoch": len(PROMPTS),
                  "gradient_step_per_epoch": OPT_STEPS, "max_epochs": epochs, "learning_rate": LR,
                  "adam_weight_decay": 1e-4, "adam_betas": [0.9, 0.999], "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
                  "ema_decay": 0.9, "ema_update_interval": 4, "ema_device": "cuda", "latent_storage_dtype": "fp32",
                  "enable_gradient_checkpointing": False, "seed": 42},
        "scheduler": {"dynamics_type": "Flow-SDE", "noise_level": NOISE_LEVEL, "num_sde_steps": 1,
                      "sde_steps": [NOISE_STEP], "seed": 42},
        "eval": {"resolution": args.resolution, "eval_freq": 0},
        "rewards": [{"name": "jpeg_compressibility", "reward_model": "__main__.JpegCompressibility", "weight": 1.0,
                     "batch_size": 4, "device": "cpu", "dtype": "float32"}],
    }
    (tmp / "paco.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (tmp / "flow_factory.yaml").write_text(yaml.safe_dump(ff, sort_keys=False))
    return tmp / "paco.yaml", tmp / "flow_factory.yaml"


def ff_environment(ff_python: str) -> dict | None:
    """Flow-Factory's interpreter's package versions, or None when flow_factory does not import there."""
    code = ("import json, importlib.metadata as m, flow_factory; print(json.dumps({k: m.version(k) for k in "
            "('torch', 'diffusers', 'transformers', 'accelerate', 'peft', 'flow-factory')}))")
    try:
        r = subprocess.run([ff_python, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    except OSError:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None


# ---------------------------------------------------------------------------------------------- paco_ds worker
def paco_worker(argv: list[str]) -> None:
    """Inside the paco_ds training process: the timing hooks (flow_factory_shim.EpochClock, as on the other
    side), then launch/train.py's own main on the remaining arguments."""
    import runpy

    p = argparse.ArgumentParser()
    p.add_argument("--clock-file", required=True)
    p.add_argument("--gate-dir", default=None)
    args, rest = p.parse_known_args(argv)
    from flow_factory_shim import EpochClock, find_module

    from paco_ds.grpo import build
    from paco_ds.grpo.trainer import GRPOTrainer
    from paco_ds.models.flux import FluxPolicy

    clock = EpochClock(args.clock_file, args.gate_dir, "paco_ds")
    adapted_policy = build.adapted_policy

    def hooked_policy(*a, **k):
        policy = adapted_policy(*a, **k)
        clock.hook_module(find_module(policy.transformer, "FluxTransformer2DModel"), "transformer")
        clock.hook_module(policy.vae.decoder, "vae_decode", count_batch=True)
        return policy

    build.adapted_policy = hooked_policy
    FluxPolicy.encode_prompts = clock.timed_call(FluxPolicy.encode_prompts, "prompt_encode")
    GRPOTrainer.sample_epoch = clock.phased(GRPOTrainer.sample_epoch, "sample")
    GRPOTrainer.score_epoch = clock.phased(GRPOTrainer.score_epoch, "reward")
    GRPOTrainer.train_epoch = clock.phased(GRPOTrainer.train_epoch, "train")
    epoch, finish = GRPOTrainer.run_epoch, GRPOTrainer.finish

    def gated_epoch(self, resumed):
        clock.gate(self.epoch)
        epoch(self, resumed)
        clock.end_epoch()

    def gated_finish(self):
        clock.gate(self.epoch, last=True)
        finish(self)

    GRPOTrainer.run_epoch, GRPOTrainer.finish = gated_epoch, gated_finish
    sys.argv = [str(REPO / "launch" / "train.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------- the turns
class Side:
    def __init__(self, name: str, cmd: list[str], env: dict, tmp: Path):
        self.name, self.cmd, self.env = name, cmd, env
        self.clock_file = tmp / f"{name}.jsonl"
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this benchmark started (launcher + trainer)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def records(self) -> list[dict]:
        if not self.clock_file.is_file():
            return []
        return [json.loads(line) for line in self.clock_file.read_text().splitlines() if line.strip()]


class Turns:
    """The gate files: a side waits at <gate>/<side>.arrived = k until <gate>/<side>.go >= k."""

    def __init__(self, gate: Path):
        self.gate = gate

    def arrived(self, side: Side, k: int, timeout: float) -> None:
        path, t0 = self.gate / f"{side.name}.arrived", time.monotonic()
        while True:
            try:
                if int(path.read_text() or -1) >= k:
                    return
            except (OSError, ValueError):
                pass
            if side.proc.poll() is not None:
                raise RuntimeError(f"{side.name} exited ({side.proc.returncode}) before gate {k}; its log:\n"
                                   f"{side.tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{side.name}: no gate {k} after {timeout:.0f}s; its log:\n{side.tail()}")
            time.sleep(0.05)

    def go(self, side: Side, k: int) -> None:
        tmp = self.gate / f"{side.name}.go.tmp"
        tmp.write_text(str(k))
        os.replace(tmp, self.gate / f"{side.name}.go")


def profiler(args, side: Side, out: Path):
    """py-spy attached to the side's trainer process for one epoch (collapsed stacks, wall time)."""
    pid = side.proc.pid
    # the deepspeed launcher's child is the trainer: profile every process of the group
    cmd = [args.py_spy, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", str(PROFILE_RATE),
           "--nonblocking", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_turns(sides: list[Side], tmp: Path, warmup: int, repeats: int, args) -> list[tuple[str, int]]:
    """Start the sides one after the other, then give them their epochs one at a time; the order of
    the timed epochs alternates (A B, B A, ...). Returns the (side, epoch) turns in the order run."""
    turns = Turns(tmp)
    epochs = warmup + repeats
    # a stop (SIGTERM) unwinds through the `finally` below, which stops the trainers this started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    order = [(s, e) for e in range(warmup) for s in sides]
    for r in range(repeats):
        order += [(s, warmup + r) for s in (sides if r % 2 == 0 else sides[::-1])]
    try:
        for s in sides:  # loading overlaps nothing timed
            s.start()
            turns.arrived(s, 0, START_TIMEOUT_S)
            print(f"{s.name}: loaded", flush=True)
        for s, e in order:
            prof = None
            if args.profile_dir and e >= warmup:
                prof = profiler(args, s, args.profile_dir / f"{s.name}_epoch{e}.txt")
                time.sleep(1.0)  # py-spy attached before the epoch starts
            t0 = time.perf_counter()
            turns.go(s, e)
            turns.arrived(s, e + 1, EPOCH_TIMEOUT_S)
            if prof is not None:
                prof.send_signal(signal.SIGINT)
                prof.wait(timeout=120)
            print(f"{s.name}: epoch {e}{' (warm-up)' if e < warmup else ''} {time.perf_counter() - t0:.1f}s "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        for s in sides:
            turns.go(s, epochs)  # finishing (the LoRA export, reports) runs after every timed epoch
        for s in sides:
            try:
                s.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                pass
            if s.proc.returncode not in (0, None):
                print(f"note: {s.name} exited {s.proc.returncode} after its epochs; its log:\n{s.tail(15)}",
                      flush=True)
    finally:
        for s in sides:
            s.stop()
    return [(s.name, e) for s, e in order]


# ---------------------------------------------------------------------------------------------- profile
PROFILE_RATE = 50  # py-spy samples per second (wall clock; idle threads are not sampled)
# categories that own a sample when any frame of its stack matches (checked in this order) ...
WHOLE_STACK = [
    ("backward", lambda fn, f: fn in ("_engine_run_backward", "Tensor.backward", "DeepSpeedEngine.backward")
     or (f.startswith("torch/autograd/") and fn == "backward")),
    ("optimizer step and clipping", lambda fn, f: f.startswith("torch/optim/") or "clip_grad" in fn
     or (fn.endswith(".step") and "deepspeed/runtime/engine.py" in f) or fn == "clip_and_step"),
    ("reward", lambda fn, f: "rewards/" in f or "JpegCompressibility" in fn or "reward_processor" in f),
    ("VAE decode", lambda fn, f: "autoencoders/" in f or fn.endswith("decode_latents") or fn == "FluxPolicy.decode"),
    ("prompt encoding", lambda fn, f: fn.endswith(("encode_prompt", "encode_prompts", "_get_t5_prompt_embeds",
                                                   "_get_clip_prompt_embeds"))),
    ("progress, logging, reports", lambda fn, f: f.startswith(("tqdm/", "tensorboard", "torch/utils/tensorboard"))
     or f.endswith(("paco_ds/runtime/metrics.py", "paco_ds/report/page.py", "paco_ds/metrics.py", "paco_ds/report.py")) or "logger/" in f or "logging/" in f
     or fn.endswith(("save_image", "make_grid", "log_data", "_print_epoch"))),
]
# ... else the first of these met walking from the leaf up
FROM_LEAF = [
    # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear by its own autograd function
    # (deepspeed/runtime/zero/linear.py): the linear layers' compute, counted where it is called from
    ("DeepSpeed engine and ZeRO-3 hooks", lambda fn, f: f.startswith("deepspeed/") and not f.endswith(ZERO3_LINEAR)),
    ("transformer forward", lambda fn, f: "transformer_flux.py" in f),
    ("SDE step and log-prob", lambda fn, f: f.startswith("kernels/") or "scheduler/" in f or "sde" in fn.lower()
     or "log_prob" in fn),
    ("sample and batch bookkeeping", lambda fn, f: f.endswith(("sampling/trajectory.py", "sampling/rollouts.py",
                                                              "grpo/epoch.py", "samples/samples.py",
                                                              "trajectory_collector.py")) or "data_utils/" in f),
]
ZERO3_LINEAR = "deepspeed/runtime/zero/linear.py"
PHASE_FRAMES = {"sample": ("GRPOTrainer.sample_epoch", "GRPOTrainer.sample"),
                "reward": ("GRPOTrainer.score_epoch", "GRPOTrainer.prepare_feedback"),
                "train": ("GRPOTrainer.train_epoch", "GRPOTrainer.optimize")}
OWN_CODE = {"paco_ds": ("paco_ds/", "kernels/", "launch/"), "flow_factory": ("flow_factory/",)}


def _frames(line: str) -> tuple[list[tuple[str, str]], int]:
    stack, _, count = line.rstrip().rpartition(" ")
    frames = []
    for part in stack.split(";"):
        if part.startswith("process ") or " (" not in part:
            continue
        fn, _, where = part.rpartition(" (")
        f = where.rstrip(")").rsplit(":", 1)[0]
        f = f.split("site-packages/", 1)[-1].split(f"{REPO}/", 1)[-1].split("/src/", 1)[-1]
        frames.append((fn, f))
    return frames, int(count)


def categorise(frames: list[tuple[str, str]]) -> str:
    for name, rule in WHOLE_STACK:
        if any(rule(fn, f) for fn, f in frames):
            return name
    for fn, f in reversed(frames):
        for name, rule in FROM_LEAF:
            if rule(fn, f):
                return name
    return "other"


def profile_summary(paths: list[Path], side: str) -> dict:
    """Seconds per category and the own-code functions that hold the time outside the transformer
    (each sample goes to the deepest frame of the side's own code in its stack), per epoch."""
    cats: dict[str, float] = {}
    by_phase: dict[str, dict[str, float]] = {}
    own: dict[str, float] = {}
    zero3_linear = 0.0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            frames, n = _frames(line)
            cat = categorise(frames)
            cats[cat] = cats.get(cat, 0.0) + n / PROFILE_RATE
            phase = next((ph for ph, names in PHASE_FRAMES.items() if any(fn in names for fn, _ in frames)), "other")
            slot = by_phase.setdefault(phase, {})
            slot[cat] = slot.get(cat, 0.0) + n / PROFILE_RATE
            if any(f.endswith(ZERO3_LINEAR) for _, f in frames):
                zero3_linear += n / PROFILE_RATE
            if cat not in ("transformer forward", "backward"):
                mine = [f"{f}:{fn}" for fn, f in frames if f.startswith(OWN_CODE[side])]
                key = mine[-1] if mine else "(no own frame) " + (f"{frames[-1][1]}:{frames[-1][0]}" if frames else "?")
                own[key] = own.get(key, 0.0) + n / PROFILE_RATE
    k = max(len(paths), 1)
    return {"epochs": len(paths), "rate_hz": PROFILE_RATE,
            "seconds_per_epoch": {c: v / k for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "in_zero3_linear_s_per_epoch": zero3_linear / k,  # of forward and backward: DeepSpeed's F.linear
            "seconds_per_epoch_by_phase": {ph: {c: v / k for c, v in sorted(d.items(), key=lambda kv: -kv[1])}
                                           for ph, d in by_phase.items()},
            "outside_transformer_by_own_function": [[f, v / k] for f, v in sorted(own.items(), key=lambda kv: -kv[1])[:25]]}


# ---------------------------------------------------------------------------------------------- summary
def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}


def summarise(records: list[dict], warmup: int, images: int) -> dict:
    startup = next((r for r in records if r["epoch"] == "startup"), None)
    timed = [r for r in records if r["epoch"] != "startup" and r["epoch"] >= warmup]
    if not timed:
        raise RuntimeError("no timed epoch recorded")

    def s(r, what, phase=None):
        d = r[what]["s"]
        return sum(d.values()) if phase is None else d.get(phase, 0.0)

    def c(r, what, phase=None):
        d = r[what]["calls"]
        return sum(d.values()) if phase is None else d.get(phase, 0)

    per = {
        "epoch_s": [r["epoch_s"] for r in timed], "cpu_s": [r["cpu_s"] for r in timed],
        "sample_s": [r["phases"].get("sample", 0.0) for r in timed],
        "reward_s": [r["phases"].get("reward", 0.0) for r in timed],
        "train_s": [r["phases"].get("train", 0.0) for r in timed],
        "other_s": [r["epoch_s"] - sum(r["phases"].values()) for r in timed],
        "transformer_s": [s(r, "transformer") for r in timed],
        "transformer_sample_s": [s(r, "transformer", "sample") for r in timed],
        "transformer_train_s": [s(r, "transformer", "train") for r in timed],
        "outside_transformer_s": [r["epoch_s"] - s(r, "transformer") for r in timed],
        "vae_decode_s": [s(r, "vae_decode") for r in timed],
        "prompt_encode_s": [s(r, "prompt_encode") for r in timed],
    }
    calls = {k: [f(r) for r in timed] for k, f in {
        "transformer_calls": lambda r: c(r, "transformer"),
        "transformer_calls_sample": lambda r: c(r, "transformer", "sample"),
        "transformer_calls_train": lambda r: c(r, "transformer", "train"),
        "vae_decoded_images": lambda r: c(r, "vae_decode"),
        "prompt_encode_calls": lambda r: c(r, "prompt_encode")}.items()}
    med_epoch = statistics.median(per["epoch_s"])
    out = {
        "images_per_epoch": images,
        "images_per_sec": images / med_epoch,
        "images_per_sec_by_epoch": spread([images / e for e in per["epoch_s"]]),
        "images_per_cpu_sec": images / statistics.median(per["cpu_s"]),
        **{k: spread(v) for k, v in per.items()},
        "calls_per_epoch": {k: spread(v) for k, v in calls.items()},
        "transformer_calls_per_image": statistics.median(calls["transformer_calls"]) / images,
        "transformer_s_per_call_sample": statistics.median(
            [a / max(b, 1) for a, b in zip(per["transformer_sample_s"], calls["transformer_calls_sample"])]),
        "transformer_s_per_call_train": statistics.median(
            [a / max(b, 1) for a, b in zip(per["transformer_train_s"], calls["transformer_calls_train"])]),
        "epochs": [r["epoch"] for r in timed],
        "load_average_by_epoch": [r["load_average"][0] for r in timed],
    }
    if startup is not None:
        out["startup"] = {"s": startup["epoch_s"], "prompt_encode_s": s(startup, "prompt_encode"),
                          "prompt_encode_calls": c(startup, "prompt_encode"),
                          "transformer_calls": c(startup, "transformer")}
    return out


def print_table(res: dict) -> None:
    rows = [("images/s (median epoch)", lambda r: f"{r['images_per_sec']:.4f}"),
            ("images/s min/med/max", lambda r: "/".join(f"{v:.4f}" for v in (
                r["images_per_sec_by_epoch"]["min"], r["images_per_sec_by_epoch"]["median"],
                r["images_per_sec_by_epoch"]["max"])))]
    for key, label in (("epoch_s", "epoch s"), ("sample_s", "sampling s"), ("reward_s", "reward+advantage s"),
                       ("train_s", "training s"), ("other_s", "rest of the epoch s"),
                       ("transformer_s", "in transformer fwd s"), ("transformer_sample_s", "  of it sampling s"),
                       ("transformer_train_s", "  of it training s"),
                       ("outside_transformer_s", "outside transformer fwd s"), ("vae_decode_s", "VAE decode s"),
                       ("prompt_encode_s", "prompt encoding s / epoch"), ("cpu_s", "process CPU s")):
        rows.append((label + " min/med/max", lambda r, k=key: "/".join(f"{r[k][q]:.2f}" for q in ("min", "median",
                                                                                                   "max"))))
    rows += [("transformer calls / image", lambda r: f"{r['transformer_calls_per_image']:.2f}"),
             ("calls sampling / training", lambda r: "{}/{}".format(
                 r["calls_per_epoch"]["transformer_calls_sample"]["median"],
                 r["calls_per_epoch"]["transformer_calls_train"]["median"])),
             ("s / call sampling, training", lambda r: f"{r['transformer_s_per_call_sample']:.2f}, "
                                                       f"{r['transformer_s_per_call_train']:.2f}"),
             ("prompt encoding at startup s", lambda r: f"{r.get('startup', {}).get('prompt_encode_s', 0.0):.2f} "
                                                        f"({r.get('startup', {}).get('prompt_encode_calls', 0)} calls)")]
    names = list(res)
    print(f"{'':>38} " + " ".join(f"{n:>24}" for n in names))
    for label, f in rows:
        print(f"{label:>38} " + " ".join(f"{f(res[n]):>24}" for n in names))


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "paco-worker" in argv:  # inside the training process (the deepspeed launcher puts --local_rank first)
        paco_worker([a for a in argv if a != "paco-worker"])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ff-python", help="python of an environment where Flow-Factory is installed (pip install -e)")
    p.add_argument("--ff-root", type=Path, help="the Flow-Factory checkout (its commit is recorded)")
    p.add_argument("--paco-only", action="store_true", help="run the paco_ds side alone (no Flow-Factory needed)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per side (default 3; --quick 1)")
    p.add_argument("--resolution", type=int, default=None, help="px (default 128; --quick 32)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="T5 tokens (default 128; --quick 32)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                   help="torch threads per side (OMP_NUM_THREADS; default 1)")
    p.add_argument("--paco-launcher", choices=("deepspeed", "python"), default="deepspeed",
                   help="deepspeed --num_gpus 1 launch/train.py (default) or plain python launch/train.py")
    p.add_argument("--paco-set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of paco_ds's recipe (launch/train.py --set), e.g. deepspeed.zero_stage=2")
    p.add_argument("--quick", action="store_true", help="tiny FLUX folder, 32 px, 1 epoch per side, no warm-up")
    p.add_argument("--profile-dir", type=Path, help="py-spy each timed epoch into this folder (collapsed stacks)")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy", help="the py-spy executable")
    p.add_argument("--keep", type=Path, help="copy the run folder (logs, recipes, clock files) here")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/grpo_vs_flow_factory_cpu.json)")
    args = p.parse_args(argv)
    for k, full, quick in (("repeats", 3, 1), ("resolution", 128, 32), ("max_sequence_length", 128, 32)):
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    ff_env = None
    if not args.paco_only:
        ff_env = ff_environment(args.ff_python) if args.ff_python else None
        if ff_env is None or args.ff_root is None or not (args.ff_root / "src" / "flow_factory").is_dir():
            print("Flow-Factory not found: pass --ff-python <python of an environment where Flow-Factory is installed "
                  "per its README (pip install -e <checkout>)> and --ff-root <that checkout>, or --paco-only",
                  file=sys.stderr)
            return 2
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    machine_info = machine()
    source = git_state(REPO)
    ff_source = git_state(args.ff_root) if args.ff_root else None
    folder = model_folder(args.quick)
    warmup = 0 if args.quick else 1
    epochs = warmup + args.repeats
    images = GROUP * len(PROMPTS)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONWARNINGS": "ignore::FutureWarning", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # Flow-Factory's interpreter sees none of this repository's packages
    paco_env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(SHIM.parent)])}
    with tempfile.TemporaryDirectory(prefix="grpo_vs_ff_") as tmp_s:
        tmp = Path(tmp_s)
        recipe, ff_config = write_inputs(tmp, folder, args, epochs)
        worker = [str(Path(__file__).resolve()), "paco-worker", "--clock-file", str(tmp / "paco_ds.jsonl"),
                  "--gate-dir", str(tmp)]
        sets = [a for kv in args.paco_set for a in ("--set", kv)]
        if args.paco_launcher == "deepspeed":
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            paco_cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port", str(port),
                        *worker, "--config", str(recipe), *sets]
            user_cmd = " ".join(["deepspeed --num_gpus 1 launch/train.py --config", recipe.name, *sets])
        else:
            paco_cmd = [sys.executable, *worker, "--config", str(recipe), *sets]
            user_cmd = " ".join(["python launch/train.py --config", recipe.name, *sets])
        sides = [Side("paco_ds", paco_cmd, paco_env, tmp)]
        if not args.paco_only:
            sides.append(Side("flow_factory", [args.ff_python, str(SHIM), "--clock-file", str(tmp / "flow_factory.jsonl"),
                                               "--gate-dir", str(tmp), "--max-sequence-length",
                                               str(args.max_sequence_length), str(ff_config)], env, tmp))
        print(f"model: {folder}; {images} images per epoch ({len(PROMPTS)} prompts x {GROUP}), {args.resolution}px, "
              f"{STEPS} steps, noise step [{NOISE_STEP}], {args.max_sequence_length} T5 tokens, {args.threads} "
              f"thread(s); {warmup} warm-up + {args.repeats} timed epochs per side", flush=True)
        order = run_turns(sides, tmp, warmup, args.repeats, args)
        recipes = {"paco_ds": recipe.read_text(), "flow_factory": ff_config.read_text()}
        res = {s.name: summarise(s.records(), warmup, images) for s in sides}
        logs = {s.name: s.tail(8) for s in sides}
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    print_table(res)
    ratio = None
    if "flow_factory" in res:
        a, b = res["paco_ds"], res["flow_factory"]
        ratio = {"images_per_sec": a["images_per_sec"] / b["images_per_sec"],
                 "images_per_cpu_sec": a["images_per_cpu_sec"] / b["images_per_cpu_sec"],
                 "outside_transformer_s": b["outside_transformer_s"]["median"] / a["outside_transformer_s"]["median"]}
        print(f"paco_ds / Flow-Factory images/s: {ratio['images_per_sec']:.3f}x (per process CPU second "
              f"{ratio['images_per_cpu_sec']:.3f}x); seconds outside the transformer's forward, Flow-Factory / "
              f"paco_ds: {ratio['outside_transformer_s']:.2f}x")
    profile = None
    if args.profile_dir:
        profile = {s: profile_summary(sorted(args.profile_dir.glob(f"{s}_epoch*.txt")), s) for s in res}
        for name, prof in profile.items():
            print(f"\n{name}: seconds per epoch by category (py-spy, {prof['epochs']} epoch(s))")
            for cat, v in prof["seconds_per_epoch"].items():
                print(f"  {cat:>36} {v:8.2f}")
            print(f"  {'(of forward + backward: in ZeRO-3 linear)':>36} {prof['in_zero3_linear_s_per_epoch']:8.2f}")
            for ph, d in prof["seconds_per_epoch_by_phase"].items():
                print(f"  {ph}: " + ", ".join(f"{c} {v:.2f}" for c, v in d.items()))
            print(f"{name}: outside the transformer's forward and backward, by the deepest own-code frame")
            for f, v in prof["outside_transformer_by_own_function"][:12]:
                print(f"  {v:8.2f}  {f}")
    from flow_factory_shim import __doc__ as shim_doc

    report = {
        "config": {"quick": args.quick, "model": str(folder.relative_to(REPO)), "transformer": "tiny" if args.quick
                   else "reduced FLUX (REDUCED_FLUX_TRANSFORMER: 1 double + 2 single blocks, 24 heads x 128, "
                   "T5 width 4096)", "prompts": PROMPTS, "images_per_epoch": images, "group_size": GROUP,
                   "resolution": args.resolution, "steps": STEPS, "noise_level": NOISE_LEVEL,
                   "noise_steps": [NOISE_STEP], "guidance": GUIDANCE, "max_sequence_length": args.max_sequence_length,
                   "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA}, "learning_rate": LR,
                   "optimizer_steps_per_epoch": OPT_STEPS, "reward": "jpeg_compressibility", "dtype": "float32",
                   "torch_threads": args.threads, "warmup_epochs": warmup, "repeats": args.repeats,
                   "paco_launcher": args.paco_launcher, "paco_user_command": user_cmd, "paco_set": args.paco_set,
                   "flow_factory_user_command": "python -m flow_factory.train flow_factory.yaml (ff-train, one process),"
                                                " through benchmarks/flow_factory_shim.py",
                   "recipes": recipes, "choices": CHOICES},
        "order": order,
        "sides": res,
        "ratios": ratio,
        "source": source,
        "flow_factory": {"source": ff_source, "environment": ff_env,
                         "patches": shim_doc[shim_doc.index("| patch"):shim_doc.index("\n\nOffline")]}
        if not args.paco_only else None,
        "paco_ds_environment": {k: machine_info.get(k) for k in ("python", "torch")},
        "profile": profile,
        "log_tails": logs,
        "load_average_at_end": os.getloadavg(),
        "method": "two trainer processes, each started once (the second after the first loaded); a gate before "
                  "every epoch lets one epoch run at a time: one warm-up epoch per side, then the timed epochs in "
                  "ABBA order; per-epoch timings from the same hooks and wrappers on both sides "
                  "(flow_factory_shim.EpochClock); images/s = images per epoch / median epoch seconds",
    }
    out = args.out or RESULTS / f"grpo_vs_flow_factory_cpu{'_quick' if args.quick else ''}.json"
    path = write_report(out.stem, report, out.parent, machine_info)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
