"""Code rewards and dataset converters, graded against hand-derived outcomes.

tests/fixtures/code/hub_rows.json holds small rows written by the project in the hub formats of
APPS, HumanEval, HumanEval+ (EvalPlus export, numpy assertion), MBPP and MBPP+;
responses.json pairs responses with their expected verdicts and pass fractions, derived by hand
(each wrong response's comment there names the cases it fails).
"""
import json
import math
import os

import pytest

from quatro_nemo.data.code_datasets import DATASETS
from quatro_nemo.rewards import get_verifier
from quatro_nemo.rewards.code import CodeVerifier, extract_code, stdio_output_matches

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "code")


def _load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def records():
    rows = _load("hub_rows.json")
    return {name: [DATASETS[name].convert_row(row, i) for i, row in enumerate(rows[name])] for name in rows}


@pytest.fixture(scope="module")
def graded(sandbox, records):
    """Every fixture response graded once, all cases run (fraction mode), in one parallel batch."""
    cases = _load("responses.json")
    problems = [records[c["dataset"]][c["row"]] for c in cases]
    verifier = CodeVerifier(sandbox=sandbox, reward="fraction", num_workers=2)
    grades = verifier.grade_batch(problems, [c["response"] for c in cases], stop_on_failure=False)
    return cases, problems, grades


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore") == "print(1)\n"
    # the last python block wins over an earlier one and over other languages
    assert extract_code("```python\na=1\n```\n```bash\nls\n```\n```py\nb=2\n```") == "b=2\n"
    assert extract_code("```\nx = 3\n```") == "x = 3\n"
    assert extract_code("```python\nunterminated = 1\n") == "unterminated = 1\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_stdio_output_matching_rules():
    assert stdio_output_matches("5\n6\n", "5\n6")
    assert stdio_output_matches("5  \n6\n\n\n", "5\n6\n")
    assert stdio_output_matches("1 2 3\n", "1\n2\n3\n")              # same tokens
    assert stdio_output_matches("0.3333333333\n", "0.333333333\n")   # within 1e-6
    assert not stdio_output_matches("0.33\n", "0.333333333\n")
    assert not stdio_output_matches("5\n", "5\n6\n")
    assert not stdio_output_matches("56\n", "5 6\n")
    assert not stdio_output_matches("", "0\n")


def test_converters_produce_the_schema(records):
    apps = records["apps_train"]
    assert apps[0]["tests"]["kind"] == "stdio" and len(apps[0]["tests"]["cases"]) == 3
    assert apps[0]["tests"]["cases"][1] == {"input": "-4 5\n", "output": "1\n-20\n"}
    assert apps[1]["tests"]["kind"] == "call" and apps[1]["entry_point"] == "runningSum"
    assert apps[3] is None                                            # APPS row without tests: skipped
    assert records["mbpp"][0]["entry_point"] == "second_largest"
    assert len(records["mbpp"][0]["tests"]["cases"]) == 3
    assert records["mbpp_plus"][0]["entry_point"] == "reverse_text"
    assert records["humaneval"][0]["tests"]["cases"][0].rstrip().endswith("check(count_vowels)")
    for name, recs in records.items():
        for rec in recs:
            if rec is not None:
                assert rec["benchmark"] == name.replace("_train", "")
                assert rec["prompt"].endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="mbpp row 7: missing field 'test_list'"):
        DATASETS["mbpp"].convert_row({"task_id": 1, "text": "x"}, 7)


def test_reference_solutions_pass(sandbox, records):
    """The dataset's own reference solution (the record's answer) passes every case."""
    problems = [rec for recs in records.values() for rec in recs if rec is not None]
    verifier = CodeVerifier(sandbox=sandbox, num_workers=2)
    assert verifier.score_batch(problems, [p["answer"] for p in problems]) == [1.0] * len(problems)


def test_fixture_responses_are_graded_right(graded):
    cases, _, grades = graded
    for case, grade in zip(cases, grades):
        label = (case["dataset"], case["row"], case["response"][:80])
        assert grade.ran_all, label
        assert grade.all_passed == case["passes"], (label, grade.statuses)
        assert math.isclose(grade.fraction, case["fraction"]), (label, grade.statuses)


def test_early_exit_does_not_pass(graded):
    cases, _, grades = graded
    exits = [g for c, g in zip(cases, grades) if "exit(0)" in c["response"]]
    assert len(exits) == 2
    # sys.exit(0) while loading is an exception the runner reports; os._exit(0) ends its process
    assert [g.statuses for g in exits] == [["error"], ["no_result"]]


def test_score_batch_modes_and_registry(sandbox, records):
    problem = records["mbpp"][0]
    partly_wrong = "```python\ndef second_largest(xs):\n    return sorted(xs)[-2]\n```"
    right = "```python\ndef second_largest(xs):\n    return sorted(set(xs))[-2]\n```"
    assert CodeVerifier(sandbox=sandbox).score_batch([problem] * 2, [partly_wrong, right]) == [0.0, 1.0]
    fractions = CodeVerifier(sandbox=sandbox, reward="fraction").score_batch([problem] * 2, [partly_wrong, right])
    assert fractions == pytest.approx([1 / 3, 1.0])
    # "pass" mode stops at the first failing case
    grade = CodeVerifier(sandbox=sandbox).grade(problem, "```python\ndef second_largest(xs):\n    return 0\n```")
    assert grade.statuses == ["wrong_answer"] and not grade.ran_all
    verifier = get_verifier("code", reward="fraction", wall_timeout_s=5.0)
    assert isinstance(verifier, CodeVerifier) and verifier.sandbox.config.wall_timeout_s == 5.0
    with pytest.raises(ValueError, match="reward"):
        CodeVerifier(sandbox=sandbox, reward="partial")
    with pytest.raises(ValueError, match="tests"):
        CodeVerifier(sandbox=sandbox).score_batch([{"id": "x"}], ["print(1)"])
