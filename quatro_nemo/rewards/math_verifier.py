"""Math answer verifier: the final boxed answer, checked against the gold answer by math-verify.

The same verifier is the training reward for math and the grader of the evaluation suite.

1. Extraction (in the calling process, no sympy): the content of the *last* ``\\boxed{...}`` (or
   ``\\fbox{...}``) of the response, braces matched; Qwen2.5-Math is prompted to put its final
   answer there. No box -> ``no_answer`` (score 0), unless ``require_boxed=False``, when the
   response's tail goes to math-verify's own extraction.
2. Checking (math-verify 0.9, Apache-2.0): ``verify(parse("$" + gold + "$"), parse("$" + pred + "$"))``,
   gold first (bare strings mis-parse, e.g. ``2\\sqrt{5}`` -> 2; stack-facts.md). It runs in worker
   processes (``quatro_nemo.rewards.grading.WorkerPool``: forked, or started from a fork server
   once CUDA is initialised, ``default_start_method``) with a per-check wall-clock timeout,
   because math-verify's own timeout uses ``signal.alarm`` (main thread only) and sympy can hang
   on inputs such as ``9^{9^{9^{9}}}``. A check that times out, raises or crashes scores 0 and is
   counted in :attr:`MathVerifier.stats` and in its :class:`Grade`.
3. Verdicts are cached per (gold, extracted answer): a batch of 256 samples usually holds a
   handful of distinct answers. An answer identical to the gold string (spaces ignored) is
   correct without a check.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from quatro_nemo.data.math_datasets import extract_boxed_answer
from quatro_nemo.rewards.grading import STATUS_OK, STATUS_TIMEOUT, WorkerPool

# statuses of a Grade
CORRECT, INCORRECT, NO_ANSWER, TIMEOUT, ERROR = "correct", "incorrect", "no_answer", "timeout", "error"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> Any:
    from math_verify import parse

    return parse("$" + gold + "$", parsing_timeout=None)


# Checks that touch the sympy paths real answers take (radicals, fractions vs decimals,
# intervals, sets, matrices, polynomials): their first call costs seconds of lazy imports.
_WARMUP_KEYS = (("1", "1", True), ("2\\sqrt{5}", "\\sqrt{20}", True), ("\\frac{1}{2}", "0.5", True),
                ("(1,2]", "[1,2]", True), ("\\{1,2\\}", "\\{2,1\\}", True), ("x^2+2x+1", "(x+1)^2", True),
                ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
                ("5", "5\\text{ cm}", True), ("\\pi/2", "\\frac{\\pi}{2}", True))


def warmup() -> None:
    """Import math-verify and run representative checks, so no timed check pays start-up costs."""
    for key in _WARMUP_KEYS:
        check_answer(key)


def check_answer(key: Tuple[str, str, bool]) -> bool:
    """Worker-side check of one (gold, prediction, wrap) key; runs in a grading worker.

    `wrap` is True for an extracted boxed answer (parsed as ``$pred$``), False for a raw response
    tail left to math-verify's own extraction. Timeouts are enforced by the pool, so math-verify's
    signal-based ones are switched off (None).
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold, pred, wrap = key
    gold_parsed = _parse_gold(gold)
    pred_parsed = parse("$" + pred + "$" if wrap else pred, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _same_text(gold: str, pred: str) -> bool:
    return "".join(gold.split()) == "".join(pred.split())


@dataclasses.dataclass(frozen=True)
class Grade:
    score: float                  # 1.0 correct, else 0.0
    status: str                   # correct | incorrect | no_answer | timeout | error
    extracted: Optional[str]      # the boxed answer (None when there was none)
    message: str = ""


class MathVerifier:
    """Verifier "math" (see ``quatro_nemo.rewards.get_verifier``).

    Args:
        num_workers: grading worker processes.
        timeout_s: wall-clock limit of one (gold, answer) check.
        require_boxed: a response without a box scores 0 (``no_answer``); if False its last
            `tail_chars` characters go to math-verify's extraction instead.
        max_cache_entries: verdict cache size (least recently used entries dropped).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, require_boxed: bool = True,
                 tail_chars: int = 400, max_cache_entries: int = 1_000_000, start_method: Optional[str] = None):
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        self.require_boxed = require_boxed
        self.tail_chars = tail_chars
        self.max_cache_entries = max_cache_entries
        self._pool = WorkerPool(check_answer, num_workers=num_workers, timeout_s=timeout_s,
                                start_method=start_method, warmup_fn=warmup)
        self._cache: "collections.OrderedDict[Tuple[str, str, bool], Tuple[str, str]]" = collections.OrderedDict()
        self.stats: Dict[str, int] = collections.Counter()   # per status, plus cache hits/misses
        self._parent_warm = False

    def _warm_parent(self) -> None:
        """With fork, warm math-verify/sympy once in this process (known-safe inputs), so every
        forked worker, including replacements after a timeout, starts warm in milliseconds."""
        if not self._parent_warm and self._pool.start_method == "fork":
            warmup()
        self._parent_warm = True

    def _key(self, problem: Dict[str, Any], response: str) -> Tuple[Optional[Tuple[str, str, bool]], Optional[str]]:
        if "answer" not in problem:
            raise ValueError(f"problem {problem.get('id', '?')!r} has no 'answer' key")
        gold = str(problem["answer"]).strip()
        extracted = extract_boxed_answer(response)
        if extracted is not None:
            return (gold, extracted, True), extracted
        if self.require_boxed:
            return None, None
        return (gold, response[-self.tail_chars:], False), None

    def grade_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[Grade]:
        """One Grade per (problem, response) pair; never raises because of a response's content."""
        if len(problems) != len(responses):
            raise ValueError(f"got {len(problems)} problems and {len(responses)} responses")
        keys, extracted = zip(*(self._key(p, r) for p, r in zip(problems, responses))) if problems else ((), ())
        verdicts: Dict[Tuple[str, str, bool], Tuple[str, str]] = {}     # this batch's, by key
        for key in keys:
            if key is None or key in verdicts:
                continue
            if key in self._cache:
                verdicts[key] = self._cache[key]
                self._cache.move_to_end(key)
            elif key[2] and _same_text(key[0], key[1]):
                # identical strings (spaces ignored) need no sympy: many correct answers are verbatim
                verdicts[key] = (CORRECT, "")
                self._store(key, verdicts[key])
        todo = sorted({k for k in keys if k is not None and k not in verdicts})
        self.stats["cache_hits"] += sum(1 for k in keys if k is not None) - len(todo)
        self.stats["checks"] += len(todo)
        if todo:
            self._warm_parent()
        for key, result in zip(todo, self._pool.map(todo)):
            if result.status == STATUS_OK:
                verdicts[key] = (CORRECT if result.value else INCORRECT, "")
            elif result.status == STATUS_TIMEOUT:
                verdicts[key] = (TIMEOUT, result.message)
            else:
                verdicts[key] = (ERROR, f"{result.status}: {result.message}")
            self._store(key, verdicts[key])
        grades = []
        for key, ext in zip(keys, extracted):
            status, message = verdicts[key] if key is not None else (NO_ANSWER, "no \\boxed{} answer")
            self.stats[status] += 1
            grades.append(Grade(1.0 if status == CORRECT else 0.0, status, ext, message))
        return grades

    def _store(self, key: Tuple[str, str, bool], verdict: Tuple[str, str]) -> None:
        self._cache[key] = verdict
        while len(self._cache) > self.max_cache_entries:
            self._cache.popitem(last=False)

    def score_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[float]:
        """Rewards in {0, 1}, one per response (the verifier interface of docs/interfaces.md)."""
        return [g.score for g in self.grade_batch(problems, responses)]

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
