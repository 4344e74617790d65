"""Public code datasets (paper Sec. 4.2, Table 4) converted to the project's JSONL schema.

Training: APPS (Hendrycks et al. 2021, ``codeparrot/apps`` train). Evaluation: HumanEval (Chen
et al. 2021, ``openai/openai_humaneval``), HumanEval+ and MBPP+ (EvalPlus, Liu et al. 2023,
``evalplus/humanevalplus``, ``evalplus/mbppplus``), MBPP (Austin et al. 2021,
``google-research-datasets/mbpp`` "full" test split). Each record:

    {"id": "humaneval/HumanEval/0", "benchmark": "humaneval",
     "prompt": <ChatML prompt>, "question": <raw task text>, "answer": <reference solution>,
     "tests": {"kind": "stdio" | "function", ...},      # see quatro_nemo/rewards/code.py
     "entry_point": "has_close_elements",               # function-style only
     "code_prompt": "def has_close_elements(...):..."}  # HumanEval(+) only: prepended when the
                                                         # response omits the signature

Test forms (graded by quatro_nemo.rewards.code.CodeVerifier):
- APPS stdin/stdout problems -> ``{"kind": "stdio", "cases": [{"input", "output"}]}``.
- APPS call-based problems (``fn_name``, LeetCode-style ``class Solution``) ->
  ``{"kind": "call", "fn_name", "cases": [{"args", "expected"}]}``: the arguments go to the
  program, the expected values stay with the trainer, which applies APPS's
  ``eval/testing_util.py`` rule (quatro_nemo.rewards.code.call_output_matches).
- HumanEval(+) -> one case: the dataset's ``check(candidate)`` program plus ``check(entry_point)``.
- MBPP -> one case per assert of ``test_list`` (setup: ``test_setup_code``).
- MBPP+ -> one case: the dataset's ``test`` program (setup: ``test_imports``).
EvalPlus's test programs ``import numpy``: the sandbox's interpreter needs numpy for them
(docs/sandbox.md). A converter returns None for a row that has no usable tests (some APPS rows);
the caller skips those.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Optional

from quatro_nemo.data.schema import DatasetSource, validate_record

CODE_SYSTEM = "You are a helpful programming assistant."
STDIO_INSTRUCTION = ("Write a complete Python 3 program that reads from standard input and writes to "
                     "standard output. Put the program in one ```python code block.")
FUNCTION_INSTRUCTION = "Write the Python 3 function. Put the code in one ```python code block."

def qwen_code_prompt(question: str, instruction: str) -> str:
    """ChatML prompt (Qwen2.5-Coder's chat format), ending where the assistant's answer starts."""
    return (f"<|im_start|>system\n{CODE_SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{question.strip()}\n\n{instruction}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def _field(row: Dict[str, Any], key: str, where: str) -> Any:
    if key not in row or row[key] is None:
        raise ValueError(f"{where}: missing field {key!r} (row has {sorted(row)})")
    return row[key]


def _json_field(row: Dict[str, Any], key: str, where: str) -> Any:
    """APPS stores lists/dicts as JSON strings; an empty string means absent."""
    value = row.get(key)
    if value in (None, ""):
        return None
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: field {key!r} is not valid JSON ({err})") from err
    return value


def _entry_point_from_asserts(asserts: List[str], where: str) -> str:
    """MBPP names the function only in its tests: `assert name(...) == ...`."""
    for line in asserts:
        match = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:math\.isclose\(|set\()?\s*([A-Za-z_]\w*)\s*\(", line)
        if match:
            return match.group(1)
    raise ValueError(f"{where}: cannot find the function name in test_list {asserts[:1]!r}")


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def convert_apps_row(row: Dict[str, Any], index: int) -> Optional[Dict[str, Any]]:
    where = f"apps row {index}"
    question = _field(row, "question", where)
    io = _json_field(row, "input_output", where)
    if not io or not io.get("inputs") or len(io["inputs"]) != len(io.get("outputs", [])):
        return None                                    # no usable tests
    solutions = _json_field(row, "solutions", where) or []
    starter = row.get("starter_code") or ""
    fn_name = io.get("fn_name")
    if fn_name:
        tests = {"kind": "call", "fn_name": fn_name,
                 "cases": [{"args": inp, "expected": out} for inp, out in zip(io["inputs"], io["outputs"])]}
        prompt_text = f"{question.strip()}\n\nStarter code:\n```python\n{starter.rstrip()}\n```" if starter else question
        instruction = FUNCTION_INSTRUCTION
    else:
        tests = {"kind": "stdio",
                 "cases": [{"input": _as_text(inp), "output": _as_text(out)}
                           for inp, out in zip(io["inputs"], io["outputs"])]}
        prompt_text, instruction = question, STDIO_INSTRUCTION
    record = {"id": f"apps/{row.get('problem_id', index)}", "benchmark": "apps",
              "prompt": qwen_code_prompt(prompt_text, instruction), "question": question,
              "answer": solutions[0] if solutions else "", "tests": tests,
              "difficulty": row.get("difficulty", "")}
    if fn_name:
        record["entry_point"] = fn_name
    validate_record(record, where)
    return record


def make_humaneval_converter(benchmark: str) -> Callable[[Dict[str, Any], int], Dict[str, Any]]:
    """HumanEval and HumanEval+ share columns: task_id, prompt, canonical_solution, test, entry_point."""

    def convert(row: Dict[str, Any], index: int) -> Dict[str, Any]:
        where = f"{benchmark} row {index}"
        code_prompt = _field(row, "prompt", where)
        entry_point = _field(row, "entry_point", where)
        record = {"id": f"{benchmark}/{_field(row, 'task_id', where)}", "benchmark": benchmark,
                  "prompt": qwen_code_prompt(f"Complete this function:\n```python\n{code_prompt.rstrip()}\n```",
                                             FUNCTION_INSTRUCTION),
                  "question": code_prompt, "answer": code_prompt + (row.get("canonical_solution") or ""),
                  "tests": {"kind": "function", "setup": "",
                            "cases": [f"{_field(row, 'test', where)}\n\ncheck({entry_point})\n"]},
                  "entry_point": entry_point, "code_prompt": code_prompt}
        validate_record(record, where)
        return record

    return convert


def _mbpp_prompt(text: str, asserts: List[str]) -> str:
    """The MBPP paper's prompt: the task, then the tests the code should pass (they name the function)."""
    return qwen_code_prompt(f"{text.strip()}\nYour code should pass these tests:\n" + "\n".join(asserts),
                            FUNCTION_INSTRUCTION)


def convert_mbpp_row(row: Dict[str, Any], index: int) -> Dict[str, Any]:
    where = f"mbpp row {index}"
    text = _field(row, "text", where)
    asserts = list(_field(row, "test_list", where))
    record = {"id": f"mbpp/{_field(row, 'task_id', where)}", "benchmark": "mbpp",
              "prompt": _mbpp_prompt(text, asserts), "question": text, "answer": row.get("code") or "",
              "tests": {"kind": "function", "setup": row.get("test_setup_code") or "", "cases": asserts},
              "entry_point": _entry_point_from_asserts(asserts, where)}
    validate_record(record, where)
    return record


def convert_mbpp_plus_row(row: Dict[str, Any], index: int) -> Dict[str, Any]:
    where = f"mbpp_plus row {index}"
    text = _field(row, "prompt", where)
    asserts = list(_field(row, "test_list", where))
    entry_point = _entry_point_from_asserts(asserts, where)
    test = _field(row, "test", where)
    if re.search(r"^def check\(", test, re.M):                  # HumanEval-style export
        test = f"{test}\n\ncheck({entry_point})\n"
    record = {"id": f"mbpp_plus/{_field(row, 'task_id', where)}", "benchmark": "mbpp_plus",
              "prompt": _mbpp_prompt(text, asserts[:1]), "question": text, "answer": row.get("code") or "",
              "tests": {"kind": "function", "setup": "\n".join(row.get("test_imports") or []), "cases": [test]},
              "entry_point": entry_point}
    validate_record(record, where)
    return record


DATASETS: Dict[str, DatasetSource] = {
    "apps_train": DatasetSource(hub_id="codeparrot/apps", split="train", convert_row=convert_apps_row,
                                description="APPS train (5k problems), stdin/stdout and call-based tests"),
    "humaneval": DatasetSource(hub_id="openai/openai_humaneval", split="test",
                               convert_row=make_humaneval_converter("humaneval"),
                               description="HumanEval (164 problems)"),
    "humaneval_plus": DatasetSource(hub_id="evalplus/humanevalplus", split="test",
                                    convert_row=make_humaneval_converter("humaneval_plus"),
                                    description="HumanEval+ (EvalPlus, 164 problems, ~80x more tests)"),
    "mbpp": DatasetSource(hub_id="google-research-datasets/mbpp", config="full", split="test",
                          convert_row=convert_mbpp_row, description="MBPP full test split (500 problems)"),
    "mbpp_plus": DatasetSource(hub_id="evalplus/mbppplus", split="test", convert_row=convert_mbpp_plus_row,
                               description="MBPP+ (EvalPlus, 378 problems)"),
}
