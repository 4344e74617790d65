"""vLLM rollout backend (GPU clusters): the :class:`~quatro_nemo.engine.rollout.RolloutBackend`
protocol, colocated with the megatron-core trainer on the same GPUs.

``rollout.backend=vllm`` selects it and the ``vllm:`` config section
(:class:`quatro_nemo.engine.memory_plan.VllmConfig`) sizes it;
:func:`quatro_nemo.engine.rollout_backends.build_rollout_backend` builds it from the run's config.

How it works (vLLM's documented offline API: ``LLM``, ``SamplingParams``, ``collective_rpc``,
``sleep``/``wake_up``):

- **One engine per group of ``vllm.tensor_parallel`` consecutive ranks**, inside the training
  processes (``distributed_executor_backend="external_launcher"``, in-process engine core), so no
  extra GPUs or processes. Megatron's tensor-parallel group (consecutive ranks at PP = 1) holds
  one prompt list; it is split across the ``parallel.tensor / vllm.tensor_parallel`` engines in
  it and the results are all-gathered back in prompt order.
- **Sampling** with the training settings (temperature, top-p, max new tokens, stop at
  ``eos_id``); each response is its own request with seed ``f(params.seed, global sequence id)``,
  so rollouts do not depend on the layout. The sampled tokens' log-probs come back (diagnostics;
  the trainer recomputes pi_old with Megatron).
- **Weight push**: :meth:`update_weights` (after every optimizer step) marks the engine stale; the
  next :meth:`generate` streams the trained weights into vLLM before sampling: the collective
  :func:`quatro_nemo.megatron.checkpoint.iter_full_parameters` (one full tensor at a time) mapped
  to HF Qwen2 names by :func:`quatro_nemo.megatron.hf_conversion.iter_megatron_to_hf`, consumed
  by the vLLM model's own ``load_weights`` (which shards for its TP rank). With K inner loops the
  push happens once per rollout, not once per optimizer step.
- **Memory between phases** (``vllm.sleep_between_phases``): after sampling the engine sleeps at
  level 2 (KV cache and weights freed: the next push rewrites the weights anyway); before
  sampling it wakes the weights, receives the push, then wakes the KV cache.
- **Engine start**: vLLM builds the model from a ``config.json`` written from the trainer's
  ``ModelConfig`` with dummy weights (``load_format="dummy"``); no checkpoint is read (the first
  push brings the weights), so a randomly initialised policy works like a pretrained one.

GPU only. Without the ``vllm`` package, or where vLLM's platform is not CUDA, construction raises a
RuntimeError that says so (:func:`require_vllm`). CPU tests: the pure parts
(:func:`build_sample_output`, :func:`engine_slices`, :func:`request_seed`), and ``train()`` with
vLLM replaced at its import boundary by a fake engine (``tests/engine/test_vllm_train.py``). The
real engine runs in ``scripts/gpu_check.sh``.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from quatro_nemo.engine.memory_plan import VllmConfig
from quatro_nemo.engine.rollout import RolloutBatch, global_sequence_ids
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.collectives import tp_all_gather_objects
from quatro_nemo.megatron.sampling import SampleOutput, SamplingParams

_SEED_MODULUS = 2**31 - 1


@dataclass
class GeneratedResponse:
    """One completion, engine-independent: response token ids, their log-probs, and whether it
    ended with EOS (else it hit the token limit)."""

    token_ids: List[int]
    logprobs: List[float]
    finished: bool


def request_seed(seed: int, sequence_id: int) -> int:
    """The per-request seed of global sequence ``sequence_id`` (layout independent)."""
    return (int(seed) * 1_000_003 + int(sequence_id)) % _SEED_MODULUS


def engine_slices(num_prompts: int, num_engines: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, end)`` prompt ranges of each engine in a tensor-parallel group
    (the first ``num_prompts % num_engines`` engines take one more)."""
    base, extra = divmod(num_prompts, num_engines)
    slices, start = [], 0
    for engine in range(num_engines):
        end = start + base + (1 if engine < extra else 0)
        slices.append((start, end))
        start = end
    return slices


def build_sample_output(rows: Sequence[Sequence[int]], responses: Sequence[GeneratedResponse],
                        pad_id: int) -> SampleOutput:
    """The rollout tensors of ``docs/interfaces.md`` from prompts and generated responses.

    ``tokens [S, L]`` = prompt + response right-padded with ``pad_id``; ``response_mask`` and
    ``logprobs`` ``[S, L-1]`` with entry ``t`` describing ``tokens[t+1]``.
    """
    if len(rows) != len(responses):
        raise ValueError(f"{len(rows)} prompt rows but {len(responses)} responses")
    length = max(len(row) + len(resp.token_ids) for row, resp in zip(rows, responses))
    count = len(rows)
    tokens = torch.full((count, length), pad_id, dtype=torch.long)
    mask = torch.zeros(count, length - 1)
    logprobs = torch.zeros(count, length - 1)
    for i, (row, resp) in enumerate(zip(rows, responses)):
        if len(resp.logprobs) != len(resp.token_ids):
            raise ValueError(f"response {i}: {len(resp.token_ids)} tokens but {len(resp.logprobs)} log-probs")
        if not row:
            raise ValueError(f"prompt row {i} is empty (a prompt needs at least BOS)")
        prompt_len, response_len = len(row), len(resp.token_ids)
        tokens[i, :prompt_len] = torch.tensor(list(row), dtype=torch.long)
        if response_len:
            tokens[i, prompt_len:prompt_len + response_len] = torch.tensor(resp.token_ids, dtype=torch.long)
            mask[i, prompt_len - 1:prompt_len - 1 + response_len] = 1.0
            logprobs[i, prompt_len - 1:prompt_len - 1 + response_len] = torch.tensor(resp.logprobs)
    return SampleOutput(
        tokens=tokens, response_mask=mask, logprobs=logprobs,
        prompt_lengths=torch.tensor([len(row) for row in rows], dtype=torch.long),
        response_lengths=torch.tensor([len(r.token_ids) for r in responses], dtype=torch.long),
        finished=torch.tensor([r.finished for r in responses], dtype=torch.bool),
    )


def require_vllm():
    """The ``vllm`` module, or a RuntimeError saying why this backend cannot run here.

    The device check is vLLM's own (``vllm.platforms.current_platform``, the platform vLLM
    detected and would run its kernels on), so it lives at the import boundary: whatever
    ``vllm`` package is imported answers it. vLLM's CPU platform is refused (the colocated
    trainer and its weight push are written for GPUs)."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise RuntimeError("rollout.backend=vllm needs the vllm package (GPU container); "
                           "or use rollout.backend=megatron") from exc
    if not current_platform.is_cuda_alike():
        raise RuntimeError(f"rollout.backend=vllm needs CUDA GPUs (vLLM detected the "
                           f"{type(current_platform).__name__} platform); use rollout.backend=megatron on the CPU")
    return vllm


def write_engine_model_dir(model_config, directory: str) -> str:
    """An HF directory holding only the ``config.json`` of ``model_config`` (Qwen2), what vLLM
    builds its model from. The engine starts with dummy weights (``load_format="dummy"``): the
    trainer's weights are pushed before the first rollout, so no checkpoint is read, and random
    initialisation needs none."""
    from quatro_nemo.megatron.hf_conversion import hf_config_from_model_config

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(hf_config_from_model_config(model_config), handle, indent=2)
    return directory


class VllmRolloutBackend:
    """Colocated vLLM sampling with weight pushes from the megatron-core model (see module doc).

    ``model``: this rank's megatron-core stage; ``model_config``: its
    :class:`~quatro_nemo.megatron.models.ModelConfig` (Qwen2: the engine's architecture, dtype,
    vocabulary and ``max_model_len`` = ``max_position_embeddings``); ``engine``: the ``vllm:``
    section; ``eos_id`` / ``pad_id``: the task's tokens (sampling stops at EOS).
    """

    def __init__(self, model, model_config, engine: VllmConfig, eos_id: int, pad_id: int):
        vllm = require_vllm()
        self.vllm_config = engine
        self.model, self.model_config = model, model_config
        self.eos_id, self.pad_id = eos_id, pad_id
        tp, vllm_tp = parallel.tp_size(), engine.tensor_parallel
        if parallel.pp_size() != 1:
            raise ValueError("rollout.backend=vllm needs parallel.pipeline=1 (engines are built from "
                             "consecutive ranks inside a tensor-parallel group)")
        if tp % vllm_tp:
            raise ValueError(f"vllm.tensor_parallel={vllm_tp} must divide parallel.tensor={tp}")
        self.engines_per_group = tp // vllm_tp
        self.engine_index = parallel.tp_rank() // vllm_tp
        self._model_dir = tempfile.TemporaryDirectory(prefix="quatro-vllm-model-")
        # In-process engine core: the external launcher shares this process's torch.distributed.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(
            model=write_engine_model_dir(model_config, self._model_dir.name), load_format="dummy",
            tensor_parallel_size=vllm_tp, distributed_executor_backend="external_launcher",
            dtype=model_config.params_dtype,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            enable_sleep_mode=engine.sleep_between_phases,
            max_model_len=model_config.max_position_embeddings, max_num_seqs=engine.max_num_seqs,
            enforce_eager=engine.enforce_eager, seed=engine.seed,
            skip_tokenizer_init=True,
        )
        self._vllm = vllm
        self._asleep = False
        self._stale = True  # push the trainer's weights before the first rollout (dummy weights, resume)

    # ---- phases -------------------------------------------------------------------------------

    def update_weights(self) -> None:
        """After an optimizer step: the engine's weights are stale; pushed at the next generate."""
        self._stale = True

    def _push_weights(self) -> None:
        from quatro_nemo.megatron.checkpoint import iter_full_parameters
        from quatro_nemo.megatron.hf_conversion import iter_megatron_to_hf

        # Collective over the model-parallel group; every rank feeds its own vLLM worker.
        weights = iter_megatron_to_hf(iter_full_parameters(self.model, vocab_size=self.model_config.vocab_size),
                                      self.model_config)

        def load(worker):
            worker.model_runner.model.load_weights(weights=weights)

        self.llm.collective_rpc(load)
        self._stale = False

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        if self._stale:
            self._push_weights()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def _sleep(self) -> None:
        if self.vllm_config.sleep_between_phases:
            self.llm.sleep(level=2)
            self._asleep = True
            self._stale = True  # level 2 discards the weights

    # ---- sampling -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams,
                 first_prompt_index: int = 0, prompt_indices: Optional[Sequence[int]] = None) -> RolloutBatch:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        rows = [list(prompt) for prompt in prompts for _ in range(num_samples)]
        sequence_ids = global_sequence_ids(first_prompt_index, len(prompts), num_samples, prompt_indices)
        start, end = engine_slices(len(prompts), self.engines_per_group)[self.engine_index]
        mine = slice(start * num_samples, end * num_samples)

        self._wake()
        local = self._sample(rows[mine], sequence_ids[mine], params)
        self._sleep()
        responses = self._gather_over_engines(local)
        return RolloutBatch(sample=build_sample_output(rows, responses, self.pad_id),
                            num_prompts=len(prompts), num_samples=num_samples)

    def _sample(self, rows, sequence_ids, params: SamplingParams) -> List[GeneratedResponse]:
        vllm = self._vllm
        greedy = params.temperature == 0
        requests = [
            vllm.SamplingParams(
                n=1, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
                max_tokens=params.max_new_tokens, stop_token_ids=[self.eos_id], logprobs=0,
                seed=None if greedy else request_seed(params.seed, sid), detokenize=False,
            )
            for sid in sequence_ids
        ]
        prompts = [{"prompt_token_ids": row} for row in rows]
        outputs = self.llm.generate(prompts, sampling_params=requests, use_tqdm=False)
        responses = []
        for output in outputs:
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
            finished = bool(token_ids) and token_ids[-1] == self.eos_id
            responses.append(GeneratedResponse(token_ids, logprobs, finished))
        return responses

    def _gather_over_engines(self, local: List[GeneratedResponse]) -> List[GeneratedResponse]:
        """Every engine's responses, in prompt order, on every rank of the TP group."""
        if self.engines_per_group == 1:
            return local
        gathered: List[List[GeneratedResponse]] = tp_all_gather_objects(local)
        vllm_tp = self.vllm_config.tensor_parallel
        # The first rank of each engine speaks for it (all its ranks hold the same outputs).
        return [resp for engine in range(self.engines_per_group) for resp in gathered[engine * vllm_tp]]


__all__ = ["GeneratedResponse", "VllmRolloutBackend", "build_sample_output", "engine_slices",
           "request_seed", "require_vllm", "write_engine_model_dir"]
