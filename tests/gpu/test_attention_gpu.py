"""`model.attention_backend` on a GPU: the tiny FLUX transformer in bf16 gives the same velocity
through PyTorch SDPA (`native`), PyTorch's flash kernel (`_native_flash`) and flash-attn (`flash`,
where the `flash` extra is installed), within bf16's rounding (2e-2 of the output's scale)."""
import pytest
import torch

from paco_ds.recipe.schema import ModelConfig
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
        pytest.skip(f"optional package not installed here: {err}")  # flash-attn: the check says so in one line
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


def test_the_judge_with_flash_attention_2_equals_sdpa_in_bf16():
    """The judge's hf engine with `reward_servers.attn_implementation: flash_attention_2`: the tiny
    Qwen2.5-VL's next-token log-probs (what a P(Yes) reward reads) equal SDPA's within bf16 rounding."""
    from paco_ds.errors import ConfigError
    from paco_ds.models.attention import check_attn_implementation
    from paco_ds.serving.hf_engine import Engine

    try:
        check_attn_implementation("flash_attention_2", "reward_servers.attn_implementation", torch.device("cuda"))
    except ConfigError as err:
        pytest.skip(f"optional package not installed here: {err}")
    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 41]], device="cuda")
    out = {}
    for name in ("sdpa", "flash_attention_2"):
        engine = Engine.load(None, tiny=True, device="cuda", dtype="bf16", attn_implementation=name)
        with torch.no_grad():
            out[name] = engine.model(input_ids=ids).logits.float().log_softmax(-1)
    err = (out["flash_attention_2"] - out["sdpa"]).abs().max().item()
    assert err < 5e-2, f"flash_attention_2 vs sdpa: largest log-prob difference {err:.3e}"
