"""Flow-Factory's own GRPO trainer, run inside Flow-Factory's interpreter with the patches an offline
fp32 CPU run and the benchmark's timing need (benchmarks/grpo_vs_flow_factory.py starts it).

    <flow-factory python> benchmarks/flow_factory_shim.py --clock-file F --gate-dir D [--max-sequence-length N] CONFIG

It applies the patches below, then calls `flow_factory.train.main()` on CONFIG: what `ff-train CONFIG`
runs with one process (`python -m flow_factory.train CONFIG`). Nothing in Flow-Factory's files is
changed; every patch is made here, at run time, on the imported modules (X-GenGroup/Flow-Factory at
a0b2bc5; the places are named by file under src/flow_factory/).

| patch | where in Flow-Factory | why |
|---|---|---|
| autocast only for mixed_precision fp16/bf16 | trainers/abc.py, `BaseTrainer.__init__` sets `self.autocast = partial(torch.autocast, device_type, dtype=fp16 if "fp16" else bf16)`, which is on whatever `mixed_precision` says | with `mixed_precision: "no"` its sampling and training forwards would run under bf16 autocast on the CPU; an fp32 run needs it off (it stays on for "fp16"/"bf16") |
| a local JPEG-compressibility reward, `__main__.JpegCompressibility` | rewards/registry.py `get_reward_model_class` imports a reward class by its python path | a cheap reward with no model and no server: the formula of paco_ds's `jpeg_compressibility` (-8 x JPEG bytes at quality 95 per pixel) |
| T5 prompt length (only when `--max-sequence-length` is not 512) | models/flux/flux1.py `Flux1Adapter.encode_prompt` calls diffusers' `FluxPipeline.encode_prompt` without `max_sequence_length`, so 512 T5 tokens; no config key sets it | the same text tokens as the paco_ds side (its `model.max_sequence_length`); 512 tokens at 128 px triple each transformer call on a CPU |
| timing (measurement only) | forward pre/post hooks on the `FluxTransformer2DModel` and the VAE's decoder; wrappers on `GRPOTrainer.sample` / `prepare_feedback` / `optimize` (trainers/grpo.py) and `Flux1Adapter.encode_prompt`; the turn gate in `BaseTrainer.should_continue_training` (trainers/abc.py), which the epoch loop calls before every epoch and once after the last | per-epoch phase seconds, seconds and calls inside the transformer, prompt encoding and decode, written as JSON lines to `--clock-file`; the gate lets the benchmark run the two trainers' epochs in turns |

Offline: the benchmark sets HF_HUB_OFFLINE=1, the recipe loads a local FluxPipeline folder, logs to
TensorBoard, and has no eval and no checkpoints. On a CPU-only machine Accelerate's device is the
CPU, and Flow-Factory's "cuda" device settings (EMA, reward) resolve to it; nothing else needs a patch.

`EpochClock` (the JSON-lines clock and the gate) is stdlib-only, so the benchmark's paco_ds side
imports it from here and both sides are timed by the same code.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

GATE_POLL_S = 0.05


# ---------------------------------------------------------------------------------------------- clock
class EpochClock:
    """One trainer process's per-epoch record, written as a JSON line when the epoch ends, and the
    turn gate: before epoch k (and once after the last, k = epochs) the process writes
    `<side>.arrived` = k in `gate_dir` and waits until the benchmark writes `<side>.go` >= k.

    A record: `epoch`, `epoch_s` (from the gate's release to the epoch's end), `cpu_s` (this
    process's CPU seconds), `phases` (seconds per named phase), `transformer` / `vae_decode` /
    `prompt_encode` ({"s": {phase: seconds}, "calls": {phase: n}}; the decoder counts images).
    Before the first gate a `startup` record collects what ran while loading (Flow-Factory encodes
    its prompt set there)."""

    def __init__(self, path: str | Path, gate_dir: str | Path | None, side: str):
        self.path, self.side = Path(path), side
        self.gate_dir = Path(gate_dir) if gate_dir else None
        self.phase = "other"
        self.rec: dict = self._new("startup")
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        self._starts: dict[tuple[str, int], list[float]] = {}

    @staticmethod
    def _new(epoch) -> dict:
        return {"epoch": epoch, "phases": {}, "transformer": {"s": {}, "calls": {}},
                "vae_decode": {"s": {}, "calls": {}}, "prompt_encode": {"s": {}, "calls": {}}}

    def _add(self, what: str, seconds: float, n: int = 1) -> None:
        slot = self.rec[what]
        slot["s"][self.phase] = slot["s"].get(self.phase, 0.0) + seconds
        slot["calls"][self.phase] = slot["calls"].get(self.phase, 0) + n

    # ---- hooks and wrappers
    def hook_module(self, module, what: str, count_batch: bool = False) -> None:
        """Seconds from a module's forward pre-hook to its forward hook, per phase (CPU: synchronous)."""
        key = (what, id(module))

        def pre(mod, args, kwargs):
            self._starts.setdefault(key, []).append(time.perf_counter())

        def post(mod, args, kwargs, out):
            t = self._starts[key].pop()
            x = args[0] if args else next(iter(kwargs.values()), None)
            n = int(x.shape[0]) if count_batch and hasattr(x, "shape") else 1
            self._add(what, time.perf_counter() - t, n)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    def timed_call(self, fn, what: str):
        """`fn` wrapped to add its seconds to `what` (e.g. prompt_encode) under the current phase."""
        clock = self

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock._add(what, time.perf_counter() - t)

        wrapper.__wrapped__ = fn
        return wrapper

    def phased(self, fn, phase: str):
        """`fn` wrapped as the phase `phase`: its seconds, and what runs inside it counted there."""
        clock = self

        def wrapper(*args, **kwargs):
            prev, clock.phase = clock.phase, phase
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.rec["phases"][phase] = clock.rec["phases"].get(phase, 0.0) + time.perf_counter() - t
                clock.phase = prev

        wrapper.__wrapped__ = fn
        return wrapper

    # ---- epochs
    def end_epoch(self) -> None:
        """Close the open record (the startup's or an epoch's) and write it."""
        if self.rec is None:
            return
        self.rec["epoch_s"] = time.perf_counter() - self.t0
        self.rec["cpu_s"] = time.process_time() - self.c0
        self.rec["load_average"] = os.getloadavg()
        self.rec["side"] = self.side
        with open(self.path, "a") as f:
            f.write(json.dumps(self.rec) + "\n")
        self.rec = None

    def gate(self, k: int, last: bool = False) -> None:
        """Before epoch k (or after the last one, `last`): close what is open, wait for the turn,
        then open epoch k's record."""
        self.end_epoch()
        if self.gate_dir is not None:
            _write(self.gate_dir / f"{self.side}.arrived", str(k))
            go = self.gate_dir / f"{self.side}.go"
            while True:
                try:
                    if int(go.read_text() or -1) >= k:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(GATE_POLL_S)
        if not last:
            self.rec = self._new(k)
            self.phase = "other"
            self.t0, self.c0 = time.perf_counter(), time.process_time()


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def find_module(root, class_name: str):
    """The first submodule of `root` (itself included) whose class is `class_name`."""
    return next(m for m in root.modules() if type(m).__name__ == class_name)


# ---------------------------------------------------------------------------------------------- patches
def define_reward():
    """Patch 2: the JPEG-compressibility reward as a Flow-Factory pointwise reward model (defined
    here, not at import, so that this module imports without Flow-Factory)."""
    import io

    import torch
    from flow_factory.rewards.abc import PointwiseRewardModel, RewardModelOutput

    class JpegCompressibility(PointwiseRewardModel):
        """-8 * JPEG bytes (quality 95) per pixel: paco_ds/rewards/jpeg_compressibility.py's formula."""
        use_tensor_inputs = False  # PIL images

        def __init__(self, config, accelerator):
            super().__init__(config, accelerator)
            self.quality = int(getattr(config, "extra_kwargs", {}).get("quality", 95))

        @torch.no_grad()
        def __call__(self, prompt, image=None, video=None, condition_images=None, condition_videos=None, **kwargs):
            out = []
            for im in image:
                buf = io.BytesIO()
                im.convert("RGB").save(buf, format="JPEG", quality=self.quality)
                out.append(-8.0 * buf.tell() / (im.size[0] * im.size[1]))
            return RewardModelOutput(rewards=torch.tensor(out, dtype=torch.float32), extra_info={})

    globals()["JpegCompressibility"] = JpegCompressibility
    sys.modules["__main__"].JpegCompressibility = JpegCompressibility
    return JpegCompressibility


def apply_patches(clock: EpochClock, max_sequence_length: int) -> list[str]:
    """Patches 1, 3 and 4 on the imported Flow-Factory modules; the names of those applied."""
    from functools import partial

    import torch
    from flow_factory.models.flux.flux1 import Flux1Adapter
    from flow_factory.trainers.abc import BaseTrainer
    from flow_factory.trainers.grpo import GRPOTrainer

    applied = []
    # 1. autocast only where mixed precision asks for it
    init = BaseTrainer.__init__

    def trainer_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        mp = self.accelerator.mixed_precision
        self.autocast = partial(torch.autocast, device_type=self.accelerator.device.type,
                                dtype=torch.float16 if mp == "fp16" else torch.bfloat16,
                                enabled=mp in ("fp16", "bf16"))
        # 4. timing hooks, once the adapter's components are final (LoRA, accelerator.prepare)
        clock.hook_module(find_module(self.adapter.transformer, "FluxTransformer2DModel"), "transformer")
        clock.hook_module(self.adapter.pipeline.vae.decoder, "vae_decode", count_batch=True)

    BaseTrainer.__init__ = trainer_init
    applied.append("autocast enabled only for mixed_precision fp16/bf16 (BaseTrainer.__init__)")

    # 3. T5 prompt length
    if max_sequence_length != 512:
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

        encode = FluxPipeline.encode_prompt

        def encode_prompt(self, *args, **kwargs):
            kwargs.setdefault("max_sequence_length", max_sequence_length)
            return encode(self, *args, **kwargs)

        FluxPipeline.encode_prompt = encode_prompt
        applied.append(f"T5 prompt length {max_sequence_length} (FluxPipeline.encode_prompt's default 512)")

    # 4. timing: phases, prompt encoding, the turn gate
    GRPOTrainer.sample = clock.phased(GRPOTrainer.sample, "sample")
    GRPOTrainer.prepare_feedback = clock.phased(GRPOTrainer.prepare_feedback, "reward")
    GRPOTrainer.optimize = clock.phased(GRPOTrainer.optimize, "train")
    Flux1Adapter.encode_prompt = clock.timed_call(Flux1Adapter.encode_prompt, "prompt_encode")
    should = BaseTrainer.should_continue_training

    def should_continue_training(self):
        go_on = should(self)
        clock.gate(self.epoch, last=not go_on)
        return go_on

    BaseTrainer.should_continue_training = should_continue_training
    applied.append("timing: transformer and VAE-decoder hooks, GRPOTrainer.sample/prepare_feedback/optimize, "
                   "Flux1Adapter.encode_prompt, the turn gate in should_continue_training")
    return applied


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clock-file", required=True, help="JSON lines: one record per epoch")
    p.add_argument("--gate-dir", default=None, help="turn files (none: run the epochs back to back)")
    p.add_argument("--max-sequence-length", type=int, default=512, help="T5 tokens (512: Flow-Factory's own)")
    p.add_argument("config", help="Flow-Factory YAML recipe")
    args = p.parse_args(argv)
    clock = EpochClock(args.clock_file, args.gate_dir, "flow_factory")
    define_reward()
    applied = apply_patches(clock, args.max_sequence_length)
    print("flow_factory_shim: " + "; ".join(applied) + "; reward __main__.JpegCompressibility", flush=True)
    from flow_factory import train

    sys.argv = [train.__file__, args.config]
    train.main()


if __name__ == "__main__":
    main()
