"""The reward model under training: Qwen2.5-VL + a peft LoRA, and the fused LM-head loss under ZeRO-3.

Loading: under ZeRO-3 the model is read with `from_pretrained` while an `HfDeepSpeedConfig` is
alive (`zero3_loading`), so every rank materialises only its partition of the 7B weights
(transformers runs zero.Init). The tiny CPU model takes the same path: it is written to
`<run>/tiny_base` first.

LoRA: every linear layer of the language model (LLaMA-Factory's `lora_target: all`, which leaves
out the LM head), plus the vision tower's and the projector's when they are not frozen. Everything
else is frozen.

The loss (why a wrapper module): the fused linear + CE (kernels/weighted_ce.py) needs the whole
LM-head weight, which ZeRO-3 keeps partitioned and gathers only around the forward of the module
that owns it. `LMHeadLoss` is a module that holds the same Parameter as `lm_head`, so ZeRO-3's
hooks gather the weight for exactly its forward, where the fused op runs; `lm_head` itself is never
called. The op computes dL/dhidden inside that forward; the module returns it detached and
`RewardSFTModel` attaches it to the graph outside the module (`_AttachGrad`), so the output of
`LMHeadLoss` needs no backward and ZeRO-3 does not gather the 152k x 3584 weight a second time.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from paco_ds.errors import ConfigError
from paco_ds.sft.config import SFTConfig, SFTLoraConfig
from paco_ds.sft.loss import IGNORE_INDEX, Mode, first_token_weights, shift_labels


def base_path(cfg: SFTConfig) -> Path | str:
    """Where the base model is read from: model.path, or the tiny model's directory in the run."""
    if cfg.model.tiny:
        return cfg.run_dir / "tiny_base"
    p = Path(cfg.model.path).expanduser()
    local = p if p.is_absolute() else cfg.resolve_path(cfg.model.path)
    return local if local.exists() else cfg.model.path  # else a hub id


TINY_HEAD_SCALE = 10.0


def write_tiny_base(path: Path, seed: int) -> None:
    """The tiny random-weight Qwen2.5-VL and its processor (once; a resumed run finds it).

    Its LM head is scaled up: the random head (std 0.02 over 32 RMS-normalised dims) spreads the
    logits over about 0.1 nat, so with the head frozen, as LoRA SFT keeps it, no answer could ever
    become likely. Scaled, the logits span a few nats, as a trained model's do."""
    from transformers.utils import logging as hf_logging

    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

    if (path / "config.json").is_file():
        return
    model, processor = tiny_qwen2_5_vl(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(TINY_HEAD_SCALE)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for one tiny shard is noise before a possible data error
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    processor.save_pretrained(path)


def load_processor(path, cfg: SFTConfig):
    """The checkpoint's processor with the training image limits, so the saved copy serves alike."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(path), revision=cfg.model.revision)
    except OSError as err:
        raise ConfigError(f"config key 'model.path': cannot load a processor from {path} ({err})") from None
    proc.image_processor.size = {"shortest_edge": cfg.model.image_min_pixels,
                                 "longest_edge": cfg.model.image_max_pixels}
    return proc


def zero3_loading(ds_config: dict):
    """Make `from_pretrained` load partitioned (zero.Init) for this ZeRO-3 engine config. The caller
    keeps the returned object alive as long as the model: transformers holds only a weak reference."""
    import transformers  # noqa: F401  (imported first: importing it inside zero.Init fails with a signature mismatch)
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def load_model(path, cfg: SFTConfig, dtype: torch.dtype):
    """Qwen2_5_VLForConditionalGeneration in `dtype` (partitioned while a zero3_loading object lives)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from paco_ds.models.attention import sdpa_without_cudnn

    kwargs = {"dtype": dtype, "revision": cfg.model.revision}
    if cfg.model.attn_implementation in (None, "sdpa"):  # transformers' default: PyTorch's SDPA
        sdpa_without_cudnn()  # its backward fails in cuDNN's kernel on Hopper (paco_ds/models/attention.py)
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), **kwargs)
    except OSError as err:
        raise ConfigError(f"config key 'model.path': cannot load Qwen2.5-VL from {path} ({err})") from None
    model.config.use_cache = False
    return model


def lora_targets(model: nn.Module, cfg: SFTConfig) -> str | list[str]:
    """peft target_modules: a regex over full module names for "all", else the configured suffixes."""
    if cfg.lora.target_modules != "all":
        return list(cfg.lora.target_modules)
    scopes = [r"model\.language_model\."]
    if not cfg.model.freeze_vision_tower:
        scopes.append(r"model\.visual\.blocks\.")
    if not cfg.model.freeze_multi_modal_projector:
        scopes.append(r"model\.visual\.merger\.")
    names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, nn.Linear) and re.match("|".join(scopes), name)})
    return rf"^(?:{'|'.join(scopes)}).*\.(?:{'|'.join(map(re.escape, names))})$"


def add_lora(model: nn.Module, cfg: SFTConfig):
    """Freeze the base and wrap it in a PeftModel with a trainable LoRA adapter (or load cfg.lora.path)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model.requires_grad_(False)
    if cfg.lora.path:
        path = cfg.resolve_path(cfg.lora.path)
        if not (path / "adapter_config.json").is_file():
            raise ConfigError(f"config key 'lora.path': no peft adapter (adapter_config.json) in {path}")
        return PeftModel.from_pretrained(model, str(path), is_trainable=True)
    lora: SFTLoraConfig = cfg.lora
    conf = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora_targets(model, cfg), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, conf)
    except ValueError as err:
        raise ConfigError(f"config key 'lora.target_modules': {err}") from None


class LMHeadLoss(nn.Module):
    """Owns the LM-head weight (the same Parameter as lm_head) so ZeRO-3 gathers it for this forward."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor, shifted: torch.Tensor, weights: torch.Tensor, normalizer: torch.Tensor,
                want_grad: bool, chunk_size: int | None, backend: str):
        """(loss, per-token CE, argmax, dL/dhidden or None), all detached; `hidden` comes in detached
        (so that ZeRO-3 hooks no backward to it)."""
        import kernels

        h = hidden.requires_grad_(want_grad)
        out = kernels.weighted_linear_ce(h, self.weight, shifted, weights, normalizer=normalizer,
                                         chunk_size=chunk_size, backend=backend)
        grad = torch.autograd.grad(out.loss, h)[0] if want_grad else None
        return out.loss.detach(), out.token_loss, out.predictions, grad


class _AttachGrad(torch.autograd.Function):
    """loss as a function of hidden whose gradient was computed in forward."""

    @staticmethod
    def forward(ctx, hidden, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None


class SFTOutput(NamedTuple):
    loss: torch.Tensor
    shifted: torch.Tensor  # [B, T] labels aligned with the predicting positions
    token_loss: torch.Tensor  # [B, T]
    predictions: torch.Tensor  # [B, T]


class RewardSFTModel(nn.Module):
    """What the DeepSpeed engine wraps: the PeftModel and the fused loss on its last hidden states."""

    def __init__(self, peft_model: nn.Module, alpha: float | None, mode: Mode, chunk_size: int | None = None,
                 backend: str = "auto"):
        super().__init__()
        self.model = peft_model
        self.head = LMHeadLoss(peft_model.get_base_model().lm_head.weight)
        if self.head.weight.requires_grad:
            raise ValueError("the fused loss expects a frozen LM head (LoRA never targets it)")
        self.alpha, self.mode, self.chunk_size, self.backend = alpha, mode, chunk_size, backend

    def forward(self, input_ids, attention_mask, labels, pixel_values, image_grid_thw, mm_token_type_ids) -> SFTOutput:
        decoder = self.model.get_base_model().model  # Qwen2_5_VLModel: vision tower + language model
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                         image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids,
                         use_cache=False).last_hidden_state
        shifted = shift_labels(labels)
        weights = first_token_weights(shifted, self.alpha, self.mode)
        normalizer = (shifted != IGNORE_INDEX).sum().clamp_min(1)
        want_grad = torch.is_grad_enabled() and hidden.requires_grad
        loss, token_loss, pred, grad = self.head(hidden.detach(), shifted, weights, normalizer, want_grad,
                                                 self.chunk_size, self.backend)
        if grad is not None:
            loss = _AttachGrad.apply(hidden, loss, grad)
        return SFTOutput(loss, shifted, token_loss, pred)


def enable_gradient_checkpointing(peft_model: nn.Module) -> None:
    """Recompute the decoder layers in backward (non-reentrant: the frozen inputs need no grad)."""
    base = peft_model.get_base_model()
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # older transformers (the GPU image's 5.17)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
