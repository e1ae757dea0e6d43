"""Qwen-Image-Edit-2509 and -2511 (diffusers `QwenImageEditPlusPipeline`) as a `Policy`: an edit
conditioned on one to three input images, each entering twice, as Qwen-Image-Edit's one does
(qwen_image_edit.py, `QwenEditPolicy`, which this class extends):

- the VL prompt encoder sees every input, numbered in the user turn as the pipeline writes it:
  "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: ...", then the instruction.
  Each input is resized once from its original to about 384x384 pixels at its own aspect ratio
  (the pipeline's CONDITION_IMAGE_SIZE, sides multiples of 32), then to the nearest multiples of
  28, which is where the pipeline's processor snaps it (one resampling here, two there);
- the transformer reads [noisy target tokens | input 1 tokens | input 2 tokens | ...]: each input's
  VAE latents, packed, concatenated along the sequence in order, and `img_shapes` lists the target
  then every input, so the RoPE gives each its own frame index. The pipeline encodes each input at
  about 1024x1024 pixels (its VAE_IMAGE_SIZE) for a 1024x1024-area output; here each input is
  encoded at the target's area at its own aspect ratio (the target itself when the aspects agree),
  the same rule at the recipe's resolution, as QwenEditPolicy does for its one reference;
- the output takes the last input's aspect ratio, as the pipeline's (paco_ds/sampling/rollouts.py
  sizes an edit by its last input image).

The two checkpoints differ only in the transformer's config: 2511 sets `zero_cond_t` (the input
images' tokens are modulated with t = 0, the target's with the step's t), which diffusers'
`QwenImageTransformer2DModel` reads from `img_shapes` by itself; no parameter differs. The tiny model
is built with `zero_cond_t`, so the CPU tests run 2511's path.

A sample's inputs arrive as a tuple of uint8 [3, H, W] tensors (one tensor: a single-input edit).
Every sample of a batch needs the same number of inputs at the same condition sizes (a group's k
samples share their inputs; mixed data trains with sample.batch_size 1, as for QwenEditPolicy).
Encoding happens once per sample at rollout; the embeddings and latents travel in the Trajectory to
every training forward. Guidance: as Qwen-Image-Edit (one forward per step, no negative prompt).
"""
from __future__ import annotations

import math

import torch

from paco_ds.models.base import Condition, TextEmbeds
from paco_ds.models.full_size import FullSize, empty
from paco_ds.models.qwen_image import QWEN_IMAGE_TRANSFORMER
from paco_ds.models.qwen_image_edit import PROMPT_TEMPLATE as EDIT_TEMPLATE
from paco_ds.models.qwen_image_edit import QwenEditPolicy, _resize, full_size_components

# The family's checkpoints; a recipe picks one with model.path (the default: 2509).
HUB_IDS = {"2509": "Qwen/Qwen-Image-Edit-2509", "2511": "Qwen/Qwen-Image-Edit-2511"}
DEFAULT_PATH = HUB_IDS["2509"]
MAX_INPUT_IMAGES = 3  # what both checkpoints are published for ("1-3 input images")

# diffusers' QwenImageEditPlusPipeline.prompt_template_encode: Qwen-Image-Edit's system turn, and the
# user turn starting with the numbered images (img_prompt_template) instead of one image.
PROMPT_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>{}", "{}")
IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
VL_AREA = 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE: the VL encoder's pixels per input


def full_size_transformer():
    """Qwen-Image's transformer with 2511's `zero_cond_t` (the same parameters as 2509's)."""
    from diffusers import QwenImageTransformer2DModel

    return empty(lambda: QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER, zero_cond_t=True))


def inputs_of(entry) -> tuple[torch.Tensor, ...]:
    """A sample's input images: the Condition's entry, a tensor (one input) or a tuple of them."""
    return entry if isinstance(entry, tuple) else (entry,)


class QwenEditPlusPolicy(QwenEditPolicy):
    display_name = "Qwen-Image-Edit-2509/2511"
    default_path = DEFAULT_PATH
    max_input_images = MAX_INPUT_IMAGES
    # The VAE, VL encoder and processor are Qwen-Image-Edit's (2509/2511 ship the same configs).
    full_size = FullSize(full_size_transformer, full_size_components)
    prompt_template = PROMPT_TEMPLATE
    template_prefix_end = "{}"  # the dropped prefix is the system turn; the numbered images stay

    tiny_options = {"zero_cond_t": True}  # 2511's condition tokens modulated at t = 0

    # ------------------------------------------------------------------ sizes
    def vl_input_size(self, ref_height: int, ref_width: int) -> tuple[int, int]:
        """Where the VL encoder sees an input: about VL_AREA pixels at its aspect ratio, sides
        multiples of 32 (diffusers' calculate_dimensions), then the nearest multiples of 28."""
        aspect = ref_width / ref_height
        width = round(math.sqrt(VL_AREA * aspect) / 32) * 32
        height = round(math.sqrt(VL_AREA * aspect) / aspect / 32) * 32
        return self.vl_size(max(32, height), max(32, width))

    # ------------------------------------------------------------------ condition and prompts
    @torch.no_grad()
    def encode_condition(self, images: list, height: int, width: int) -> Condition:
        """Each input's VAE tokens at its condition size, concatenated along the sequence in input
        order; `size` holds those sizes. The originals stay in the Condition for the rewards."""
        per_sample = [inputs_of(e) for e in images]
        layouts = {tuple(self.condition_size(int(im.shape[1]), int(im.shape[2]), height, width) for im in ins)
                   for ins in per_sample}
        if len(layouts) > 1:
            raise ValueError(f"the samples of one batch have different input images' sizes {sorted(layouts)} for a "
                             f"{height}x{width} target; use sample.batch_size 1 for such data")
        sizes = layouts.pop()
        if len(sizes) > self.max_input_images:
            raise ValueError(f"{self.display_name} reads at most {self.max_input_images} input images, got {len(sizes)}")
        tokens = [self.vae_tokens([ins[k] for ins in per_sample], *size) for k, size in enumerate(sizes)]
        return Condition(images=list(images), latents=torch.cat(tokens, dim=1), size=sizes)

    def condition_sizes(self, condition: Condition) -> list[tuple[int, int]]:
        return list(condition.size)

    def vl_text(self, prompt: str, n_images: int) -> str:
        """The VL encoder's text for an instruction on n input images (the pipeline's)."""
        return self.prompt_template.format("".join(IMAGE_PROMPT.format(i + 1) for i in range(n_images)) + prompt)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition: Condition | None = None) -> TextEmbeds:
        """One VL forward for the batch: each instruction after its numbered input images."""
        if condition is None or len(condition) != len(prompts):
            raise ValueError(f"{self.display_name} encodes each prompt together with its input images: "
                             "pass the batch's Condition")
        per_sample = [inputs_of(e) for e in condition.images]
        images = [_resize(im, *self.vl_input_size(int(im.shape[1]), int(im.shape[2])))
                  for ins in per_sample for im in ins]
        return self.vl_embeds([self.vl_text(p, len(ins)) for p, ins in zip(prompts, per_sample)], images)
