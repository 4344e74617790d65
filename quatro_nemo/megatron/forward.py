"""What the training loop calls: log-probs of a batch, and one forward/backward of a policy loss.

Both take this DP rank's part of the batch, a dict laid out as in ``docs/interfaces.md``
(``tokens``, ``position_ids`` [S, L]; ``response_mask``, ``old_logprobs``, ``ref_logprobs``
[S, T]; ``advantages``, optionally ``lengths`` [S]), split it into micro-batches as a
:class:`~quatro_nemo.megatron.batching.MicroBatching` says (rows per micro-batch, or a
padded-token budget with rows sorted by length and each micro-batch trimmed to its longest row,
optionally packed into THD sequences on Transformer Engine) and run megatron-core's pipeline
schedule (``get_forward_backward_func()``: no pipelining at PP=1, 1F1B otherwise). Attention is
causal (``attention_mask=None``); right padding never influences earlier positions, and padded
positions are masked out of every loss by ``response_mask``.

Gradients. Training takes the model wrapped in megatron's ``DistributedDataParallel``
(:func:`quatro_nemo.megatron.training.wrap_for_training`): backward accumulates into its float32
gradient buffers (``param.main_grad``), and :func:`finalize_gradients` runs megatron's
``finalize_model_grads`` once per optimizer step: the data-parallel SUM (each DP rank's loss is
already its share of the global loss, :mod:`quatro_nemo.megatron.loss`) and the tied-embedding
all-reduce between pipeline stages. The engine then runs the megatron optimizer's ``step()``.
Log-probs take the model with or without the wrapper.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from quatro_nemo.algos.aggregation import LossNormalizer
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.batching import (
    MicroBatch,
    MicroBatching,
    gather_micro_batch,
    pack_micro_batch,
    plan_micro_batches,
    row_lengths,
    scatter_rows,
    with_empty_micro_batches,
)
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.logprobs import micro_batch_logprobs_and_entropy
from quatro_nemo.megatron.models import transformer_engine_available
from quatro_nemo.megatron.loss import (
    broadcast_from_last_stage,
    global_loss_normalizer,
    make_loss_func,
    reduce_metrics,
    unit_count,
)

TRAIN_KEYS = ("tokens", "position_ids", "response_mask", "old_logprobs", "advantages")
OPTIONAL_TRAIN_KEYS = ("ref_logprobs", "is_weights")
LOGPROB_KEYS = ("tokens", "position_ids")


def split_micro_batches(batch: Mapping[str, torch.Tensor], batching: Union[MicroBatching, int],
                        keys: Tuple[str, ...], equal_over_data_parallel: bool = False
                        ) -> Tuple[List[MicroBatch], List[Dict[str, object]]]:
    """This rank's micro-batches: (the plan, the tensors of each micro-batch) (:mod:`.batching`).

    ``batching``: a :class:`MicroBatching`, or an int = rows per micro-batch (the padded path).
    ``keys``: the batch entries each micro-batch carries (present ones), plus ``lengths``.
    ``equal_over_data_parallel``: append empty micro-batches up to the largest count over the
    data-parallel group (one MAX all-reduce), so every DP rank runs the same number of schedule
    steps and hence the same collectives. Ranks of one pipeline / tensor group hold the same rows
    and compute the same plan by themselves.
    """
    if isinstance(batching, int):
        batching = MicroBatching(rows=batching)
    batch = dict(batch, lengths=row_lengths(batch))
    plan = plan_micro_batches(batch, batching)
    dp_group = parallel.dp_group()
    if equal_over_data_parallel and dist.get_world_size(dp_group) > 1:
        count = torch.tensor([len(plan)], dtype=torch.long, device=current_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        plan = with_empty_micro_batches(plan, int(count.item()))
    if not plan:
        raise ValueError("no rows to split into micro-batches")
    if batching.pack and not transformer_engine_available():
        raise ValueError("parallel.sequence_packing=true needs Transformer Engine (THD attention); megatron's "
                         "local layer spec has none: use parallel.max_tokens_per_micro_batch alone")
    micro_batches = []
    for micro in plan:
        part = gather_micro_batch(batch, micro, tuple(keys) + ("lengths",))
        micro_batches.append(pack_micro_batch(part) if batching.pack else part)
    return plan, micro_batches


def _schedule_shape(micro_batch: Mapping[str, object]) -> Tuple[int, int]:
    """(sequence length, rows) the model sees for ``micro_batch``: its packed length x 1 when packed."""
    if "packed_layout" in micro_batch:
        return micro_batch["packed_layout"].total, 1
    rows, width = micro_batch["tokens"].shape
    return width, rows


def _model_forward(model, micro_batch: Mapping[str, object]) -> torch.Tensor:
    """One stage's forward of ``micro_batch``: row layout, or packed THD with ``PackedSeqParams``."""
    layout = micro_batch.get("packed_layout")
    if layout is None:
        return model(micro_batch["tokens"], micro_batch["position_ids"], None)
    from megatron.core.packed_seq_params import PackedSeqParams

    device = micro_batch["packed_tokens"].device
    cu_seqlens, cu_seqlens_padded = layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                             max_seqlen_q=layout.max_seqlen, max_seqlen_kv=layout.max_seqlen)
    return model(micro_batch["packed_tokens"], micro_batch["packed_position_ids"], None, packed_seq_params=params)


def _run_schedule(model, micro_batches: List[Dict[str, object]], make_loss, forward_only: bool):
    """Run megatron's schedule over ``micro_batches``; returns the last stage's loss outputs.

    With PP > 1 the stages exchange activations of each micro-batch's own shape: the model's
    config must have ``variable_seq_lengths=True`` (``models.build_model`` sets it at PP > 1),
    which sends every activation's shape ahead of it; ``seq_length`` / ``micro_batch_size``
    below are then only the first micro-batch's (megatron ignores them).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    shapes = {_schedule_shape(micro_batch) for micro_batch in micro_batches}
    if (len(shapes) > 1 and parallel.pp_size() > 1
            and not get_model_config(model).variable_seq_lengths):
        raise ValueError(f"micro-batches of {len(shapes)} shapes under pipeline parallelism need "
                         "TransformerConfig(variable_seq_lengths=True) (quatro_nemo.megatron.models.build_model "
                         "sets it when PP > 1)")

    def forward_step(data_iterator: Iterator, step_model):
        micro_batch = next(data_iterator)
        return _model_forward(step_model, micro_batch), make_loss(micro_batch)

    seq_length, rows = _schedule_shape(micro_batches[0])
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def compute_logprobs(model, batch: Mapping[str, torch.Tensor], batching: Union[MicroBatching, int]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward-only log-probs and entropies ``[S, T]`` (float32) of this DP rank's batch, in its
    row order (0 past each micro-batch's width when trimmed; see :mod:`.batching`).

    ``batching``: a :class:`MicroBatching` or rows per micro-batch. No data-parallel collective
    runs here, so DP ranks may hold different numbers of rows (evaluation's last rank).
    The result is available on every rank of the model-parallel group (TP-complete on each TP
    rank of the last stage, then broadcast over the pipeline group).
    """
    plan, micro_batches = split_micro_batches(batch, batching, LOGPROB_KEYS)

    def make_loss(micro_batch):
        def loss_func(logits):
            logprobs, entropy = micro_batch_logprobs_and_entropy(logits, micro_batch)
            return (logprobs.sum() * 0.0, unit_count(logprobs),
                    {"logprobs": logprobs.detach(), "entropy": entropy.detach()})
        return loss_func

    model.eval()
    with torch.no_grad():
        outputs = _run_schedule(model, micro_batches, make_loss, forward_only=True)
    tokens = batch["tokens"]
    shape = (tokens.shape[0], tokens.shape[1] - 1)
    if parallel.is_last_stage():
        logprobs = scatter_rows([out["logprobs"] for out in outputs], plan, *shape)
        entropy = scatter_rows([out["entropy"] for out in outputs], plan, *shape)
    else:
        logprobs = torch.empty(shape, dtype=torch.float32, device=tokens.device)
        entropy = torch.empty(shape, dtype=torch.float32, device=tokens.device)
    if parallel.pp_size() > 1:
        both = torch.stack([logprobs, entropy])
        dist.broadcast(both, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
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
    policy_loss: Callable,
    algo_config,
    batching: Union[MicroBatching, int],
    normalizer: Optional[LossNormalizer] = None,
    finalize_grads: bool = True,
) -> Dict[str, float]:
    """Forward + backward of the policy loss over this DP rank's batch; gradients finalised.

    Args:
        model: this rank's model stage in megatron's DDP (:func:`training.wrap_for_training`).
        batch: this DP rank's rows (``TRAIN_KEYS``, optionally ``OPTIONAL_TRAIN_KEYS``).
        policy_loss: the algorithm's loss function (``AlgorithmSpec.policy_loss``).
        algo_config: that loss's typed config.
        batching: a :class:`MicroBatching` (rows, or a token budget), or rows per micro-batch.
            Every DP rank runs the same number of micro-batches (empty ones pad the shorter plans).
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
    if normalizer is None:
        normalizer = global_loss_normalizer(batch["response_mask"])
    _, micro_batches = split_micro_batches(batch, batching, TRAIN_KEYS + OPTIONAL_TRAIN_KEYS,
                                           equal_over_data_parallel=True)

    def make_loss(micro_batch):
        return make_loss_func(policy_loss, algo_config, normalizer, micro_batch)

    model.train()
    outputs = _run_schedule(model, micro_batches, make_loss, forward_only=False)
    if finalize_grads:
        finalize_gradients(model)
    metrics = reduce_metrics(outputs) if parallel.is_last_stage() else None
    return broadcast_from_last_stage(metrics)
