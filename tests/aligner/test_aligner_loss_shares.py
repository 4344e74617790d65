"""The actor's loss closure body: micro-batch shares x Megatron/NeMo scaling = the global loss.

Simulates what Megatron and NeMo do with the returned loss (divide by the number of
micro-batches; average gradients over DP ranks) and compares loss and gradient with the
independent float64 formula of quatro-math.md (tests/aligner/aligner_reference.py).
"""
import pytest
import torch

from quatro_nemo.algos import LossNormalizer
from quatro_nemo.aligner.loss import keys_for_stage, loss_scale, microbatch_loss
from aligner_reference import quatro_loss_reference


def _batch(num_sequences=8, num_positions=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(num_sequences, num_positions, generator=generator, dtype=torch.float64) * 2)
    mask = torch.zeros(num_sequences, num_positions, dtype=torch.float64)
    for i in range(num_sequences):  # varied prompt / response lengths
        start = 1 + i % 2
        mask[i, start: start + 1 + (i * 3) % (num_positions - start)] = 1
    return {
        "logprobs": logprobs,
        "old_logprobs": logprobs + 0.1 * torch.randn(num_sequences, num_positions, generator=generator,
                                                      dtype=torch.float64),
        "ref_logprobs": logprobs + 0.2 * torch.randn(num_sequences, num_positions, generator=generator,
                                                      dtype=torch.float64),
        "advantages": torch.randn(num_sequences, generator=generator, dtype=torch.float64),
        "response_mask": mask,
    }


@pytest.mark.parametrize("micro_batch_size,dp_size", [(1, 1), (2, 1), (3, 2), (1, 4), (3, 1)])
def test_scaled_shares_give_global_loss_and_gradient(quatro_spec, micro_batch_size, dp_size):
    spec, config_cls = quatro_spec
    config = config_cls(beta=0.05, delta=0.1)
    data = _batch(num_sequences=12)
    theta = data["logprobs"].clone().requires_grad_(True)
    expected = quatro_loss_reference(theta, data["old_logprobs"], data["advantages"], data["response_mask"],
                                     beta=0.05, ref_logprobs=data["ref_logprobs"])
    expected_grad, = torch.autograd.grad(expected, theta)

    normalizer = LossNormalizer.from_mask(data["response_mask"])  # global counts: the whole batch
    per_rank = 12 // dp_size
    num_microbatches = per_rank // micro_batch_size
    scale = loss_scale(num_microbatches, dp_size)
    theta = data["logprobs"].clone().requires_grad_(True)
    total, loss_metric = 0.0, 0.0
    for rank in range(dp_size):
        rank_rows = slice(rank * per_rank, (rank + 1) * per_rank)
        rank_loss = 0.0
        for mb in range(num_microbatches):
            rows = torch.arange(12)[rank_rows][mb * micro_batch_size:(mb + 1) * micro_batch_size]
            batch = {k: v[rows] for k, v in data.items() if k != "logprobs"}
            loss, mb_metrics = microbatch_loss(theta[rows], batch, spec.policy_loss, config, normalizer, scale)
            rank_loss = rank_loss + loss / num_microbatches  # Megatron's schedule
            loss_metric = loss_metric + mb_metrics["policy/loss"]  # additive shares
        total = total + rank_loss / dp_size  # NeMo's DP gradient averaging
    grad, = torch.autograd.grad(total, theta)
    torch.testing.assert_close(total.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss_metric, expected.detach(), rtol=1e-12, atol=1e-12)


def test_keys_for_stage_sends_loss_tensors_to_last_stage_only():
    assert keys_for_stage(1, True, True) >= {"response_tokens", "advantages", "old_logprobs", "attention_mask"}
    middle = keys_for_stage(4, False, False)
    assert middle == {"attention_mask"}
    first = keys_for_stage(2, True, False)
    assert "advantages" not in first and "response_tokens" in first and "position_ids" in first
    last = keys_for_stage(2, False, True)
    assert {"advantages", "old_logprobs", "ref_logprobs", "response_mask"} <= last and "position_ids" not in last
