import pytest

from quatro_nemo.rewards import get_verifier


def test_score_batch_hand_cases():
    verifier = get_verifier("countdown")
    problem = {"id": "p", "benchmark": "countdown", "prompt": "1 2 4>12:", "answer": "12",
               "numbers": [1, 2, 4], "target": 12}
    responses = ["1+2=3,3*4=12", "4*2=8,8+1=9", "2*4=8,8+4=12", "garbage", ""]
    assert verifier.score_batch([problem] * 5, responses) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_errors_name_the_problem():
    verifier = get_verifier("countdown")
    with pytest.raises(ValueError, match="2 problems but 1 responses"):
        verifier.score_batch([{}, {}], ["x"])
    with pytest.raises(ValueError, match="'numbers'"):
        verifier.score_batch([{"id": "q", "target": 3}], ["1+2=3"])
