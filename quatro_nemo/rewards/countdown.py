"""Verifier of the embedded CPU task (Countdown with steps, ``quatro_nemo.data.countdown``).

Reward 1.0 when the response's steps reach the problem's target under the task's rules, else 0.0
(exact; no partial credit, no format reward). A problem is a record of the JSONL schema with the
task's fields ``numbers`` and ``target``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from quatro_nemo.data.countdown import is_correct


class CountdownVerifier:
    """``score_batch(problems, responses) -> list[float]`` (``docs/interfaces.md``)."""

    def score(self, problem: Dict[str, Any], response: str) -> float:
        try:
            numbers, target = problem["numbers"], problem["target"]
        except KeyError as error:
            raise ValueError(
                f"countdown problem {problem.get('id', '?')!r} lacks the field {error.args[0]!r}"
            ) from None
        return 1.0 if is_correct(numbers, target, response) else 0.0

    def score_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[float]:
        if len(problems) != len(responses):
            raise ValueError(f"score_batch: {len(problems)} problems but {len(responses)} responses")
        return [self.score(problem, response) for problem, response in zip(problems, responses)]
