"""Prompt datasets (T2IS, text, image editing) and the k-repeat sampler."""
from paco_ds.data.edit import read_reference, read_references
from paco_ds.data.prompts_io import PromptItem, load_edit, load_prompts, load_t2is_jsonl, load_text_prompts
from paco_ds.data.sampler import KRepeatSampler, RankBatch

__all__ = ["PromptItem", "load_prompts", "load_t2is_jsonl", "load_text_prompts", "load_edit", "read_reference",
           "read_references",
           "KRepeatSampler", "RankBatch"]
