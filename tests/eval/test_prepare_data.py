"""Dataset converters on rows written by the project in the hub's field layout (no hub access)."""
import importlib.util
import json
import os

import pytest

from quatro_nemo.data.math_datasets import DATASETS, EVAL_BENCHMARKS, QWEN_MATH_SYSTEM, qwen_math_prompt
from quatro_nemo.data.schema import REQUIRED_KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW = json.load(open(os.path.join(ROOT, "tests", "fixtures", "eval", "raw_rows.json")))

# (dataset, row index) -> (id, answer, question) written by hand from the fixture rows
EXPECTED = {
    ("math_train", 0): ("math_train/0", "2", "What is $1+1$?"),
    ("math_train", 1): ("math_train/1", "\\frac{1}{2}", "Simplify $\\frac{2}{4}$."),
    ("math500", 0): ("math500/test/algebra/1.json", "3", "Find $x$ if $2x=6$."),
    ("amc23", 0): ("amc23/0", "4.0", "How many primes are below 10?"),
    ("aime24", 0): ("aime24/60", "204", "Find the remainder."),
    ("aime25", 0): ("aime25/0", "70", "Find $n$."),
    ("minerva", 0): ("minerva/0", "6.7e-3", "Compute the mass in kg."),
    ("olympiadbench", 0): ("olympiadbench/1606", "3, -1", "Find all $x$."),
    ("olympiadbench", 1): ("olympiadbench/1607", "25", "Let $a_n = n^2$.\nCompute $a_5$."),
}


def test_every_benchmark_of_the_paper_has_a_source():
    assert set(EVAL_BENCHMARKS) | {"math_train"} == set(DATASETS)
    assert DATASETS["olympiadbench"].config == "OE_TO_maths_en_COMP"
    assert DATASETS["math500"].hub_id == "HuggingFaceH4/MATH-500"


@pytest.mark.parametrize("dataset,index", sorted(EXPECTED))
def test_row_conversion(dataset, index):
    record = DATASETS[dataset].convert_row(RAW[dataset][index], index)
    want_id, want_answer, want_question = EXPECTED[(dataset, index)]
    assert all(k in record for k in REQUIRED_KEYS)
    assert (record["id"], record["answer"], record["question"], record["benchmark"]) == (
        want_id, want_answer, want_question, dataset)
    assert record["prompt"] == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        f"<|im_start|>user\n{want_question}<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_template_and_missing_fields():
    assert QWEN_MATH_SYSTEM.endswith("within \\boxed{}.")
    assert qwen_math_prompt("  Q  ").count("Q") == 1
    with pytest.raises(ValueError, match="math500 row 3: no answer field"):
        DATASETS["math500"].convert_row({"problem": "p"}, 3)
    with pytest.raises(ValueError, match="math_train row 0: no \\\\boxed"):
        DATASETS["math_train"].convert_row({"problem": "p", "solution": "no box"}, 0)
    with pytest.raises(ValueError, match="no question field"):
        DATASETS["minerva"].convert_row({"answer": "1"}, 0)


def test_prepare_data_recipe_converts_offline_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(ROOT, "recipes", "prepare_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in RAW["olympiadbench"]) + "\n")
    written = module.main(["--dataset", "olympiadbench", "--input", str(rows), "--out", str(tmp_path / "data")])
    records = [json.loads(line) for line in open(written["olympiadbench"])]
    assert [r["answer"] for r in records] == ["3, -1", "25"]
    assert set(module.collect_datasets()) >= set(DATASETS)
    with pytest.raises(SystemExit, match="unknown dataset"):
        module.main(["--dataset", "nope", "--out", str(tmp_path)])
