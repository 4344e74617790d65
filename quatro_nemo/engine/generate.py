"""Samples from a training checkpoint, for recipes/evaluate.py checkpoint=... (one process, CPU or GPU).

`checkpoint` is a run directory (its newest complete checkpoint) or one of its
`checkpoints/step_XXXXXX` folders. The run's own config.yaml rebuilds the task's tokenizer and the
model. Checkpoints of multi-rank runs are sharded per rank: export them to Hugging Face format first
(`recipes/convert_checkpoint.py run-to-hf`) and evaluate that with vLLM.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Sequence

import torch

from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine.evaluation import sample_responses, training_eval_settings
from quatro_nemo.engine.rollout import MegatronRolloutBackend
from quatro_nemo.engine.run_dir import RunDir


def _run_dir_and_step(checkpoint: str):
    checkpoint = os.path.abspath(checkpoint)
    name = os.path.basename(checkpoint)
    if name.startswith("step_"):
        return os.path.dirname(os.path.dirname(checkpoint)), int(name.split("_")[1])
    step = ckpt.latest_step(checkpoint)
    if step is None:
        raise ValueError(f"{checkpoint}: no complete checkpoint under {checkpoint}/checkpoints/")
    return checkpoint, step


def generate_samples(checkpoint: str, problems: Sequence[Dict[str, Any]], num_samples: int, temperature: float,
                     top_p: float, max_new_tokens: int, seed: int) -> List[Dict[str, Any]]:
    """`num_samples` responses per problem: the problem records plus `responses` (the samples layout)."""
    run_dir, step = _run_dir_and_step(checkpoint)
    with RunDir(run_dir).load_policy(step) as loaded:    # any training layout loads into TP=1, PP=1
        task = loaded.task
        backend = MegatronRolloutBackend(loaded.policy, stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
        settings = dataclasses.replace(training_eval_settings(loaded.config), n_samples=num_samples,
                                       temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        with torch.no_grad():
            _, responses = sample_responses(task, backend, problems, range(len(problems)), settings)
    # the problem's own fields stay: verifiers need more than the answer (countdown: numbers, target)
    return [dict(p, benchmark=p.get("benchmark", "heldout"), responses=responses[i * num_samples:(i + 1) * num_samples])
            for i, p in enumerate(problems)]
