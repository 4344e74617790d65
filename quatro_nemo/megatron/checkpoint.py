"""Full (TP=1, PP=1) state dicts of a megatron-core model sharded in any TP x PP layout.

Two collective operations, the basis of checkpoint conversion (:mod:`hf_conversion`), weight
pushes to a rollout engine (:mod:`quatro_nemo.engine.vllm_backend`) and the parallel-equivalence
tests:

- :func:`gather_full_state_dict`: the state dict a TP=1, PP=1 build of the same model would have,
  returned on **every rank** (every rank of the model-parallel group must call it; data-parallel
  replicas gather independently and get the same result). :func:`iter_full_parameters` is the
  streaming form (one full tensor at a time, for weight pushes that must not hold two copies).
- :func:`load_full_state_dict`: this rank's TP shard / PP stage sliced out of a full state dict
  (local; no communication).

What "full" means, for each of megatron's sharding rules (megatron-core 0.10 .. 0.16):

- **Tensor parallelism** (``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
  attributes set by ``megatron.core.tensor_parallel.layers``): the full tensor along
  ``partition_dim`` is cut into ``TP * stride`` equal chunks and rank ``r`` holds chunks
  ``r, r + TP, ..., r + (stride - 1) * TP`` concatenated
  (``tensor_parallel.layers._initialize_affine_weight_cpu``: ``weight_list[rank::world_size]``).
- **Fused SwiGLU** ``mlp.linear_fc1`` (``gated_linear_unit=True``): the full weight is
  ``[gate; up]`` and each rank holds ``[gate_r; up_r]``, i.e. stride 2. megatron-core >= 0.14
  marks it with ``partition_stride=2`` (``transformer/mlp.py``); older releases (0.10, the
  NeMo-Aligner container) leave stride 1 although the layout is the same, so stride 2 is
  applied here from the module name and the config, not from the attribute.
- **Fused QKV under GQA**: megatron stores ``linear_qkv`` grouped by query group,
  ``[q_g (heads/groups * d), k_g (d), v_g (d)]`` for ``g = 0 .. groups-1``, and requires
  ``groups % TP == 0``, so a TP shard is a contiguous block of whole groups (stride 1). The
  HF <-> megatron interleaving lives in :mod:`hf_conversion`, not here.
- **Pipeline parallelism**: decoder layer ``i`` of a stage is global layer
  ``layer_number - 1`` (:func:`quatro_nemo.megatron.models.global_parameter_name`).
- **Vocabulary padding**: the vocab-parallel ``embedding.word_embeddings.weight`` and
  ``output_layer.weight`` have ``model.vocab_size`` rows (a multiple of TP). Loading a full tensor
  with fewer rows pads it with zero rows; :func:`gather_full_state_dict` trims to ``vocab_size``
  rows when asked, so ``gather(load(sd), vocab_size=V) == sd``.
- **Tied embeddings**: the full model has only ``embedding.word_embeddings.weight``. With PP > 1
  the last stage keeps a copy in ``output_layer.weight`` (megatron all-reduces it over the
  embedding group); loading fills it from the embedding, gathering skips it.

Only parameters are handled. Non-parameter state (Transformer Engine's ``_extra_state`` FP8
metadata; megatron's local spec has none that matters in bf16/fp32) is not part of the result.
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.models import global_parameter_name

# Parameters of megatron's vocab-parallel layers (rows = padded vocabulary).
VOCAB_PARALLEL_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")
TIED_OUTPUT_NAME = "output_layer.weight"
_GATED_FC1 = re.compile(r"(^|\.)mlp\.linear_fc1\.(weight|bias)$")

ModelOrChunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]


# ---------------------------------------------------------------------------------------------
# Model helpers
# ---------------------------------------------------------------------------------------------


def model_chunks(model: ModelOrChunks) -> List[torch.nn.Module]:
    """The GPTModel chunk(s) of this rank, with DDP / Float16Module wrappers removed."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    unwrapped = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped


def _is_gated_fc1(chunk: torch.nn.Module, local_name: str) -> bool:
    return bool(_GATED_FC1.search(local_name)) and bool(getattr(chunk.config, "gated_linear_unit", False))


def partition_layout(chunk: torch.nn.Module, local_name: str, param: torch.Tensor) -> Tuple[Optional[int], int]:
    """``(partition_dim, stride)`` of a parameter; ``partition_dim`` is None if not TP-sharded."""
    if not getattr(param, "tensor_model_parallel", False):
        return None, 1
    stride = int(getattr(param, "partition_stride", 1))
    if _is_gated_fc1(chunk, local_name):
        stride = 2  # [gate_r; up_r] per rank, whatever the attribute says (see module docstring)
    return int(param.partition_dim), stride


def _is_tied_output_copy(chunk: torch.nn.Module, local_name: str) -> bool:
    return local_name == TIED_OUTPUT_NAME and bool(getattr(chunk, "share_embeddings_and_output_weights", False))


# ---------------------------------------------------------------------------------------------
# Strided TP slicing (pure tensor functions, tested against hand-built layouts)
# ---------------------------------------------------------------------------------------------


def shard_tensor(full: torch.Tensor, partition_dim: int, stride: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``full``: chunks ``tp_rank::tp_size`` of ``tp_size * stride``.

    Megatron's rule (``tensor_parallel.layers._initialize_affine_weight_cpu``).
    """
    pieces = tp_size * stride
    if full.shape[partition_dim] % pieces != 0:
        raise ValueError(
            f"dimension {partition_dim} of size {full.shape[partition_dim]} cannot be split into "
            f"tensor_parallel={tp_size} x stride={stride} equal chunks"
        )
    chunks = torch.chunk(full, pieces, dim=partition_dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=partition_dim)


def merge_shards(shards: Sequence[torch.Tensor], partition_dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's shard in TP-rank order."""
    tp_size = len(shards)
    per_rank = [torch.chunk(shard, stride, dim=partition_dim) for shard in shards]
    # Full chunk j = k * tp_size + r is chunk k of rank r.
    ordered = [per_rank[r][k] for k in range(stride) for r in range(tp_size)]
    return torch.cat(ordered, dim=partition_dim)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def _pad_vocab_rows(full: torch.Tensor, rows: int, key: str) -> torch.Tensor:
    if full.shape[0] == rows:
        return full
    if full.shape[0] > rows:
        raise ValueError(
            f"{key!r} has {full.shape[0]} vocabulary rows but the model's padded vocabulary is "
            f"{rows}: raise model.vocab_size to at least {full.shape[0]}"
        )
    padding = full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))
    return torch.cat([full, padding], dim=0)


def load_full_state_dict(model: ModelOrChunks, full_state: Dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's TP shard / PP stage of a full (TP=1, PP=1) state dict into ``model``.

    Local: no communication. Every rank of every data-parallel replica calls it with the same
    ``full_state``. With ``strict``, a local parameter absent from ``full_state`` raises
    ``KeyError`` naming it, and (at PP=1, where one rank sees the whole model) so does a key of
    ``full_state`` that no parameter uses. A shape mismatch raises ``ValueError`` naming the key.
    """
    tp_size = parallel.tp_size()
    tp_rank = parallel.tp_rank()
    used = set()
    with torch.no_grad():
        for chunk in model_chunks(model):
            for local_name, param in chunk.named_parameters():
                key = global_parameter_name(chunk, local_name)
                if key not in full_state:
                    if strict:
                        raise KeyError(f"parameter {key!r} (local {local_name!r}) missing from the full state dict")
                    continue
                used.add(key)
                full = full_state[key]
                partition_dim, stride = partition_layout(chunk, local_name, param)
                if local_name in VOCAB_PARALLEL_NAMES:  # vocab-parallel: rows split over TP
                    full = _pad_vocab_rows(full, param.shape[0] * tp_size, key)
                if partition_dim is not None:
                    full = shard_tensor(full, partition_dim, stride, tp_size, tp_rank)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{key!r}: this rank's shard has shape {tuple(full.shape)}, the model's "
                        f"parameter {local_name!r} has {tuple(param.shape)}"
                    )
                param.copy_(full.to(dtype=param.dtype, device=param.device))
    if strict and parallel.pp_size() == 1:
        unused = sorted(set(full_state) - used)
        if unused:
            raise KeyError(f"keys of the full state dict used by no parameter: {unused[:5]}")


# ---------------------------------------------------------------------------------------------
# Gather
# ---------------------------------------------------------------------------------------------


def _owned_parameters(model: ModelOrChunks):
    """``(global_name, chunk, local_name, param)`` of the parameters this stage contributes."""
    owned = []
    for chunk in model_chunks(model):
        for local_name, param in chunk.named_parameters():
            if _is_tied_output_copy(chunk, local_name):
                continue  # the first stage contributes the embedding it copies
            owned.append((global_parameter_name(chunk, local_name), chunk, local_name, param))
    return owned


def _gather_tensor_parallel(chunk, local_name: str, param: torch.Tensor) -> torch.Tensor:
    partition_dim, stride = partition_layout(chunk, local_name, param)
    tp_size = parallel.tp_size()
    local = param.detach()
    if partition_dim is None or tp_size == 1:
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=parallel.tp_group())
    return merge_shards(shards, partition_dim, stride)


def iter_full_parameters(
    model: ModelOrChunks, vocab_size: Optional[int] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(full_name, full_tensor)`` for every parameter of the TP=1, PP=1 model.

    Collective over the model-parallel group: every rank must consume the whole iterator. The
    order is pipeline stage by stage, then ``named_parameters`` order; every rank yields the same
    sequence. Tensors live on the parameters' device. ``vocab_size`` trims the padded vocabulary
    rows of the embedding / output layer.
    """
    owned = _owned_parameters(model)
    pp_size = parallel.pp_size()
    if pp_size == 1:
        for key, chunk, local_name, param in owned:
            yield key, _trim_vocab(key, _gather_tensor_parallel(chunk, local_name, param), vocab_size)
        return

    pp_group = parallel.pp_group()
    my_stage = parallel.pp_rank()
    stage_ranks = dist.get_process_group_ranks(pp_group)
    device = owned[0][3].device if owned else torch.device("cpu")
    # Each stage announces (name, full shape, dtype) of what it contributes.
    manifest = [(key, tuple(_full_shape(chunk, local_name, param)), param.dtype) for key, chunk, local_name, param in owned]
    manifests: List[list] = [None] * pp_size  # type: ignore[list-item]
    dist.all_gather_object(manifests, manifest, group=pp_group)
    for stage in range(pp_size):
        for index, (key, shape, dtype) in enumerate(manifests[stage]):
            if stage == my_stage:
                _, chunk, local_name, param = owned[index]
                full = _gather_tensor_parallel(chunk, local_name, param).contiguous()
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(full, src=stage_ranks[stage], group=pp_group)
            yield key, _trim_vocab(key, full, vocab_size)


def _full_shape(chunk, local_name: str, param: torch.Tensor) -> torch.Size:
    partition_dim, _ = partition_layout(chunk, local_name, param)
    shape = list(param.shape)
    if partition_dim is not None:
        shape[partition_dim] *= parallel.tp_size()
    return torch.Size(shape)


def _trim_vocab(key: str, full: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    if vocab_size is None or key not in VOCAB_PARALLEL_NAMES:
        return full
    if vocab_size > full.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} exceeds the {full.shape[0]} rows of {key!r}")
    return full[:vocab_size]


def gather_full_state_dict(
    model: ModelOrChunks, vocab_size: Optional[int] = None, to_cpu: bool = True
) -> Dict[str, torch.Tensor]:
    """The TP=1, PP=1 state dict (parameters only) of ``model``, on every rank.

    Collective: every rank of the model-parallel group calls it. Keys are the parameter names of
    a TP=1, PP=1 build (``decoder.layers.{global index}...``; tied models have no
    ``output_layer.weight``). ``vocab_size`` trims padded vocabulary rows; ``to_cpu`` moves each
    tensor to the CPU as it arrives (so a GPU holds one full tensor at a time).
    """
    full_state: Dict[str, torch.Tensor] = {}
    for key, tensor in iter_full_parameters(model, vocab_size=vocab_size):
        full_state[key] = tensor.cpu() if to_cpu else tensor
    return full_state


__all__ = [
    "VOCAB_PARALLEL_NAMES",
    "gather_full_state_dict",
    "iter_full_parameters",
    "load_full_state_dict",
    "merge_shards",
    "model_chunks",
    "partition_layout",
    "shard_tensor",
]
