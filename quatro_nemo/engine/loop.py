"""The RL training loop, top to bottom (architecture.md, "One training step").

    for step in steps:
        prompts      <- B prompts of the training set (a function of (seed, step): exact resume)
        rollouts     <- N responses per prompt from pi_old                 (rollout backend)
        rewards      <- verifier(prompt, response)                         [B, N]
        advantages   <- registry estimator(rewards)   (QUATRO: exact per-prompt dual, Eq. 11-15)
        log pi_old, log pi_ref <- Megatron forward under TP/PP
        repeat K times (inner loops; pi_old stays the rollout policy):
            for each mini-batch: Megatron forward/backward of the registry loss with GLOBAL
                                 normalisers -> megatron DDP grad reduction -> megatron
                                 (distributed) optimizer step, which clips the global grad norm
        metrics -> metrics.jsonl / TensorBoard; checkpoint; periodic held-out evaluation

Every algorithm runs through this same function: only `spec.advantage_estimator`, `spec.policy_loss`
and the config differ. Data parallelism splits each mini-batch's prompts across DP ranks (a group of
N responses never straddles ranks), so the optimizer sees the same global batch in any layout.

One run device: rollout book-keeping and rewards live on the CPU; every tensor that reaches the
model, the loss or a collective is on ``current_device()`` (the rank's GPU, or the CPU without
CUDA).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

import torch
from omegaconf import OmegaConf

from quatro_nemo.algos import QuatroConfig, ShapedGroups, get_algorithm
from quatro_nemo.algos.adaptive_delta import DeltaController, achieved_kl
from quatro_nemo.algos.importance import ImportanceCorrection, truncated_importance_weights
from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine.config import ExperimentConfig
from quatro_nemo.engine.evaluation import evaluate_policy, training_eval_settings
from quatro_nemo.engine.logging import MetricsLogger
from quatro_nemo.engine.report import heldout_table, write_report
from quatro_nemo.engine.rollout import model_inputs
from quatro_nemo.engine.rollout_backends import build_rollout_backend
from quatro_nemo.engine.task import build_task
from quatro_nemo.eval.samples import write_samples
from quatro_nemo.megatron.sampling import SamplingParams
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


def step_prompt_indices(step: int, batch_size: int, dataset_size: int, seed: int) -> List[int]:
    """Indices of the B prompts of rollout step `step`: epochs of seeded permutations, so the data
    position is a pure function of the step (nothing to save for exact resume)."""
    indices: List[int] = []
    position = step * batch_size
    while len(indices) < batch_size:
        epoch, offset = divmod(position, dataset_size)
        order = list(range(dataset_size))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        take = min(batch_size - len(indices), dataset_size - offset)
        indices.extend(order[offset:offset + take])
        position += take
    return indices


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


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from (run seed, purpose, step): independent noise streams, no state to save."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def shape_rewards(spec, algo_cfg, rollout, local_rewards: torch.Tensor, batch_size: int,
                  mini_batch_size: int, max_new_tokens: int):
    """Step 3b: (global [B, N] verifier rewards, the algorithm's data-side view of them:
    ``spec.shape_groups`` -> ShapedGroups(rewards for the advantages, [B] group weights))."""
    lengths = rollout.sample.response_lengths.view(rollout.num_prompts, rollout.num_samples).to(torch.float64)
    rewards = global_rewards(local_rewards, batch_size, mini_batch_size)
    lengths = global_rewards(lengths, batch_size, mini_batch_size)
    return rewards, spec.shape_groups(rewards, lengths, max_new_tokens, algo_cfg)


def make_batch(rollout, advantages: torch.Tensor, group_weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The Megatron batch layout of docs/interfaces.md, on the run device. `group_weights` [S] are
    1/0 per row (groups dropped by dynamic sampling leave the loss)."""
    batch = model_inputs(rollout, current_device())
    batch["response_mask"] = rollout.response_mask.to(batch["tokens"].device).float() * group_weights.to(
        batch["tokens"].device).float()[:, None]
    batch["advantages"] = advantages.to(batch["tokens"].device).float()
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
    shares = reduce_metrics([{
        "abs_sum": diff.abs().sum(), "tokens": mask.sum(),
        "token_abs/max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
        "seq_abs_sum": (sequence_log_ratio.abs() * has_tokens).sum(),
        "seq_ratio_sum": (sequence_log_ratio.exp() * has_tokens).sum(), "sequences": has_tokens.sum(),
    }])
    tokens, sequences = max(shares["tokens"], 1.0), max(shares["sequences"], 1.0)
    return {"engine_gap/token_abs_mean": shares["abs_sum"] / tokens,
            "engine_gap/token_abs_max": shares["token_abs/max"],
            "engine_gap/seq_log_ratio_abs_mean": shares["seq_abs_sum"] / sequences,
            "engine_gap/seq_ratio_mean": shares["seq_ratio_sum"] / sequences}


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


def update_policy(policy_ddp, optimizer, batch: Dict[str, torch.Tensor], spec, algo_cfg, trainer,
                  rows_per_mini: int, batching: MicroBatching, optimizer_steps_done: int) -> List[Dict[str, float]]:
    """K inner loops over one rollout batch (step 6): each mini-batch of `rows_per_mini` local rows
    is one optimizer step. Returns each update's metrics (loss metrics, grad_norm, lr).

    No step without a signal: a mini-batch whose loss has no gradient at all (every advantage 0
    while the policy is still pi_old and pi_ref) takes no optimizer step and returns no metrics,
    so neither Adam's momentum nor weight decay moves the weights. Its gradient is exactly 0 only
    because pi_old's log-probs equal the training forward's bitwise (`batching.mini_batch_rows`
    = `rows_per_mini`: the same micro-batches in both passes)."""
    updates: List[Dict[str, float]] = []
    for _inner in range(trainer.inner_loops):
        for start in range(0, batch["tokens"].shape[0], rows_per_mini):
            mini = slice_batch(batch, slice(start, start + rows_per_mini))
            if dp_sum(mini["response_mask"].sum()) == 0:
                continue  # every group of this mini-batch was filtered out (dynamic sampling)
            training.zero_gradients(policy_ddp, optimizer)
            metrics = train_step_forward_backward(policy_ddp, mini, spec.policy_loss, algo_cfg, batching)
            if not training.has_gradient(policy_ddp):
                continue  # no learning signal: no step on a zero gradient
            lr = training.warmup_learning_rate(trainer.lr, trainer.lr_warmup_steps, optimizer_steps_done)
            training.set_learning_rate(optimizer, lr)
            metrics["grad_norm"] = training.optimizer_step(policy_ddp, optimizer)
            metrics["lr"] = lr
            optimizer_steps_done += 1
            updates.append(metrics)
    return updates


def build_training_state(policy, trainer, distributed_optimizer: bool):
    """(megatron's DDP around ``policy``, megatron's (distributed) optimizer with the
    ``trainer.*`` settings). Shared by :func:`train` and ``benchmarks/bench_step.py``."""
    policy_ddp = training.wrap_for_training(policy, distributed_optimizer=distributed_optimizer)
    optimizer = training.build_optimizer(policy_ddp, training.OptimizerSettings(
        lr=trainer.lr, weight_decay=trainer.weight_decay, adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2, adam_eps=trainer.adam_eps, grad_clip=trainer.grad_clip))
    return policy_ddp, optimizer


@dataclass
class RolloutLearning:
    """What :func:`learn_from_rollout` returns: the estimator's output (``advantages`` [B, N] and
    its metrics), one metrics dict per optimizer step, pi_old's entropies [S_local, T], the
    ``time.perf_counter()`` at which the log-prob passes ended, and, when asked for, the updated
    policy's trajectory log-ratios ``log pi_theta(o_i) / pi_old(o_i)`` [S_local] (adaptive delta)."""

    advantages: Any
    metrics: List[Dict[str, float]]
    old_entropy: torch.Tensor
    t_logprobs: float
    policy_shift: Any = None
    engine_gap: Dict[str, float] = dataclasses.field(default_factory=dict)


def learn_from_rollout(cfg: ExperimentConfig, spec, policy, policy_ddp, reference, optimizer, backend, rollout,
                       groups: ShapedGroups, slots: List[int], optimizer_steps_done: int,
                       measure_policy_shift: bool = False) -> RolloutLearning:
    """Steps 4-6 of a training step on this rank's rollout, shared by :func:`train` and
    ``benchmarks/bench_step.py`` (which replays saved rollouts through it).

    ``groups``: the algorithm's data-side view of the global [B, N] rewards (:func:`shape_rewards`);
    ``slots``: this DP rank's global prompt positions (:func:`local_prompt_slots`). Collective over
    all ranks. ``measure_policy_shift``: one more forward pass after the updates, for the
    adaptive-delta controller (``RolloutLearning.policy_shift``).
    """
    n = cfg.rollout.n
    rows_per_mini = (cfg.trainer.mini_batch_prompts or cfg.trainer.prompts_per_step) // parallel.dp_size() * n
    batching = MicroBatching.from_parallel_config(cfg.parallel, mini_batch_rows=rows_per_mini)

    # 4. Advantages from the registry (QUATRO: one vectorised dual solve over all B groups).
    advantage_out = spec.advantage_estimator(groups.rewards, cfg.algorithm)
    advantages = advantage_out.advantages[slots].reshape(-1)

    # 5. log pi_old (recomputed by Megatron, as the loss sees it) and log pi_ref; rows of groups
    # the data-side hook dropped (DAPO's filter) leave the loss.
    group_weights = groups.weights[slots].repeat_interleave(n)
    batch = make_batch(rollout, advantages, group_weights)
    with torch.no_grad():
        batch["old_logprobs"], old_entropy = compute_logprobs(policy, batch, batching)
        if reference is not None:
            batch["ref_logprobs"], _ = compute_logprobs(reference, batch, batching)
    engine_gap = ({} if rollout.engine_logprobs is None else
                  engine_gap_metrics(rollout.engine_logprobs, batch["old_logprobs"], rollout.response_mask))
    correction = ImportanceCorrection(cfg.rollout.importance_correction)
    if rollout.engine_logprobs is not None and correction != ImportanceCorrection.none:
        device = batch["old_logprobs"].device
        batch["is_weights"] = truncated_importance_weights(
            batch["old_logprobs"], rollout.engine_logprobs.to(device), rollout.response_mask.to(device),
            correction, cfg.rollout.importance_cap)
    t_logprobs = time.perf_counter()

    # 6. K inner loops over the same rollouts; each mini-batch is one optimizer step.
    update_metrics = update_policy(policy_ddp, optimizer, batch, spec, cfg.algorithm, cfg.trainer,
                                   rows_per_mini, batching, optimizer_steps_done)
    if update_metrics:
        backend.update_weights()
    policy_shift = None
    if measure_policy_shift:
        with torch.no_grad():
            new_logprobs, _ = compute_logprobs(policy, batch, batching)
        policy_shift = ((new_logprobs - batch["old_logprobs"]) * batch["response_mask"]).sum(dim=-1)
    return RolloutLearning(advantage_out, update_metrics, old_entropy, t_logprobs, policy_shift, engine_gap)


def train(cfg: ExperimentConfig) -> Dict[str, Any]:
    quiet_library_warnings()
    select_device(cfg.trainer.device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    layout = parallel.initialize_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.run.seed)
    rank0 = layout.rank == 0
    run_dir = cfg.run.dir
    spec = get_algorithm(cfg.algorithm_name)
    trainer, rollout_cfg = cfg.trainer, cfg.rollout
    scale = cfg.scale
    batch_size = trainer.prompts_per_step
    mini_batch_size = trainer.mini_batch_prompts or batch_size
    dp, dp_rank = layout.data_parallel, layout.dp_rank
    check_mini_batches(batch_size, trainer.mini_batch_prompts, dp)
    _write_run_files(cfg, layout)

    # Task: prompts, tokenizer, verifier, and the base model (warm-start on the CPU default).
    task: Task = build_task(cfg)
    model_cfg = task.model_config(cfg.model)
    base_state = task.load_base_state(model_cfg)    # full (TP=1, PP=1) state dict, same on all ranks

    # The policy (sampling and log-probs use it directly), megatron's DDP around it for training,
    # and megatron's (distributed) optimizer.
    policy = build_model(model_cfg)
    if base_state is not None:  # None: the task keeps megatron's random initialisation
        load_full_state_dict(policy, base_state)
    del base_state
    # The rollout engine first: a colocated vLLM engine checks at start-up that its share of GPU
    # memory is free, which it no longer is once gradient buffers and optimizer state exist.
    backend = build_rollout_backend(cfg, policy, model_cfg, task)
    policy_ddp, optimizer = build_training_state(policy, trainer, scale.distributed_optimizer)
    reference = None
    if spec.needs_reference_model(cfg.algorithm):
        reference = build_model(model_cfg)
        reference.load_state_dict(policy.state_dict())  # pi_ref: the base policy
        reference.requires_grad_(False)
    # A colocated rollout engine needs the device memory the optimizer state and gradients hold:
    # the backend moves them to the host around each of its sampling calls (rollouts, evaluation).
    if scale.offload_optimizer_in_rollout and rollout_cfg.backend == "vllm":
        backend.manage_training_state(policy_ddp, optimizer)

    # QUATRO's adaptive-delta controller (None: the paper's fixed delta); its state is in the checkpoint.
    delta_controller = DeltaController.from_config(cfg.algorithm) if isinstance(cfg.algorithm, QuatroConfig) else None

    # Resume (any parallel layout: the checkpoint is sharded by megatron's dist_checkpointing).
    ckpt_layout = ckpt.layout_signature(layout)
    start_step, optimizer_steps_done = 0, 0
    resume_from = ckpt.latest_step(run_dir) if cfg.run.resume else None
    if resume_from is not None:
        position = ckpt.load_checkpoint(run_dir, resume_from, policy_ddp, optimizer, ckpt_layout)
        start_step, optimizer_steps_done = position["next_step"], position["optimizer_steps"]
        if delta_controller is not None and "delta_controller" in position:
            delta_controller.load_state_dict(position["delta_controller"])
    logger = MetricsLogger(run_dir, enabled=rank0, resumed_step=resume_from, tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
                           config=OmegaConf.to_container(cfg.raw, resolve=True))
    preemption = PreemptionFlag()
    if rank0:
        print(f"[quatro] {cfg.algorithm_name} | world {layout.world_size} (tp {layout.tensor_parallel}, "
              f"pp {layout.pipeline_parallel}, dp {dp}) | steps {start_step}->{trainer.steps} | run dir {run_dir}",
              flush=True)

    heldout = task.heldout_problems[:cfg.eval.num_problems]

    def evaluate(step: int) -> Dict[str, Any]:
        eval_metrics, rows = evaluate_policy(policy, backend, task, heldout, training_eval_settings(cfg))
        if rank0:   # the samples recipes/evaluate.py and the run report read
            os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
            write_samples(os.path.join(run_dir, "eval", f"samples_step{step:06d}.jsonl"), rows)
        logger.log(step, eval_metrics, kind="eval")
        return eval_metrics

    if start_step == 0 and cfg.eval.num_problems > 0:
        evaluate(0)   # the base model's held-out numbers, the report's "before" column

    slots = local_prompt_slots(batch_size, mini_batch_size, dp_rank, dp)
    progress = _progress_bar(cfg, rank0, start_step)
    for step in range(start_step, trainer.steps):
        t_start = time.perf_counter()

        # 1. Prompts of this step; this DP rank's share.
        indices = step_prompt_indices(step, batch_size, len(task.train_problems), cfg.run.seed)
        problems = [task.train_problems[indices[s]] for s in slots]

        # 2. Rollouts: N responses per prompt from pi_old (sampling noise keyed by global slot, so
        #    every layout draws the same responses).
        params = SamplingParams(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                                max_new_tokens=rollout_cfg.max_new_tokens,
                                seed=derive_seed(cfg.run.seed, "rollout", step))
        rollout, responses = task.sample(backend, problems, slots, rollout_cfg.n, params)
        t_rollout = time.perf_counter()

        # 3. Rewards [B_local, N] -> global [B, N] (advantage estimators may use batch statistics).
        local_rewards = torch.tensor(task.verifier.score_batch(
            [p for p in problems for _ in range(rollout_cfg.n)], responses),
            dtype=torch.float64).view(len(problems), rollout_cfg.n)
        rewards, groups = shape_rewards(spec, cfg.algorithm, rollout, local_rewards, batch_size, mini_batch_size,
                                        rollout_cfg.max_new_tokens)

        # 4-6. Advantages, log pi_old / log pi_ref, K inner loops of optimizer steps.
        step_cfg = cfg if delta_controller is None else dataclasses.replace(
            cfg, algorithm=delta_controller.apply(cfg.algorithm))
        learned = learn_from_rollout(step_cfg, spec, policy, policy_ddp, reference, optimizer, backend, rollout,
                                     groups, slots, optimizer_steps_done,
                                     measure_policy_shift=delta_controller is not None)
        advantage_out, update_metrics, old_entropy = learned.advantages, learned.metrics, learned.old_entropy
        optimizer_steps_done += len(update_metrics)
        t_logprobs, t_update = learned.t_logprobs, time.perf_counter()

        # 7. Metrics (identical on every rank), checkpoint, evaluation.
        metrics = _step_metrics(rewards, advantage_out.metrics, update_metrics, rollout, old_entropy)
        metrics.update(learned.engine_gap)
        metrics.update(rollout.timings)
        if delta_controller is not None:  # the next step's radius, from this step's achieved KL
            shift = global_rewards(learned.policy_shift.view(len(problems), rollout_cfg.n).double(),
                                   batch_size, mini_batch_size)
            metrics["quatro/delta_used"] = delta_controller.delta
            delta_controller.update(achieved_kl(shift, rewards))
            metrics.update(delta_controller.metrics())
        metrics.update({"time/rollout": t_rollout - t_start,
                        "time/logprobs": t_logprobs - t_rollout, "time/update": t_update - t_logprobs,
                        "time/step": time.perf_counter() - t_start})
        if (step + 1) % trainer.log_every == 0 or step + 1 == trainer.steps:
            logger.log(step + 1, metrics)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.1f}")

        done = step + 1 == trainer.steps
        if cfg.eval.num_problems > 0 and (done or trainer.eval_every and (step + 1) % trainer.eval_every == 0):
            evaluate(step + 1)   # before the checkpoint: a resumed run never redoes a logged record
        preempted = preemption.any_rank_signalled()
        if done or preempted or (trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0):
            position = {"next_step": step + 1, "optimizer_steps": optimizer_steps_done}
            if delta_controller is not None:
                position["delta_controller"] = delta_controller.state_dict()
            ckpt.save_checkpoint(run_dir, step + 1, policy_ddp, optimizer, position,
                                 ckpt_layout, keep=trainer.keep_checkpoints)
        if preempted and not done:
            logger.close()
            raise Preempted(f"{preemption.signal_name or 'signal on another rank'} at step {step + 1}")

    if progress is not None:
        progress.close()
    logger.close()
    summary: Dict[str, Any] = {}
    if rank0:
        summary = write_report(run_dir, cfg, task.properties)
        print(f"[quatro] done: report at {os.path.join(run_dir, 'report.md')}", flush=True)
        if summary["base"] and summary["final"]:   # the before/after comparison, where the user is looking
            print("\n".join(heldout_table(summary["base"], summary["final"])), flush=True)
    return summary


def _step_metrics(rewards, advantage_metrics, update_metrics, rollout, old_entropy) -> Dict[str, float]:
    """Per-step training metrics, reduced identically on every rank."""
    out: Dict[str, float] = {
        "reward/mean": float(rewards.mean()),
        "reward/solved_frac": float((rewards.max(dim=1).values > 0).float().mean()),
    }
    out.update({k: float(v) for k, v in advantage_metrics.items()})
    out["optimizer_steps"] = len(update_metrics)
    for key in (update_metrics[0] if update_metrics else []):  # mean over the step's updates (max/min for extrema)
        values = [m[key] for m in update_metrics]
        out[key] = max(values) if key.endswith("/max") else (
            min(values) if key.endswith("/min") else sum(values) / len(values))
    mask = rollout.response_mask.to(old_entropy.device).float()  # every sampled token, filtered groups too
    local = torch.tensor([float((old_entropy * mask).sum()), float(mask.sum()), float(mask.shape[0])],
                         dtype=torch.float64, device=current_device())
    dp_sum_in_place(local)
    out["entropy"] = float(local[0] / local[1].clamp(min=1))
    out["response_length/mean"] = float(local[1] / local[2])
    return out


def _progress_bar(cfg: ExperimentConfig, rank0: bool, start_step: int):
    if not (rank0 and cfg.run.progress_bar and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.trainer.steps, initial=start_step, desc=f"{cfg.algorithm_name}", unit="step")


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
