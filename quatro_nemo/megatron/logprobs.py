"""Per-token log-probs and full-vocabulary entropy from vocab-parallel logits.

Under tensor parallelism the output layer gives each TP rank a slice ``z[..., r*Vp:(r+1)*Vp]`` of
the logits (``Vp = V / TP``). With the softmax ``p_v = exp(z_v - m) / Z`` over the WHOLE
vocabulary, ``m = max_v z_v`` and ``Z = sum_v exp(z_v - m)``:

    log p(y)  = z_y - m - log Z
    H         = -sum_v p_v log p_v = m + log Z - E_p[z],      E_p[z] = sum_v p_v z_v

Forward needs one MAX all-reduce (``m``) and one SUM all-reduce of three partial sums per token
(``Z``, ``z_y`` from the rank that owns ``y``, ``sum_v exp(z_v - m) z_v``); this is megatron's
``vocab_parallel_cross_entropy`` (Megatron-LM, Shoeybi et al. 2019, Sec. 3) extended by the
entropy term. The results are TP-complete on every TP rank.

Backward is local to each rank's vocabulary slice (no communication):

    d log p(y) / d z_v = 1[v = y] - p_v
    d H / d z_v        = -p_v (z_v - E_p[z])

Unlike megatron's ``vocab_parallel_cross_entropy`` (which subtracts the max from its float32
input in place), the input logits are never modified, so one forward can feed both outputs.

The entropy is usually a metric only (``quatro_nemo.megatron.loss`` detaches it): autograd then
hands the backward no gradient for it (``ctx.set_materialize_grads(False)``) rather than a tensor
of zeros, and the backward computes the log-prob term alone, in one float32 buffer of the slice's
size (``shifted``, overwritten by ``p_v``, then by the gradient). Peak bytes per logit element of
the backward: the saved float32 logits and that buffer, 8 (28 when the entropy term ran on a
materialised zero gradient: ``shifted``, ``probs``, ``grad`` and three temporaries of the entropy
term beside the logits; ``benchmarks/bench_logprobs.py``). The forward's peak, 16 bytes (the logits, ``shifted``,
``exp(shifted)`` and their product), is then the larger.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from quatro_nemo.megatron import parallel


class _VocabParallelLogProbsEntropy(torch.autograd.Function):
    """(logits [..., Vp], target [...]) -> (log p(target) [...], entropy [...]), float32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        z = logits.float()
        vocab_size_local = z.shape[-1]

        # m = max_v z_v over the full vocabulary.
        logits_max = z.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - logits_max.unsqueeze(-1)
        exp_shifted = shifted.exp()

        # z_y - m, taken on the rank whose slice holds y (0 on the others).
        local_target = target - vocab_start
        owns_target = (local_target >= 0) & (local_target < vocab_size_local)
        safe_index = torch.where(owns_target, local_target, torch.zeros_like(local_target))
        target_shifted = shifted.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1)
        target_shifted = torch.where(owns_target, target_shifted, torch.zeros_like(target_shifted))

        # One SUM all-reduce: Z, z_y - m, sum_v exp(z_v - m) (z_v - m).
        partial = torch.stack(
            [exp_shifted.sum(dim=-1), target_shifted, (exp_shifted * shifted).sum(dim=-1)], dim=0
        )
        if group is not None:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_shifted, weighted_shifted = partial.unbind(0)
        log_sum_exp = sum_exp.log()

        logprobs = target_shifted - log_sum_exp
        # E_p[z - m] = sum_v exp(z_v - m)(z_v - m) / Z;  H = log Z - E_p[z - m].
        expected_shifted = weighted_shifted / sum_exp
        entropy = log_sum_exp - expected_shifted

        ctx.save_for_backward(logits, logits_max, log_sum_exp, expected_shifted, safe_index, owns_target)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        logits, logits_max, log_sum_exp, expected_shifted, safe_index, owns_target = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None
        shifted = logits.float() - logits_max.unsqueeze(-1)
        if grad_entropy is None:  # the entropy is a metric only: the log-prob term, in place
            # p_v = exp(z_v - m - log Z), written over shifted; d log p(y)/dz_v = 1[v=y] - p_v
            grad = shifted.sub_(log_sum_exp.unsqueeze(-1)).exp_().mul_(-grad_logprobs.unsqueeze(-1))
            _add_target_term(grad, grad_logprobs, safe_index, owns_target)
            return grad.to(logits.dtype), None, None, None
        probs = (shifted - log_sum_exp.unsqueeze(-1)).exp()
        grad = torch.zeros_like(probs)
        if grad_logprobs is not None:
            # d log p(y)/dz_v = 1[v=y] - p_v
            grad -= grad_logprobs.unsqueeze(-1) * probs
            _add_target_term(grad, grad_logprobs, safe_index, owns_target)
        # dH/dz_v = -p_v (z_v - E_p[z])
        grad -= grad_entropy.unsqueeze(-1) * probs * (shifted - expected_shifted.unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None


def _add_target_term(grad: torch.Tensor, grad_logprobs: torch.Tensor, safe_index: torch.Tensor,
                     owns_target: torch.Tensor) -> None:
    """The ``1[v = y]`` term of d log p(y)/dz_v, times the incoming gradient, added in place on
    the rank whose vocabulary slice holds y."""
    onehot_grad = torch.where(owns_target, grad_logprobs, torch.zeros_like(grad_logprobs))
    grad.scatter_add_(-1, safe_index.unsqueeze(-1), onehot_grad.unsqueeze(-1))


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor, target: torch.Tensor, group=None, vocab_start: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and full-vocabulary entropy from this rank's slice of the logits.

    Args:
        logits: ``[..., V/TP]`` this TP rank's vocabulary slice (any float dtype; computed in
            float32).
        target: ``[...]`` int64 token ids in ``[0, V)``.
        group: the tensor-parallel process group; default megatron's TP group when model
            parallelism is initialised, else no communication (TP=1).
        vocab_start: first vocabulary id of this rank's slice; default ``tp_rank * V/TP``.

    Returns ``(logprobs, entropy)``, both ``[...]`` float32, identical on every TP rank, with
    autograd to ``logits``.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    if group is None or vocab_start is None:
        if parallel.model_parallel_initialized():
            group = parallel.tp_group() if group is None else group
            if vocab_start is None:
                vocab_start = parallel.tp_rank() * logits.shape[-1]
        elif vocab_start is None and group is None:
            vocab_start = 0  # no model parallelism: the slice is the whole vocabulary
    if vocab_start is None:
        raise ValueError("vocab_start is required when a TP group is given without megatron's parallel state")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelLogProbsEntropy.apply(logits, target, group, vocab_start)


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropies of a batch, in the layout of ``docs/interfaces.md``.

    Args:
        logits: ``[S, L, V/TP]`` vocab-parallel logits (``GPTModel`` output, batch first).
        tokens: ``[S, L]`` the input tokens.

    Returns ``(logprobs, entropy)`` ``[S, T]``, ``T = L - 1``: entry ``t`` is
    ``log p(tokens[t+1] | tokens[:t+1])`` and the entropy of that next-token distribution.
    """
    return vocab_parallel_logprobs_and_entropy(logits[:, :-1, :], tokens[:, 1:])


def micro_batch_logprobs_and_entropy(logits: torch.Tensor, micro_batch) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs_and_entropy` of one micro-batch, in its row layout ``[s, w - 1]``.

    A packed micro-batch (``packed_layout`` set by ``batching.pack_micro_batch``) has logits
    ``[1, total, V/TP]`` over its packed tokens; the packed next-token values are mapped back to
    rows with ``batching.unpack_rows`` (0 past each row's length).
    """
    layout = micro_batch.get("packed_layout")
    if layout is None:
        return token_logprobs_and_entropy(logits, micro_batch["tokens"])
    from quatro_nemo.megatron.batching import unpack_rows

    logprobs, entropy = token_logprobs_and_entropy(logits, micro_batch["packed_tokens"])
    num_columns = micro_batch["tokens"].shape[1] - 1
    return unpack_rows(logprobs, layout, num_columns), unpack_rows(entropy, layout, num_columns)
