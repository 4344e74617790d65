"""What the training loop calls: log-probs of a batch, and one forward/backward of a policy loss.

Both take this DP rank's part of the batch, a dict laid out as in ``docs/interfaces.md``
(``tokens``, ``position_ids`` [S, L]; ``response_mask``, ``old_logprobs``, ``ref_logprobs``
[S, T]; ``advantages`` [S]), split it into micro-batches of ``micro_batch_size`` rows and run
megatron-core's pipeline schedule (``get_forward_backward_func()``: no pipelining at PP=1, 1F1B
otherwise). Attention is causal (``attention_mask=None``); right padding never influences earlier
positions, and padded positions are masked out of every loss by ``response_mask``.

Gradients. Training takes the model wrapped in megatron's ``DistributedDataParallel``
(:func:`quatro_nemo.megatron.training.wrap_for_training`): backward accumulates into its float32
gradient buffers (``param.main_grad``), and :func:`finalize_gradients` runs megatron's
``finalize_model_grads`` once per optimizer step: the data-parallel SUM (each DP rank's loss is
already its share of the global loss, :mod:`quatro_nemo.megatron.loss`) and the tied-embedding
all-reduce between pipeline stages. The engine then runs the megatron optimizer's ``step()``.
Log-probs take the model with or without the wrapper.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from quatro_nemo.algos import get_policy_loss
from quatro_nemo.algos.aggregation import LossNormalizer
from quatro_nemo.megatron.logprobs import token_logprobs_and_entropy
from quatro_nemo.megatron.loss import (
    broadcast_from_last_stage,
    global_loss_normalizer,
    make_loss_func,
    reduce_metrics,
    unit_count,
)

TRAIN_KEYS = ("tokens", "position_ids", "response_mask", "old_logprobs", "advantages")
OPTIONAL_TRAIN_KEYS = ("ref_logprobs",)


def micro_batch_rows(num_rows: int, at_most: int) -> int:
    """The largest micro-batch size <= `at_most` that divides `num_rows` (the loss path is exact for
    any split, so this only trades memory for speed)."""
    for size in range(min(at_most, num_rows), 0, -1):
        if num_rows % size == 0:
            return size
    raise ValueError(f"cannot split {num_rows} rows into micro-batches of at most {at_most}")


def split_micro_batches(batch: Mapping[str, torch.Tensor], micro_batch_size: int,
                        keys: Tuple[str, ...]) -> List[Dict[str, torch.Tensor]]:
    """Consecutive row slices of ``batch[key]`` for ``key`` in ``keys`` (present ones)."""
    num_rows = batch["tokens"].shape[0]
    if micro_batch_size < 1 or num_rows % micro_batch_size != 0:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must divide this rank's {num_rows} sequences"
        )
    for key in keys:
        if key in batch and batch[key].shape[0] != num_rows:
            raise ValueError(f"batch[{key!r}] has {batch[key].shape[0]} rows, tokens has {num_rows}")
    return [
        {key: batch[key][start:start + micro_batch_size] for key in keys if key in batch}
        for start in range(0, num_rows, micro_batch_size)
    ]


def _run_schedule(model, micro_batches: List[Dict[str, torch.Tensor]], make_loss, forward_only: bool):
    """Run megatron's schedule over ``micro_batches``; returns the last stage's loss outputs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator, step_model):
        micro_batch = next(data_iterator)
        output = step_model(micro_batch["tokens"], micro_batch["position_ids"], None)
        return output, make_loss(micro_batch)

    tokens = micro_batches[0]["tokens"]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def compute_logprobs(model, batch: Mapping[str, torch.Tensor], micro_batch_size: int
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward-only log-probs and entropies ``[S, T]`` (float32) of this DP rank's batch.

    The result is available on every rank of the model-parallel group (TP-complete on each TP
    rank of the last stage, then broadcast over the pipeline group).
    """
    from megatron.core import parallel_state as ps

    micro_batches = split_micro_batches(batch, micro_batch_size, ("tokens", "position_ids"))

    def make_loss(micro_batch):
        def loss_func(logits):
            logprobs, entropy = token_logprobs_and_entropy(logits, micro_batch["tokens"])
            return (logprobs.sum() * 0.0, unit_count(logprobs),
                    {"logprobs": logprobs.detach(), "entropy": entropy.detach()})
        return loss_func

    model.eval()
    with torch.no_grad():
        outputs = _run_schedule(model, micro_batches, make_loss, forward_only=True)
    tokens = batch["tokens"]
    shape = (tokens.shape[0], tokens.shape[1] - 1)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        logprobs = torch.cat([out["logprobs"] for out in outputs]).contiguous()
        entropy = torch.cat([out["entropy"] for out in outputs]).contiguous()
    else:
        logprobs = torch.empty(shape, dtype=torch.float32, device=tokens.device)
        entropy = torch.empty(shape, dtype=torch.float32, device=tokens.device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        both = torch.stack([logprobs, entropy])
        dist.broadcast(both, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        logprobs, entropy = both.unbind(0)
    return logprobs, entropy


def finalize_gradients(model) -> None:
    """Make the gradient buffers hold the gradient of the GLOBAL loss: megatron's own
    ``finalize_model_grads`` on the DDP-wrapped model (:func:`quatro_nemo.megatron.training.
    wrap_for_training`): the data-parallel SUM (all-reduce, or reduce-scatter onto each rank's
    shard with the distributed optimizer) and, under PP with tied embeddings, the all-reduce of
    the embedding/output weight's gradient between the first and last stage. Once per optimizer
    step, after the last backward."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model])


def train_step_forward_backward(
    model,
    batch: Mapping[str, torch.Tensor],
    policy_loss_name: str,
    algo_config,
    micro_batch_size: int,
    normalizer: Optional[LossNormalizer] = None,
    finalize_grads: bool = True,
) -> Dict[str, float]:
    """Forward + backward of the policy loss over this DP rank's batch; gradients finalised.

    Args:
        model: this rank's model stage in megatron's DDP (:func:`training.wrap_for_training`).
        batch: this DP rank's rows (``TRAIN_KEYS``, optionally ``ref_logprobs``).
        policy_loss_name: a name in the ``quatro_nemo.algos`` policy-loss registry.
        algo_config: that loss's typed config.
        micro_batch_size: rows per micro-batch (must divide the local batch).
        normalizer: global counts of the optimizer step's batch; default: counted from this
            batch's ``response_mask`` and all-reduced over DP (:func:`global_loss_normalizer`).
            Pass it explicitly when one optimizer step spans several calls.
        finalize_grads: run :func:`finalize_gradients` at the end. It must run exactly ONCE per
            optimizer step (its all-reduces are not idempotent): when one step spans several
            calls, pass False to all but the last.

    Gradients are ADDED to the DDP buffers ``param.main_grad`` (zero them before the first call
    of an optimizer step: :func:`quatro_nemo.megatron.training.zero_gradients`). Returns the
    metrics of the loss (``"loss"`` plus the loss function's keys), reduced over micro-batches and
    DP, on every rank.
    """
    for key in TRAIN_KEYS:
        if key not in batch:
            raise KeyError(f"batch is missing {key!r} (needs {TRAIN_KEYS})")
    policy_loss = get_policy_loss(policy_loss_name)
    if normalizer is None:
        normalizer = global_loss_normalizer(batch["response_mask"])
    micro_batches = split_micro_batches(batch, micro_batch_size, TRAIN_KEYS + OPTIONAL_TRAIN_KEYS)

    def make_loss(micro_batch):
        return make_loss_func(policy_loss, algo_config, normalizer, micro_batch)

    from megatron.core import parallel_state as ps

    model.train()
    outputs = _run_schedule(model, micro_batches, make_loss, forward_only=False)
    if finalize_grads:
        finalize_gradients(model)
    metrics = reduce_metrics(outputs) if ps.is_pipeline_last_stage(ignore_virtual=True) else None
    return broadcast_from_last_stage(metrics)
