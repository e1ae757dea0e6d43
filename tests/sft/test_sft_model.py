"""The model wrapper without DeepSpeed: the fused loss equals the reference's loss on the model's own
logits (values and LoRA gradients), with and without gradient checkpointing; lora.path resumes an adapter."""
import pytest
import torch

from conftest import REPO
from paco_ds.sft.config import load_sft_config
from paco_ds.sft.data import Collator, Encoder, SFTDataset, load_records, write_synthetic_dataset
from paco_ds.sft.loss import naive_weighted_ce
from paco_ds.sft.model import (RewardSFTModel, add_lora, base_path, enable_gradient_checkpointing, load_model,
                               load_processor, write_tiny_base)

pytestmark = pytest.mark.fast

TINY = REPO / "configs" / "tiny" / "reward_sft.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    cfg = load_sft_config(TINY, [f"output_dir={out}"])
    write_tiny_base(base_path(cfg), cfg.seed)
    processor = load_processor(base_path(cfg), cfg)
    train, _ = write_synthetic_dataset(out / "data", 4, 1, 64)
    enc = Encoder(processor, cfg.data.cutoff_len, cfg.model.image_min_pixels, cfg.model.image_max_pixels)
    ds = SFTDataset(load_records([train], "k"), enc)
    batch = Collator(enc.pad_id, enc.image_pad)([ds[i] for i in range(3)]).model_inputs(torch.device("cpu"))
    return cfg, batch


def lora_model(cfg, seed=0):
    torch.manual_seed(seed)
    peft = add_lora(load_model(base_path(cfg), cfg, torch.float32), cfg)
    with torch.no_grad():  # non-zero B, so the adapter changes the outputs
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft


def grads(peft):
    return {n: p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_loss_equals_the_reference_on_model_logits(setup, checkpointing):
    cfg, batch = setup
    peft = lora_model(cfg)
    if checkpointing:
        enable_gradient_checkpointing(peft)
    model = RewardSFTModel(peft, 0.1, "exact", chunk_size=7).train()
    calls = []
    mlp = peft.get_base_model().model.language_model.layers[0].mlp
    hook = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    out = model(**batch)
    out.loss.backward()
    hook.remove()
    assert len(calls) == (2 if checkpointing else 1)  # a checkpointed layer runs its modules again in backward
    fused = grads(peft)
    peft.zero_grad(set_to_none=True)
    logits = peft(**{k: v for k, v in batch.items() if k != "labels"}).logits
    ref = naive_weighted_ce(logits, batch["labels"], 0.1)
    ref.backward()
    naive = grads(peft)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert set(fused) == set(naive) and len(fused) == 28  # A and B of 14 linear layers
    for n in fused:
        assert torch.allclose(fused[n], naive[n], rtol=1e-4, atol=1e-7), n
    assert torch.equal(out.predictions[out.shifted != -100], logits.argmax(-1)[out.shifted != -100])


def test_lora_path_starts_from_a_saved_adapter(setup, tmp_path):
    from paco_ds.sft.export import save_adapter

    cfg, _ = setup
    trained = lora_model(cfg, seed=1)
    state = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    save_adapter(trained, state, tmp_path / "adapter")
    again = add_lora(load_model(base_path(cfg), cfg, torch.float32), cfg.model_copy(
        update={"lora": cfg.lora.model_copy(update={"path": str(tmp_path / "adapter")})}))
    loaded = {n: p for n, p in again.named_parameters() if p.requires_grad}
    assert set(loaded) == set(state) and all(torch.equal(loaded[n], state[n]) for n in state)
