"""The run report, from a hand-made run directory (metrics.jsonl + evaluation samples)."""
import json
import types

from quatro_nemo.engine.report import heldout_table, write_report


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_compares_base_and_final_and_buckets_by_base_difficulty(tmp_path):
    n = 4
    _write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": 0, "kind": "eval", "reward/mean": 0.25, "pass@1": 0.25, "entropy": 1.5, "num_problems": 3, "n_samples": n},
        {"step": 1, "kind": "train", "reward/mean": 0.2, "entropy": 1.4, "time/step": 2.0},
        {"step": 2, "kind": "train", "reward/mean": 0.5, "entropy": 1.2, "time/step": 4.0},
        {"step": 2, "kind": "eval", "reward/mean": 0.5, "pass@1": 0.5, "entropy": 1.0, "num_problems": 3, "n_samples": n},
    ])
    base = [{"id": "a", "num_correct": 0, "rewards": [0] * n, "cluster_sizes": []},
            {"id": "b", "num_correct": 1, "rewards": [1, 0, 0, 0], "cluster_sizes": [1]},
            {"id": "c", "num_correct": 4, "rewards": [1] * n, "cluster_sizes": [2, 1, 1]}]
    final = [{"id": "a", "num_correct": 2, "rewards": [1, 1, 0, 0], "cluster_sizes": [2]},
             {"id": "b", "num_correct": 0, "rewards": [0] * n, "cluster_sizes": []},
             {"id": "c", "num_correct": 4, "rewards": [1] * n, "cluster_sizes": [4]}]
    _write_jsonl(tmp_path / "eval" / "samples_step000000.jsonl", base)
    _write_jsonl(tmp_path / "eval" / "samples_step000002.jsonl", final)
    cfg = types.SimpleNamespace(algorithm_name="quatro",
                                trainer=types.SimpleNamespace(steps=2, prompts_per_step=8, inner_loops=1, lr=1e-3),
                                rollout=types.SimpleNamespace(n=n))
    summary = write_report(str(tmp_path), cfg, {"task": {"num_problems": 3}})

    assert summary["heldout_reward_improvement"] == 0.25
    very_hard = summary["flip_buckets"][0]          # counts scaled to 256 samples: 0 -> very hard only
    assert (very_hard["num_problems"], very_hard["num_base_unsolved"], very_hard["num_flipped"]) == (1, 1, 1)
    text = (tmp_path / "report.md").read_text()
    assert "| reward/mean | 0.2500 | 0.5000 | 0.2500 |" in text
    assert "| entropy | 1.5000 | 1.0000 | -0.5000 |" in text
    # what train() prints at the end
    assert "| reward/mean | 0.2500 | 0.5000 | 0.2500 |" in heldout_table(summary["base"], summary["final"])
    # success rates 0, 0.25, 1.0 -> bins [0,0.1), [0.2,0.3), [0.9,1.0]
    assert "| 1 | 0 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 1 |" in text
    assert "1 of 3 prompts never solved, 1 always solved." in text
    assert "mean step time: 3.0000 s" in text
    # distinct correct per solved problem: base (1 + 3) / 2 solved, trained (1 + 1) / 2 solved
    assert summary["distinct_correct_per_solved"] == {"base": 2.0, "final": 1.0}
    assert "base 2.0000, trained 1.0000" in text
