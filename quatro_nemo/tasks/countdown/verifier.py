"""Verifier of the embedded CPU task (Countdown with steps, ``quatro_nemo.tasks.countdown.problems``).

``reward="binary"`` (default): 1.0 when the response's steps reach the problem's target under the
task's rules, else 0.0 (exact; no partial credit, no format reward). ``reward="graded"`` (issue 19):
1.0 for an exact answer, partial credit for a valid step sequence that ends near the target, 0
for an invalid one (``countdown.graded_reward``), so the rewards of a group take many values and
QUATRO's dual solve runs its continuous branch. A problem is a record of the JSONL schema with the
task's fields ``numbers`` and ``target``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from quatro_nemo.tasks.countdown.problems import graded_reward, is_correct
from quatro_nemo.validation import choice_values, choices, coerce_choices

CountdownReward = choices("CountdownReward", ("binary", "graded"), __name__)
REWARD_KINDS = tuple(choice_values(CountdownReward))


@dataclass
class CountdownRewardConfig:
    """``task.reward`` and ``task.partial_credit`` of the countdown task (ValueError naming the key)."""

    reward: CountdownReward = CountdownReward.binary
    partial_credit: float = 0.5

    def __post_init__(self) -> None:
        coerce_choices(self, "task")
        if isinstance(self.partial_credit, bool) or not isinstance(self.partial_credit, (int, float)) \
                or not math.isfinite(self.partial_credit) or not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"task.partial_credit={self.partial_credit!r} must be in [0, 1) (an exact answer gets 1)")


class CountdownVerifier:
    """``score_batch(problems, responses) -> list[float]`` (``docs/interfaces.md``)."""

    def __init__(self, reward: str = "binary", partial_credit: float = 0.5) -> None:
        self.config = CountdownRewardConfig(reward, partial_credit)

    def score(self, problem: Dict[str, Any], response: str) -> float:
        try:
            numbers, target = problem["numbers"], problem["target"]
        except KeyError as error:
            raise ValueError(
                f"countdown problem {problem.get('id', '?')!r} lacks the field {error.args[0]!r}"
            ) from None
        if self.config.reward == "graded":
            return graded_reward(numbers, target, response, self.config.partial_credit)
        return 1.0 if is_correct(numbers, target, response) else 0.0

    def score_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[float]:
        if len(problems) != len(responses):
            raise ValueError(f"score_batch: {len(problems)} problems but {len(responses)} responses")
        return [self.score(problem, response) for problem, response in zip(problems, responses)]
