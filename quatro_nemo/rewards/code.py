"""Code rewards: run a response's program against a problem's tests in the sandbox.

A code problem (JSONL schema, see quatro_nemo/data/code_datasets.py) carries ``"tests"`` in one
of two forms:

- stdin/stdout (APPS): ``{"kind": "stdio", "cases": [{"input": str, "output": str}, ...]}``.
  The program runs once per case with the input on stdin; its stdout is compared **outside** the
  sandbox with the APPS checker's rules (exact after trimming trailing whitespace, else the same
  whitespace-separated tokens, else equal numbers within 1e-6: hendrycks/apps,
  ``eval/testing_util.py``). Expected outputs never enter the sandbox.
- function (HumanEval(+), MBPP(+), APPS call-based): ``{"kind": "function", "setup": str,
  "cases": [str, ...]}``; each case is Python (asserts, or a ``check(candidate)`` call) run after
  the program in the same interpreter, one sandboxed run per case. A case passes when the
  harness reaches its end and prints a per-run random token as the last line, so a program that
  exits early (``sys.exit(0)``, ``os._exit(0)``) fails.

Reward (``score_batch``): ``"pass"`` gives 1.0 when every case passes, else 0.0 (the paper's
Pass@k grading; stops at the first failing case); ``"fraction"`` gives the fraction of cases
passed. Responses are graded in parallel, one sandboxed process per run, by a thread pool: the
threads only wait on child processes, and the trainer is never forked (safe with CUDA).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

from quatro_nemo.rewards.sandbox import Sandbox, SandboxConfig

REWARD_MODES = ("pass", "fraction")

# ```python ... ``` (also py, python3, or no language); the closing fence may be missing.
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(response: str) -> str:
    """The program in a model response: the last ```python fenced block, else the last fenced
    block of any language, else the whole response (a model may answer with bare code)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(response)]
    python_blocks = [body for lang, body in blocks if lang in _PYTHON_TAGS]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return response


# -- stdio output comparison (APPS rules) --------------------------------------------------------
def _lines(text: str) -> List[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _numbers_close(a: str, b: str, tol: float = 1e-6) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def stdio_output_matches(actual: str, expected: str) -> bool:
    """APPS-style comparison (hendrycks/apps eval/testing_util.py, simplified to its three
    accepting rules): same lines after trimming trailing whitespace and trailing blank lines;
    else the same whitespace-separated tokens; else same token count with every token equal or
    both numbers within 1e-6 (relative or absolute)."""
    if _lines(actual) == _lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    return len(got) == len(want) and all(g == w or _numbers_close(g, w) for g, w in zip(got, want))


# -- function-style harness ----------------------------------------------------------------------
# Trusted code that runs inside the sandbox: reads the run token from stdin (so the program
# cannot read it from there), runs setup, program and test case in one namespace, then prints
# the token. Any exception, SystemExit or os._exit before the end leaves the token unprinted.
_FUNCTION_HARNESS = """\
import sys
_token = sys.stdin.readline().strip()
sys.stdin.close()
_namespace = {"__name__": "__main__"}
for _name in ("setup.py", "solution.py", "case.py"):
    with open("/code/" + _name, encoding="utf-8") as _f:
        _source = _f.read()
    exec(compile(_source, _name, "exec"), _namespace)
sys.stdout.flush()
sys.stdout.write("\\n" + _token + "\\n")
"""


@dataclasses.dataclass
class CodeGrade:
    """Outcome of one response on one problem."""

    passed: int                       # cases passed
    total: int                        # cases in the problem
    statuses: List[str]               # sandbox status (or "wrong_answer") of each case run
    ran_all: bool                     # False when grading stopped at the first failure

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _problem_tests(problem: Dict[str, Any]) -> Dict[str, Any]:
    tests = problem.get("tests")
    where = f"problem {problem.get('id', '?')!r}"
    if not isinstance(tests, dict) or tests.get("kind") not in ("stdio", "function"):
        raise ValueError(f"{where}: 'tests' must be a dict with kind 'stdio' or 'function', got {tests!r:.200}")
    if not isinstance(tests.get("cases"), list) or not tests["cases"]:
        raise ValueError(f"{where}: 'tests.cases' must be a non-empty list")
    return tests


def build_program(problem: Dict[str, Any], response: str) -> str:
    """The code to run: the extracted program, preceded by the problem's ``code_prompt``
    (e.g. HumanEval's signature and docstring) when the response does not define the entry
    point itself (a completion-style answer)."""
    code = extract_code(response)
    entry_point = problem.get("entry_point")
    prefix = problem.get("code_prompt")
    if entry_point and prefix and not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        code = prefix + code
    return code


class CodeVerifier:
    """Verifier "code": reward = tests passed by the program in the response (see module doc)."""

    def __init__(self, reward: str = "pass", num_workers: Optional[int] = None,
                 sandbox: Optional[Sandbox] = None, sandbox_config: Optional[SandboxConfig] = None,
                 **sandbox_overrides: Any):
        if reward not in REWARD_MODES:
            raise ValueError(f"CodeVerifier.reward must be one of {REWARD_MODES}, got {reward!r}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"CodeVerifier.num_workers must be >= 1, got {num_workers}")
        if sandbox is None:
            config = sandbox_config or SandboxConfig()
            if sandbox_overrides:
                config = dataclasses.replace(config, **sandbox_overrides)
            sandbox = Sandbox(config)
        elif sandbox_config is not None or sandbox_overrides:
            raise ValueError("CodeVerifier: pass either sandbox or sandbox_config/overrides, not both")
        self.reward = reward
        self.num_workers = num_workers or (os.cpu_count() or 1)
        self.sandbox = sandbox

    # -- one (problem, response) ---------------------------------------------------------------
    def grade(self, problem: Dict[str, Any], response: str, stop_on_failure: Optional[bool] = None) -> CodeGrade:
        """Run the response against every case of the problem (stop at the first failure when
        `stop_on_failure`, the default in "pass" mode)."""
        tests = _problem_tests(problem)
        if stop_on_failure is None:
            stop_on_failure = self.reward == "pass"
        program = build_program(problem, response)
        cases = tests["cases"]
        statuses: List[str] = []
        for case in cases:
            if tests["kind"] == "stdio":
                status = self._run_stdio_case(program, case)
            else:
                status = self._run_function_case(program, tests.get("setup", ""), case)
            statuses.append(status)
            if status != "passed" and stop_on_failure:
                break
        return CodeGrade(passed=statuses.count("passed"), total=len(cases), statuses=statuses,
                         ran_all=len(statuses) == len(cases))

    def _run_stdio_case(self, program: str, case: Dict[str, str]) -> str:
        result = self.sandbox.run(program, stdin=case["input"])
        if not result.ok:
            return result.status
        return "passed" if stdio_output_matches(result.stdout, case["output"]) else "wrong_answer"

    def _run_function_case(self, program: str, setup: str, case: str) -> str:
        token = secrets.token_hex(16)
        result = self.sandbox.run(_FUNCTION_HARNESS, stdin=token + "\n",
                                  files={"setup.py": setup, "solution.py": program, "case.py": case})
        if not result.ok:
            return result.status
        last_line = result.stdout.rstrip("\n").rsplit("\n", 1)[-1]
        return "passed" if last_line == token else "no_verdict"

    # -- batches -------------------------------------------------------------------------------
    def grade_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str],
                    stop_on_failure: Optional[bool] = None) -> List[CodeGrade]:
        if len(problems) != len(responses):
            raise ValueError(f"got {len(problems)} problems but {len(responses)} responses")
        for problem in problems:
            _problem_tests(problem)                   # fail fast on malformed records
        if not problems:
            return []
        with ThreadPoolExecutor(max_workers=min(self.num_workers, len(problems))) as pool:
            futures = [pool.submit(self.grade, p, r, stop_on_failure) for p, r in zip(problems, responses)]
            return [f.result() for f in futures]

    def score_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[float]:
        """One reward in [0, 1] per (problem, response): all cases pass (1/0), or fraction passed."""
        grades = self.grade_batch(problems, responses)
        if self.reward == "pass":
            return [1.0 if g.all_passed else 0.0 for g in grades]
        return [g.fraction for g in grades]
