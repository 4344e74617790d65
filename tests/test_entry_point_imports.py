"""The training entry points keep torch, megatron and the engine out of their top level.

dist_checkpointing's writer starts a ``spawn`` Manager at a process's first checkpoint, and a
spawned process re-runs the parent's ``__main__`` as ``__mp_main__`` (multiprocessing.spawn's
``_fixup_main_from_path`` / ``_fixup_main_from_name``). A heavy top level there costs every
training process ~2 s. Each check runs the entry point exactly as that spawned process does, in
a fresh interpreter, and asks which modules it imported."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

AS_SPAWNED_MAIN = {
    "recipes/train.py": "import runpy; runpy.run_path('recipes/train.py', run_name='__mp_main__')",
    "scripts/gpu_check_train.py": "import runpy; runpy.run_path('scripts/gpu_check_train.py', run_name='__mp_main__')",
    "quatro_nemo.study.forkserver": "import runpy; runpy.run_module('quatro_nemo.study.forkserver', run_name='__mp_main__', alter_sys=True)",
}


@pytest.mark.parametrize("entry_point", sorted(AS_SPAWNED_MAIN))
def test_the_entry_point_run_as_a_spawned_main_imports_no_torch(entry_point):
    check = AS_SPAWNED_MAIN[entry_point] + "; import sys; print(sorted(m for m in ('torch', 'megatron', 'hydra') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{entry_point} imports {result.stdout.strip()} at its top level"
