"""Rollout backends: N responses per prompt from the current policy (pi_old).

A backend turns ``B`` prompts into a grouped rollout of ``S = B * N`` sequences (rows
``g*N .. g*N + N - 1`` belong to prompt ``g``; ``docs/interfaces.md``). The training loop only
sees :class:`RolloutBackend`; which engine samples is a config choice:

- ``"megatron"`` (:class:`MegatronRolloutBackend`): megatron-core's own model with a KV cache
  (``quatro_nemo.megatron.sampling``), in the training processes, under any TP/PP/DP layout.
  No weight copy is needed: it samples from the very parameters being trained.
- ``"vllm"`` (:class:`quatro_nemo.engine.vllm_backend.VllmRolloutBackend`): GPU clusters, a
  colocated vLLM engine sized by the ``vllm:`` section; :meth:`RolloutBackend.update_weights`
  marks its weights stale and the next rollout pushes the trained weights into it.

:func:`quatro_nemo.engine.rollout_backends.build_rollout_backend` builds the configured one,
giving each backend exactly what its constructor declares.

Determinism: the randomness of sequence ``g*N + j`` depends only on ``(params.seed, global prompt
index, j)``, so the same global batch gives the same rollouts in every parallel layout and for
any split of the prompts across data-parallel ranks (pass each rank's ``first_prompt_index``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch

from quatro_nemo.megatron.batching import MicroBatching
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.forward import compute_logprobs
from quatro_nemo.megatron.sampling import SampleOutput, SamplingParams, generate


@dataclass
class RolloutBatch:
    """A grouped rollout of ``num_prompts * num_samples`` rows (this rank's prompts).

    ``sample`` holds the token tensors of ``docs/interfaces.md`` (``tokens``, ``response_mask``,
    the sampler's ``logprobs``, lengths, ``finished``). ``engine_logprobs`` [S, L-1]: where the
    sampling engine is not the trained model itself (vLLM), its log pi(token) of each sampled
    token at temperature 1, aligned like ``response_mask``: what the trainer's recomputed log-probs
    are compared with (:func:`quatro_nemo.engine.loop.engine_gap_metrics`, through
    :meth:`gap_logprobs`); None otherwise.
    ``timings``: what the backend measured around sampling, by metric name (the vLLM backend's
    ``time/offload`` / ``time/reload`` of the training state, and with ``vllm.check_push`` the
    push check's ``engine_push/*``), logged with the step's metrics.
    """

    sample: SampleOutput
    num_prompts: int
    num_samples: int
    engine_logprobs: Optional[torch.Tensor] = None
    timings: Dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> torch.Tensor:
        return self.sample.tokens

    def gap_logprobs(self, temperature: float) -> Optional[torch.Tensor]:
        """The sampler's log pi(token) [S, L-1] that the trainer's recomputation is compared with
        (``engine_gap/*``): :attr:`engine_logprobs` where set, else the sampler's own
        ``sample.logprobs`` when it sampled at ``temperature`` 1 (they are of
        ``softmax(logits / temperature)``): the megatron sampler's KV-cache forward against the
        training forward. None otherwise."""
        if self.engine_logprobs is not None:
            return self.engine_logprobs
        return self.sample.logprobs if temperature == 1.0 else None

    @property
    def response_mask(self) -> torch.Tensor:
        return self.sample.response_mask

    @property
    def lengths(self) -> torch.Tensor:
        """``[S]`` real length of each row (prompt + response tokens); the rest is padding."""
        return self.sample.prompt_lengths + self.sample.response_lengths

    @property
    def position_ids(self) -> torch.Tensor:
        """``[S, L]``: ``0 .. L-1`` on every row."""
        rows, length = self.sample.tokens.shape
        return torch.arange(length).unsqueeze(0).expand(rows, length).contiguous()

    def response_ids(self) -> List[List[int]]:
        """Each row's response token ids (EOS included when emitted)."""
        s = self.sample
        return [
            s.tokens[row, int(s.prompt_lengths[row]): int(s.prompt_lengths[row] + s.response_lengths[row])].tolist()
            for row in range(s.tokens.shape[0])
        ]


class RolloutBackend(Protocol):
    """What the training loop needs from a sampler."""

    def generate(self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams,
                 first_prompt_index: int = 0, prompt_indices: Optional[Sequence[int]] = None) -> RolloutBatch:
        """``num_samples`` responses for each of ``prompts`` (token ids with BOS), grouped.

        ``first_prompt_index``: global index of ``prompts[0]`` in the step's global batch (data
        parallel rank r passes ``r * len(prompts)``); or ``prompt_indices``, the global index of
        every prompt, when a rank's prompts are not contiguous in the global batch.
        """

    def update_weights(self) -> None:
        """Called after every optimizer step (a no-op when sampling from the trained model)."""


def global_sequence_ids(first_prompt_index: int, num_prompts: int, num_samples: int,
                        prompt_indices: Optional[Sequence[int]] = None) -> List[int]:
    """Global row index ``prompt_index * num_samples + j`` of each local row, where the prompt
    indices are ``prompt_indices`` or else ``first_prompt_index + g``."""
    if prompt_indices is None:
        prompt_indices = range(first_prompt_index, first_prompt_index + num_prompts)
    elif len(prompt_indices) != num_prompts:
        raise ValueError(f"{len(prompt_indices)} prompt_indices for {num_prompts} prompts")
    return [index * num_samples + j for index in prompt_indices for j in range(num_samples)]


class MegatronRolloutBackend:
    """Samples with the training model itself (megatron-core, KV cache, any TP/PP/DP layout)."""

    def __init__(self, model, stop_token_ids: Sequence[int], pad_id: int):
        self.model = model
        self.stop_token_ids = tuple(stop_token_ids)
        self.pad_id = pad_id

    def generate(self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams,
                 first_prompt_index: int = 0, prompt_indices: Optional[Sequence[int]] = None) -> RolloutBatch:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        rows = [list(prompt) for prompt in prompts for _ in range(num_samples)]
        sample = generate(
            self.model, rows, params, stop_token_ids=self.stop_token_ids, pad_id=self.pad_id,
            sequence_ids=global_sequence_ids(first_prompt_index, len(prompts), num_samples, prompt_indices),
        )
        return RolloutBatch(sample=sample, num_prompts=len(prompts), num_samples=num_samples)

    def update_weights(self) -> None:
        """Nothing to do: the backend samples from the parameters being trained."""


def pad_to_length(sample: SampleOutput, length: int, pad_id: int) -> SampleOutput:
    """``sample`` right-padded to ``L = length`` (e.g. the longest row over data-parallel ranks)."""
    current = sample.tokens.shape[1]
    if length < current:
        raise ValueError(f"pad_to_length: length {length} < current length {current}")
    extra = length - current
    return SampleOutput(
        tokens=torch.nn.functional.pad(sample.tokens, (0, extra), value=pad_id),
        response_mask=torch.nn.functional.pad(sample.response_mask, (0, extra)),
        logprobs=torch.nn.functional.pad(sample.logprobs, (0, extra)),
        prompt_lengths=sample.prompt_lengths,
        response_lengths=sample.response_lengths,
        finished=sample.finished,
    )


def trainer_logprobs(policy, batching: MicroBatching) -> Callable[[RolloutBatch], torch.Tensor]:
    """``rollout -> log pi(o_t)`` [S, L-1] (CPU, float32, 0 outside the response) by the trainer's
    own forward pass (``compute_logprobs``, the function that computes pi_prox when the step
    trains: with the same weights, the same values bit for bit) at temperature 1: the behaviour
    log-probs of the megatron sampler, which samples with the trained model itself
    (docs/quatro-math.md Sec. 9.6). Collective over the model-parallel group."""

    def logprobs(rollout: RolloutBatch) -> torch.Tensor:
        with torch.no_grad():
            values, _ = compute_logprobs(policy, model_inputs(rollout, current_device()), batching)
        return values.cpu() * rollout.response_mask

    return logprobs


def model_inputs(rollout: RolloutBatch, device: torch.device) -> Dict[str, torch.Tensor]:
    """``tokens``, ``position_ids`` and each row's real ``lengths`` (which the token-budget
    micro-batches trim to) of a rollout on the run's device (rollout book-keeping lives on the
    CPU; everything that reaches the model or a collective is on ``device``)."""
    return {"tokens": rollout.tokens.to(device), "position_ids": rollout.position_ids.to(device),
            "lengths": rollout.lengths.to(device)}
