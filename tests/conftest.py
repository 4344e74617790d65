"""Shared test settings: one thread per process (2-core CI machines), float64 where asked; the
longest test modules first."""
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# The longest modules run first (issue 31). pytest-xdist hands tests out in collection order, so a
# long test collected near the end (tests/study comes late alphabetically) runs alone while the
# other worker has nothing left: longest-first keeps that tail short and the suite's wall time
# near its total CPU time / workers. Measured with `pytest --durations` (loaded 2-core machine):
# the quick study 9 min, the tiny adaptive study 2 min (both in tests/study, collected late), no
# other single test over 3 min (2026-12-03).
# Whole modules move, in their own order, so module-scoped fixtures are built once per worker.
LONGEST_FIRST = ("tests/study/test_quick_study.py", "tests/study/test_adaptive_study_e2e.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {path: position for position, path in enumerate(LONGEST_FIRST)}

    def position(item):
        path = Path(str(item.fspath)).resolve()
        relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        return rank.get(relative, len(rank))

    items.sort(key=position)  # stable: everything else keeps its collection order
