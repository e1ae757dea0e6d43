"""Tiny random-weight Wan parts, built offline from a seed (no hub access).

The real classes at toy sizes: `WanTransformer3DModel` (patch (1, 2, 2), Wan's 3-axis rope, self- and
cross-attention and the feed-forward of every block), `AutoencoderKLWan` with the real 4x temporal and
8x spatial downsampling (Wan2.1's; Wan2.2-TI2V-5B's residual autoencoder with its 2x2 patchify and 16x
spatial downsampling for `ti2v`), and a one-layer `UMT5EncoderModel` (the real one is UMT5-XXL's
encoder) with the package's offline T5 tokenizer. Wan2.2-A14B's second expert (`transformer_2`, the
low-noise one) is a second transformer of the same shape from its own seed. The scheduler configs
are the published checkpoints' own (diffusers' scripts/convert_wan_to_diffusers.py writes them:
UniPC with flow sigmas and `flow_shift` 3, 5 for TI2V-5B), so the tiny policies' schedules are the
real ones.
"""
from __future__ import annotations

from paco_ds.models.tiny import seeded, t5_tokenizer
from paco_ds.recipe.schema import TinyModelConfig

# scheduler/scheduler_config.json of Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers and Wan2.2-T2V-A14B-Diffusers
WAN_SCHEDULER_CONFIG = {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000,
                        "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
# Wan2.2-TI2V-5B-Diffusers': the same scheduler with flow_shift 5
WAN_TI2V_SCHEDULER_CONFIG = WAN_SCHEDULER_CONFIG | {"flow_shift": 5.0}
# model_index.json of Wan2.2-T2V-A14B-Diffusers: the high-noise expert below t = 875, the low-noise one after
WAN22_BOUNDARY_RATIO = 0.875


def latent_statistics(z: int) -> tuple[list[float], list[float]]:
    """Per-channel latent means and stds that are not the identity, so a decode that forgets to
    de-normalise differs from the pipeline's."""
    return [0.1 * (i % 5) - 0.2 for i in range(z)], [0.8 + 0.1 * (i % 4) for i in range(z)]


def tiny_umt5(spec: TinyModelConfig, tok):
    from transformers import UMT5Config, UMT5EncoderModel

    d = spec.text_dim
    model = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=d, d_kv=d // 2, d_ff=2 * d, num_layers=1,
                                        num_heads=2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                        decoder_start_token_id=0, dropout_rate=0.0))
    model.encoder.embed_tokens = model.shared  # tied, as UMT5-XXL's checkpoint holds them
    return model


def tiny_wan_transformer(spec: TinyModelConfig, in_channels: int):
    from diffusers import WanTransformer3DModel

    head = spec.attention_head_dim
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_attention_heads, attention_head_dim=head,
        in_channels=in_channels, out_channels=in_channels, text_dim=spec.text_dim, freq_dim=32, ffn_dim=4 * head,
        num_layers=spec.num_layers + spec.num_single_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64)


def tiny_wan_vae(spec: TinyModelConfig, ti2v: bool = False):
    """Wan2.1's causal 3D autoencoder (4x in time, 8x in space) at toy width; with `ti2v` Wan2.2's
    residual one, which patchifies 2x2 first (16x in space), with twice the latent channels."""
    from diffusers import AutoencoderKLWan

    if ti2v:
        z = 2 * spec.latent_channels
        mean, std = latent_statistics(z)
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                                out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                                latents_mean=mean, latents_std=std)
    z = spec.latent_channels
    mean, std = latent_statistics(z)
    return AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)


def tiny_wan_components(spec: TinyModelConfig | None = None, seed: int = 0, experts: int = 1,
                        ti2v: bool = False) -> dict:
    """transformer (and transformer_2 with two experts), vae, text_encoder (UMT5), tokenizer,
    scheduler_config, and the pipeline's flags (boundary_ratio, expand_timesteps)."""
    spec = spec or TinyModelConfig()
    tok = t5_tokenizer()
    with seeded(seed):
        vae = tiny_wan_vae(spec, ti2v)
        z = vae.config.z_dim
        transformer = tiny_wan_transformer(spec, z)
        text_encoder = tiny_umt5(spec, tok)
        second = tiny_wan_transformer(spec, z) if experts == 2 else None
    out = {"transformer": transformer, "vae": vae.eval(), "text_encoder": text_encoder.eval(), "tokenizer": tok,
           "scheduler_config": dict(WAN_TI2V_SCHEDULER_CONFIG if ti2v else WAN_SCHEDULER_CONFIG),
           "boundary_ratio": WAN22_BOUNDARY_RATIO if experts == 2 else None, "expand_timesteps": ti2v}
    if second is not None:
        out["transformer_2"] = second
    return out


def tiny_wan_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None,
                      scheduler=None, **options):
    """A diffusers `WanPipeline` assembled from the tiny parts (or the given ones); `scheduler`: the
    pipeline's scheduler (default: the published UniPC config's)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    parts = dict(parts or tiny_wan_components(spec, seed, **options))
    config = parts.pop("scheduler_config")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    scheduler = scheduler or UniPCMultistepScheduler(**config)
    return WanPipeline(scheduler=scheduler, **parts)
