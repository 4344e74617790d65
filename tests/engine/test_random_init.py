"""warmstart.enabled=false: the countdown task's base model is megatron's random initialisation
(the GPU check's 0.5 B Qwen2): nothing is trained or cached, and the report says so."""
from __future__ import annotations

from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.task import build_task


def test_disabled_warmstart_gives_no_base_state_and_trains_nothing(tmp_path):
    cfg = load_config(["warmstart.enabled=false", f"warmstart.cache_dir={tmp_path}", "task.num_train=8",
                       "task.num_heldout=4"])
    task = build_task(cfg)
    assert task.load_base_state(task.model_config(cfg.model)) is None
    assert list(tmp_path.iterdir()) == []  # no warm-start cache written
    assert task.properties["warmstart"] == {"enabled": False}
