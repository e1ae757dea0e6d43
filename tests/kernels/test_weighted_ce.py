"""The first_token_weight loss through the fused linear + CE op (torch rows, CPU) against float64."""
import pytest
import torch

import kernels
from paco_ds.sft.loss import first_token_weights, naive_weighted_ce, sft_loss, shift_labels
from weighted_ce_checks import N_FIRST, SPANS, check_against_float64, loss64, make_case

pytestmark = pytest.mark.fast

ALPHAS = [None, 0.0, 0.1, 1 / N_FIRST, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["exact", "share"])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_fused_loss_matches_float64(alpha, mode, dtype):
    check_against_float64("torch", dtype, alpha, mode)


def test_one_chunk_and_many_chunks_agree():
    hidden, weight, labels = make_case(SPANS, 12, 16, 97, torch.float32)
    a = sft_loss(hidden, weight, labels, 0.1, chunk_size=1, backend="torch")
    b = sft_loss(hidden, weight, labels, 0.1, chunk_size=4096, backend="torch")
    assert abs(a.loss.item() - b.loss.item()) < 1e-6 and torch.equal(a.predictions, b.predictions)


@pytest.mark.parametrize("mode", ["exact", "share"])
def test_naive_reference_is_the_formula(mode):
    hidden, weight, labels = make_case(SPANS, 12, 16, 97, torch.float64)
    for alpha in ALPHAS:
        assert abs(naive_weighted_ce(hidden @ weight.t(), labels, alpha, mode).item()
                   - loss64(hidden, weight, labels, alpha, mode).item()) < 1e-12


def test_the_two_readings_of_alpha():
    # One sequence of n supervised tokens.
    hidden, weight, labels = make_case([(1, 7)], 8, 16, 50, torch.float64)
    n = 6
    ce = naive_weighted_ce(hidden @ weight.t(), labels, None)  # mean CE
    shifted = shift_labels(labels)
    w_exact = first_token_weights(shifted, 1 / n, "exact")[shifted != -100]
    w_share = first_token_weights(shifted, 1 / n, "share")[shifted != -100]
    # exact: the first token gets alpha = 1/n, the others n (1 - alpha) / (n - 1) = 1: not uniform
    assert torch.allclose(w_exact, torch.tensor([1 / n] + [1.0] * (n - 1)))
    # share: alpha = 1/n is uniform CE
    assert torch.allclose(w_share, torch.ones(n))
    assert abs(naive_weighted_ce(hidden @ weight.t(), labels, 1 / n, "share").item() - ce.item()) < 1e-12
    # alpha = 1 trains only the first token (weight 1 exact, n share); alpha = 0.1 gives ~0.9 n/(n-1)
    assert torch.allclose(first_token_weights(shifted, 1.0, "exact")[shifted != -100], torch.tensor([1.0] + [0.0] * 5))
    assert torch.allclose(first_token_weights(shifted, 0.1)[shifted != -100], torch.tensor([0.1] + [0.9 * 6 / 5] * 5))


def test_single_supervised_token_gets_alpha_in_both_modes():
    hidden, weight, labels = make_case([(4, 5)], 8, 16, 50, torch.float64)
    logits = hidden @ weight.t()
    ce = naive_weighted_ce(logits, labels, None)
    for mode in ("exact", "share"):
        assert abs(naive_weighted_ce(logits, labels, 0.1, mode).item() - 0.1 * ce.item()) < 1e-12


def test_batch_without_labels_gives_zero_loss_and_gradient():
    hidden, weight, labels = make_case([(0, 0), (0, 0)], 6, 8, 20, torch.float32)
    h = hidden.clone().requires_grad_(True)
    out = sft_loss(h, weight, labels, 0.1, backend="torch")
    out.loss.backward()
    assert out.loss.item() == 0 and (h.grad == 0).all() and (out.predictions == -100).all()


def test_defaults_are_mean_cross_entropy_and_auto_backend_runs_on_cpu():
    hidden, weight, labels = make_case(SPANS, 12, 16, 97, torch.float32)
    shifted = shift_labels(labels)
    out = kernels.weighted_linear_ce(hidden, weight, shifted)  # backend "auto" on CPU: torch rows
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).flatten(0, 1), shifted.flatten())
    assert abs(out.loss.item() - ref.item()) < 1e-6
    assert out.token_loss.shape == labels.shape and out.predictions.shape == labels.shape


def test_rejects_mixed_dtypes():
    hidden, weight, labels = make_case(SPANS, 12, 16, 97, torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        kernels.weighted_linear_ce(hidden.bfloat16(), weight, shift_labels(labels), backend="torch")


def test_auto_chunk_size_bounds_the_logits_chunk():
    from kernels.weighted_ce import CHUNK_BUDGET_BYTES, auto_chunk_size

    assert auto_chunk_size(152064) == 1024 and 1024 * 152064 * 4 <= CHUNK_BUDGET_BYTES < 2048 * 152064 * 4
    assert auto_chunk_size(267) == 4096  # tiny vocabularies: capped
