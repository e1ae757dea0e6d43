"""The reduced full-width FLUX (1 double + 2 single blocks at FLUX.1-dev's width) with PaCo-RL's
LoRA r64, bf16, through the sequence the benchmarks run: sample (no grad, batch 4), a training step
(one forward with grad, the SDE log-prob and PPO loss kernels, backward), sample again. Each stage is
synchronised and printed, so with CUDA_LAUNCH_BLOCKING=1 a fault names its stage and its op.

Run by tests/gpu/test_flux_lora_gpu.py in a process of its own (a CUDA fault poisons the process).
On an H100 (torch 2.11+cu130) benchmarks/compile_blocks.py and grpo_vs_reference.py hit an illegal
memory access in this sequence at 512 px, and a bf16 GRPO run skipped every optimizer step on a
non-finite gradient norm: this probe checks both at 512 px and at the tiny run's 64 px.

    python tests/gpu/flux_lora_probe.py [--device cuda] [--backend triton] [--sizes 1024x512,16x64]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from paco_ds.recipe.schema import LoraConfig  # noqa: E402
from paco_ds.models.flux import FluxPolicy  # noqa: E402
from paco_ds.models.attention import set_attention_backend  # noqa: E402
from paco_ds.models.lora import add_lora  # noqa: E402
from paco_ds.models.tiny.flux import REDUCED_FLUX_TRANSFORMER  # noqa: E402

SIGMA, SIGMA_NEXT, NOISE_LEVEL = 0.9441, 0.8825, 0.7  # step 1 of FLUX's 512 px, 10-step schedule


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton", help="kernels backend for the SDE log-prob and PPO loss")
    p.add_argument("--sizes", default="1024x512,16x64", help="image x text tokens, comma-separated")
    p.add_argument("--transformer", default=None, help="JSON of a FluxTransformer2DModel config (default: reduced)")
    p.add_argument("--sdpa", default="default", choices=("default", "math", "flash", "efficient", "cudnn"),
                   help="restrict torch's scaled_dot_product_attention to one backend (to isolate a fault)")
    p.add_argument("--no-lora", action="store_true", help="train the whole transformer instead of a LoRA")
    args = p.parse_args(argv)
    import json

    from diffusers import FluxTransformer2DModel

    dev = torch.device(args.device)
    dtype = torch.bfloat16
    conf = json.loads(args.transformer) if args.transformer else REDUCED_FLUX_TRANSFORMER
    torch.manual_seed(0)
    with torch.device(dev):  # initialised where it runs: a 0.7B model's init on the CPU takes longer than the probe
        model = FluxTransformer2DModel(**conf)
    if args.no_lora:
        model.requires_grad_(True)
    else:
        add_lora(model, LoraConfig(rank=64, alpha=128, target_modules=list(FluxPolicy.lora_targets)))
    model.to(dev, dtype)
    set_attention_backend(model, None)  # the trainer's default: PyTorch's SDPA without cuDNN's kernel
    if args.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        only = sdpa_kernel(names[args.sdpa])  # held for the whole probe (a dropped context manager restores)
        only.__enter__()
    print(f"probe: backend {args.backend}, sdpa {args.sdpa}, {'whole model' if args.no_lora else 'LoRA r64'}, "
          f"torch {torch.__version__}", flush=True)
    lora = [q for q in model.parameters() if q.requires_grad]
    channels, text_dim, pooled = conf["in_channels"], conf["joint_attention_dim"], conf["pooled_projection_dim"]

    def inputs(batch, img, txt, seed):
        g = torch.Generator().manual_seed(seed)
        on = dict(device=dev, dtype=dtype)
        return dict(hidden_states=torch.randn(batch, img, channels, generator=g).to(**on),
                    encoder_hidden_states=torch.randn(batch, txt, text_dim, generator=g).to(**on),
                    pooled_projections=torch.randn(batch, pooled, generator=g).to(**on),
                    timestep=torch.full((batch,), SIGMA, **on), guidance=torch.full((batch,), 3.5, **on),
                    img_ids=torch.zeros(img, 3, **on), txt_ids=torch.zeros(txt, 3, **on), return_dict=False)

    def stage(name, fn):
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"ok {name}", flush=True)
        return out

    def sample(img, txt, seed):
        model.eval()
        with torch.no_grad():
            v = model(**inputs(4, img, txt, seed))[0]
        assert torch.isfinite(v).all(), "non-finite velocity when sampling"

    def train(img, txt, seed):
        model.train()
        model.zero_grad(set_to_none=True)
        x = inputs(1, img, txt, seed)
        v = model(**x)[0]
        lat = x["hidden_states"]
        sig = torch.full((1,), SIGMA, device=dev)
        sig_next = torch.full((1,), SIGMA_NEXT, device=dev)
        with torch.no_grad():
            noise = torch.randn(lat.shape, generator=torch.Generator().manual_seed(seed)).to(dev, dtype)
            old = kernels.sde_step(lat, v.detach(), sig, sig_next, NOISE_LEVEL, sig, noise=noise,
                                   backend=args.backend, return_mean=False)
        new = kernels.sde_step(lat, v, sig, sig_next, NOISE_LEVEL, sig, prev_sample=old.prev_sample,
                               backend=args.backend, return_mean=False)
        loss, _ = kernels.ppo_clip_loss(new.log_prob, old.log_prob, torch.ones(1, device=dev), 1e-4, 5.0,
                                        backend=args.backend)
        loss.backward()
        grads = [q.grad for q in lora if q.grad is not None]
        assert grads, "no LoRA parameter received a gradient"
        bad = sum(int(not torch.isfinite(gr).all()) for gr in grads)
        assert bad == 0, f"{bad} of {len(grads)} LoRA gradients hold non-finite values"
        norm = torch.sqrt(sum(gr.float().pow(2).sum() for gr in grads))
        assert norm > 0, "every LoRA gradient is zero"
        print(f"   loss {float(loss.detach()):.3e}, LoRA grad norm {float(norm):.3e}", flush=True)

    for size in args.sizes.split(","):
        img, txt = (int(n) for n in size.split("x"))
        stage(f"{size} sample", lambda: sample(img, txt, 0))
        stage(f"{size} train step", lambda: train(img, txt, 0))
        stage(f"{size} sample after training", lambda: sample(img, txt, 1))
        stage(f"{size} train step again", lambda: train(img, txt, 1))
    print("probe passed")


if __name__ == "__main__":
    main()
