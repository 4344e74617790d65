"""scale.max_prompt_tokens: training prompts longer than it (in the task's tokens) are dropped when
the task is built, counted in the run report; held-out problems are kept."""
import pytest

from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.task import Task, build_task, drop_long_prompts
from quatro_nemo.validation import ConfigError


def _task(prompts):
    return Task(name="t", train_problems=[{"prompt": p} for p in prompts], heldout_problems=[{"prompt": "x" * 50}],
                verifier=None, vocab_size=8, stop_token_ids=(0,), pad_id=0,
                encode_prompt=lambda problem: [ord(c) for c in problem["prompt"]], decode_response=str,
                load_base_state=lambda model_cfg: None)


def test_longer_training_prompts_are_dropped_and_counted(capsys):
    task = _task(["abc", "abcd", "abcde", "ab"])    # 3, 4, 5, 2 tokens
    kept = drop_long_prompts(task, 4)
    assert [p["prompt"] for p in kept.train_problems] == ["abc", "abcd", "ab"]
    assert kept.heldout_problems == task.heldout_problems and kept.properties["dropped_long_prompts"] == 1
    assert "dropped 1 of 4 training prompts" in capsys.readouterr().out
    assert drop_long_prompts(task, 5) is task                    # none longer: the task as built
    with pytest.raises(ConfigError, match="scale.max_prompt_tokens=1 drops all 4"):
        drop_long_prompts(task, 1)


def test_build_task_applies_the_configured_limit():
    cfg = load_config(["warmstart.enabled=false", "task.num_train=64"])
    full = build_task(cfg)
    lengths = sorted(len(full.encode_prompt(p)) for p in full.train_problems)
    limit = lengths[-1] - 1                 # drops the longest prompts
    cfg.scale.max_prompt_tokens = limit
    limited = build_task(cfg)
    assert len(limited.train_problems) == sum(n <= limit for n in lengths) < len(full.train_problems)
    assert all(len(limited.encode_prompt(p)) <= limit for p in limited.train_problems)
