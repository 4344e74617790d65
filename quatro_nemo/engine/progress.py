"""A training run's progress where its user looks (rank 0): a tqdm bar on a terminal, and
everywhere else (SLURM logs, pipes, files, ``run.progress_bar=false``) one line per logged step,
as NeMo-RL and verl print in their logs:

    [quatro] step 12/300 | reward 0.412 | kl_ref 0.0012 | engine gap 0.0031 | 1,874 tok/s | step 41.2 s | ETA 3h18m

``kl_ref`` (``policy/kl_ref``: the k3 KL to pi_ref) and ``engine gap``
(``engine_gap/token_abs_mean``: |log pi_trainer - log pi_engine| per sampled token, vLLM) appear
when the step measured them; ``tok/s`` counts the step's sampled tokens over its wall time; the ETA
is the mean step time of this process's steps times the steps left.
"""
from __future__ import annotations

import sys
from typing import Any, List, Mapping, Optional, TextIO


def format_duration(seconds: float) -> str:
    """``3h18m``, ``4m05s``, ``12s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_line(step: int, total_steps: int, metrics: Mapping[str, float], sequences_per_step: int,
                  eta_seconds: float) -> str:
    """One logged step (module doc); ``sequences_per_step``: prompts x responses of a step."""
    parts = [f"[quatro] step {step}/{total_steps}", f"reward {metrics['reward/mean']:.3f}"]
    if "policy/kl_ref" in metrics:
        parts.append(f"kl_ref {metrics['policy/kl_ref']:.4f}")
    if "engine_gap/token_abs_mean" in metrics:
        parts.append(f"engine gap {metrics['engine_gap/token_abs_mean']:.4f}")
    step_seconds = metrics["time/step"]
    tokens = metrics["response_length/mean"] * sequences_per_step
    parts += [f"{tokens / step_seconds:,.0f} tok/s", f"step {step_seconds:.1f} s",
              f"ETA {format_duration(eta_seconds)}"]
    return " | ".join(parts)


class StepProgress:
    """Rank 0's progress report of one ``train()`` call: the bar on a terminal (``run.progress_bar``),
    else :func:`progress_line` for every logged step; nothing on other ranks."""

    def __init__(self, cfg: Any, rank0: bool, start_step: int, terminal: Optional[TextIO] = None):
        terminal = terminal or sys.stderr
        self.total_steps = cfg.trainer.steps
        self.sequences_per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
        self.step_seconds: List[float] = []
        self.bar = None
        if rank0 and cfg.run.progress_bar and terminal.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.trainer.steps, initial=start_step, desc=f"{cfg.algorithm_name}", unit="step")
        self.lines = rank0 and self.bar is None

    def step_done(self, step: int, metrics: Mapping[str, float], logged: bool) -> None:
        """After step ``step`` (1-based) with its metrics; ``logged``: the step was logged."""
        self.step_seconds.append(metrics["time/step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.1f}")
        elif self.lines and logged:
            eta = sum(self.step_seconds) / len(self.step_seconds) * (self.total_steps - step)
            print(progress_line(step, self.total_steps, metrics, self.sequences_per_step, eta), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


__all__ = ["StepProgress", "format_duration", "progress_line"]
