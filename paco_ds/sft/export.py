"""From a trained adapter to what the reward server loads, and the reward it computes.

`save_adapter`: the LoRA in peft's format (adapter_config.json + adapter_model.safetensors) with
the processor beside it; the trainer writes one into every checkpoint and <run>/adapter at the end.

`merge_adapter`: the base model with the LoRA merged into its weights, saved with the processor
(training image limits included) as a plain Qwen2.5-VL checkpoint directory, which
`Qwen2_5_VLForConditionalGeneration.from_pretrained`, the hf reward engine and `vllm serve` load
as they would the base model. Merging runs in one process on the CPU: no DeepSpeed.

`p_yes`: the reward of a pair, P(Yes) / (P(Yes) + P(No)) at the first answer token of the prompt the
reward server builds from an OpenAI chat request (the model's chat template, images first).
"""
from __future__ import annotations

from pathlib import Path

import torch

from paco_ds.runtime.dtypes import resolve_dtype
from paco_ds.errors import UserError
from paco_ds.sft.config import SFTConfig
from paco_ds.sft.model import base_path, load_model, load_processor, write_tiny_base

MERGED_NOTE = "paco_reward_export.txt"


def save_adapter(peft_model, state_dict: dict[str, torch.Tensor], out_dir: Path, processor=None) -> Path:
    """Write the adapter of `peft_model` with the given (gathered) LoRA weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir), state_dict=state_dict, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(str(out_dir))
    return out_dir


def merge_adapter(cfg: SFTConfig, adapter_dir: Path, out_dir: Path, device: str = "cpu"):
    """Base + LoRA merged, saved to out_dir with the processor; returns the merged model."""
    from peft import PeftModel

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(f"no peft adapter (adapter_config.json) in {adapter_dir}")
    from paco_ds.models.attention import check_attn_implementation

    check_attn_implementation(cfg.model.attn_implementation, "model.attn_implementation", torch.device(device))
    base = base_path(cfg)
    if cfg.model.tiny:
        write_tiny_base(base, cfg.seed)
    dtype = resolve_dtype(cfg.model.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(base, cfg, dtype).to(device)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()
    merged.config.use_cache = True  # training turned the KV cache off; generation wants it
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out_dir), safe_serialization=True)
    load_processor(base, cfg).save_pretrained(str(out_dir))
    (out_dir / MERGED_NOTE).write_text(f"base: {base}\nadapter: {adapter_dir.resolve()}\n")
    return merged


def resolve_adapter(cfg: SFTConfig, checkpoint: str | None, adapter: str | None) -> Path:
    """--adapter DIR, else the adapter inside --checkpoint (default: the latest of the recipe's run)."""
    from paco_ds.runtime.checkpoint import LATEST

    if adapter:
        return Path(adapter)
    if checkpoint and checkpoint != LATEST:
        return Path(checkpoint) / "adapter"
    root = cfg.run_dir / "checkpoints"
    pointer = root / LATEST
    if not pointer.is_file():
        raise UserError(f"export: no checkpoint in {root} (train first, or pass --checkpoint DIR or --adapter DIR)")
    return root / pointer.read_text().strip() / "adapter"


@torch.no_grad()
def p_yes(model, processor, images, question: str) -> float:
    """P(Yes) / (P(Yes) + P(No)) of the first answer token for `images` followed by `question`."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=list(images), return_tensors="pt").to(model.device)
    logp = model(**inputs).logits[0, -1].float().log_softmax(-1)
    tok = processor.tokenizer
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    return torch.sigmoid(logp[yes] - logp[no]).item()
