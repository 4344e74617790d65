"""Public math datasets (paper Sec. 4.1) converted to the project's JSONL schema.

Training: MATH (7.5k train, Hendrycks et al. 2021). Evaluation: MATH500, AMC23, AIME24, AIME25,
Minerva Math, OlympiadBench (hub ids: stack-facts.md). Each record:

    {"id": "math500/test/precalculus/807.json", "benchmark": "math500",
     "prompt": <Qwen2.5-Math chat prompt>, "question": <raw problem>, "answer": <gold answer>}

The prompt is Qwen2.5-Math's chain-of-thought template ("qwen25-math-cot" in the Qwen2.5-Math
evaluation code; Yang et al. 2024): system message "Please reason step by step, and put your
final answer within \\boxed{}." in the ChatML format, so the math verifier can read the last box.
Field names differ between hub datasets; each converter names the fields it reads and raises a
ValueError naming the dataset and row when one is missing.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from quatro_nemo.data.schema import DatasetSource, validate_record

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed_answer(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in `text` (nested braces matched):
    where the prompt asks for the final answer. Reads gold answers out of MATH solutions here and
    responses in the math verifier (``quatro_nemo.rewards.math_verifier``).

    ``\\boxed 5`` (no braces) gives the next whitespace-delimited token, as in Hendrycks' MATH
    grader. Returns None when there is no complete box (e.g. an unclosed brace).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    pos = start + len(cmd)
    if text.startswith(" ", pos) and not text[pos:].lstrip().startswith("{"):
        rest = text[pos:].split()
        return rest[0].rstrip("$.,") if rest else None
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1:i].strip()
    return None


def qwen_math_prompt(question: str) -> str:
    """Qwen2.5-Math CoT chat prompt (ChatML), ending where the assistant's answer starts."""
    return (f"<|im_start|>system\n{QWEN_MATH_SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{question.strip()}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def _first(row: Dict[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        value = row.get(key)
        if value not in (None, "", []):
            return value
    return None


def _answer_text(value: Any) -> str:
    """OlympiadBench stores a list of final answers ("$x=1$"); join them, drop outer $...$."""
    if isinstance(value, (list, tuple)):
        return ", ".join(_answer_text(v) for v in value)
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


def make_converter(benchmark: str, question_keys: Sequence[str] = ("problem", "question"),
                   answer_keys: Sequence[str] = ("answer", "final_answer"),
                   id_keys: Sequence[str] = ("unique_id", "id"), context_key: Optional[str] = None,
                   answer_from_solution: bool = False) -> Callable[[Dict[str, Any], int], Dict[str, Any]]:
    """A (row, index) -> record function for one benchmark.

    answer_from_solution: take the gold answer from the last \\boxed{} of the row's "solution"
    (MATH train has no separate answer column).
    """

    def convert(row: Dict[str, Any], index: int) -> Dict[str, Any]:
        where = f"{benchmark} row {index}"
        question = _first(row, question_keys)
        if question is None:
            raise ValueError(f"{where}: no question field (looked for {list(question_keys)})")
        context = row.get(context_key) if context_key else None
        if context:
            question = f"{str(context).strip()}\n{question}"
        if answer_from_solution:
            solution = row.get("solution")
            answer = extract_boxed_answer(solution) if solution else None
            if answer is None:
                raise ValueError(f"{where}: no \\boxed{{}} answer in the 'solution' field")
        else:
            raw = _first(row, answer_keys)
            if raw is None:
                raise ValueError(f"{where}: no answer field (looked for {list(answer_keys)})")
            answer = _answer_text(raw)
        row_id = _first(row, id_keys)
        record = {
            "id": f"{benchmark}/{row_id if row_id is not None else index}",
            "benchmark": benchmark,
            "prompt": qwen_math_prompt(str(question)),
            "question": str(question).strip(),
            "answer": answer,
        }
        for extra in ("level", "subject", "type", "year"):
            if row.get(extra) not in (None, ""):
                record[extra] = row[extra]
        validate_record(record, where)
        return record

    return convert


DATASETS: Dict[str, DatasetSource] = {
    "math_train": DatasetSource(
        hub_id="DigitalLearningGmbH/MATH-lighteval", split="train",
        convert_row=make_converter("math_train", answer_from_solution=True),
        description="MATH training set, 7,500 problems (Hendrycks et al. 2021)"),
    "math500": DatasetSource(
        hub_id="HuggingFaceH4/MATH-500", split="test", convert_row=make_converter("math500"),
        description="MATH-500 test subset (Lightman et al. 2023)"),
    "amc23": DatasetSource(
        hub_id="math-ai/amc23", split="test", convert_row=make_converter("amc23"),
        description="AMC 2023, 40 problems"),
    "aime24": DatasetSource(
        hub_id="HuggingFaceH4/aime_2024", split="train", convert_row=make_converter("aime24"),
        description="AIME 2024 I and II, 30 problems"),
    "aime25": DatasetSource(
        hub_id="math-ai/aime25", split="test", convert_row=make_converter("aime25"),
        description="AIME 2025 I and II, 30 problems"),
    "minerva": DatasetSource(
        hub_id="math-ai/minervamath", split="test", convert_row=make_converter("minerva"),
        description="Minerva Math, 272 problems (Lewkowycz et al. 2022)"),
    "olympiadbench": DatasetSource(
        hub_id="Hothan/OlympiadBench", config="OE_TO_maths_en_COMP", split="train",
        convert_row=make_converter("olympiadbench", context_key="context"),
        description="OlympiadBench, open-ended text-only English competition maths, 674 problems"),
}

EVAL_BENCHMARKS = ("math500", "amc23", "aime24", "aime25", "minerva", "olympiadbench")
