"""The embedded CPU task: Countdown with step-by-step answers.

A problem gives a few small numbers and a target; a response reaches the target by a sequence of
binary steps, each consuming two available values and producing a new one::

    prompt:    "3 5 7 2>24:"
    response:  "5-2=3,3+7=10,..."             (steps separated by ",")

Rules (the classic Countdown game, as in TinyZero's countdown task,
https://github.com/Jiayi-Pan/TinyZero): each given number is used at most once, every
intermediate result is used exactly once by a later step (the steps form one expression tree, no
dead steps), operations are ``+ - * /``, every result is a positive integer (``-`` must stay
> 0, ``/`` must divide exactly), and the last step's result equals the target. Numbers are written without leading zeros, so a response string
and a step sequence map one to one.

Why this task (``docs/cpu-task.md``): a problem typically has dozens of distinct correct step
sequences (commuted operands, different orders and routes); difficulty varies a lot across
targets (some need only additions, some a specific product or exact division); responses are
15-30 characters; verification is exact and fast; problems come from a seed with train and
held-out splits that can never overlap, because the split of a problem is a hash of its content.

This module is pure Python (no torch): generation, brute-force enumeration of all solutions
(the independent reference for the verifier and the "distinct correct answers" property) and
the task's measured properties.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

BENCHMARK = "countdown"
SPLITS = ("train", "heldout")
OPERATORS = ("+", "-", "*", "/")
STEP_SEPARATOR = ","
PROMPT_TARGET_SEPARATOR = ">"
PROMPT_END = ":"

# One step "a op b=c" with canonical non-negative integers (no leading zeros).
_INT = r"(0|[1-9][0-9]*)"
STEP_PATTERN = re.compile(rf"^{_INT}([+\-*/]){_INT}={_INT}$")
# A step as the model writes it: (a, op, b, c)
Step = Tuple[int, str, int, int]


@dataclass
class CountdownTaskConfig:
    """Shape of the generated problems. Validated in ``__post_init__`` (ValueError naming the key).

    Attributes:
        num_numbers: how many numbers a problem may give (one is drawn uniformly per problem).
        min_number, max_number: range of the given numbers (inclusive).
        min_target, max_target: range of the target (inclusive).
        min_solutions: a problem is kept only if it has at least this many distinct correct step
            sequences (so diversity can be measured on every prompt).
        heldout_fraction: fraction of the problem space (by content hash) reserved for held-out.
        num_train, num_heldout: how many problems each split holds.
        seed: generator seed (the split assignment does not depend on it).
    """

    num_numbers: Tuple[int, ...] = (3, 4)
    min_number: int = 1
    max_number: int = 12
    min_target: int = 10
    max_target: int = 99
    min_solutions: int = 8
    heldout_fraction: float = 0.2
    num_train: int = 1024
    num_heldout: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        self.num_numbers = tuple(int(k) for k in self.num_numbers)
        if not self.num_numbers or any(k < 2 or k > 5 for k in self.num_numbers):
            raise ValueError(f"task.num_numbers={self.num_numbers}: each entry must be in 2..5")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(
                f"task.min_number={self.min_number}, task.max_number={self.max_number}: "
                "need 1 <= min_number <= max_number"
            )
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError(
                f"task.min_target={self.min_target}, task.max_target={self.max_target}: "
                "need 1 <= min_target <= max_target"
            )
        if self.min_solutions < 1:
            raise ValueError(f"task.min_solutions={self.min_solutions} must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        for key in ("num_train", "num_heldout"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.{key}={getattr(self, key)} must be >= 1")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Text formats


def format_prompt(numbers: Sequence[int], target: int) -> str:
    """``[3, 5, 7, 2], 24 -> "3 5 7 2>24:"``."""
    return " ".join(str(n) for n in numbers) + PROMPT_TARGET_SEPARATOR + str(target) + PROMPT_END


def format_steps(steps: Sequence[Step]) -> str:
    """``[(5, "-", 2, 3), (3, "+", 7, 10)] -> "5-2=3,3+7=10"``."""
    return STEP_SEPARATOR.join(f"{a}{op}{b}={c}" for a, op, b, c in steps)


def apply_operator(a: int, op: str, b: int) -> Optional[int]:
    """The result of ``a op b`` under the task's rules, or None when the step is not allowed.

    Every intermediate value must be a positive integer: ``a - b`` needs ``a > b``, ``a / b``
    needs ``b`` to divide ``a``.
    """
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    if op == "-":
        return a - b if a > b else None
    if op == "/":
        return a // b if b > 0 and a % b == 0 else None
    raise ValueError(f"unknown operator {op!r}")


# --------------------------------------------------------------------------------------------
# Checking one response (the verifier's core; quatro_nemo.tasks.countdown.verifier wraps it)


def parse_steps(response: str) -> Optional[List[Step]]:
    """Parse ``"a op b=c,..."`` into steps; None if any step is malformed or there are none."""
    text = response.strip()
    if not text:
        return None
    steps: List[Step] = []
    for piece in text.split(STEP_SEPARATOR):
        match = STEP_PATTERN.match(piece)
        if match is None:
            return None
        a, op, b, c = match.groups()
        steps.append((int(a), op, int(b), int(c)))
    return steps


def final_value(numbers: Sequence[int], response: str) -> Optional[int]:
    """The value a valid ``response`` reaches from ``numbers``, or None if it breaks a rule.

    Each step's operands must be available (given numbers or earlier results, each usable once),
    its written result must equal ``a op b`` exactly, and every result but the last must be used by
    a later step (no dead steps); the last step's result is the value.
    """
    steps = parse_steps(response)
    if steps is None:
        return None
    given = list(numbers)  # given numbers not used yet
    results: List[int] = []  # results produced and not used yet
    for a, op, b, c in steps:
        if apply_operator(a, op, b) != c:
            return None
        for operand in (a, b):
            # Taking a result before an equal given number is never worse: the values left are
            # the same, and fewer unused results remain.
            if operand in results:
                results.remove(operand)
            elif operand in given:
                given.remove(operand)
            else:
                return None
        results.append(c)
    return results[0] if len(results) == 1 else None


def is_correct(numbers: Sequence[int], target: int, response: str) -> bool:
    """Whether ``response`` reaches ``target`` from ``numbers`` under the task's rules
    (:func:`final_value` is the target)."""
    return final_value(numbers, response) == target


def graded_reward(numbers: Sequence[int], target: int, response: str, partial_credit: float) -> float:
    """The graded reward of a response (issue 19), in [0, 1]:

        1                                              the value is the target (exactly when is_correct)
        partial_credit * max(0, 1 - |v - target| / target)  a valid response that reaches v != target
        0                                              unparsable, wrong arithmetic, numbers not given
                                                       (or reused), dead steps

    An inexact value earns at most ``partial_credit * (1 - 1 / target)`` < partial_credit, so an
    exact answer is always the group's unique best reward level; credit falls linearly with the
    relative distance to the target and is 0 from twice the target (or 0) on.
    """
    value = final_value(numbers, response)
    if value is None:
        return 0.0
    if value == target:
        return 1.0
    return partial_credit * max(0.0, 1.0 - abs(value - target) / target)


def canonical_expression(response: str) -> Optional[str]:
    """The expression tree a step sequence builds, with ``+``/``*`` operands sorted; None if unparsable.

    Two responses that differ only by commuted operands or by the order of independent steps map
    to the same string (``"5+3=8,8*2=16"`` and ``"3+5=8,2*8=16"`` both give ``"(2*(3+5))"``):
    the "exact after normalisation" clustering of UCC@k.
    Call it on correct responses: each step's operand is taken to be the most recent unused
    result of that value if there is one, else a given number.
    """
    steps = parse_steps(response)
    if steps is None:
        return None
    results: List[Tuple[int, str]] = []  # (value, expression) of unused results
    expression = ""
    for a, op, b, c in steps:
        operands = []
        for value in (a, b):
            match = next((k for k in range(len(results) - 1, -1, -1) if results[k][0] == value), None)
            operands.append(results.pop(match)[1] if match is not None else str(value))
        if op in ("+", "*"):
            operands.sort()
        expression = f"({operands[0]}{op}{operands[1]})"
        results.append((c, expression))
    return expression


# --------------------------------------------------------------------------------------------
# Brute-force enumeration (independent reference; also measures "distinct correct answers")


def enumerate_solutions(numbers: Sequence[int], target: int, limit: Optional[int] = None) -> List[str]:
    """Every distinct correct response string for a problem, by exhaustive search.

    Independent of :func:`is_correct`: searches all ordered pairs of pool entries (each entry
    flagged given / produced) and all operators, at every depth up to ``len(numbers) - 1``
    steps, and keeps a step sequence when its last result is the target and no other produced
    entry is left unused. The result is deduplicated (equal given numbers give equal strings)
    and sorted; ``limit`` stops the search once that many are found.
    """
    found: set = set()

    def search(pool: Tuple[Tuple[int, bool], ...], steps: List[Step]) -> bool:
        for i, (a, _) in enumerate(pool):
            for j, (b, _) in enumerate(pool):
                if i == j:
                    continue
                rest = tuple(e for k, e in enumerate(pool) if k != i and k != j)
                rest_all_given = not any(produced for _, produced in rest)
                for op in OPERATORS:
                    c = apply_operator(a, op, b)
                    if c is None:
                        continue
                    steps.append((a, op, b, c))
                    if c == target and rest_all_given:
                        found.add(format_steps(steps))
                        if limit is not None and len(found) >= limit:
                            return True
                    if rest and search(rest + ((c, True),), steps):
                        return True
                    steps.pop()
        return False

    search(tuple((n, False) for n in numbers), [])
    return sorted(found)


# --------------------------------------------------------------------------------------------
# Generation with disjoint splits


def problem_key(numbers: Sequence[int], target: int) -> str:
    """Content key of a problem, independent of the order of its numbers."""
    return " ".join(str(n) for n in sorted(numbers)) + PROMPT_TARGET_SEPARATOR + str(target)


def split_of(numbers: Sequence[int], target: int, heldout_fraction: float) -> str:
    """``"heldout"`` or ``"train"``, from a hash of the problem's content (never from the seed).

    The same problem (in any number order, from any seed) always lands in the same split, so
    train and held-out can never share a problem.
    """
    digest = hashlib.sha256(problem_key(numbers, target).encode()).digest()
    unit = int.from_bytes(digest[:8], "big") / 2.0**64
    return "heldout" if unit < heldout_fraction else "train"


def make_record(numbers: Sequence[int], target: int, split: str, index: int) -> Dict[str, Any]:
    """A record of the JSONL schema (``quatro_nemo.data.schema``) plus the task's own fields."""
    return {
        "id": f"{BENCHMARK}-{split}-{index:06d}",
        "benchmark": BENCHMARK,
        "prompt": format_prompt(numbers, target),
        "answer": str(target),
        "numbers": list(numbers),
        "target": int(target),
        "split": split,
    }


def _draw_candidate(rng: random.Random, config: CountdownTaskConfig) -> Tuple[List[int], int]:
    """Random numbers, and a target reached by a random valid step sequence over them."""
    while True:
        k = rng.choice(config.num_numbers)
        numbers = [rng.randint(config.min_number, config.max_number) for _ in range(k)]
        available = list(numbers)
        value = None
        for _ in range(rng.randint(1, k - 1)):
            a = available.pop(rng.randrange(len(available)))
            b = available.pop(rng.randrange(len(available)))
            value = apply_operator(a, rng.choice(OPERATORS), b)
            if value is None:
                break
            available.append(value)
        if value is not None and config.min_target <= value <= config.max_target and value not in numbers:
            return numbers, value


def iter_problems(config: CountdownTaskConfig, split: str) -> Iterator[Dict[str, Any]]:
    """Endless stream of distinct problems of one split, deterministic given ``config``."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    rng = random.Random(f"{config.seed}-{split}")
    seen: set = set()
    index = 0
    while True:
        numbers, target = _draw_candidate(rng, config)
        key = problem_key(numbers, target)
        if key in seen or split_of(numbers, target, config.heldout_fraction) != split:
            continue
        seen.add(key)
        if len(enumerate_solutions(numbers, target, limit=config.min_solutions)) < config.min_solutions:
            continue
        yield make_record(numbers, target, split, index)
        index += 1


# Generated splits and measured properties, per process: a process that builds the task twice
# (the study's job trains, then evaluates) generates it once.
_SPLITS: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
_PROPERTIES: Dict[Tuple[str, ...], "TaskProperties"] = {}


def generate_split(config: CountdownTaskConfig, split: str, count: Optional[int] = None) -> List[Dict[str, Any]]:
    """The first ``count`` problems of a split (default: ``num_train`` / ``num_heldout``)."""
    if count is None:
        count = config.num_train if split == "train" else config.num_heldout
    key = (json.dumps(config.to_dict(), sort_keys=True), split, count)
    if key not in _SPLITS:
        stream = iter_problems(config, split)
        _SPLITS[key] = [next(stream) for _ in range(count)]
    return [dict(record, numbers=list(record["numbers"])) for record in _SPLITS[key]]


# --------------------------------------------------------------------------------------------
# Measured properties, for the run report


@dataclass
class TaskProperties:
    """What ``measure_task_properties`` found over a sample of problems."""

    num_problems: int
    solutions_per_problem: Dict[str, float] = field(default_factory=dict)  # min/median/mean/max
    expressions_per_problem: Dict[str, float] = field(default_factory=dict)  # modulo commuting
    solution_length_chars: Dict[str, float] = field(default_factory=dict)  # over all solutions
    prompt_length_chars: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """min / median / mean / max of a non-empty sequence."""
    if not values:
        raise ValueError("summarize() of an empty sequence")
    return {
        "min": float(min(values)),
        "median": float(statistics.median(values)),
        "mean": float(statistics.fmean(values)),
        "max": float(max(values)),
    }


def measure_task_properties(problems: Sequence[Dict[str, Any]]) -> TaskProperties:
    """Distinct correct answers per problem (exhaustive; as strings and as expressions modulo
    commuting, :func:`canonical_expression`), and answer / prompt lengths in characters (one
    character is one token of :class:`quatro_nemo.data.tokenizer.CharTokenizer`)."""
    key = tuple(p["prompt"] for p in problems)
    if key not in _PROPERTIES:
        _PROPERTIES[key] = _measure_task_properties(problems)
    return _PROPERTIES[key]


def _measure_task_properties(problems: Sequence[Dict[str, Any]]) -> TaskProperties:
    counts, expression_counts, answer_lengths = [], [], []
    for problem in problems:
        solutions = enumerate_solutions(problem["numbers"], problem["target"])
        counts.append(len(solutions))
        expression_counts.append(len({canonical_expression(s) for s in solutions}))
        answer_lengths.extend(len(s) for s in solutions)
    return TaskProperties(
        num_problems=len(problems),
        solutions_per_problem=summarize(counts),
        expressions_per_problem=summarize(expression_counts),
        solution_length_chars=summarize(answer_lengths),
        prompt_length_chars=summarize([len(p["prompt"]) for p in problems]),
    )
