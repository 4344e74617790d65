"""The actor's loss closure, as pure functions (no NeMo import): stage keys and the scaled loss share.

NeMo-Aligner 0.7.0's ``MegatronGPTReinforceActorModel.get_actor_forward_output_and_loss_func``
(``nemo_aligner/models/nlp/gpt/megatron_gpt_reinforce_actor.py``) computes a REINFORCE loss as a
``masked_mean`` over each micro-batch, i.e. a mean of local means (exact only at micro-batch
size 1 and one DP rank). Here the loss of a micro-batch is its ADDITIVE share of the global
batch loss: the registry's policy loss (``docs/interfaces.md``) is called with a
:class:`LossNormalizer` holding counts of the whole optimizer step (all micro-batches, all DP
ranks), then multiplied by :func:`loss_scale` to undo what Megatron and NeMo do to it:

- Megatron's schedules divide a 2-tuple loss by ``num_microbatches``
  (``megatron/core/pipeline_parallel/schedules.py``, ``forward_step``);
- NeMo's data-parallel gradient reduction AVERAGES over DP ranks (apex
  ``DistributedFusedAdam(average_grad_sync=True)``, megatron-core DDP
  ``gradient_scaling_factor = 1 / dp``).

With the scale ``num_microbatches * dp_size`` the gradient every rank ends with is the gradient of
the global-batch loss, whatever the micro-batch size and DP size. (The project's own Megatron
loop needs no scale: it builds its models with ``calculate_per_token_loss=True``, under which
megatron neither divides by ``num_microbatches`` nor averages over DP; NeMo's models do not.) The global counts and the metric reduction are the Megatron
layer's: ``quatro_nemo.megatron.loss.global_loss_normalizer`` / ``reduce_metrics`` /
``broadcast_from_last_stage``.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set, Tuple

import torch

from quatro_nemo.algos import LossNormalizer

# Keys of a training micro-batch (the actor's batch layout; shapes per docs/interfaces.md,
# ``response_tokens`` [s, L], the others [s, T = L - 1] except ``advantages`` [s]).
INPUT_KEYS = ("response_tokens", "position_ids", "attention_mask")  # what the first stage consumes
LOSS_KEYS = ("response_tokens", "response_mask", "advantages", "old_logprobs", "ref_logprobs")


def keys_for_stage(pp_size: int, is_first_stage: bool, is_last_stage: bool) -> Set[str]:
    """Keys a pipeline stage needs on its device; the rest stay on the host (``None``).

    Every stage needs the attention mask; only the first stage the token inputs and only the
    last stage (where the loss closure runs) the per-sequence and per-token loss tensors.
    """
    if pp_size == 1:
        return set(INPUT_KEYS) | set(LOSS_KEYS)
    keys = {"attention_mask"}
    if is_first_stage:
        keys.update(INPUT_KEYS)
    if is_last_stage:
        keys.update(LOSS_KEYS)
    return keys


def loss_scale(num_microbatches: int, dp_size: int) -> int:
    """Factor that turns an additive global-batch share into what Megatron/NeMo expect (module doc)."""
    return num_microbatches * dp_size


def microbatch_loss(
    logprobs: torch.Tensor,
    batch: Mapping[str, Optional[torch.Tensor]],
    policy_loss: Any,
    config: Any,
    normalizer: LossNormalizer,
    scale: float,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The loss closure's body: scaled global-batch share of one micro-batch's loss, and metrics.

    Args:
        logprobs: [s, T] TP-complete log-probs of ``response_tokens[:, 1:]`` (requires grad), e.g.
            NeMo-Aligner's ``from_parallel_logits_to_logprobs`` output.
        batch: the micro-batch (``LOSS_KEYS``; ``ref_logprobs`` may be None or absent).
        policy_loss: ``get_policy_loss(name)`` / ``AlgorithmSpec.policy_loss``.
        config: the algorithm's typed config.
        normalizer: global counts (``quatro_nemo.megatron.loss.global_loss_normalizer``).
        scale: :func:`loss_scale`.

    Returns:
        (``scale * share`` for Megatron's backward, metrics: unscaled additive shares, detached).
    """
    loss, metrics = policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["response_mask"],
        config,
        normalizer,
        ref_logprobs=batch.get("ref_logprobs"),
    )
    return loss * scale, metrics
