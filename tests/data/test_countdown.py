"""The Countdown task: generation, splits, exhaustive enumeration, rules (hand-derived cases)."""
import random

import pytest

from quatro_nemo.tasks.countdown.problems import (
    CountdownTaskConfig,
    canonical_expression,
    enumerate_solutions,
    format_steps,
    generate_split,
    is_correct,
    measure_task_properties,
    problem_key,
)

SMALL = CountdownTaskConfig(num_train=60, num_heldout=40, seed=5)


def test_splits_are_disjoint_deterministic_and_seeded():
    train = generate_split(SMALL, "train")
    heldout = generate_split(SMALL, "heldout")
    train_keys = {problem_key(p["numbers"], p["target"]) for p in train}
    heldout_keys = {problem_key(p["numbers"], p["target"]) for p in heldout}
    assert len(train_keys) == 60 and len(heldout_keys) == 40  # distinct within a split
    assert not train_keys & heldout_keys
    # another seed draws other problems, but a problem never changes split
    other = generate_split(CountdownTaskConfig(num_train=60, num_heldout=40, seed=6), "heldout")
    assert {problem_key(p["numbers"], p["target"]) for p in other} & train_keys == set()
    assert [p["prompt"] for p in other] != [p["prompt"] for p in heldout]
    assert generate_split(SMALL, "heldout") == heldout


def test_generated_problems_respect_the_config():
    for p in generate_split(SMALL, "heldout"):
        assert len(p["numbers"]) in SMALL.num_numbers
        assert SMALL.min_target <= p["target"] <= SMALL.max_target
        assert all(SMALL.min_number <= n <= SMALL.max_number for n in p["numbers"])
        assert len(enumerate_solutions(p["numbers"], p["target"])) >= SMALL.min_solutions
        assert set(p) >= {"id", "benchmark", "prompt", "answer"} and p["answer"] == str(p["target"])


def test_enumeration_small_cases_by_hand():
    assert enumerate_solutions([2, 3], 6) == ["2*3=6", "3*2=6"]
    assert enumerate_solutions([2, 3], 5) == ["2+3=5", "3+2=5"]
    assert enumerate_solutions([2, 3], 1) == ["3-2=1"]
    assert enumerate_solutions([2, 4], 2) == ["4-2=2", "4/2=2"]
    assert enumerate_solutions([2, 3], 7) == []
    # [1, 2, 4] -> 12: (1+2)*4 in 2 x 2 orders of operands; 4*(2+1)... ; (4-1)... no: 3*4 only via 1+2
    # and 2*(4+... ) 2*6 with 6 = 4+2 uses 2 twice (not allowed) -> exactly the four strings below.
    assert enumerate_solutions([1, 2, 4], 12) == ["1+2=3,3*4=12", "1+2=3,4*3=12", "2+1=3,3*4=12", "2+1=3,4*3=12"]


@pytest.mark.parametrize("response, expected", [
    ("1+2=3,3*4=12", True),
    ("4*3=12", False),            # 3 is not given and was not produced
    ("2*4=8,8+1=9", False),       # wrong target (12)
    ("1+2=4,4*3=12", False),      # wrong arithmetic
    ("1+2=3,3*4=12,", False),     # trailing separator
    ("1+2=3, 3*4=12", False),     # space is not part of the grammar
    ("2-1=1,1*4=4", False),       # wrong target
    ("", False),
    ("01+2=3,3*4=12", False),     # leading zero
])
def test_rules_hand_cases(response, expected):
    assert is_correct([1, 2, 4], 12, response) is expected


def test_rules_usage_hand_cases():
    assert not is_correct([3, 5], 6, "3+3=6")                 # 3 used twice
    assert is_correct([3, 3, 5], 6, "3+3=6")                  # two 3s given
    assert is_correct([2, 3, 4, 9], 12, "3*4=12")             # unused numbers are fine
    assert not is_correct([2, 3, 4, 9], 12, "9-2=7,3*4=12")   # dead step: 7 never used
    assert not is_correct([3, 3, 9], 9, "3-3=0,0+9=9")        # results must be positive
    assert not is_correct([7, 2, 3], 3, "7/2=3")              # division must be exact
    assert is_correct([8, 2, 3], 12, "8/2=4,3*4=12")


def _random_response(rng, numbers):
    """A random well-formed step string: operands from the pool (sometimes not), any operator,
    the true result or an off-by-one one, at a random depth."""
    pool, steps = list(numbers), []
    for _ in range(rng.randint(1, len(numbers))):
        if len(pool) < 2:
            break
        a = pool.pop(rng.randrange(len(pool)))
        b = pool.pop(rng.randrange(len(pool))) if rng.random() < 0.9 else rng.randint(1, 12)
        op = rng.choice("+-*/")
        c = {"+": a + b, "-": a - b, "*": a * b, "/": a // max(b, 1)}[op]
        c += rng.choice([0, 0, 0, 1])
        if c < 0:
            c = 0
        steps.append((a, op, b, c))
        if rng.random() < 0.7:
            pool.append(c)
    return format_steps(steps)


def test_verifier_agrees_with_exhaustive_enumeration():
    """For any well-formed response, correct <=> it is among all solutions found by brute force."""
    rng = random.Random(0)
    problems = generate_split(SMALL, "train")[:25]
    checked_true = 0
    for problem in problems:
        numbers, target = problem["numbers"], problem["target"]
        solutions = set(enumerate_solutions(numbers, target))
        assert all(is_correct(numbers, target, s) for s in solutions)
        for _ in range(150):
            response = _random_response(rng, numbers)
            assert is_correct(numbers, target, response) == (response in solutions), response
            checked_true += response in solutions
        # and every sequence whose final value hits the target by chance is covered
    assert checked_true > 0


def test_canonical_expression_by_hand():
    assert canonical_expression("5+3=8,8*2=16") == "((3+5)*2)"
    assert canonical_expression("3+5=8,2*8=16") == "((3+5)*2)"
    assert canonical_expression("9-2=7,3*4=12") == "(3*4)"  # only called on correct responses
    assert canonical_expression("1+2=3,4*3=12") == canonical_expression("2+1=3,3*4=12")
    assert canonical_expression("not steps") is None


def test_measure_task_properties_counts_solutions():
    problems = [{"numbers": [2, 3], "target": 6, "prompt": "2 3>6:"},
                {"numbers": [1, 2, 4], "target": 12, "prompt": "1 2 4>12:"}]
    props = measure_task_properties(problems)
    assert props.solutions_per_problem == {"min": 2.0, "median": 3.0, "mean": 3.0, "max": 4.0}
    assert props.expressions_per_problem["max"] == 1.0  # all four are ((1+2)*4)
    assert props.solution_length_chars["max"] == len("1+2=3,3*4=12")


@pytest.mark.parametrize("overrides, key", [
    ({"num_numbers": (1,)}, "task.num_numbers"),
    ({"min_number": 5, "max_number": 4}, "task.min_number"),
    ({"heldout_fraction": 1.0}, "task.heldout_fraction"),
    ({"num_train": 0}, "task.num_train"),
])
def test_config_validation_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        CountdownTaskConfig(**overrides)


def test_shipped_default_task_has_many_correct_answers_per_prompt():
    """conf/config.yaml's task section (the CPU default) keeps docs/cpu-task.md item 1: dozens of
    distinct correct step strings per held-out prompt and several distinct expressions."""
    from pathlib import Path

    from omegaconf import OmegaConf

    section = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "config.yaml").task)
    options = {k: v for k, v in section.items() if k not in ("name", "tokenizer")}
    config = CountdownTaskConfig(**dict(options, num_heldout=24))
    props = measure_task_properties(generate_split(config, "heldout"))
    assert props.solutions_per_problem["min"] >= config.min_solutions
    assert props.solutions_per_problem["median"] >= 20
    assert props.expressions_per_problem["median"] >= 4
    assert props.solution_length_chars["median"] >= 12  # responses of tens of tokens (+ EOS)
