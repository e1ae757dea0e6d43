"""`model.attention_backend` on a GPU: the tiny FLUX transformer in bf16 gives the same velocity
through PyTorch SDPA (`native`), PyTorch's flash kernel (`_native_flash`) and flash-attn (`flash`,
where the `flash` extra is installed), within bf16's rounding (2e-2 of the output's scale)."""
import pytest
import torch

from paco_ds.config import ModelConfig
from paco_ds.models.attention import check_attention_backend, set_attention_backend
from paco_ds.models.flux import FluxPolicy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["_native_flash", "flash"])
def test_a_flash_backend_equals_sdpa_in_bf16(backend):
    from paco_ds.errors import ConfigError

    device = torch.device("cuda")
    try:
        check_attention_backend(backend, FluxPolicy, device)
    except ConfigError as err:
        pytest.skip(str(err))  # flash-attn not on this machine: the check says so in one line
    cfg = ModelConfig(tiny=True, dtype="bf16", max_sequence_length=64)
    policy = FluxPolicy.load(cfg, device)
    emb = policy.encode_prompts(["a red fox on a bench", "two cats"])
    x = policy.initial_latents(2, 256, 256, [torch.Generator().manual_seed(i) for i in range(2)])
    with torch.no_grad():
        ref = policy.velocity(policy.transformer, x, 0.7, emb, 256, 256, 3.5).float()
        set_attention_backend(policy.transformer, backend)
        out = policy.velocity(policy.transformer, x, 0.7, emb, 256, 256, 3.5).float()
    scale = ref.abs().mean()
    assert ((out - ref).abs().mean() / scale) < 2e-2, f"{backend}: mean error {(out - ref).abs().mean() / scale:.3e}"
