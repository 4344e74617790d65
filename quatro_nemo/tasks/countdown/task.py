"""task=countdown: the embedded CPU task's config section and :class:`~quatro_nemo.tasks.base.Task`.

The base model comes from the cached supervised warm-start (:mod:`.warmstart`), the same in every
parallel layout. `task.reward` picks the verifier's reward: `binary` (default, exact answers) or
`graded` (partial credit by how close a valid answer gets to the target, `task.partial_credit`;
:mod:`.verifier`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from quatro_nemo.data.tokenizer import CharTokenizer, TokenizerConfig
from quatro_nemo.rewards import get_verifier
from quatro_nemo.tasks.base import Task, check_task_name, section_part
from quatro_nemo.tasks.countdown import problems as countdown
from quatro_nemo.tasks.countdown.problems import CountdownTaskConfig
from quatro_nemo.tasks.countdown.verifier import CountdownRewardConfig
from quatro_nemo.tasks.countdown.warmstart import load_or_train_base_model


@dataclass
class CountdownTaskSection(CountdownRewardConfig, CountdownTaskConfig):
    """task=countdown (conf/task/countdown.yaml): the embedded CPU task's problems
    (CountdownTaskConfig's keys), its reward (CountdownRewardConfig's: task.reward,
    task.partial_credit) and its character tokenizer."""

    name: str = "countdown"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self) -> None:
        CountdownTaskConfig.__post_init__(self)
        CountdownRewardConfig.__post_init__(self)
        check_task_name(self, "countdown")

    def problems(self) -> CountdownTaskConfig:
        """The problem generator's config (not the reward: the warm-start's cache key is the problems')."""
        return section_part(self, CountdownTaskConfig)

    def reward_config(self) -> CountdownRewardConfig:
        return section_part(self, CountdownRewardConfig)


def countdown_vocab_size(section: CountdownTaskSection) -> int:
    """The character tokenizer's (padded) vocabulary size."""
    return CharTokenizer(section.tokenizer).vocab_size


def build_countdown_task(cfg) -> Task:
    task_cfg, tokenizer_cfg, warm_cfg = cfg.task.problems(), cfg.task.tokenizer, cfg.warmstart
    tokenizer = CharTokenizer(tokenizer_cfg)
    train = countdown.generate_split(task_cfg, "train")
    heldout = countdown.generate_split(task_cfg, "heldout")
    warm_report: Dict[str, Any] = {}

    def load_base_state(model_cfg) -> Optional[Dict[str, torch.Tensor]]:
        if not warm_cfg.enabled:  # warmstart.enabled=false: a randomly initialised base model
            warm_report.update(enabled=False)
            return None
        state, report = load_or_train_base_model(task_cfg, tokenizer_cfg, model_cfg, warm_cfg)
        warm_report.update(report)
        return state

    properties = {"task": dataclasses.asdict(countdown.measure_task_properties(heldout)),
                  "warmstart": warm_report}
    return Task(
        name="countdown", train_problems=train, heldout_problems=heldout,
        verifier=get_verifier("countdown", **dataclasses.asdict(cfg.task.reward_config())),
        vocab_size=tokenizer.vocab_size, stop_token_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
        encode_prompt=lambda problem: tokenizer.encode_prompt(problem["prompt"]),
        decode_response=tokenizer.decode,
        load_base_state=load_base_state,
        solution_key=lambda problem, response: countdown.canonical_expression(response) or response,
        properties=properties,
    )
