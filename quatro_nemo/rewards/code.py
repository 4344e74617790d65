"""Code rewards: run a response's program against a problem's tests in the sandbox.

A code problem (JSONL schema, see quatro_nemo/data/code_datasets.py) carries ``"tests"`` in one
of three forms. In all three the verdict is computed where the program cannot reach it
(docs/sandbox.md, "Trust boundary"), and expected values never enter the program's process:

- stdin/stdout (APPS): ``{"kind": "stdio", "cases": [{"input": str, "output": str}, ...]}``.
  One sandboxed run per case with the input on stdin; its stdout is compared here, in the
  trainer, by ``stdio_output_matches``.
- call (APPS call-based): ``{"kind": "call", "fn_name": str, "cases": [{"args": [...],
  "expected": value}, ...]}``. One run calls the function (or ``Solution().fn_name``) on every
  case's arguments (function_runner.py) and writes each result as plain data
  (plain_data.py); the trainer decodes them into builtins and compares with APPS's rule.
- function (HumanEval(+), MBPP(+)): ``{"kind": "function", "setup": str, "cases": [str, ...]}``;
  each case is assertion code (asserts, or a ``check(candidate)`` call). A trusted judge
  (judge.py) runs setup and cases in its own interpreter inside the sandbox; calls to the
  program's functions go to the program's process as plain data and come back as plain data.
  The problem's ``code_prompt`` (HumanEval's helpers, e.g. ``poly``) is run in the judge too.

The cases of one response share one run (and one program process) for "call" and "function";
that run's wall and CPU limits are the configured ones times its number of cases. When the
program's process ends or is killed at case k, case k gets that status and, in "fraction" mode,
cases after k run in a fresh sandbox.

Reward (``score_batch``): ``"pass"`` gives 1.0 when every case passes, else 0.0 (the paper's
Pass@k grading; stops at the first failing case); ``"fraction"`` gives the fraction of cases
passed. Responses are graded in parallel, one sandboxed process per run, by a thread pool: the
threads only wait on child processes, and the trainer is never forked (safe with CUDA).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence

from quatro_nemo.rewards import plain_data
from quatro_nemo.rewards.sandbox import STATUS_CPU_LIMIT, ExecutionResult, Sandbox, SandboxConfig, killed_by_cpu_limit

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


# Decimal numbers as a C or Python program prints them, nothing else: no `1_000`, `inf`, `nan`,
# hexadecimal or surrounding spaces (all of which Python's int()/float() would accept).
_INTEGER_RE = re.compile(r"[+-]?[0-9]+\Z")
_DECIMAL_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def _tokens_equal(actual: str, expected: str, tol: float = 1e-6) -> bool:
    """One token: equal text; else, when both are integers, equal values (exactly); else, when
    the expected token is a decimal fraction (has a point or an exponent), numbers within `tol`
    (relative or absolute). An integer answer never gets a tolerance."""
    if actual == expected:
        return True
    if _INTEGER_RE.match(expected):
        return _INTEGER_RE.match(actual) is not None and int(actual) == int(expected)
    if _DECIMAL_RE.match(expected) and _DECIMAL_RE.match(actual):
        return math.isclose(float(actual), float(expected), rel_tol=tol, abs_tol=tol)
    return False


def stdio_output_matches(actual: str, expected: str) -> bool:
    """APPS-style comparison (hendrycks/apps eval/testing_util.py, simplified to its three
    accepting rules): same lines after trimming trailing whitespace and trailing blank lines;
    else the same whitespace-separated tokens; else same token count with every token equal by
    ``_tokens_equal`` (integers exactly, decimal fractions within 1e-6)."""
    if _lines(actual) == _lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    return len(got) == len(want) and all(_tokens_equal(g, w) for g, w in zip(got, want))


def call_output_matches(output: Any, expected: Any) -> bool:
    """APPS's call-based rule (hendrycks/apps eval/testing_util.py): the return value, a tuple
    read as a list, equals the expected value or, for a non-empty expected list, its first
    element. Both sides are plain builtins (plain_data.decode), so ``==`` is Python's own."""
    if type(output) is tuple:
        output = list(output)
    return output == expected or (type(expected) is list and len(expected) > 0 and output == expected[0])


# -- what runs in the sandbox ---------------------------------------------------------------------
@lru_cache(maxsize=None)
def _harness_source(name: str) -> str:
    """Source of a module of this package that runs inside the sandbox (judge, runner, codec)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return f.read()


def _sandbox_files(program: str, setup: str = "") -> Dict[str, str]:
    return {"solution.py": program, "setup.py": setup, "plain_data.py": _harness_source("plain_data.py"),
            "function_runner.py": _harness_source("function_runner.py")}


@dataclasses.dataclass
class CodeGrade:
    """Outcome of one response on one problem."""

    passed: int                       # cases passed
    total: int                        # cases in the problem
    statuses: List[str]               # "passed", "wrong_answer", "error", "no_result", or a sandbox status
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
    if not isinstance(tests, dict) or tests.get("kind") not in ("stdio", "function", "call"):
        raise ValueError(f"{where}: 'tests' must be a dict with kind 'stdio', 'function' or 'call', "
                         f"got {tests!r:.200}")
    if not isinstance(tests.get("cases"), list) or not tests["cases"]:
        raise ValueError(f"{where}: 'tests.cases' must be a non-empty list")
    if tests["kind"] == "call":
        if not isinstance(tests.get("fn_name"), str):
            raise ValueError(f"{where}: 'tests.fn_name' must be the function's name")
        if not all(isinstance(c, dict) and isinstance(c.get("args"), list) and "expected" in c for c in tests["cases"]):
            raise ValueError(f"{where}: each of 'tests.cases' must be {{'args': [...], 'expected': ...}}")
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


def _ended_status(result: ExecutionResult) -> str:
    """Status of a case during which the program's run ended without a verdict for it."""
    return "no_result" if result.ok else result.status


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
        while len(statuses) < len(cases):
            first = len(statuses)
            if tests["kind"] == "stdio":
                batch = [self._run_stdio_case(program, cases[first])]
            elif tests["kind"] == "call":
                batch = self._run_call_cases(program, tests, first)
            else:
                batch = self._run_judged_cases(program, problem, tests, first, stop_on_failure)
            for status in batch:
                statuses.append(status)
                if status != "passed" and stop_on_failure:
                    return CodeGrade(passed=statuses.count("passed"), total=len(cases), statuses=statuses,
                                     ran_all=len(statuses) == len(cases))
        return CodeGrade(passed=statuses.count("passed"), total=len(cases), statuses=statuses, ran_all=True)

    def _limits(self, num_cases: int) -> Dict[str, Any]:
        cfg = self.sandbox.config
        return {"timeout_s": cfg.wall_timeout_s * num_cases, "cpu_time_s": cfg.cpu_time_s * num_cases}

    def _run_stdio_case(self, program: str, case: Dict[str, str]) -> str:
        result = self.sandbox.run(program, stdin=case["input"])
        if not result.ok:
            return result.status
        return "passed" if stdio_output_matches(result.stdout, case["output"]) else "wrong_answer"

    def _run_call_cases(self, program: str, tests: Dict[str, Any], first: int) -> List[str]:
        """Cases first.. in one run; the program's replies are decoded and judged here."""
        cases = tests["cases"][first:]
        requests = "".join(plain_data.encode([tests["fn_name"], case["args"], {}]) + "\n" for case in cases)
        result = self.sandbox.run(_harness_source("function_runner.py"), stdin=requests,
                                  files=_sandbox_files(program), **self._limits(len(cases)))
        replies = result.stdout.splitlines()
        if not replies:
            return [_ended_status(result)] * len(cases)     # ended while loading: same for every case
        if not _is_reply(replies[0], "loaded"):
            return ["error"] * len(cases)                   # raised while loading
        statuses = []
        for case, line in zip(cases, replies[1:]):
            try:
                reply = plain_data.decode(line)
            except ValueError:
                reply = None
            if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
                statuses.append("passed" if call_output_matches(reply[1], case["expected"]) else "wrong_answer")
            else:
                statuses.append("error")
        if len(statuses) < len(cases):
            statuses.append(_ended_status(result))
        return statuses

    def _run_judged_cases(self, program: str, problem: Dict[str, Any], tests: Dict[str, Any], first: int,
                          stop_on_failure: bool) -> List[str]:
        """Cases first.. in one run of the judge (judge.py); the tests travel on its stdin."""
        cases = tests["cases"][first:]
        setup = tests.get("setup") or ""
        payload = json.dumps({"prelude": problem.get("code_prompt") or "", "setup": setup, "cases": cases,
                              "entry_point": problem.get("entry_point"), "stop_on_failure": stop_on_failure})
        limits = self._limits(len(cases))
        result = self.sandbox.run(_harness_source("judge.py"), stdin=payload, files=_sandbox_files(program, setup),
                                  **limits)
        statuses = []
        for line in result.stdout.splitlines():
            try:
                verdict = json.loads(line)
            except ValueError:                        # the judge was killed mid-line
                break
            if verdict.get("case") != len(statuses):
                raise RuntimeError(f"judge: verdict out of order: {line[:200]}")
            statuses.append(_judged_status(verdict, limits["cpu_time_s"]))
        if len(statuses) < len(cases) and (not statuses or not result.ok):
            statuses.append(_ended_status(result))    # the run ended before the judge did
        return statuses

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


def _judged_status(verdict: Dict[str, Any], cpu_limit_s: float) -> str:
    """A judge verdict's status; "no_result" says how the program's process ended."""
    if verdict["status"] == "no_result" and killed_by_cpu_limit(verdict.get("signal"), verdict.get("cpu_s") or 0.0,
                                                                 cpu_limit_s):
        return STATUS_CPU_LIMIT
    return verdict["status"]


def _is_reply(line: str, kind: str) -> bool:
    try:
        reply = plain_data.decode(line)
    except ValueError:
        return False
    return type(reply) is list and len(reply) >= 1 and reply[0] == kind
