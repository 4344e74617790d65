"""The grading worker pool: per-check timeouts, errors and crashes never hang or kill the caller."""
import os
import time

import pytest

from quatro_nemo.rewards.grading import WorkerPool


def check(arg):
    kind, value = arg
    if kind == "sleep":
        time.sleep(value)
        return "slept"
    if kind == "raise":
        raise ZeroDivisionError("boom")
    if kind == "die":
        os._exit(3)
    return value * 2


def test_results_in_order_with_timeout_error_and_crash():
    args = [("double", 1), ("sleep", 30), ("double", 2), ("raise", 0), ("die", 0), ("double", 3)]
    with WorkerPool(check, num_workers=2, timeout_s=1.5) as pool:
        start = time.perf_counter()
        results = pool.map(args)
        elapsed = time.perf_counter() - start
        assert [r.status for r in results] == ["ok", "timeout", "ok", "error", "crash", "ok"]
        assert [r.value for r in results if r.status == "ok"] == [2, 4, 6]
        assert "ZeroDivisionError: boom" in results[3].message
        assert "exit code 3" in results[4].message
        assert pool.num_restarts == 2
        assert pool.map([("double", 5)])[0].value == 10        # still usable
    assert elapsed < 20, elapsed


def test_pool_validates_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPool(check, num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        WorkerPool(check, timeout_s=0)
    assert WorkerPool(check).map([]) == []
