"""evaluate_runs / write_report / recipes/evaluate.py on hand-made samples with hand-derived values."""
import csv
import json
import math
import os
import importlib.util

import pytest

from quatro_nemo.eval.report import MetricsConfig, evaluate_runs
from quatro_nemo.eval.samples import load_samples
from quatro_nemo.eval.tables import AVERAGE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "eval")
BASE = os.path.join(FIXTURES, "samples_base.jsonl")
TRAINED = os.path.join(FIXTURES, "samples_trained.jsonl")


def _load_recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(ROOT, "recipes", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluate_main(argv):
    return _load_recipe("evaluate").main(argv)


@pytest.fixture(scope="module")
def report():
    config = MetricsConfig(ucc_metric="exact", base_run="base", pairwise_metrics=("jaccard",))
    return evaluate_runs({"base": load_samples(BASE), "trained": load_samples(TRAINED)}, config, verifier=None)


def test_pass_at_k_per_benchmark_and_averaged_over_benchmarks(report):
    # base: a1 c=0, a2 c=2 (n=4): pass@2 = 1 - C(2,2)/C(4,2) = 5/6; b1 c=4
    base = report["runs"]["base"]
    assert base["benchmarks"]["bench_a"]["pass@k"][2] == pytest.approx((0 + 5 / 6) / 2)
    assert base["benchmarks"]["bench_b"]["pass@k"][1] == pytest.approx(1.0)
    # the average is over benchmarks (0.25 + 1) / 2, not over problems (0 + 0.5 + 1) / 3
    assert base[AVERAGE]["pass@k"][1] == pytest.approx(0.625)
    trained = report["runs"]["trained"]
    assert trained[AVERAGE]["pass@k"][2] == pytest.approx(((0.5 + 1.0) / 2 + 1.0) / 2)
    assert list(trained[AVERAGE]["pass@k"]) == [1, 2, 4]


def test_ucc_and_ucr_with_exact_criterion(report):
    base, trained = report["runs"]["base"], report["runs"]["trained"]
    # base b1: "x = 1 ..." twice (case/space), two other texts -> clusters [2, 1, 1]
    # UCC@2 = (1 - C(2,2)/6) + 2 * (1 - C(3,2)/6) = 5/6 + 1
    assert base["benchmarks"]["bench_b"]["ucc@k"][2] == pytest.approx(11 / 6)
    assert base["benchmarks"]["bench_b"]["ucr"] == pytest.approx(3 / 4)
    assert base[AVERAGE]["ucc@k"][2] == pytest.approx(((0 + 1.0) / 2 + 11 / 6) / 2)
    # trained b1: four identical texts -> one cluster; a2: three distinct correct texts
    assert trained["benchmarks"]["bench_b"]["ucc@k"][4] == pytest.approx(1.0)
    assert trained["benchmarks"]["bench_a"]["ucc@k"][2] == pytest.approx((0.5 + 1.5) / 2)


def test_entropy_similarity_and_flip_rate(report):
    trained = report["runs"]["trained"]["benchmarks"]
    assert trained["bench_a"]["entropy"] == pytest.approx(10 / 7)        # token-weighted
    assert trained["bench_a"]["nll"] == pytest.approx(10 / 7)
    assert math.isnan(report["runs"]["base"]["benchmarks"]["bench_a"]["entropy"])
    assert trained["bench_b"]["similarity"]["jaccard"] == pytest.approx(1.0)   # identical texts
    flip = report["flip"]["trained"]
    assert flip["flip_rate"] == 1.0                                          # a1: 0 -> 1 correct
    by_name = {b["name"]: b for b in flip["buckets"]}
    assert by_name["very hard"]["num_problems"] == 1 and by_name["very hard"]["flip_rate"] == 1.0
    # easy: a2 (2/4 -> 128 of 256) improved 2 -> 3, b1 stayed at 4/4
    assert by_name["easy"]["num_problems"] == 2 and by_name["easy"]["improvement_rate"] == 0.5


class EndsWithVerifier:
    """Test verifier: correct when the response ends with the gold answer."""

    def score_batch(self, problems, responses):
        return [1.0 if r.endswith(str(p["answer"])) else 0.0 for p, r in zip(problems, responses)]


def test_grading_runs_when_rewards_are_missing():
    records = [{"id": "q", "benchmark": "b", "answer": "42", "responses": ["is 42", "is 41", "42"]}]
    out = evaluate_runs({"r": records}, MetricsConfig(pairwise_metrics=()), verifier=EndsWithVerifier())
    assert out["runs"]["r"][AVERAGE]["pass@k"][1] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="verifier is needed"):
        evaluate_runs({"r": records}, MetricsConfig(), verifier=None)


def test_config_and_samples_validation(tmp_path):
    with pytest.raises(ValueError, match="ucc_metric"):
        MetricsConfig(ucc_metric="bleu")
    with pytest.raises(ValueError, match="ucc_threshold"):
        MetricsConfig(ucc_threshold=2.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "benchmark": "b", "answer": "1", "responses": ["x"]}\n'
                   '{"id": 2, "benchmark": "b", "responses": ["x"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: .*missing key\(s\) \['answer'\]"):
        load_samples(str(bad))
    bad.write_text('{"id": 1, "benchmark": "b", "answer": "1", "responses": ["x", "y"], "rewards": [1]}\n')
    with pytest.raises(ValueError, match="line 1: 'rewards' must be a list with one entry per response"):
        load_samples(str(bad))
    with pytest.raises(ValueError, match="base_run"):
        evaluate_runs({"a": load_samples(BASE)}, MetricsConfig(base_run="nope"))


def test_evaluate_recipe_regrades_with_math_verifier_and_writes_everything(tmp_path, report):
    out = tmp_path / "report"
    argv = [f"+runs.base={BASE}", f"+runs.trained={TRAINED}", "base_run=base", "regrade=true",
            "ucc_metric=exact", "pairwise_metrics=[jaccard,rouge_l]", "grading_workers=1", "grading_timeout=30",
            f"out={out}"]
    assert evaluate_main(argv) == 0
    data = json.loads((out / "report.json").read_text())                  # strict JSON (no NaN)
    # the math verifier's grades reproduce the hand labels, so the numbers match the fixture run
    for run in ("base", "trained"):
        for k in ("1", "2", "4"):
            assert data["runs"][run][AVERAGE]["pass@k"][k] == pytest.approx(
                report["runs"][run][AVERAGE]["pass@k"][int(k)])
    assert data["runs"]["base"][AVERAGE]["grading"] == {"correct": 6, "incorrect": 5, "no_answer": 1}
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    row = [r for r in rows if (r["run"], r["benchmark"], r["metric"], r["k"]) == ("base", AVERAGE, "pass@k", "1")]
    assert float(row[0]["value"]) == pytest.approx(0.625)
    md = (out / "report.md").read_text()
    assert "## Pass@k: average" in md and "## Flip rate vs base run `base`" in md
    for name in ("pass_at_k.png", "ucc_at_k.png", "similarity.png", "flip_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


MISSING_FILE = os.path.join(FIXTURES, "no_such_samples.jsonl")


@pytest.mark.parametrize("argv, exit_code, named", [
    # Hydra rejects the override itself (exit 1), naming the key
    (["num_samplez=3", f"+runs.a={BASE}", "out=o"], 1, "num_samplez"),
    (["num_samples=many", f"+runs.a={BASE}", "out=o"], 1, "num_samples"),
    (["plots=maybe", f"+runs.a={BASE}", "out=o"], 1, "plots"),
    ([f"+runs.a={BASE}", "ucc_metric=bogus", "out=o"], 1, "full_key: ucc_metric"),   # a choice: the key
    ([f"+runs.a={BASE}", "verifier=nope", "out=o"], 1, "full_key: verifier"),         # and its choices
    # our validation rejects the value (exit 2), naming the key
    ([f"+runs.a={BASE}"], 2, "config key out"),
    ([f"+runs.a={MISSING_FILE}", "out=o"], 2, "config key runs.a"),
    (["out=o"], 2, "config key runs"),
    ([f"+runs.a={BASE}", "ucc_threshold=1.5", "out=o"], 2, "config key ucc_threshold"),
    ([f"+runs.a={BASE}", "pairwise_metrics=[jaccard,nope]", "out=o"], 2, "config key pairwise_metrics"),
    ([f"+runs.a={BASE}", "ks=[0,2]", "out=o"], 2, "config key ks"),
    ([f"+runs.a={BASE}", "grading_timeout=0", "out=o"], 2, "config key grading_timeout"),
    (["checkpoint=ckpt", "out=o"], 2, "config key data"),
    (["checkpoint=ckpt", f"data=[{BASE}]", "num_samples=0", "out=o"], 2, "config key num_samples"),
    ([f"+runs.checkpoint={BASE}", "checkpoint=ckpt", f"data=[{BASE}]", "out=o"], 2, "config key name"),
    (["checkpoint=ckpt", f"data=[{BASE}]", "generator=no_such_module:generate", "out=o"], 2,
     "config key generator"),
])
def test_evaluate_recipe_names_the_bad_key_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, exit_code, named):
    monkeypatch.chdir(tmp_path)       # out=o is relative: nothing may appear here
    assert evaluate_main(argv) == exit_code
    assert named in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_precomputed_cluster_sizes_are_used_and_checked():
    records = [{"id": "q", "benchmark": "b", "answer": None, "responses": ["a", "b", "c", "d"],
                "rewards": [1, 1, 1, 0], "cluster_sizes": [2, 1]}]
    out = evaluate_runs({"r": records}, MetricsConfig(ucc_metric="precomputed", pairwise_metrics=()), verifier=None)
    # UCC@2 = (1 - C(2,2)/C(4,2)) + (1 - C(3,2)/C(4,2)) = 5/6 + 1/2
    assert out["runs"]["r"][AVERAGE]["ucc@k"][2] == pytest.approx(5 / 6 + 1 / 2)
    records[0]["cluster_sizes"] = [1, 1]
    with pytest.raises(ValueError, match="problem 'q' \\(b\\): precomputed cluster_sizes sum to 2"):
        evaluate_runs({"r": records}, MetricsConfig(ucc_metric="precomputed"), verifier=None)
