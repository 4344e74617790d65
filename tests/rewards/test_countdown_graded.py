"""The graded Countdown reward (task.reward=graded, issue 19) against an evaluator written here,
independently of quatro_nemo.tasks.countdown.problems: each step checked with exact fractions, operands
taken from a multiset of available values, the spec's formula applied to the value reached."""
import random
from collections import Counter
from fractions import Fraction

import pytest

from quatro_nemo.tasks.countdown.problems import enumerate_solutions, generate_split, CountdownTaskConfig
from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.task import build_task
from quatro_nemo.tasks.countdown.verifier import CountdownVerifier

PARTIAL = 0.5


def reference_value(numbers, response):
    """The value a valid response reaches, or None (independent re-implementation of the rules)."""
    if not response or response != response.strip():
        return None
    given = Counter(numbers)
    produced = Counter()
    value = None
    for step in response.split(","):
        left, eq, written = step.partition("=")
        if not eq or not written.isdigit() or (len(written) > 1 and written[0] == "0"):
            return None
        ops = [i for i, ch in enumerate(left) if ch in "+-*/" and i > 0]
        if len(ops) != 1:
            return None
        a_text, op, b_text = left[:ops[0]], left[ops[0]], left[ops[0] + 1:]
        if not (a_text.isdigit() and b_text.isdigit()) or any(len(t) > 1 and t[0] == "0" for t in (a_text, b_text)):
            return None
        a, b, c = Fraction(int(a_text)), Fraction(int(b_text)), Fraction(int(written))
        exact = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        if exact is None or exact <= 0 or exact.denominator != 1 or exact != c:
            return None
        for operand in (int(a_text), int(b_text)):
            if produced[operand]:
                produced[operand] -= 1
            elif given[operand]:
                given[operand] -= 1
            else:
                return None
        produced[int(written)] += 1
        value = int(written)
    return value if sum(produced.values()) == 1 else None


def reference_reward(numbers, target, response):
    value = reference_value(numbers, response)
    if value is None:
        return 0.0
    if value == target:
        return 1.0
    return PARTIAL * max(0.0, 1.0 - abs(value - target) / target)


def test_hand_computed_rewards():
    verifier = CountdownVerifier("graded", PARTIAL)
    problem = {"numbers": [9, 2, 3, 7], "target": 18}
    cases = {
        "9*2=18": 1.0,
        "9+2=11": 0.5 * 11 / 18,          # |11 - 18| / 18 = 7/18
        "9*3=27": 0.25,                   # 9/18 off
        "9*7=63": 0.0,                    # more than the target away
        "9+2=11,11+7=18": 1.0,
        "9+2=11,3+7=10": 0.0,             # two results left: a dead step
        "9+9=18": 0.0,                    # 9 given once
        "9+2=12": 0.0,                    # wrong arithmetic
        "7-9=2": 0.0,                     # results must stay positive
        "": 0.0, "9*2": 0.0, "18": 0.0,
    }
    for response, expected in cases.items():
        assert verifier.score(problem, response) == pytest.approx(expected, abs=1e-15), response
    assert CountdownVerifier().score(problem, "9+2=11") == 0.0   # binary stays the default


def mutated(text, rng):
    chars = "0123456789+-*/=,"
    pos = rng.randrange(len(text) + 1)
    kind = rng.random()
    if kind < 0.4 and text:
        return text[:pos] + rng.choice(chars) + text[pos + 1:]
    if kind < 0.7:
        return text[:pos] + rng.choice(chars) + text[pos:]
    return text[:pos] + text[pos + 1:]


def random_steps(numbers, rng):
    pool = list(numbers)
    steps = []
    for _ in range(rng.randint(1, len(numbers) - 1)):
        a, b = rng.sample(pool, 2)
        op = rng.choice("+-*/")
        c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else a + 1}[op]
        steps.append(f"{a}{op}{b}={c if rng.random() < 0.9 else c + 1}")
        pool.remove(a)
        pool.remove(b)
        pool.append(c)
    return ",".join(steps)


def test_graded_rewards_match_the_independent_evaluator_and_lie_in_unit_interval():
    rng = random.Random(0)
    verifier = CountdownVerifier("graded", PARTIAL)
    problems = generate_split(CountdownTaskConfig(num_train=40, max_number=9, max_target=60), "train")
    checked, partial, levels = 0, 0, set()
    for problem in problems:
        numbers, target = problem["numbers"], problem["target"]
        responses = enumerate_solutions(numbers, target, limit=5)
        responses += [random_steps(numbers, rng) for _ in range(30)]
        responses += [mutated(r, rng) for r in list(responses)]
        rewards = verifier.score_batch([problem] * len(responses), responses)
        for response, reward in zip(responses, rewards):
            assert 0.0 <= reward <= 1.0
            assert reward == pytest.approx(reference_reward(numbers, target, response), abs=1e-15), (numbers, target,
                                                                                                      response)
            assert (reward == 1.0) == (CountdownVerifier().score(problem, response) == 1.0)
            levels.add(round(reward, 9))
            checked += 1
            partial += 0.0 < reward < 1.0
    assert checked > 2000 and partial > 300
    assert len(levels) > 20            # many reward levels: the dual's continuous branch
    assert {0.0, 1.0} <= levels


def test_task_reward_is_selected_by_config_and_validated_by_name():
    task = build_task(load_config(["task.reward=graded", "task.partial_credit=0.3", "task.num_train=8",
                                   "task.num_heldout=4", "warmstart.enabled=false"]))
    problem = {"numbers": [9, 2, 3, 7], "target": 18}
    assert task.verifier.score_batch([problem], ["9*3=27"]) == [pytest.approx(0.15)]
    for bad, key in (("task.reward=partial", "task.reward"), ("task.partial_credit=1.0", "task.partial_credit")):
        with pytest.raises(ValueError, match=key):
            build_task(load_config([bad, "task.num_train=8", "task.num_heldout=4"]))
