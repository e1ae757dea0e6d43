"""JPEG compressibility: minus the bits per pixel of the image saved as JPEG.

Cheap, deterministic and learnable (smoother images compress better), which makes it the
learning signal of the CPU demo. Bits per pixel keep the scale independent of the resolution.
"""
from __future__ import annotations

import io

from paco_ds.rewards.base import JpegQuality, Reward, RewardResult


class JpegCompressibility(Reward):
    name = "jpeg_compressibility"
    video = "frames"  # a video: the mean over its frames (each frame compressed alone)

    def __init__(self, quality: JpegQuality = 95):
        self.quality = quality

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        out = []
        for im in images:
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="JPEG", quality=self.quality)
            out.append(-8.0 * buf.tell() / (im.size[0] * im.size[1]))
        return RewardResult.ok(out)
