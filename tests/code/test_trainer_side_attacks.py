"""Issue 28, first part: the trainer's own code that reads a program's output (decoders,
comparators, response parsing) is total and linear, runs outside the threads that enforce the
sandboxes' wall clocks, and float checks look at shape and type before tolerance. Every test
here fails on the code before issue 28 (commit 7e6e9af): an exception out of score_batch, a
quadratic parse that freezes the trainer, a reward of 1.0 for ``return []``, or a fresh budget
for every restart.
"""
import dataclasses
import json
import os
import time

import pytest

from quatro_nemo.data.code_datasets import DATASETS
from quatro_nemo.rewards import plain_data
from quatro_nemo.rewards.code import CodeVerifier, build_program, extract_code, stdio_output_matches
from quatro_nemo.rewards.grading import STATUS_OK, STATUS_TIMEOUT, CheckerProcesses
from quatro_nemo.rewards.sandbox import Sandbox

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "code")
MERSENNE_61 = 2 ** 61 - 1          # CPython: hash(n) == hash(n + k * MERSENNE_61)


def _stdio(expected: str, stdin: str = "", cases: int = 1):
    return {"id": "stdio", "tests": {"kind": "stdio", "cases": [{"input": stdin, "output": expected}] * cases}}


def _call(expected_values, fn="f"):
    return {"id": "call", "tests": {"kind": "call", "fn_name": fn,
                                    "cases": [{"args": [i], "expected": v} for i, v in enumerate(expected_values)]}}


def _program(source: str) -> str:
    return "```python\n" + source + "\n```"


# The runner's replies are written by plain_data.encode in the program's own process: replacing
# it sends the trainer any text as the reply of every call.
def _raw_reply(reply_expression: str) -> str:
    return _program("import plain_data\n_real = plain_data.encode\n"
                    f"plain_data.encode = lambda m: _real(m) if m == ['loaded'] else {reply_expression}\n"
                    "def f(x):\n    return 0\n")


@pytest.fixture(scope="module")
def verifier(sandbox):
    return CodeVerifier(sandbox=Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=10.0), self_check=False),
                        reward="fraction", num_workers=2)


# Protection: integers compared as canonical text (no int(): no 4,300-digit ValueError), call
# replies decoded with plain_data's own bounds, responses and inputs written with surrogatepass.
def test_exceptions_of_the_decode_path_are_per_sample_statuses(verifier):
    big = "1" + "0" * 5000                          # a true answer beyond int()'s 4,300 digits
    cases = [
        (_stdio(big + "\n"), _program("print('9' * 5001)"), 0.0, "wrong_answer"),
        (_stdio(big + "\n"), _program(f"print('+{'0' * 3}{big}')"), 1.0, "passed"),
        (_stdio("7\n"), _program("print('7' * 5000)"), 0.0, "wrong_answer"),
        (_stdio("1\n"), _program("print('\ud800')"), 0.0, "error"),       # lone surrogate in the response
        (_stdio("1\n", stdin="\udcff\n"), _program("print(1)"), 1.0, "passed"),   # ... in a case input
        (_call([1]), _raw_reply("'[\"ok\",{\"c\":[1' + '0' * 400 + ',0]}]'"), 0.0, "invalid_output"),
        (_call([1]), _raw_reply("'[\"ok\",' + '7' * 200000 + ']'"), 0.0, "invalid_output"),
        (_call([1]), _raw_reply("'[\"ok\",' + '[' * 100 + ']' * 100 + ']'"), 0.0, "invalid_output"),
        (_call([10 ** 5000]), _program("def f(x):\n    return 10 ** 5000 + 1"), 0.0, "wrong_answer"),
        (_call([10 ** 5000]), _program("def f(x):\n    return 10 ** 5000"), 1.0, "passed"),
    ]
    grades = verifier.grade_batch([c[0] for c in cases], [c[1] for c in cases])
    assert [(g.fraction, g.statuses[0]) for g in grades] == [(reward, status) for _, _, reward, status in cases]


# Protection: a decimal recogniser without backtracking, set members with equal hashes refused
# before the set is built, and both checks in a checker process: the trainer's threads keep
# enforcing the other samples' wall clocks. Before, the first two held the trainer's GIL for
# tens of seconds each and the sleeper lived as long.
def test_quadratic_outputs_neither_freeze_the_trainer_nor_outlive_their_samples(sandbox):
    wall = 2.0
    verifier = CodeVerifier(sandbox=Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=wall),
                                            self_check=False), reward="fraction", num_workers=3)
    equal_hashes = ",".join(str(k * MERSENNE_61 + 1) for k in range(40000))
    problems = [_stdio("0.5\n"), _call([[1]]), _stdio("1\n")]
    responses = [_program("print('1' * 30000 + 'a')"),
                 _raw_reply(f"'[\"ok\",{{\"s\":[{equal_hashes}]}}]'"),
                 _program("import time\ntime.sleep(100)")]
    start = time.monotonic()
    grades = verifier.grade_batch(problems, responses)
    elapsed = time.monotonic() - start
    assert [g.statuses for g in grades] == [["wrong_answer"], ["invalid_output"], ["timeout"]]
    assert elapsed < wall + 6.0, elapsed


def test_response_parsing_is_linear():
    start = time.monotonic()
    fences = "```" * 100_000                                       # before: 7.8 s for 30,000 characters
    assert extract_code(fences) == fences                           # no block: the whole response
    assert extract_code("```\n" * 100_000) == ""
    assert build_program({"entry_point": "f", "code_prompt": "def f():\n"}, "\n" * 200_000 + "x").startswith("def f")
    assert stdio_output_matches("1" * 1_000_000 + "a", "0.5") is False
    assert time.monotonic() - start < 2.0
    # what the scan finds is what the old regex found
    assert extract_code("```python\na=1\n```\n````\nb\n```\n```py  x\nc=3\n") == "c=3\n"
    assert extract_code("```bash\nls\n```\n````\nb\n```") == "b\n"


@pytest.mark.parametrize("printed, expected, equal", [
    ("-0", "0", True), ("+7", "7", True), ("007", "7", True), ("7", "-7", False), ("٣", "3", False),
    ("1e5", "100000.0", True), ("1.", "1.0", True), (".5", "0.5", True), ("1e", "1.0", False),
    ("1.2.3", "1.2", False), ("1e5e5", "1.0", False), ("e5", "1.0", False), ("1_0.0", "10.0", False),
])
def test_number_tokens_without_regex(printed, expected, equal):
    assert stdio_output_matches(printed, expected) is equal


def test_set_members_with_equal_hashes_are_refused_quickly():
    members = [k * MERSENNE_61 + 5 for k in range(plain_data.MAX_EQUAL_HASHES + 1)]
    with pytest.raises(ValueError, match="hash"):
        plain_data.decode(json.dumps({"s": members}))
    with pytest.raises(ValueError, match="hash"):
        plain_data.decode(json.dumps({"d": [[m, 0] for m in members]}))
    assert plain_data.decode(json.dumps({"s": members[:-1]})) == set(members[:-1])     # up to the bound
    assert plain_data.decode('{"s": [-1, -2]}') == {-1, -2}                             # hash(-1) == hash(-2)


def test_checks_have_their_own_time_bound():
    checkers = CheckerProcesses("time:sleep", timeout_s=0.5)
    start = time.monotonic()
    assert checkers.call(30).status == STATUS_TIMEOUT
    assert time.monotonic() - start < 3.0
    assert checkers.call(0).status == STATUS_OK                    # a fresh process after the kill
    checkers.close()


# Protection: the judge's numpy comparisons check shape and type before tolerance.
def test_empty_or_misshaped_float_answers_fail(verifier):
    with open(os.path.join(FIXTURES, "hub_rows.json")) as f:
        rows = json.load(f)
    humaneval_plus = DATASETS["humaneval_plus"].convert_row(rows["humaneval_plus"][0], 0)
    allclose = {"id": "allclose", "entry_point": "half", "tests": {"kind": "function", "setup": "import numpy as np",
                "cases": ["assert np.allclose(half(1), 0.5)", "assert np.isclose(half(3), 1.5)"]}}
    cases = [
        (humaneval_plus, "def mean_or_zero(values):\n    return []", 0.0),
        (humaneval_plus, "def mean_or_zero(values):\n    return [sum(values) / len(values) if values else 0.0]", 0.0),
        (humaneval_plus, "def mean_or_zero(values):\n    return str(sum(values) / len(values) if values else 0.0)", 0.0),
        (humaneval_plus, "def mean_or_zero(values):\n    return sum(values) / len(values) if values else 0.0", 1.0),
        (allclose, "def half(x):\n    return []", 0.0),
        (allclose, "def half(x):\n    return [[x / 2]]", 0.0),
        (allclose, "def half(x):\n    return x / 2", 1.0),
    ]
    assert verifier.score_batch([c[0] for c in cases], [_program(c[1]) for c in cases]) == [c[2] for c in cases]


# Protection: one wall budget per response. Before, every restart after a timeout got the full
# budget of the cases left: n (n + 1) / 2 walls for a program that hangs on each case.
def test_a_response_has_one_budget_in_fraction_mode(sandbox):
    wall, n = 0.5, 6
    verifier = CodeVerifier(sandbox=Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=wall),
                                            self_check=False), reward="fraction")
    start = time.monotonic()
    grade = verifier.grade(_call([0] * n), _program("import time\ndef f(x):\n    time.sleep(100)"))
    elapsed = time.monotonic() - start
    assert grade.statuses == ["timeout"] * n and grade.ran_all
    assert elapsed < n * wall + 2.5, elapsed                        # before: 21 walls, 10.5 s


def _worst_small_outputs(size):
    """Adversarial outputs of about `size` characters for each check run in the grading thread."""
    depth = "[" * 65 + "]" * 65
    hashes = ",".join(str(k * MERSENNE_61 + 1) for k in range(size // 24))
    return [("stdio", "1" * (size - 1) + "a", "0.5"),
            ("stdio", " ".join(["1"] * (size // 2)), " ".join(["1.0"] * (size // 2))),
            ("call", '["loaded"]\n["ok",' + depth * (size // len(depth) - 1) + "]\n", [1]),
            ("call", '["loaded"]\n["ok",{"s":[' + hashes + "]}]\n", [1]),
            ("call", '["loaded"]\n["ok",[' + ",".join(["7"] * (size // 2 - 20)) + "]]\n", [1])]


# The bound that lets small outputs skip the checker process: every check of an output of
# INLINE_CHECK_CHARS is fast (linear: ~50 ms at most here, most of it Python loops that let
# other threads run; before issue 28 the first output cost 3.9 s at 9,000 characters).
def test_small_outputs_are_checked_quickly_in_the_thread():
    from quatro_nemo.rewards.code import INLINE_CHECK_CHARS, check_output
    for kind, stdout, expected in _worst_small_outputs(INLINE_CHECK_CHARS):
        assert len(stdout) <= INLINE_CHECK_CHARS + 64
        start = time.perf_counter()
        check_output(kind, stdout, expected)
        assert time.perf_counter() - start < 2.0, (kind, stdout[:40])
