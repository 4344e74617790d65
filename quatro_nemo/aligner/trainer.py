"""QUATRO trainer for NeMo-Aligner 0.7.0: ``ReinforceTrainer`` with grouped advantages and DP shards.

Imports NeMo-Aligner: import this module only where it is installed. What changes against the
parent (``nemo_aligner/algorithms/reinforce.py``), step by step (``docs/aligner.md``):

1. Generation as in the parent (``num_rollouts_per_prompt`` responses per prompt), but every
   rollout carries the DATASET ID of its prompt (``prompt_ids``) and is scored at once by the
   reward client (``quatro_nemo.aligner.rewards``: the project's verifier in-process, or the
   parent's remote reward server).
2. The rollouts of all DP ranks are gathered (the parent's ``gather_and_balance_globally``),
   grouped by dataset id (not by identical prompt tokens), and the registry's advantage estimator
   runs ONCE on the global ``[B, N]`` rewards (QUATRO: one vectorised dual solve).
3. Each DP rank keeps only its shard (``rollouts.dp_shard_indices``): global mini-batch ``t`` of
   ``model.global_batch_size`` sequences is split across the DP ranks. The parent trains every
   rank on the whole batch.
4. Log-probs of pi_old, and of pi_ref when the algorithm's ``beta > 0`` (k3 KL in the loss), are
   computed on the local shard only.
5. ``trainer.reinforce.quatro.inner_loops`` (K) optimizer passes over the same rollouts, pi_old
   fixed to the rollout policy (quatro-math.md Sec. 4, "K inner loops").
6. SIGUSR1 / SIGTERM (``quatro_nemo.megatron.preemption``, as the project's own loop): at the next
   step boundary every rank sees the signal, the parent's time-limit path saves a checkpoint
   (``check_progress(run_time_exceeded=True)``) and ``fit`` raises ``Preempted``; the recipe
   exits 75 and the SLURM template requeues. The rerun resumes from that checkpoint (NeMo's
   ``exp_manager.resume_if_exists``).

The parent's reward-side KL penalty (``initial_policy_kl_penalty``) must be 0: the reference KL is
the loss's k3 term (``model.quatro.algorithm.beta``).
"""
from __future__ import annotations

from contextlib import nullcontext

from nemo_aligner.algorithms.reinforce import (
    ReinforceRolloutBatch,
    ReinforceTrainer,
    compute_num_rollout_microbatches,
)
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.parallel_state import is_trt_llm_reshard, trt_llm_reshard_region
from nemo_aligner.utils.utils import cpu_dict
from quatro_nemo.aligner.config import QuatroTrainerOptions, check_save_interval
from quatro_nemo.aligner.rollouts import PROMPT_IDS, REWARDS, gather_rows, response_mask, shard_global_rollouts
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.preemption import Preempted, PreemptionFlag


class RunTimerOrSignal:
    """NeMo-Aligner's run timer (``nemo_aligner.utils.distributed.Timer``), also finished once any
    rank got SIGUSR1/SIGTERM. The parent's ``fit`` asks it once per step on every rank; when it is
    finished the parent saves a checkpoint and returns. ``signalled`` says it was the signal."""

    def __init__(self, timer, preemption: PreemptionFlag) -> None:
        self.timer = timer
        self.preemption = preemption
        self.signalled = False

    def start_time(self) -> None:
        self.timer.start_time()

    def is_finished(self) -> bool:
        time_is_up = bool(self.timer.is_finished())
        self.signalled = self.preemption.any_rank_signalled()
        return time_is_up or self.signalled

    def __repr__(self) -> str:
        return f"{self.timer!r} or SIGUSR1/SIGTERM"


class QuatroReinforceTrainer(ReinforceTrainer):
    """NeMo-Aligner's REINFORCE trainer driving a :class:`~quatro_nemo.aligner.actor.QuatroReinforceActor`.

    ``model`` must expose ``algorithm`` (an ``AlgorithmSpec``), ``algorithm_config`` and
    ``needs_reference_logprobs`` (the QUATRO actor does); ``collate_fn`` must add ``prompt_ids``
    (``quatro_nemo.aligner.data.collate_with_prompt_ids``).
    """

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader_builder, val_dataloader_builder,
                 collate_fn, rm, batch_iterator_cls, logger, ckpt_callback, run_timer):
        if cfg.get("initial_policy_kl_penalty", 0) != 0:
            raise ValueError(
                "trainer.reinforce.initial_policy_kl_penalty must be 0 with the QUATRO trainer: the reference "
                "KL is the k3 term of the loss, set by model.quatro.algorithm.beta"
            )
        check_save_interval(cfg.get("save_interval"))
        self.quatro_options = QuatroTrainerOptions.from_config(cfg.get("quatro"))
        self.preemption = PreemptionFlag()
        super().__init__(cfg, model, optimizer, scheduler, train_dataloader_builder, val_dataloader_builder,
                         collate_fn, rm, batch_iterator_cls, logger, ckpt_callback,
                         RunTimerOrSignal(run_timer, self.preemption))
        self.compute_init_policy_kl = False  # the parent's reward-side KL is off; see compute_reference

    @property
    def compute_reference(self) -> bool:
        return self.model.needs_reference_logprobs

    def _generate_scored_rollouts(self, dataloader_builder, consumed_samples: int, is_validation: bool):
        """Step 1: the global rollout batch (every DP rank's rollouts), each with its reward."""
        reshard_context = trt_llm_reshard_region if self.trtllm_reshard else nullcontext
        rollout_batches, futures = [], []
        with reshard_context():
            dataloader = dataloader_builder(consumed_samples=consumed_samples)
            num_microbatches = compute_num_rollout_microbatches(dataloader)
            with self.timer("batch_iterator_init"):
                batch_iterator = self.batch_iterator_cls(
                    iter(dataloader.batch_sampler), num_microbatches, dataloader.dataset, self.collate_fn
                )
            num_responses = 1 if is_validation else self.cfg.num_rollouts_per_prompt
            with self.timer("generate"):
                for batch in batch_iterator:
                    if PROMPT_IDS not in batch:
                        raise KeyError(
                            "the rollout batch has no 'prompt_ids': build collate_fn with "
                            "quatro_nemo.aligner.data.collate_with_prompt_ids"
                        )
                    for _ in range(num_responses):
                        rollout_batch = self.model.infer(batch)
                        rollout_batch[PROMPT_IDS] = batch[PROMPT_IDS].to(rollout_batch["response_tokens"].device)
                        rollout_batches.append(rollout_batch)
                        futures.append(self.rm.infer_rm(rollout_batch))
            with self.timer("reward_wait"):
                for rollout_batch, future in zip(rollout_batches, futures):
                    rollout_batch[REWARDS] = future.result().flatten().to(rollout_batch["response_tokens"].device)
            local_batch = ReinforceRolloutBatch.from_rollout_batches(
                rollout_batches,
                eos_id=self.model.tokenizer.eos_id,
                rollout_batch_seq_length=self.cfg.rollout_batch_seq_length,
            )
            # Inside the reshard region: is_trt_llm_reshard() must see it (as in the parent).
            return self._gather_globally(local_batch)

    def _gather_globally(self, local_batch):
        """Every DP rank's rollouts, in rank order, on every rank (the parent's
        ``gather_and_balance_globally``, with a gather that also runs on gloo: ``rollouts.gather_rows``).
        With TRT-LLM resharding the pipeline groups generated separately and are gathered first."""
        groups = [parallel.dp_group()]
        if is_trt_llm_reshard():
            groups.insert(0, parallel.pp_group())
        gathered = {}
        for key, tensor in local_batch.items():
            for group in groups:
                tensor = gather_rows(tensor, group)
            gathered[key] = tensor
        return gathered

    def _run_inference(self, dataloader_builder, consumed_samples, is_validation):
        """Steps 1-4 of the module doc. Returns (this rank's shard, global rollout metrics)."""
        global_batch = self._generate_scored_rollouts(dataloader_builder, consumed_samples, is_validation)
        metrics = self.compute_rollout_metrics(global_batch)
        if is_validation:
            return global_batch, cpu_dict(metrics)

        num_responses = self.cfg.num_rollouts_per_prompt
        shuffle_seed = self.quatro_options.seed + self.step if self.quatro_options.shuffle_groups else None
        local_batch, advantage_metrics = shard_global_rollouts(
            global_batch,
            num_responses,
            self.model.algorithm.advantage_estimator,
            self.model.algorithm_config,
            self.cfg.model_gbs,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
            shuffle_seed,
        )
        with self.timer("logprobs"):
            local_batch["old_logprobs"] = self.model.get_inference_log_probs(local_batch["response_tokens"])
        if self.compute_reference:
            with self.timer("init_logprobs"):
                local_batch["ref_logprobs"] = self.model.get_init_policy_logprobs(local_batch["response_tokens"])
        # consumed_samples counts PROMPTS (what the dataloader's sampler consumed), not responses.
        metrics["rollout_size"] = global_batch[PROMPT_IDS].numel() // num_responses
        metrics["num_responses"] = global_batch[PROMPT_IDS].numel()
        metrics.update({f"advantages/{k}": float(v) for k, v in advantage_metrics.items()})
        return local_batch, cpu_dict(metrics)

    def generate_reinforce_data(self, rollout_batch):
        """The training batch of this rank (the actor's keys, ``quatro_nemo.aligner.loss.LOSS_KEYS``)."""
        old_logprobs = rollout_batch["old_logprobs"]
        data = {
            "response_tokens": rollout_batch["response_tokens"],
            "response_mask": response_mask(
                rollout_batch["prompt_lengths"], rollout_batch["response_lengths"], old_logprobs.size(1)
            ).to(old_logprobs.device),
            "advantages": rollout_batch["advantages"],
            "old_logprobs": old_logprobs,
        }
        if "ref_logprobs" in rollout_batch:
            data["ref_logprobs"] = rollout_batch["ref_logprobs"]
        return data, {}

    def run_training(self, dataloader_iter):
        """K passes (``trainer.reinforce.quatro.inner_loops``) of the parent's optimizer loop."""
        minibatches = list(dataloader_iter)
        result = None
        for _ in range(self.quatro_options.inner_loops):
            result = super().run_training(iter(minibatches))
        return result

    def fit(self):
        """The parent's loop. After SIGUSR1/SIGTERM it has saved a checkpoint at the step boundary
        and returned: raise ``Preempted`` (the recipe exits 75) unless that was the last step."""
        super().fit()
        if self.run_timer.signalled and self.step < self.max_steps:
            raise Preempted(f"{self.preemption.signal_name or 'signal on another rank'} at step {self.step}")
