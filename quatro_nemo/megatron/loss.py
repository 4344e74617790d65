"""The loss closure for megatron's ``forward_backward_func``, global normalisers, metric reduction.

Exactness over any split of the global batch (NeMo-RL's ``global_valid_seqs/toks``):

- :func:`global_loss_normalizer` counts sequences and response tokens of the whole optimizer
  step: the local batch of this DP rank summed (all-reduce SUM) over data-parallel ranks.
- each micro-batch's policy loss, computed with those global counts, is its additive share of the
  full-batch loss (``docs/interfaces.md``). Models are built with megatron's
  ``calculate_per_token_loss=True`` (:mod:`quatro_nemo.megatron.models`): the schedule then takes
  the closure's ``(loss, count, metrics)`` as is (no division by ``num_microbatches``), and
  megatron's DDP SUMS data-parallel gradients instead of averaging them
  (:mod:`quatro_nemo.megatron.training`), which is exactly what shares of a global loss need.
- metrics are additive shares too and are summed over micro-batches and DP ranks, except maxima
  and minima (each metric's declared reduction: :mod:`quatro_nemo.algos.metric_reduction`;
  :func:`reduce_metrics`). They are computed on the last pipeline stage and broadcast to every
  stage.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from quatro_nemo.algos.aggregation import LossNormalizer, count_sequences, count_tokens
from quatro_nemo.algos.importance import importance_weighted_logprobs
from quatro_nemo.algos.metric_reduction import Reduction, metric_reduction
from quatro_nemo.megatron import parallel

LOSS_KEY = "loss"


def global_loss_normalizer(response_mask: torch.Tensor, group=None) -> LossNormalizer:
    """:class:`LossNormalizer` of the global batch from this DP rank's ``response_mask`` [S, T].

    ``group``: the data-parallel group (default megatron's). One SUM all-reduce of two numbers.
    """
    counts = torch.stack([count_sequences(response_mask).double(), count_tokens(response_mask).double()])
    if group is None:
        group = parallel.dp_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    num_sequences, num_tokens = counts.tolist()
    if num_sequences <= 0 or num_tokens <= 0:
        raise ValueError("the global batch has no response tokens (response_mask is all zero)")
    return LossNormalizer(num_sequences=int(num_sequences), num_tokens=float(num_tokens))


def make_loss_func(
    policy_loss: Callable,
    algo_config,
    normalizer: LossNormalizer,
    micro_batch: Mapping[str, torch.Tensor],
) -> Callable:
    """Loss closure for one micro-batch, run by megatron's schedule on the last pipeline stage.

    ``policy_loss`` has the registry signature of ``docs/interfaces.md``. The closure maps the
    model's vocab-parallel logits ``[s, w, V/TP]`` (or ``[1, total, V/TP]`` when packed) to
    TP-complete log-probs and entropies in the micro-batch's row layout (with ``is_weights``, the
    truncated importance weights of :mod:`quatro_nemo.algos.importance`, scaling their gradients),
    applies the loss and
    returns ``(loss, 1, metrics)``: megatron's three-tuple form, whose middle count
    megatron only accumulates under ``calculate_per_token_loss`` (see the module docstring).
    ``metrics`` holds detached 0-dim tensors, with the micro-batch's loss share under ``"loss"``.
    """
    from quatro_nemo.megatron.logprobs import micro_batch_logprobs_and_entropy

    def loss_func(logits: torch.Tensor):
        logprobs, entropy = micro_batch_logprobs_and_entropy(logits, micro_batch)
        if "is_weights" in micro_batch:  # truncated importance sampling: gradients scaled, values kept
            logprobs = importance_weighted_logprobs(logprobs, micro_batch["is_weights"])
        loss, metrics = policy_loss(
            logprobs,
            micro_batch["old_logprobs"],
            micro_batch["advantages"],
            micro_batch["response_mask"],
            algo_config,
            normalizer,
            ref_logprobs=micro_batch.get("ref_logprobs"),
            entropy=entropy.detach(),
        )
        reported = {key: value.detach().clone() for key, value in metrics.items()}
        if LOSS_KEY in reported:
            raise ValueError(f"policy loss returned a metric named {LOSS_KEY!r}, which is reserved")
        reported[LOSS_KEY] = loss.detach().clone()
        return loss, unit_count(loss), reported

    return loss_func


def unit_count(like: torch.Tensor) -> torch.Tensor:
    """The count megatron's schedule accumulates from a loss closure's three-tuple (unused here:
    our losses are normalised by global counts already)."""
    return torch.ones((), dtype=torch.int, device=like.device)


def reduce_metrics(per_microbatch: List[Mapping[str, torch.Tensor]], dp_group=None) -> Dict[str, float]:
    """Reduce metric shares over micro-batches and data-parallel ranks (last stage only).

    Each key reduces by its declared reduction
    (:data:`~quatro_nemo.algos.metric_reduction.METRIC_REDUCTIONS`: shares with sum, maxima with
    max, minima with min; an undeclared key is a KeyError). One all-reduce per kind over ``dp_group``
    (default megatron's DP group); every DP rank must pass the same keys.
    """
    keys = sorted({key for metrics in per_microbatch for key in metrics})
    reductions = {key: metric_reduction(key) for key in keys}
    if dp_group is None:
        dp_group = parallel.dp_group()
    torch_ops = {Reduction.SHARE: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX,
                 Reduction.MIN: dist.ReduceOp.MIN}
    local_reducers = {Reduction.SHARE: torch.sum, Reduction.MAX: torch.amax, Reduction.MIN: torch.amin}
    result: Dict[str, float] = {}
    for kind, torch_op in torch_ops.items():
        kind_keys = [key for key, reduction in reductions.items() if reduction is kind]
        if not kind_keys:
            continue
        values = torch.stack([
            local_reducers[kind](torch.stack([m[key].double().reshape(()) for m in per_microbatch if key in m]))
            for key in kind_keys
        ])
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(values, op=torch_op, group=dp_group)
        result.update(zip(kind_keys, values.tolist()))
    return result


def broadcast_from_last_stage(metrics: Optional[Dict[str, float]]) -> Dict[str, float]:
    """Send the last pipeline stage's metrics to every stage of its pipeline group."""
    if parallel.pp_size() == 1:
        assert metrics is not None
        return metrics
    box = [metrics]
    dist.broadcast_object_list(
        box, src=parallel.last_stage_global_rank(), group=parallel.pp_group()
    )
    return box[0]
