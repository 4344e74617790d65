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
cases after k run in a fresh sandbox with what is left of the response's one budget (_Budget).
The program's output is judged by ``check_output`` in a checker process with its own time bound
(docs/sandbox.md, "The trainer's own checking code"); an output the decoder refuses is
"invalid_output", never an exception.

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

from quatro_nemo.rewards import plain_data
from quatro_nemo.rewards.grading import STATUS_OK as GRADING_OK
from quatro_nemo.rewards.grading import STATUS_TIMEOUT as GRADING_TIMEOUT
from quatro_nemo.rewards.grading import CheckerProcesses
from quatro_nemo.rewards.sandbox import (STATUS_CPU_LIMIT, STATUS_TIMEOUT, ExecutionResult, Sandbox, SandboxConfig,
                                         killed_by_cpu_limit)

REWARD_MODES = ("pass", "fraction")

_PYTHON_TAGS = {"python", "py", "python3"}
_LANGUAGE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")
_FENCE = "```"


def _fenced_blocks(response: str) -> List[Tuple[str, str]]:
    """(language, body) of every fenced block: ``` [spaces] language [rest of line] newline body,
    up to the next ``` or the end. One left-to-right pass of str.find (no regex: a response is
    the policy's, and a backtracking pattern over one is quadratic in its length)."""
    blocks, start = [], response.find(_FENCE)
    while start >= 0:
        line_end = response.find("\n", start + len(_FENCE))
        if line_end < 0:
            break
        info = response[start + len(_FENCE):line_end].lstrip(" \t")
        language_end = next((i for i, char in enumerate(info) if char not in _LANGUAGE_CHARS), len(info))
        close = response.find(_FENCE, line_end + 1)
        blocks.append((info[:language_end].lower(), response[line_end + 1:close if close >= 0 else len(response)]))
        start = response.find(_FENCE, close + len(_FENCE)) if close >= 0 else -1
    return blocks


def extract_code(response: str) -> str:
    """The program in a model response: the last ```python fenced block, else the last fenced
    block of any language, else the whole response (a model may answer with bare code)."""
    blocks = _fenced_blocks(response)
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
# hexadecimal, non-ASCII digits or surrounding spaces (all of which Python's int()/float() would
# accept). Recognised with str methods (linear, no regex), and integers compared as text (no
# int(): any length, no digit limit, no quadratic conversion).
def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _unsigned(token: str) -> Tuple[str, str]:
    """(sign, rest): the sign is "-" or ""."""
    if token[:1] in ("+", "-"):
        return token[:1].replace("+", ""), token[1:]
    return "", token


def _canonical_integer(token: str) -> Optional[str]:
    """The integer `token` in canonical form (no "+", no leading zeros, "0" for "-0"), or None
    when it is not an optionally signed run of ASCII digits."""
    sign, digits = _unsigned(token)
    if not _digits(digits):
        return None
    digits = digits.lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def _is_decimal(token: str) -> bool:
    """[+-] digits [. digits] [e [+-] digits], with digits on at least one side of the point."""
    mantissa, _, exponent = token.replace("E", "e").partition("e")
    if "e" in token.lower() and not _digits(_unsigned(exponent)[1]):
        return False
    whole, _, fraction = _unsigned(mantissa)[1].partition(".")
    return (whole or fraction) != "" and all(_digits(part) for part in (whole, fraction) if part)


def _tokens_equal(actual: str, expected: str, tol: float = 1e-6) -> bool:
    """One token: equal text; else, when both are integers, equal values (exactly); else, when
    the expected token is a decimal fraction (has a point or an exponent), numbers within `tol`
    (relative or absolute). An integer answer never gets a tolerance."""
    if actual == expected:
        return True
    expected_integer = _canonical_integer(expected)
    if expected_integer is not None:
        return _canonical_integer(actual) == expected_integer
    if _is_decimal(expected) and _is_decimal(actual):
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
    statuses: List[str]               # "passed", "wrong_answer", "error", "no_result", "invalid_output",
                                      # "check_timeout", or a sandbox status
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
    # [ \t], not \s: \s* at every line start would span the following blank lines (quadratic)
    if entry_point and prefix and not re.search(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.M):
        code = prefix + code
    return code


# Statuses of cases whose output the trainer could not judge (reward 0, never an exception).
STATUS_INVALID_OUTPUT = "invalid_output"  # the output broke a bound of the decoder, or the check failed
STATUS_CHECK_TIMEOUT = "check_timeout"    # the check exceeded its own time bound
_CASE_STATUSES = frozenset({"passed", "wrong_answer", "error", "no_result", STATUS_INVALID_OUTPUT})
# Outputs up to this many characters are checked in the grading thread: the checks are linear,
# their C-level steps (split, replace, json) on this much text take ~3 ms at most, and their
# Python loops let other threads run every 5 ms (sys.getswitchinterval()); measured worst
# cases in test_small_outputs_are_checked_quickly_in_the_thread. Longer outputs go to a checker
# process.
INLINE_CHECK_CHARS = 16 << 10


def call_reply_statuses(stdout: str, expected: Sequence[Any]) -> Optional[List[str]]:
    """Statuses of the call-format cases with `expected` values from the runner's replies
    (function_runner.py): None when the program ended before saying it loaded, one "error" per
    case when it did not load, else one status per reply line received (fewer when the run ended
    early). A line the decoder refuses (plain_data's bounds) is "invalid_output"."""
    replies = stdout.split("\n")
    if replies[-1] == "":
        replies.pop()
    if not replies:
        return None
    if not _is_reply(replies[0], "loaded"):
        return ["error"] * len(expected)
    statuses = []
    for value, line in zip(expected, replies[1:]):
        try:
            reply = plain_data.decode(line)
        except ValueError:
            statuses.append(STATUS_INVALID_OUTPUT)
            continue
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            statuses.append("passed" if call_output_matches(reply[1], value) else "wrong_answer")
        else:
            statuses.append("error")
    return statuses


def check_output(kind: str, stdout: str, expected: Any) -> Optional[List[str]]:
    """What a program's output earns: ``kind`` "stdio" (``expected`` is the case's output text)
    or "call" (``expected`` the cases' values, see call_reply_statuses). Runs in a checker
    process (grading.CheckerProcesses), never in the trainer's interpreter."""
    if kind == "stdio":
        return ["passed" if stdio_output_matches(stdout, expected) else "wrong_answer"]
    return call_reply_statuses(stdout, expected)


def _ended_status(result: ExecutionResult) -> str:
    """Status of a case during which the program's run ended without a verdict for it."""
    return "no_result" if result.ok else result.status


@dataclasses.dataclass
class _Budget:
    """What is left of one response's limits: the configured wall and CPU seconds times its
    number of cases, shared by all its runs (a run that ends early leaves the rest to the next;
    a timeout does not buy the remaining cases a fresh budget)."""

    wall_s: float
    cpu_s: float

    def spend(self, result: ExecutionResult) -> None:
        self.wall_s -= result.wall_s
        self.cpu_s -= result.cpu_s

    def exhausted(self) -> Optional[str]:
        if self.wall_s <= 0:
            return STATUS_TIMEOUT
        if self.cpu_s <= 0:
            return STATUS_CPU_LIMIT
        return None


class CodeVerifier:
    """Verifier "code": reward = tests passed by the program in the response (see module doc).

    A program's output longer than INLINE_CHECK_CHARS is judged in a checker process
    (``check_timeout_s`` each check, then status "check_timeout"), not in the threads that wait
    on the sandboxes: a huge output cannot hold the trainer's interpreter while other samples'
    wall clocks run. Checker processes start on the first such output."""

    def __init__(self, reward: str = "pass", num_workers: Optional[int] = None,
                 sandbox: Optional[Sandbox] = None, sandbox_config: Optional[SandboxConfig] = None,
                 check_timeout_s: float = 10.0, **sandbox_overrides: Any):
        if reward not in REWARD_MODES:
            raise ValueError(f"CodeVerifier.reward must be one of {REWARD_MODES}, got {reward!r}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"CodeVerifier.num_workers must be >= 1, got {num_workers}")
        if not check_timeout_s > 0:
            raise ValueError(f"CodeVerifier.check_timeout_s must be > 0, got {check_timeout_s}")
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
        self.checkers = CheckerProcesses(f"{__name__}:check_output", timeout_s=check_timeout_s)

    # -- one (problem, response) ---------------------------------------------------------------
    def grade(self, problem: Dict[str, Any], response: str, stop_on_failure: Optional[bool] = None) -> CodeGrade:
        """Run the response against every case of the problem (stop at the first failure when
        `stop_on_failure`, the default in "pass" mode), within one budget (_Budget)."""
        tests = _problem_tests(problem)
        if stop_on_failure is None:
            stop_on_failure = self.reward == "pass"
        program = build_program(problem, response)
        cases = tests["cases"]
        cfg = self.sandbox.config
        budget = _Budget(wall_s=cfg.wall_timeout_s * len(cases), cpu_s=cfg.cpu_time_s * len(cases))
        statuses: List[str] = []
        while len(statuses) < len(cases):
            first = len(statuses)
            spent = budget.exhausted()
            if spent is not None:
                statuses += [spent] * (len(cases) - first)
                break
            if tests["kind"] == "stdio":
                batch = self._run_stdio_case(program, cases[first], budget)
            elif tests["kind"] == "call":
                batch = self._run_call_cases(program, tests, first, budget)
            else:
                batch = self._run_judged_cases(program, problem, tests, first, stop_on_failure, budget)
            for status in batch:
                statuses.append(status)
                if status != "passed" and stop_on_failure:
                    return CodeGrade(passed=statuses.count("passed"), total=len(cases), statuses=statuses,
                                     ran_all=len(statuses) == len(cases))
        return CodeGrade(passed=statuses.count("passed"), total=len(cases), statuses=statuses, ran_all=True)

    def _limits(self, num_cases: int, budget: _Budget) -> Dict[str, Any]:
        cfg = self.sandbox.config
        return {"timeout_s": min(cfg.wall_timeout_s * num_cases, budget.wall_s),
                "cpu_time_s": min(cfg.cpu_time_s * num_cases, budget.cpu_s)}

    def _run(self, budget: _Budget, num_cases: int, program: str, **kwargs: Any) -> ExecutionResult:
        result = self.sandbox.run(program, **kwargs, **self._limits(num_cases, budget))
        budget.spend(result)
        return result

    def _check(self, kind: str, stdout: str, expected: Any, num_cases: int) -> Optional[List[str]]:
        """check_output on the run's output: here when the output is at most INLINE_CHECK_CHARS
        (the linear checks then hold this interpreter for about a millisecond at most), else in
        a checker process under its own time bound. On a failure every case of the run gets it."""
        if len(stdout) <= INLINE_CHECK_CHARS:
            try:
                return check_output(kind, stdout, expected)
            except Exception:  # noqa: BLE001 - a check that fails is the sample's status, never the batch's
                return [STATUS_INVALID_OUTPUT] * num_cases
        result = self.checkers.call(kind, stdout, expected)
        if result.status == GRADING_OK:
            statuses = result.value
            if statuses is None or (type(statuses) is list and len(statuses) <= num_cases
                                    and all(status in _CASE_STATUSES for status in statuses)):
                return statuses
        return [STATUS_CHECK_TIMEOUT if result.status == GRADING_TIMEOUT else STATUS_INVALID_OUTPUT] * num_cases

    def _run_stdio_case(self, program: str, case: Dict[str, str], budget: _Budget) -> List[str]:
        result = self._run(budget, 1, program, stdin=case["input"])
        if not result.ok:
            return [result.status]
        return self._check("stdio", result.stdout, case["output"], 1)

    def _run_call_cases(self, program: str, tests: Dict[str, Any], first: int, budget: _Budget) -> List[str]:
        """Cases first.. in one run; the program's replies are judged by check_output."""
        cases = tests["cases"][first:]
        requests = "".join(plain_data.encode([tests["fn_name"], case["args"], {}]) + "\n" for case in cases)
        result = self._run(budget, len(cases), _harness_source("function_runner.py"), stdin=requests,
                           files=_sandbox_files(program))
        statuses = self._check("call", result.stdout, [case["expected"] for case in cases], len(cases))
        if statuses is None:
            return [_ended_status(result)] * len(cases)     # ended while loading: same for every case
        if len(statuses) < len(cases):
            statuses.append(_ended_status(result))
        return statuses

    def _run_judged_cases(self, program: str, problem: Dict[str, Any], tests: Dict[str, Any], first: int,
                          stop_on_failure: bool, budget: _Budget) -> List[str]:
        """Cases first.. in one run of the judge (judge.py); the tests travel on its stdin. The
        verdict lines are the judge's (the program cannot write there): read here."""
        cases = tests["cases"][first:]
        setup = tests.get("setup") or ""
        payload = json.dumps({"prelude": problem.get("code_prompt") or "", "setup": setup, "cases": cases,
                              "entry_point": problem.get("entry_point"), "stop_on_failure": stop_on_failure})
        limits = self._limits(len(cases), budget)
        result = self._run(budget, len(cases), _harness_source("judge.py"), stdin=payload,
                           files=_sandbox_files(program, setup))
        statuses = []
        for line in result.stdout.splitlines()[:len(cases)]:
            try:
                verdict = json.loads(line)
            except ValueError:                        # the judge was killed mid-line
                break
            if type(verdict) is not dict or verdict.get("case") != len(statuses):
                statuses.append(STATUS_INVALID_OUTPUT)
                break
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
    status = verdict.get("status")
    if status == "no_result" and killed_by_cpu_limit(verdict.get("signal"), verdict.get("cpu_s") or 0.0,
                                                      cpu_limit_s):
        return STATUS_CPU_LIMIT
    return status if status in _CASE_STATUSES else STATUS_INVALID_OUTPUT


def _is_reply(line: str, kind: str) -> bool:
    try:
        reply = plain_data.decode(line)
    except ValueError:
        return False
    return type(reply) is list and len(reply) >= 1 and reply[0] == kind
