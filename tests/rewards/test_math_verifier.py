"""Math grading: >= 30 hand-judged cases, extraction, caching, and a sympy-hanging answer.

Expected verdicts are a human grader's (the answers are equal as mathematics or not), never the
verifier's own output.
"""
import time

import pytest

from quatro_nemo.data.math_datasets import extract_boxed_answer
from quatro_nemo.rewards import get_verifier
from quatro_nemo.rewards.math_verifier import MathVerifier

# (gold answer, response, correct?)
CASES = [
 ("\\frac{1}{2}", "So \\boxed{0.5}.", 1),
 ("0.5", "\\boxed{\\frac12}", 1),
 ("\\frac{3}{4}", "\\boxed{0.75}", 1),
 ("\\frac{1}{3}", "\\boxed{0.33}", 0),
 ("2\\sqrt{5}", "\\boxed{\\sqrt{20}}", 1),
 ("2\\sqrt{5}", "\\boxed{2}", 0),
 ("(1,2]", "\\boxed{(1,2]}", 1),
 ("(1,2]", "\\boxed{[1,2]}", 0),
 ("[0,\\infty)", "\\boxed{[0, \\infty)}", 1),
 ("\\{1,2,3\\}", "\\boxed{\\{3,2,1\\}}", 1),
 ("\\{1,2\\}", "\\boxed{\\{1,2,3\\}}", 0),
 ("5", "\\boxed{5\\text{ cm}}", 1),
 ("10", "\\boxed{10^\\circ}", 1),
 ("\\text{(A)}", "\\boxed{A}", 1),
 ("\\text{Monday}", "\\boxed{\\text{Monday}}", 1),
 ("\\text{Monday}", "\\boxed{\\text{Tuesday}}", 0),
 ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", 1),
 ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\boxed{\\begin{pmatrix}2\\\\1\\end{pmatrix}}", 0),
 ("10", "The answer is 10.", 0),
 ("3", "first \\boxed{2}, then corrected: \\boxed{3}", 1),
 ("2", "\\boxed{2} ... final answer \\boxed{3}", 0),
 ("10", "\\boxed{\\frac{1}{", 0),
 ("10", "\\boxed{\\frac{}{}}", 0),
 ("x^2+2x+1", "\\boxed{(x+1)^2}", 1),
 ("\\pi/2", "\\boxed{\\frac{\\pi}{2}}", 1),
 ("12\\%", "\\boxed{12}", 1),
 ("-3", "\\boxed{-3}", 1),
 ("-3", "\\boxed{3}", 0),
 ("\\infty", "\\boxed{\\infty}", 1),
 ("x=3", "\\boxed{3}", 1),
 ("7", "\\fbox{7}", 1),
 ("7", "hence \\boxed 7.", 1),
 ("1000", "\\boxed{1,000}", 1),
 ("\\dfrac{1}{2}", "\\boxed{\\frac{1}{2}}", 1),
 ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}", 1),
 ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{1}{2}\\sqrt{3}}", 1),
 ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{2}}{2}}", 0),
 ("$\\$18.90$", "\\boxed{18.90}", 1),
 ("\\$18.90", "\\boxed{\\$18.90}", 1),
 ("2", "\\boxed{2.0}", 1),
 ("4", "$\\boxed{4}$", 1),
 ("(3,-1)", "\\boxed{(3, -1)}", 1),
 ("(3,-1)", "\\boxed{(-1, 3)}", 0),
]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout_s=20.0) as v:
        yield v


def test_at_least_30_hand_judged_cases(verifier):
    assert len(CASES) >= 30
    grades = verifier.grade_batch([{"id": f"p{i}", "answer": a} for i, (a, _, _) in enumerate(CASES)],
                                  [r for _, r, _ in CASES])
    wrong = [(a, r, want, g) for (a, r, want), g in zip(CASES, grades) if g.score != want]
    assert not wrong, wrong
    assert all(g.status in ("correct", "incorrect", "no_answer") for g in grades)


def test_missing_and_unclosed_boxes_are_reported_as_no_answer(verifier):
    grades = verifier.grade_batch([{"answer": "10"}] * 2, ["The answer is 10.", "\\boxed{\\frac{1}{"])
    assert [(g.score, g.status, g.extracted) for g in grades] == [(0.0, "no_answer", None)] * 2


def test_score_batch_interface_and_registry():
    v = get_verifier("math", num_workers=1, timeout_s=20.0)
    try:
        assert isinstance(v, MathVerifier)
        assert v.score_batch([{"answer": "4"}, {"answer": "4"}], ["\\boxed{4}", "\\boxed{5}"]) == [1.0, 0.0]
        with pytest.raises(ValueError, match="2 problems and 1 responses"):
            v.score_batch([{"answer": "4"}] * 2, ["x"])
        with pytest.raises(ValueError, match="no 'answer'"):
            v.score_batch([{"id": "q7"}], ["\\boxed{1}"])
    finally:
        v.close()


def test_verdicts_are_cached_per_gold_and_extracted_answer(verifier):
    before = dict(verifier.stats)
    problems = [{"answer": "\\frac{2}{3}"}] * 6
    responses = ["long reasoning A \\boxed{2/3}", "other reasoning \\boxed{2/3}", "\\boxed{0.6}"] * 2
    assert verifier.score_batch(problems, responses) == [1.0, 1.0, 0.0] * 2
    assert verifier.stats["checks"] - before.get("checks", 0) == 2          # two distinct answers
    assert verifier.score_batch(problems, responses) == [1.0, 1.0, 0.0] * 2
    assert verifier.stats["checks"] - before.get("checks", 0) == 2          # all from the cache


@pytest.mark.parametrize("text,want", [
    ("a \\boxed{1} b \\boxed{\\frac{2}{3}} c", "\\frac{2}{3}"),
    ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
    ("\\boxed {  7 }", "7"),
    ("\\fbox{x}", "x"),
    ("\\boxed 12.", "12"),
    ("no box", None),
    ("\\boxed{", None),
])
def test_extract_boxed_answer(text, want):
    assert extract_boxed_answer(text) == want


def test_sympy_hanging_answer_times_out_is_incorrect_and_reported():
    # 9^(9^(9^9)): sympy tries to evaluate the tower and never returns (checked: > 10 s).
    hang = "so the answer is \\boxed{9^{9^{9^{9}}}}"
    with MathVerifier(num_workers=2, timeout_s=3.0) as v:
        start = time.perf_counter()
        grades = v.grade_batch([{"answer": "1"}, {"answer": "\\frac{1}{2}"}, {"answer": "1"}],
                               [hang, "\\boxed{0.5}", "\\boxed{1}"])
        elapsed = time.perf_counter() - start
        assert [g.status for g in grades] == ["timeout", "correct", "correct"]
        assert grades[0].score == 0.0 and "3 s" in grades[0].message
        assert v.stats["timeout"] == 1
        # the pool replaced the killed worker and keeps grading
        assert v.score_batch([{"answer": "3"}], ["\\boxed{3}"]) == [1.0]
    assert elapsed < 60, elapsed


def test_a_cache_smaller_than_the_batch_still_grades_every_response():
    with MathVerifier(num_workers=1, timeout_s=20.0, max_cache_entries=1) as v:
        answers = ["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{2}", "\\boxed{\\frac{1}{2}}"]
        assert v.score_batch([{"answer": "\\frac{1}{2}"}] * 4, answers) == [1.0, 1.0, 0.0, 1.0]
        assert len(v._cache) == 1
