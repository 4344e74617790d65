"""Measure the host memory of real training steps, for the planner-versus-reality tests.

    python tests/engine/memory_probe.py --world-size 2 --distributed-optimizer --out DIR
    python tests/engine/memory_probe.py --world-size 2 --tensor-parallel 2 --params-dtype bfloat16 --out DIR

Each rank (forked, over gloo) builds the real model (``quatro_nemo.megatron.models.build_model``),
wraps it in megatron-core's ``DistributedDataParallel`` and optimizer exactly as the engine does
(``quatro_nemo.megatron.training``), runs two optimizer steps of ``train_step_forward_backward`` (the product's loss path), and writes
``rank<r>.json``: the growth of its resident set (``VmRSS``) and of its high-water mark
(``VmHWM``) from a baseline taken just before the model is built. The peak is reset at the
baseline through ``/proc/self/clear_refs`` (Linux "5": reset the peak RSS), so it counts only what
the step allocates.

Run it in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` set (the test does): large blocks then
go straight back to the kernel when freed, so the high-water mark follows the live tensors rather
than glibc's heap reuse (a CUDA caching allocator's fragmentation is the planner's
``cluster.reserve_gb``, which the CPU comparison sets to 0).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from quatro_nemo.engine.phase_peaks import host_memory_kb as memory_kb, reset_host_peak  # noqa: E402

# The probe's model: qwen2-style (RMSNorm, SwiGLU, GQA, RoPE), float32, untied, ~41 M parameters,
# so that training state (16 bytes per parameter) dwarfs activations and logits.
MODEL = dict(architecture="qwen2", vocab_size=16384, hidden_size=512, num_layers=8, num_attention_heads=8,
             num_query_groups=2, ffn_hidden_size=1536, max_position_embeddings=128, tie_embeddings=False,
             params_dtype="float32")
SEQUENCES, SEQUENCE_LENGTH, MICRO_BATCH = 4, 64, 2   # sequences: the default of --sequences
LOSS = "grpo"
STEPS = 2
LOSS_PATH_SHAPE = (2, 512, 16384, 64)  # rows, length, vocabulary, hidden: 16.8 M logits


def reset_peak() -> None:
    """Reset VmHWM to the current VmRSS (the engine's own reset: proc(5), /proc/pid/clear_refs)."""
    if not reset_host_peak():
        raise OSError("the kernel refused to reset VmHWM (/proc/self/clear_refs)")


def _training_batch(rank: int, sequences: int):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (sequences, SEQUENCE_LENGTH), generator=gen)
    mask = torch.zeros(sequences, SEQUENCE_LENGTH - 1)
    mask[:, SEQUENCE_LENGTH // 4:] = 1.0
    return {
        "tokens": tokens,
        "position_ids": torch.arange(SEQUENCE_LENGTH).expand(sequences, -1).contiguous(),
        "response_mask": mask,
        "old_logprobs": torch.full((sequences, SEQUENCE_LENGTH - 1), -9.7),
        "advantages": torch.randn(sequences, generator=gen),
    }


def _rank(rank: int, tensor_parallel: int, distributed_optimizer: bool, params_dtype: str, sequences: int,
          out: str) -> None:
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.forward import train_step_forward_backward
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    layout = initialize_parallel(tensor_parallel, 1, seed=5)
    algo_config = get_algorithm(LOSS).config_cls(beta=0.0)
    batch = _training_batch(layout.dp_rank, sequences)
    gc.collect()
    reset_peak()
    baseline_kb = memory_kb("VmRSS")

    model_config = ModelConfig(**dict(MODEL, params_dtype=params_dtype))
    model, optimizer = build_training_state(build_model(model_config), distributed_optimizer)
    state_kb = memory_kb("VmRSS")
    for _ in range(STEPS):
        training.zero_gradients(model, optimizer)
        train_step_forward_backward(model, batch, get_algorithm(LOSS).policy_loss, algo_config, MICRO_BATCH)
        training.optimizer_step(model, optimizer)
    gc.collect()
    result = {
        "rank": rank, "tensor_parallel": layout.tensor_parallel, "data_parallel": layout.data_parallel,
        "distributed_optimizer": distributed_optimizer,
        "params_dtype": params_dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "after_build_bytes": (state_kb - baseline_kb) * 1024,
        "resident_bytes": (memory_kb("VmRSS") - baseline_kb) * 1024,
        "peak_bytes": (memory_kb("VmHWM") - baseline_kb) * 1024,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _loss_path(rank: int, out: str) -> None:
    """The training loss alone on large logits: bytes per logit element at the backward's peak."""
    import torch

    from quatro_nemo.algos import get_algorithm, get_policy_loss
    from quatro_nemo.algos.aggregation import LossNormalizer
    from quatro_nemo.megatron.loss import make_loss_func
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=5)
    rows, length, vocab, hidden = LOSS_PATH_SHAPE
    gen = torch.Generator().manual_seed(3)
    batch = {"tokens": torch.randint(0, vocab, (rows, length), generator=gen),
             "response_mask": torch.ones(rows, length - 1), "old_logprobs": torch.full((rows, length - 1), -9.7),
             "advantages": torch.randn(rows, generator=gen)}
    hidden_states = torch.randn(rows, length, hidden, generator=gen, requires_grad=True)
    output_weight = (0.02 * torch.randn(hidden, vocab, generator=gen)).requires_grad_()
    loss_func = make_loss_func(get_policy_loss(LOSS), get_algorithm(LOSS).config_cls(beta=0.0),
                               LossNormalizer(num_sequences=rows, num_tokens=float(rows * (length - 1))), batch)
    gc.collect()
    reset_peak()
    baseline_kb = memory_kb("VmRSS")
    loss, _, _ = loss_func(hidden_states @ output_weight)  # the output layer's logits [S, L, V]
    loss.backward()
    peak = (memory_kb("VmHWM") - baseline_kb) * 1024 - (hidden_states.numel() + output_weight.numel()) * 4
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "logits": rows * length * vocab, "peak_bytes": peak}, f)


def build_training_state(model, distributed_optimizer: bool):
    """The engine's own DDP wrapper and optimizer (quatro_nemo.megatron.training, as
    quatro_nemo.engine.loop.train builds them)."""
    from quatro_nemo.megatron import training

    ddp = training.wrap_for_training(model, distributed_optimizer=distributed_optimizer)
    return ddp, training.build_optimizer(ddp, training.OptimizerSettings(lr=1e-4, weight_decay=0.01))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the Adam moments the (torch) optimizer holds on this rank."""
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    return sum(value.numel() * value.element_size() for state in inner.state.values()
               for value in state.values() if hasattr(value, "numel") and value.numel() > 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sequences", type=int, default=SEQUENCES, help="sequences per rank and step")
    parser.add_argument("--loss-path", action="store_true", help="measure the loss on large logits only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tests.distributed import run_ranks

    os.makedirs(args.out, exist_ok=True)
    if args.loss_path:
        run_ranks(1, _loss_path, args.out)
    else:
        run_ranks(args.world_size, _rank, args.tensor_parallel, args.distributed_optimizer, args.params_dtype,
                  args.sequences, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
