"""How the math grader's worker processes start: forked from the caller while CUDA is not
initialised in it, started from a fork server once it is (a GPU run's first grading comes after
CUDA, NCCL and vLLM are up). Only CUDA's initialisation is faked, at its boundary
(``torch.cuda.is_initialized``); the workers are real processes grading real answers, through the
product's own path (``get_verifier("math", **task.verifier_options)``, as task=jsonl builds it).
The verdicts are a human grader's (test_math_verifier.py's cases)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from quatro_nemo.rewards import get_verifier
from quatro_nemo.rewards.grading import WorkerPool, default_start_method

# (gold, response, correct?): each needs math-verify in a worker (no answer equals its gold as text)
CASES = [("\\frac{1}{2}", "So \\boxed{0.5}.", 1), ("2\\sqrt{5}", "\\boxed{2}", 0), ("(1,2]", "\\boxed{[1,2]}", 0),
         ("x^2+2x+1", "\\boxed{(x+1)^2}", 1)]


def parent_pid(pid: int) -> int:
    """The parent of a live process (field 4 of /proc/PID/stat, after the parenthesised name)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def grade_and_worker_parents(verifier):
    grades = verifier.grade_batch([{"answer": gold} for gold, _, _ in CASES], [resp for _, resp, _ in CASES])
    workers = verifier._pool._workers
    return [g.score for g in grades], [parent_pid(w.process.pid) for w in workers], {w.process._start_method
                                                                                     for w in workers}


def test_the_grader_forks_without_cuda_and_uses_a_fork_server_once_cuda_is_up(monkeypatch):
    expected = [float(correct) for _, _, correct in CASES]
    with get_verifier("math", num_workers=1, timeout_s=60.0) as verifier:
        scores, parents, methods = grade_and_worker_parents(verifier)
    assert scores == expected
    assert methods == {"fork"} and parents == [os.getpid()]          # a child of this process

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with get_verifier("math", num_workers=1, timeout_s=60.0) as verifier:
        scores, parents, methods = grade_and_worker_parents(verifier)
    assert scores == expected
    assert methods == {"forkserver"} and os.getpid() not in parents   # a child of the fork server


def check(arg):
    return arg


def test_the_start_method_is_decided_as_each_worker_starts(monkeypatch):
    """A pool that started before CUDA does not fork a replacement worker after it."""
    pool = WorkerPool(check, num_workers=1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert pool.start_method == default_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert pool.start_method == default_start_method() == "forkserver"
    assert WorkerPool(check, start_method="spawn").start_method == "spawn"    # a chosen method is kept
