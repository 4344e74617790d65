"""The RL training loop, top to bottom (architecture.md, "One training step").

    for step in steps:
        prompts      <- B prompts of the training set (a function of (seed, step): exact resume)
        rollouts     <- N responses per prompt, sampled by the weights of step max(0, step - k)
                        (rollout pipeline and backend; k = rollout.pipeline.max_staleness, 0: pi_old)
        rewards      <- verifier(prompt, response)                         [B, N]
        log pi_old, log pi_ref <- Megatron forward under TP/PP
        (a rollout sampled by older weights: importance weights pi_old / mu, quatro-math.md Sec. 9)
        advantages   <- registry estimator(rewards)   (QUATRO: exact per-prompt dual, Eq. 11-15)
        repeat K times (inner loops; pi_old stays the rollout policy):
            for each mini-batch: Megatron forward/backward of the registry loss with GLOBAL
                                 normalisers -> megatron DDP grad reduction -> megatron
                                 (distributed) optimizer step, which clips the global grad norm
        metrics -> metrics.jsonl / TensorBoard; checkpoint; periodic held-out evaluation

Every algorithm runs through this same function: only `spec.advantage_estimator`, `spec.policy_loss`,
the algorithm's state between steps (`spec.make_state`: QUATRO's adaptive radius and lr, behind
`config_for_step` / `observe`) and the config differ. Data parallelism splits each mini-batch's prompts across DP ranks (a group of
N responses never straddles ranks), so the optimizer sees the same global batch in any layout.

One run device: rollout book-keeping and rewards live on the CPU; every tensor that reaches the
model, the loss or a collective is on ``current_device()`` (the rank's GPU, or the CPU without
CUDA).
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch
from omegaconf import OmegaConf

from quatro_nemo.algos import AlgorithmSpec, ShapedGroups, get_algorithm
from quatro_nemo.algos.importance import ImportanceCorrection, truncated_importance_weights
from quatro_nemo.algos.metric_reduction import reduce_over_updates
from quatro_nemo.algos.step_state import AlgorithmState, StepMeasurements
from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine import rollout_store
from quatro_nemo.engine.checkpoint import TrainState
from quatro_nemo.engine.config import ExperimentConfig
from quatro_nemo.engine.evaluation import evaluate_policy, training_eval_settings
from quatro_nemo.engine.logging import PHASES_KIND, MetricsLogger
from quatro_nemo.engine.off_policy import OffPolicyStep, correct_stale_rollout
from quatro_nemo.engine.phase_peaks import PhasePeaks
from quatro_nemo.engine.pipeline import RolloutPipeline
from quatro_nemo.engine.preemption_lead import preemption_report
from quatro_nemo.engine.progress import StepProgress
from quatro_nemo.engine.report import heldout_table, write_report
from quatro_nemo.engine.rollout import RolloutBackend, model_inputs
from quatro_nemo.engine.rollout_backends import build_rollout_backend, hand_over_training_state
from quatro_nemo.engine.step_rollout import build_pipeline, step_problems
from quatro_nemo.engine.task import build_task
from quatro_nemo.engine.timer import Timer
from quatro_nemo.eval.samples import write_samples
from quatro_nemo.megatron import parallel, training
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.batching import MicroBatching
from quatro_nemo.megatron.collectives import all_gather_objects, dp_all_gather, dp_sum, dp_sum_in_place
from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
from quatro_nemo.megatron.models import build_model
from quatro_nemo.megatron.quiet import quiet_library_warnings
from quatro_nemo.megatron.checkpoint import load_full_state_dict
from quatro_nemo.megatron.preemption import Preempted, PreemptionFlag
from quatro_nemo.tasks.base import Task
from quatro_nemo.validation import check_mini_batches

# --------------------------------------------------------------------------------------------
# Small pieces the loop reads through
# --------------------------------------------------------------------------------------------


def local_prompt_slots(batch_size: int, mini_batch_size: int, dp_rank: int, dp_size: int) -> List[int]:
    """Positions (in the step's global prompt list) this DP rank rolls out and trains on.

    Mini-batch m holds global positions [m*M, (m+1)*M); each DP rank owns an equal contiguous share
    of every mini-batch, so each optimizer step sees the whole mini-batch across ranks.
    """
    share = mini_batch_size // dp_size
    slots = []
    for start in range(0, batch_size, mini_batch_size):
        slots.extend(range(start + dp_rank * share, start + (dp_rank + 1) * share))
    return slots


def global_rewards(local_rewards: torch.Tensor, batch_size: int, mini_batch_size: int) -> torch.Tensor:
    """[B, N] rewards in global prompt order from each DP rank's [B/dp, N] share (run device)."""
    dp = parallel.dp_size()
    local_rewards = local_rewards.to(current_device())
    out = torch.empty(batch_size, local_rewards.shape[1], dtype=local_rewards.dtype, device=local_rewards.device)
    for rank, part in enumerate(dp_all_gather(local_rewards)):
        out[local_prompt_slots(batch_size, mini_batch_size, rank, dp)] = part
    return out


def shape_rewards(spec, algo_cfg, rollout, local_rewards: torch.Tensor, batch_size: int,
                  mini_batch_size: int, max_new_tokens: int):
    """Step 3b: (global [B, N] verifier rewards, the algorithm's data-side view of them:
    ``spec.shape_groups`` -> ShapedGroups(rewards for the advantages, [B] group weights))."""
    lengths = rollout.sample.response_lengths.view(rollout.num_prompts, rollout.num_samples).to(torch.float64)
    rewards = global_rewards(local_rewards, batch_size, mini_batch_size)
    lengths = global_rewards(lengths, batch_size, mini_batch_size)
    return rewards, spec.shape_groups(rewards, lengths, max_new_tokens, algo_cfg)


def make_batch(rollout, group_weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The Megatron batch layout of docs/interfaces.md, on the run device, but the advantages.
    `group_weights` [S] are 1/0 per row (groups dropped by dynamic sampling leave the loss)."""
    batch = model_inputs(rollout, current_device())
    batch["response_mask"] = rollout.response_mask.to(batch["tokens"].device).float() * group_weights.to(
        batch["tokens"].device).float()[:, None]
    return batch


def slice_batch(batch: Dict[str, torch.Tensor], rows: slice) -> Dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


def engine_gap_metrics(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                       response_mask: torch.Tensor) -> Dict[str, float]:
    """How far the rollout engine's sampling distribution is from the policy the trainer
    computes (verl's rollout/trainer probability gap, NeMo-RL's token probability error), over
    every sampled token of the step (all DP ranks; identical on every rank).

    Args:
        engine_logprobs: [S, T] the engine's log pi(o_t) of each sampled token (temperature 1).
        trainer_logprobs: [S, T] Megatron's recomputed log pi_old(o_t) of the same tokens.
        response_mask: [S, T] 1 on sampled tokens.

    Returns ``engine_gap/token_abs_mean`` and ``/token_abs_max`` (|log pi_trainer - log pi_engine|
    per token), ``/seq_log_ratio_abs_mean`` (|sum_t (log pi_trainer - log pi_engine)| per
    sequence) and ``/seq_ratio_mean`` (the sequence importance ratio pi_trainer(o) / pi_engine(o)).
    """
    from quatro_nemo.megatron.loss import reduce_metrics

    mask = response_mask.to(trainer_logprobs.device).float()
    diff = (trainer_logprobs.float() - engine_logprobs.to(trainer_logprobs.device).float()) * mask
    sequence_log_ratio = diff.sum(dim=-1)
    has_tokens = (mask.sum(dim=-1) > 0).float()
    totals = reduce_metrics([{
        "engine_gap/token_abs_sum": diff.abs().sum(), "engine_gap/tokens": mask.sum(),
        "engine_gap/token_abs_max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
        "engine_gap/seq_log_ratio_abs_sum": (sequence_log_ratio.abs() * has_tokens).sum(),
        "engine_gap/seq_ratio_sum": (sequence_log_ratio.exp() * has_tokens).sum(),
        "engine_gap/sequences": has_tokens.sum(),
    }])
    tokens, sequences = max(totals["engine_gap/tokens"], 1.0), max(totals["engine_gap/sequences"], 1.0)
    return {"engine_gap/token_abs_mean": totals["engine_gap/token_abs_sum"] / tokens,
            "engine_gap/token_abs_max": totals["engine_gap/token_abs_max"],
            "engine_gap/seq_log_ratio_abs_mean": totals["engine_gap/seq_log_ratio_abs_sum"] / sequences,
            "engine_gap/seq_ratio_mean": totals["engine_gap/seq_ratio_sum"] / sequences}


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def select_device(device: str) -> None:
    """trainer.device: `cpu` hides any GPU (megatron then runs over gloo with the CPU shim), `cuda`
    insists on one, `auto` takes a GPU when there is one. Call before CUDA is first queried."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda, but no CUDA device is available (use trainer.device=cpu)")


def build_training_state(policy, trainer, distributed_optimizer: bool):
    """(megatron's DDP around ``policy``, megatron's (distributed) optimizer with the
    ``trainer.*`` settings). Shared by :func:`build_run` and ``benchmarks/bench_step.py``."""
    policy_ddp = training.wrap_for_training(policy, distributed_optimizer=distributed_optimizer)
    optimizer = training.build_optimizer(policy_ddp, training.OptimizerSettings(
        lr=trainer.lr, weight_decay=trainer.weight_decay, adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2, adam_eps=trainer.adam_eps, grad_clip=trainer.grad_clip))
    return policy_ddp, optimizer


def step_micro_batching(cfg: ExperimentConfig) -> MicroBatching:
    """The micro-batching of every pass over a step's rollouts: ``mini_batch_rows`` = one optimizer
    step's local rows (the mini-batch's prompts on this DP rank x N), so the log-prob passes split
    the rows exactly as the training forwards do."""
    mini_batch_prompts = cfg.trainer.mini_batch_prompts or cfg.trainer.prompts_per_step
    return MicroBatching.from_parallel_config(
        cfg.parallel, mini_batch_rows=mini_batch_prompts // parallel.dp_size() * cfg.rollout.n)


@dataclass
class Run:
    """Everything a training step reads, built once by :func:`build_run`: the config, the algorithm
    (``spec``) and its state between steps, the policy, megatron's DDP around it and optimizer, the
    frozen reference (None without a KL term), the rollout backend, the micro-batching, this DP
    rank's prompt ``slots`` in each step's global batch, the loop's position ``state`` (what a
    checkpoint saves) and the phases' seconds and memory peaks (``phases``). ``task``, ``logger``
    and ``layout`` are None where only the update runs (``benchmarks/bench_step.py``, tests);
    ``rollouts``, the rollout pipeline, None there too."""

    cfg: ExperimentConfig
    spec: AlgorithmSpec
    algorithm_state: AlgorithmState
    policy: Any
    policy_ddp: Any
    optimizer: Any
    reference: Any
    backend: RolloutBackend
    batching: MicroBatching
    slots: List[int]
    state: TrainState
    task: Optional[Task] = None
    logger: Optional[MetricsLogger] = None
    layout: Any = None
    rollouts: Optional[RolloutPipeline] = None
    phases: PhasePeaks = field(default_factory=PhasePeaks)


def build_run(cfg: ExperimentConfig) -> Run:
    """Set up a run (collective): parallel state, task and base model, policy, rollout backend,
    DDP and optimizer, reference, the algorithm's state, resume from the newest checkpoint, logger."""
    quiet_library_warnings()
    select_device(cfg.trainer.device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    layout = parallel.initialize_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.run.seed)
    phases = PhasePeaks()  # the start-up phase from here (on the rank's device, now chosen)
    spec = get_algorithm(cfg.algorithm_name)
    mini_batch_prompts = cfg.trainer.mini_batch_prompts or cfg.trainer.prompts_per_step
    check_mini_batches(cfg.trainer.prompts_per_step, cfg.trainer.mini_batch_prompts, layout.data_parallel)
    _write_run_files(cfg, layout)

    # Task: prompts, tokenizer, verifier, and the base model (warm-start on the CPU default).
    task: Task = build_task(cfg)
    model_cfg = task.model_config(cfg.model)
    base_state = task.load_base_state(model_cfg)    # full (TP=1, PP=1) state dict, same on all ranks
    policy = build_model(model_cfg)
    if base_state is not None:  # None: the task keeps megatron's random initialisation
        load_full_state_dict(policy, base_state)
    del base_state
    # The rollout engine first: a colocated vLLM engine checks at start-up that its share of GPU
    # memory is free, which it no longer is once gradient buffers and optimizer state exist.
    backend = build_rollout_backend(cfg, policy, model_cfg, task)
    policy_ddp, optimizer = build_training_state(policy, cfg.trainer, cfg.scale.distributed_optimizer)
    hand_over_training_state(backend, cfg, policy_ddp, optimizer)
    reference = None
    if spec.needs_reference_model(cfg.algorithm):
        reference = build_model(model_cfg)
        reference.load_state_dict(policy.state_dict())  # pi_ref: the base policy
        reference.requires_grad_(False)

    # Resume (any parallel layout: the checkpoint is sharded by megatron's dist_checkpointing).
    algorithm_state = spec.make_state(cfg.algorithm)
    state, resume_from = TrainState(), ckpt.latest_step(cfg.run.dir) if cfg.run.resume else None
    phases.end("startup")
    if resume_from is not None:
        with phases.phase("resume"):  # the checkpoint's load, on top of the training state
            state = TrainState.from_common(ckpt.load_checkpoint(cfg.run.dir, resume_from, policy_ddp, optimizer,
                                                                ckpt.layout_signature(layout)))
        algorithm_state.load_state_dict(state.algorithm_state)
    logger = MetricsLogger(cfg.run.dir, enabled=layout.rank == 0, resumed_step=resume_from,
                           tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
                           config=OmegaConf.to_container(cfg.raw, resolve=True))
    slots = local_prompt_slots(cfg.trainer.prompts_per_step, mini_batch_prompts, layout.dp_rank,
                               layout.data_parallel)
    run = Run(cfg=cfg, spec=spec, algorithm_state=algorithm_state, policy=policy, policy_ddp=policy_ddp,
              optimizer=optimizer, reference=reference, backend=backend, batching=step_micro_batching(cfg),
              slots=slots, state=state, task=task, logger=logger, layout=layout, phases=phases)
    run.rollouts = build_pipeline(run, resume_from)
    return run


def train_step(run: Run, step: int) -> Dict[str, float]:
    """One rollout step (module docstring, steps 1-7) with the config the algorithm's state sets
    for it; advances ``run.state``. Returns the step's metrics (identical on every rank)."""
    timer, cfg, task = Timer(), run.algorithm_state.config_for_step(run.cfg), run.task
    n, batch_size = cfg.rollout.n, cfg.trainer.prompts_per_step
    with timer.phase("rollout"), run.phases.phase("rollout"):
        # 1-2. This DP rank's prompts and N responses each, sampled by the weights of step
        #      max(0, step - k) (rollout.pipeline.max_staleness = k; k = 0: pi_old's, sampled now).
        run.rollouts.advance(step)
        taken = run.rollouts.take(step, run.state.optimizer_steps)
        rollout, problems = taken.batch, step_problems(run, step)
        responses = task.decode(rollout)
    with timer.phase("logprobs"):
        # 3. Rewards [B_local, N] -> global [B, N] (advantage estimators may use batch statistics).
        local_rewards = torch.tensor(task.verifier.score_batch([p for p in problems for _ in range(n)], responses),
                                     dtype=torch.float64).view(len(problems), n)
        rewards, groups = shape_rewards(run.spec, cfg.algorithm, rollout, local_rewards, batch_size,
                                        cfg.trainer.mini_batch_prompts or batch_size, cfg.rollout.max_new_tokens)
    # 4-6. log pi_old / log pi_ref, advantages (phase "logprobs"), K inner loops ("update").
    with run.phases.phase("train"):
        learned = learn_from_rollout(run, cfg, rollout, groups, timer, stale=taken.result.version < step)
    run.algorithm_state.observe(StepMeasurements(rewards, learned.policy_shift, learned.off_policy.sample_weights))
    run.state = TrainState(next_step=step + 1, optimizer_steps=run.state.optimizer_steps + len(learned.metrics),
                           algorithm_state=run.algorithm_state.state_dict())
    # 7. Metrics.
    metrics = _step_metrics(rewards, learned.advantages.metrics, learned.metrics, rollout, learned.old_entropy)
    metrics.update(learned.engine_gap)
    if cfg.rollout.pipeline.overlapped:
        metrics.update(taken.metrics, **learned.off_policy.metrics)
    metrics.update(rollout.timings)
    metrics.update(run.algorithm_state.metrics())
    metrics.update(timer.metrics())
    return metrics


def train(cfg: ExperimentConfig) -> Dict[str, Any]:
    """Build the run, then train_step over the remaining steps, with held-out evaluation (at the
    start and every ``trainer.eval_every``), logging and checkpoints (every ``checkpoint_every``,
    at the end and on a preemption signal)."""
    run = build_run(cfg)
    rank0, trainer, start_step = run.layout.rank == 0, cfg.trainer, run.state.next_step
    if rank0:
        print(f"[quatro] {cfg.algorithm_name} | world {run.layout.world_size} (tp {run.layout.tensor_parallel}, "
              f"pp {run.layout.pipeline_parallel}, dp {run.layout.data_parallel}) | steps {start_step}->"
              f"{trainer.steps} | run dir {cfg.run.dir}", flush=True)
        lead = preemption_report(cfg, run.layout.world_size)
        if lead:
            print(f"[quatro] {lead}", flush=True)
    preemption, progress = PreemptionFlag(), StepProgress(cfg, rank0, start_step)
    if start_step == 0 and cfg.eval.num_problems > 0:
        evaluate(run, 0)   # the base model's held-out numbers, the report's "before" column
    for step in range(start_step, trainer.steps):
        metrics = train_step(run, step)
        done = step + 1 == trainer.steps
        logged = (step + 1) % trainer.log_every == 0 or done
        if logged:
            run.logger.log(step + 1, metrics)
        progress.step_done(step + 1, metrics, logged)
        preempted = preemption.any_rank_signalled()
        eval_due = done or trainer.eval_every and (step + 1) % trainer.eval_every == 0
        if cfg.eval.num_problems > 0 and eval_due and (done or not preempted):
            # Before the checkpoint: a resumed run never redoes a logged record. A pending
            # preemption signal skips it (this step gets no held-out record): the save comes first.
            evaluate(run, step + 1)
            preempted = preemption.any_rank_signalled()
        if done or preempted or (trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0):
            with run.phases.phase("save"):
                ckpt.save_checkpoint(cfg.run.dir, step + 1, run.policy_ddp, run.optimizer, run.state.to_common(),
                                     ckpt.layout_signature(run.layout), keep=trainer.keep_checkpoints,
                                     files=_rollouts_in_flight(run, step + 1))
        run.logger.log(step + 1, run.phases.pop(), kind=PHASES_KIND)  # engine/phase_peaks.py
        if preempted and not done:
            run.logger.close()
            raise Preempted(f"{preemption.signal_name or 'signal on another rank'} at step {step + 1}")
    progress.close()
    run.rollouts.close()
    run.logger.close()
    return _finish(run) if rank0 else {}


def _rollouts_in_flight(run: Run, next_step: int) -> Dict[str, Any]:
    """The checkpoint's file of rollouts sampled ahead (collective; none for the synchronous loop)."""
    if not run.cfg.rollout.pipeline.overlapped:
        return {}
    return {rollout_store.ROLLOUTS_FILE: rollout_store.pipeline_state(run.rollouts, next_step, run.slots)}


def evaluate(run: Run, step: int) -> Dict[str, Any]:
    """Held-out evaluation of the current policy (collective), logged and its samples saved."""
    heldout = run.task.heldout_problems[:run.cfg.eval.num_problems]
    with run.phases.phase("eval"):
        eval_metrics, rows = evaluate_policy(run.policy, run.backend, run.task, heldout,
                                             training_eval_settings(run.cfg))
    if run.layout.rank == 0:   # the samples recipes/evaluate.py and the run report read
        os.makedirs(os.path.join(run.cfg.run.dir, "eval"), exist_ok=True)
        write_samples(os.path.join(run.cfg.run.dir, "eval", f"samples_step{step:06d}.jsonl"), rows)
    run.logger.log(step, eval_metrics, kind="eval")
    return eval_metrics


def _finish(run: Run) -> Dict[str, Any]:
    """Rank 0: the run's report, and the before/after table where the user is looking."""
    summary = write_report(run.cfg.run.dir, run.cfg, run.task.properties)
    print(f"[quatro] done: report at {os.path.join(run.cfg.run.dir, 'report.md')}", flush=True)
    if summary["base"] and summary["final"]:
        print("\n".join(heldout_table(summary["base"], summary["final"])), flush=True)
    return summary


# --------------------------------------------------------------------------------------------
# Steps 4-6: learning from one rollout
# --------------------------------------------------------------------------------------------


@dataclass
class RolloutLearning:
    """What :func:`learn_from_rollout` returns: the estimator's output (``advantages`` [B, N] and
    its metrics), one metrics dict per optimizer step, pi_old's entropies [S_local, T], the engine
    gap metrics (:meth:`RolloutBatch.gap_logprobs`), and, when the algorithm's state needs it, the
    updated policy's global trajectory log-ratios ``log pi_theta(o_i) / pi_old(o_i)`` [B, N] (else
    None); for a rollout sampled ahead (``rollout.pipeline``), its importance weights and
    ``async/ess_frac``."""

    advantages: Any
    metrics: List[Dict[str, float]]
    old_entropy: torch.Tensor
    engine_gap: Dict[str, float]
    policy_shift: Optional[torch.Tensor] = None
    off_policy: OffPolicyStep = field(default_factory=OffPolicyStep)


def learn_from_rollout(run: Run, cfg: ExperimentConfig, rollout, groups: ShapedGroups,
                       timer: Optional[Timer] = None, stale: bool = False) -> RolloutLearning:
    """Steps 4-6 of a training step on this rank's rollout with the step's config ``cfg``, shared
    by :func:`train_step` and ``benchmarks/bench_step.py`` (which replays saved rollouts through
    it). ``groups``: the algorithm's data-side view of the global [B, N] rewards
    (:func:`shape_rewards`); ``stale``: the rollout was sampled by older weights than the step's
    (``rollout.pipeline``, docs/quatro-math.md Sec. 9). Collective over all ranks. Phases
    ``logprobs`` and ``update`` of ``timer``."""
    timer = timer or Timer()
    n, batching = cfg.rollout.n, run.batching
    batch_size, mini_batch_size = cfg.trainer.prompts_per_step, cfg.trainer.mini_batch_prompts or cfg.trainer.prompts_per_step
    with timer.phase("logprobs"):
        # 4. log pi_old (recomputed by Megatron, as the loss sees it) and log pi_ref; rows of groups
        # the data-side hook dropped (DAPO's filter) leave the loss.
        batch = make_batch(rollout, groups.weights[run.slots].repeat_interleave(n))
        with torch.no_grad():
            batch["old_logprobs"], old_entropy = compute_logprobs(run.policy, batch, batching)
            if run.reference is not None:
                batch["ref_logprobs"], _ = compute_logprobs(run.reference, batch, batching)
        sampler_logprobs = rollout.gap_logprobs(cfg.rollout.temperature)
        engine_gap = ({} if sampler_logprobs is None else
                      engine_gap_metrics(sampler_logprobs, batch["old_logprobs"], rollout.response_mask))
        # A rollout sampled ahead: importance weights pi_old / mu and the correction (Sec. 9.2-9.5).
        off_policy = OffPolicyStep()
        if cfg.rollout.pipeline.overlapped:
            off_policy = correct_stale_rollout(cfg.rollout.pipeline, rollout, batch, run.slots, correct=stale,
                                               to_global=lambda local: global_rewards(local, batch_size, mini_batch_size))
        # 5. Advantages from the registry (QUATRO: one vectorised dual solve over all B groups).
        advantage_out = run.spec.advantage_estimator(groups.rewards, cfg.algorithm, off_policy.sample_weights)
        batch["advantages"] = advantage_out.advantages[run.slots].reshape(-1).to(batch["tokens"].device).float()
        correction = ImportanceCorrection(cfg.rollout.importance_correction)
        if rollout.engine_logprobs is not None and correction != ImportanceCorrection.none:
            device = batch["old_logprobs"].device
            batch["is_weights"] = truncated_importance_weights(
                batch["old_logprobs"], rollout.engine_logprobs.to(device), rollout.response_mask.to(device),
                correction, cfg.rollout.importance_cap)
    with timer.phase("update"):
        # 6. K inner loops over the same rollouts; each mini-batch is one optimizer step.
        update_metrics = update_policy(run, cfg, batch)
        if update_metrics:
            run.backend.update_weights()
        policy_shift = measure_policy_shift(run, cfg, batch) if run.algorithm_state.needs_policy_shift else None
    return RolloutLearning(advantage_out, update_metrics, old_entropy, engine_gap, policy_shift, off_policy)


def update_policy(run: Run, cfg: ExperimentConfig, batch: Dict[str, torch.Tensor]) -> List[Dict[str, float]]:
    """K inner loops over one rollout batch (step 6): each mini-batch of ``run.batching``'s
    ``mini_batch_rows`` local rows is one optimizer step. Returns each update's metrics (loss
    metrics, grad_norm, lr).

    No step without a signal: a mini-batch whose loss has no gradient at all (every advantage 0
    while the policy is still pi_old and pi_ref) takes no optimizer step and returns no metrics,
    so neither Adam's momentum nor weight decay moves the weights. Its gradient is exactly 0 only
    because pi_old's log-probs equal the training forward's bitwise (the log-prob passes use the
    same ``run.batching``: the same micro-batches in both passes)."""
    trainer, rows_per_mini = cfg.trainer, run.batching.mini_batch_rows
    optimizer_steps_done = run.state.optimizer_steps
    updates: List[Dict[str, float]] = []
    for _inner in range(trainer.inner_loops):
        for start in range(0, batch["tokens"].shape[0], rows_per_mini):
            mini = slice_batch(batch, slice(start, start + rows_per_mini))
            if dp_sum(mini["response_mask"].sum()) == 0:
                continue  # every group of this mini-batch was filtered out (dynamic sampling)
            training.zero_gradients(run.policy_ddp, run.optimizer)
            metrics = train_step_forward_backward(run.policy_ddp, mini, run.spec.policy_loss, cfg.algorithm,
                                                  run.batching)
            if not training.has_gradient(run.policy_ddp):
                continue  # no learning signal: no step on a zero gradient
            lr = training.warmup_learning_rate(trainer.lr, trainer.lr_warmup_steps, optimizer_steps_done)
            training.set_learning_rate(run.optimizer, lr)
            metrics["grad_norm"] = training.optimizer_step(run.policy_ddp, run.optimizer)
            metrics["lr"] = lr
            optimizer_steps_done += 1
            updates.append(metrics)
    return updates


def measure_policy_shift(run: Run, cfg: ExperimentConfig, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The updated policy's trajectory log-ratios ``sum_t (log pi_theta - log pi_old)`` [B, N] in
    global prompt order (float64, every rank): one more forward pass over the step's rollouts."""
    with torch.no_grad():
        new_logprobs, _ = compute_logprobs(run.policy, batch, run.batching)
    local = ((new_logprobs - batch["old_logprobs"]) * batch["response_mask"]).sum(dim=-1)
    batch_size = cfg.trainer.prompts_per_step
    return global_rewards(local.view(len(run.slots), cfg.rollout.n).double(), batch_size,
                          cfg.trainer.mini_batch_prompts or batch_size)


def _step_metrics(rewards, advantage_metrics, update_metrics, rollout, old_entropy) -> Dict[str, float]:
    """Per-step training metrics, reduced identically on every rank."""
    out: Dict[str, float] = {
        "reward/mean": float(rewards.mean()),
        "reward/solved_frac": float((rewards.max(dim=1).values > 0).float().mean()),
    }
    out.update({k: float(v) for k, v in advantage_metrics.items()})
    out["optimizer_steps"] = len(update_metrics)
    out.update(reduce_over_updates(update_metrics))
    mask = rollout.response_mask.to(old_entropy.device).float()  # every sampled token, filtered groups too
    local = torch.tensor([float((old_entropy * mask).sum()), float(mask.sum()), float(mask.shape[0])],
                         dtype=torch.float64, device=current_device())
    dp_sum_in_place(local)
    out["entropy"] = float(local[0] / local[1].clamp(min=1))
    out["response_length/mean"] = float(local[1] / local[2])
    return out


def _write_run_files(cfg: ExperimentConfig, layout) -> None:
    """Resolved config (rank 0) and world.json: every rank's host, pid and coordinates."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    me = dict(asdict(layout), host=socket.gethostname(), pid=os.getpid(),
              master=f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}")
    everyone = all_gather_objects(me)
    if layout.rank == 0:
        OmegaConf.save(cfg.raw, os.path.join(cfg.run.dir, "config.yaml"))
        with open(os.path.join(cfg.run.dir, "world.json"), "w") as f:
            json.dump(everyone, f, indent=1)
