"""The engine's front door (quatro_nemo/engine/api.py): a run's identity is its resolved config
(less where its output goes) and what it evaluates, whatever the spelling; a typed change is the
command line's override; a run directory is claimed for one run."""
import hashlib
import json

import pytest
from omegaconf import OmegaConf

from quatro_nemo.engine.api import (RunIdentityError, RunRequest, configured, identity_differences, preflight,
                                    same_run)
from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.heldout import EvalRequest
from quatro_nemo.validation import ConfigError

EVALUATION = EvalRequest(num_problems=8, n_samples=4, top_p=(0.7, 1.0))


@pytest.fixture(scope="module")
def base():
    return load_config([])


def test_two_spellings_of_a_run_are_one_digest_and_another_value_another(base):
    spelt = [RunRequest(load_config(["trainer.lr=6e-4", "run.seed=2"]), EVALUATION),
             RunRequest(load_config(["run.seed=2", "trainer.lr=0.0006"]), EVALUATION),
             RunRequest(configured(base, {"run.seed": 2, "trainer.lr": 0.0003 * 2}), EVALUATION),
             # where and how it writes is not what it computes
             RunRequest(load_config(["trainer.lr=6e-4", "run.seed=2", "run.dir=elsewhere", "trainer.checkpoint_every=0",
                                     "logging.tensorboard=false", "run.progress_bar=false"]), EVALUATION)]
    assert len({r.digest() for r in spelt}) == 1
    # the digest is the sha256 of the canonical JSON of the resolved config (written out here
    # from the composed config, not by the code under test) and of the evaluation
    config = OmegaConf.to_container(load_config(["trainer.lr=6e-4", "run.seed=2"]).raw)
    for section, key in (("run", "dir"), ("run", "resume"), ("run", "progress_bar"), ("trainer", "checkpoint_every"),
                         ("trainer", "keep_checkpoints"), ("warmstart", "cache_dir")):
        del config[section][key]
    del config["logging"]
    evaluation = {"num_problems": 8, "n_samples": 4, "top_p": [0.7, 1.0], "temperature": 1.0, "seed": 0}
    text = json.dumps({"config": config, "evaluation": evaluation}, sort_keys=True, separators=(",", ":"))
    assert spelt[0].digest() == hashlib.sha256(text.encode()).hexdigest()[:16]
    others = [RunRequest(load_config(["trainer.lr=6.0001e-4", "run.seed=2"]), EVALUATION),
              RunRequest(load_config(["trainer.lr=6e-4", "run.seed=3"]), EVALUATION),
              RunRequest(load_config(["trainer.lr=6e-4", "run.seed=2", "algorithm=grpo"]), EVALUATION),
              RunRequest(load_config(["trainer.lr=6e-4", "run.seed=2"]), EvalRequest(8, 4, (0.7,))),
              RunRequest(load_config(["trainer.lr=6e-4", "run.seed=2"]))]
    assert len({r.digest() for r in spelt[:1] + others}) == 1 + len(others)


def test_a_typed_change_is_the_overrides_config(base):
    changed = configured(base, {"trainer.inner_loops": 4, "algorithm.lr_control.kind": "kl_adaptive",
                                "task.reward": "graded"})
    composed = load_config(["trainer.inner_loops=4", "algorithm.lr_control.kind=kl_adaptive", "task.reward=graded"])
    assert changed.raw == composed.raw
    assert changed.trainer.inner_loops == 4 and changed.algorithm.lr_control.kind == "kl_adaptive"
    with pytest.raises(ConfigError, match="trainer.inner_lops"):
        configured(base, {"trainer.inner_lops": 4})
    with pytest.raises(ConfigError, match="trainer.lr"):
        configured(base, {"trainer.lr": -1.0})


def test_a_record_without_a_key_added_since_is_the_same_run_at_the_keys_default(base):
    request = RunRequest(base, EVALUATION)
    recorded = request.identity()
    del recorded["config"]["algorithm"]["lr_control"]         # recorded before the section existed
    assert identity_differences(recorded, request) == []
    assert same_run({"digest": "0" * 16, "request": recorded}, request)
    adaptive = RunRequest(configured(base, {"algorithm.lr_control.kind": "kl_adaptive"}), EVALUATION)
    assert identity_differences(recorded, adaptive) == [
        "config.algorithm.lr_control.kind='kl_adaptive' not recorded (and not its default)"]
    recorded["config"]["trainer"]["lr"] = 1.0
    recorded["config"]["trainer"]["retired_key"] = 3
    assert identity_differences(recorded, request) == ["config.trainer.lr: recorded 1.0, requested 0.0003",
                                                       "config.trainer.retired_key=3 recorded, no longer a key"]
    assert not same_run({"digest": "0" * 16, "request": recorded}, request)


def test_preflight_claims_a_run_directory_for_one_run(tmp_path, base):
    directory = str(tmp_path / "run")
    request = RunRequest(configured(base, {"run.dir": directory, "run.seed": 3}), EVALUATION)
    claimed = preflight(request)                               # a new directory: claimed
    with open(claimed.file("run_request.json")) as f:
        assert json.load(f)["digest"] == request.digest()
    preflight(RunRequest(load_config([f"run.dir={directory}", "run.seed=3", "trainer.checkpoint_every=1"]),
                         EVALUATION))                          # the same run, spelt otherwise: resumes
    with pytest.raises(RunIdentityError, match=r"config.run.seed: recorded 3, requested 4"):
        preflight(RunRequest(configured(request.config, {"run.seed": 4}), EVALUATION))
    with pytest.raises(RunIdentityError, match="evaluation.n_samples"):
        preflight(RunRequest(request.config, EvalRequest(8, 16, (0.7, 1.0))))
    unclaimed = tmp_path / "unclaimed"
    unclaimed.mkdir()
    (unclaimed / "metrics.jsonl").write_text("{}\n")           # training output of an unknown run
    with pytest.raises(RunIdentityError, match="no .* identity"):
        preflight(RunRequest(configured(base, {"run.dir": str(unclaimed)}), EVALUATION))


@pytest.mark.parametrize("fields, key", [
    (dict(num_problems=0), "evaluation.num_problems"),
    (dict(n_samples=2.5), "evaluation.n_samples"),
    (dict(top_p=(0.7, 0.7)), "evaluation.top_p"),
    (dict(top_p=(1.5,)), "evaluation.top_p"),
    (dict(temperature=0), "evaluation.temperature"),
])
def test_an_evaluation_request_names_a_bad_key(fields, key):
    values = dict(num_problems=8, n_samples=4, top_p=(0.7,))
    values.update(fields)
    with pytest.raises(ConfigError, match=key):
        EvalRequest(**values)


def test_run_trains_until_the_requested_steps_and_extends_a_shorter_run(tmp_path, base, monkeypatch):
    """recipes/train.py goes through ``run``: re-running a finished 2-step run with
    ``trainer.steps=3`` must train (resume and extend), re-running it with 2 must not."""
    from quatro_nemo.engine import api

    trained = []
    monkeypatch.setattr(api, "train", lambda config: trained.append(config.trainer.steps))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps({"steps": 2}))   # a finished 2-step training
    for steps in (2, 3):
        api.run(RunRequest(configured(base, {"run.dir": str(run_dir), "trainer.steps": steps})))
    assert trained == [3]
    assert api.RunDir(str(tmp_path / "empty")).is_trained() is False
