"""Runs recipes/study.py as a user does (a subprocess, one thread per process), for the study tests:
``study(args)`` and ``run_tiny_study(tmp_path, config)``, which runs a study config of the test's
own, chosen as Hydra's ``--config-dir DIR study=NAME`` (DIR/study/NAME.yaml)."""
import json
import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDY = os.path.join(REPO, "recipes", "study.py")


def study(args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, STUDY, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def run_tiny_study(tmp_path, config, *extra):
    """Write ``config`` as the study config ``tmp_path/conf/study/<name>.yaml`` and run the whole
    study into ``tmp_path/study`` (with the recipe's ``extra`` arguments); returns (the arguments
    choosing that study, the study directory, its report.json)."""
    conf = tmp_path / "conf"
    (conf / "study").mkdir(parents=True)
    (conf / "study" / f"{config['name']}.yaml").write_text(yaml.safe_dump(config))
    chosen = [f"--config-dir={conf}", f"study={config['name']}"]
    out = tmp_path / "study"
    code, output = study([*chosen, f"out={out}", *extra])
    assert code == 0, output
    return chosen, out, json.loads((out / "report.json").read_text())
