"""Seconds of a training step, a held-out evaluation and a checkpoint save (pure arithmetic), from
the machine's rates in ``cluster:`` (``peak_tflops`` x ``assumed_mfu`` for compute,
``memory_bandwidth_tb_s`` x ``assumed_mbu`` for decoding, ``checkpoint_write_gb_s`` for the
filesystem). Rough, on purpose pessimistic estimates: what a preemption signal must leave time for
(:attr:`PhaseSeconds.preemption_lead`, compared with the SLURM templates' ``--signal=B:USR1@N``).

- **Compute**: 6 N FLOPs per trained token (x 4/3 with full recomputation, one more forward), 2 N
  per token for each forward-only pass (pi_old, pi_ref; the evaluation's entropy) (Kaplan et al.
  2020, arXiv:2001.08361, Sec. 2.1), over every GPU.
- **Sampling** (vLLM): prefill is compute (2 N per prompt token over the engine's GPUs); decoding is
  memory-bound (Pope et al. 2022, "Efficiently Scaling Transformer Inference", arXiv:2211.05102,
  Sec. 2): each decode step of a wave reads the engine's weights and the KV cache of its running
  sequences, taken at full length (an upper bound), and a wave lasts ``max_new_tokens`` steps.
- **Save**: the bytes a node's ranks write at ``checkpoint_write_gb_s`` per node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from quatro_nemo.engine.memory_terms import GB

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ClusterConfig


def compute_seconds(flops: float, gpus: int, cluster: "ClusterConfig") -> float:
    """``flops`` spread over ``gpus`` GPUs at ``cluster.peak_tflops x cluster.assumed_mfu``."""
    return flops / (gpus * cluster.peak_tflops * 1e12 * cluster.assumed_mfu)


def train_flops(parameters: int, tokens: int, full_recompute: bool, inner_loops: int, uses_reference: bool) -> float:
    """One step's training compute: K updates (6 N per token, 8 N with full recompute) and the
    pi_old (and pi_ref) forward passes (2 N each)."""
    per_update = 6 + (2 if full_recompute else 0)
    return parameters * tokens * (per_update * inner_loops + 2 + (2 if uses_reference else 0))


@dataclass
class EngineRates:
    """One vLLM engine (``vllm.tensor_parallel`` GPUs; per-GPU figures): its weights and KV bytes
    per token on one GPU, its parameters, and how many full-length sequences run at once."""

    weight_bytes: float
    kv_bytes_per_token: float
    parameters: float
    tensor_parallel: int
    max_concurrent: int


def sampling_seconds(engine: EngineRates, sequences: int, prompt_tokens: int, new_tokens: int,
                     cluster: "ClusterConfig") -> float:
    """Seconds for one engine to sample ``sequences`` responses of up to ``new_tokens`` tokens
    (module doc, "Sampling"); 0 for none."""
    if sequences <= 0 or engine.max_concurrent <= 0:
        return 0.0
    running = min(sequences, engine.max_concurrent)
    waves = math.ceil(sequences / running)
    bandwidth = cluster.memory_bandwidth_tb_s * 1e12 * cluster.assumed_mbu
    decode_step = (engine.weight_bytes + running * (prompt_tokens + new_tokens) * engine.kv_bytes_per_token) / bandwidth
    prefill = compute_seconds(2 * engine.parameters * sequences * prompt_tokens, engine.tensor_parallel, cluster)
    return prefill + waves * new_tokens * decode_step


def save_seconds(written_bytes_per_rank: float, cluster: "ClusterConfig") -> float:
    """A node's ranks write their shares in parallel through one node's filesystem bandwidth."""
    return written_bytes_per_rank * cluster.gpus_per_node / (cluster.checkpoint_write_gb_s * GB)


@dataclass
class PhaseSeconds:
    """Estimated seconds of a step's rollout and training, one held-out evaluation and one save."""

    rollout: float
    train: float
    eval: float
    save: float

    @property
    def step(self) -> float:
        return self.rollout + self.train

    @property
    def preemption_lead(self) -> float:
        """What USR1 must leave before the time limit: the step in progress, a held-out evaluation
        (the loop skips it once the signal is seen, but one may be running when it arrives) and
        the checkpoint save."""
        return self.step + self.eval + self.save


def preemption_line(seconds: PhaseSeconds, template_lead_s: Optional[int]) -> str:
    """The start-up line (rank 0) comparing the needed lead with the SLURM template's."""
    given = (f"the template gives {template_lead_s}" if template_lead_s is not None
             else "no SLURM template's --signal lead is known here")
    line = (f"preemption: this run needs ~{seconds.preemption_lead:.0f} s after USR1 (step {seconds.step:.0f} "
            f"+ eval {seconds.eval:.0f} + save {seconds.save:.0f}); {given}")
    if template_lead_s is not None and template_lead_s < seconds.preemption_lead:
        line += " (too short: raise #SBATCH --signal=B:USR1@N, or the checkpoint may be cut off)"
    return line


__all__ = ["EngineRates", "PhaseSeconds", "compute_seconds", "preemption_line", "sampling_seconds", "save_seconds",
           "train_flops"]
