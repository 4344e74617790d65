"""The cluster scripts without a cluster: linters, template invariants, argument handling.

Fast (a few seconds); the behaviour on a real SLURM cluster is in test_one_node.py and
test_two_nodes.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TEMPLATES = ["slurm/quatro_1p5b.sh", "slurm/quatro_7b.sh", "slurm/eval.sh"]
SHELL_SCRIPTS = TEMPLATES + ["slurm/quatro_aligner.sh", "slurm/sweep.sh", "slurm/lib/common.sh",
                             "slurm/lib/launch.sh", "scripts/slurm_local.sh", "scripts/bootstrap.sh",
                             "scripts/setup_cluster_env.sh", "scripts/setup_aligner_env.sh", "scripts/lock.sh"]


def tool(name: str) -> str:
    """A linter from the environment (requirements/test.txt ships both as wheels), else PATH."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return str(path)


def run(*args, env=None, cwd=ROOT):
    return subprocess.run(args, cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=60)


def test_shell_scripts_pass_shellcheck():
    result = run(tool("shellcheck"), "-x", *SHELL_SCRIPTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint():
    result = run(tool("hadolint"), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_names_one_interpreter_and_installs_existing_locks():
    """vLLM's image has python3 and no python: every command, the ranks' QUATRO_PYTHON and the
    container default say python3, and pip runs as `python3 -m pip` (that interpreter's own)."""
    text = (ROOT / "Dockerfile").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.findall(r"(?<![\w./-])python(?![\w.])", code), "a bare `python` in the Dockerfile"
    assert not re.findall(r"(?<!-m )\bpip (?:install|check)", code), "pip not run as python3 -m pip"
    assert "QUATRO_PYTHON=python3" in code
    assert "QUATRO_CONTAINER_PYTHON:-python3}" in (ROOT / "slurm/lib/common.sh").read_text()
    for lock in re.findall(r"requirements/locks/[\w.-]+\.txt", code):
        assert (ROOT / lock).is_file(), f"the Dockerfile installs {lock}, which does not exist"


def sbatch_directives(template: str) -> list:
    """The #SBATCH options sbatch reads: it stops at the first line that is not a comment."""
    options = []
    for line in (ROOT / template).read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            options.append(line.split()[1])
    return options


@pytest.mark.parametrize("template", TEMPLATES + ["slurm/quatro_aligner.sh"])
def test_template_requeues_on_signal_and_logs_per_job(template):
    options = sbatch_directives(template)
    names = [o.split("=")[0] for o in options]
    assert len(names) == len(set(names)), f"{template}: an #SBATCH option is given twice"
    assert "--requeue" in options
    assert "--open-mode=append" in options  # a requeued job appends to its log
    (signal,) = [o for o in options if o.startswith("--signal=")]
    assert re.fullmatch(r"--signal=B:USR1@[1-9][0-9]*", signal)
    for required in ("--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--time", "--output"):
        assert required in names, f"{template}: no #SBATCH {required}"
    (output,) = [o.split("=", 1)[1] for o in options if o.startswith("--output=")]
    assert (ROOT / output).parent.is_dir(), f"{template}: log folder {output} missing (sbatch won't create it)"
    assert "%j" in output
    text = (ROOT / template).read_text()
    assert "quatro_run_recipe" in text and 'source "$QUATRO_ROOT/slurm/lib/common.sh"' in text


def test_training_templates_differ_only_in_size_and_config():
    small, large = ((ROOT / t).read_text().splitlines() for t in TEMPLATES[:2])
    assert len(small) == len(large)
    differing = [(a, b) for a, b in zip(small, large) if a != b]
    allowed = re.compile(r"^(#.*|quatro_run_recipe train run\.dir config=\S+ -- \"\$@\")$")
    assert all(allowed.match(a) and allowed.match(b) for a, b in differing), differing


# ---------------------------------------------------------------------------------------------
# launch.sh: per-rank environment and recipe lookup (what srun and `docker run` execute)
# ---------------------------------------------------------------------------------------------

ENV_DUMP = """import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"]
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
                  "pythonpath0": os.environ["PYTHONPATH"].split(":")[0]}))
"""


@pytest.fixture
def recipes_dir(tmp_path):
    (tmp_path / "train.py").write_text(ENV_DUMP)
    return tmp_path


def launch(recipes_dir, *args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                       "MASTER_", "QUATRO_CACHE_DIR", "TRITON_",
                                                                       "TORCHINDUCTOR_", "VLLM_", "QUATRO_CUDA_",
                                                                       "LD_LIBRARY_PATH"))}
    return subprocess.run(["bash", str(ROOT / "slurm/lib/launch.sh"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={**clean, "QUATRO_RECIPES_DIR": str(recipes_dir), **env})


def test_launch_derives_ranks_from_slurm(recipes_dir):
    result = launch(recipes_dir, "train", "algorithm.delta=0.05", SLURM_STEP_ID="0", SLURM_PROCID="3",
                    SLURM_NTASKS="4", SLURM_LOCALID="1", MASTER_ADDR="10.0.0.7", MASTER_PORT="21234")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["argv"] == ["algorithm.delta=0.05"]
    assert out["env"] == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                          "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "21234", "TRITON_CACHE_DIR": None,
                          "TORCHINDUCTOR_CACHE_DIR": None, "VLLM_CACHE_ROOT": None}
    assert out["pythonpath0"] == str(ROOT)  # the checkout's code comes first


def test_launch_gives_each_rank_its_own_compile_caches_under_the_job_cache(recipes_dir, tmp_path):
    step = dict(SLURM_STEP_ID="0", SLURM_NTASKS="2", MASTER_ADDR="10.0.0.7", MASTER_PORT="21234",
                QUATRO_CACHE_DIR=str(tmp_path / "job7"))
    caches = [json.loads(launch(recipes_dir, "train", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                                **step).stdout)["env"] for rank in (0, 1)]
    for rank, env in enumerate(caches):
        assert env["TRITON_CACHE_DIR"] == f"{tmp_path}/job7/rank{rank}/triton"
        assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/job7/rank{rank}/inductor"
        assert env["VLLM_CACHE_ROOT"] == f"{tmp_path}/job7/rank{rank}/vllm"
    chosen = launch(recipes_dir, "train", SLURM_PROCID="0", SLURM_LOCALID="0", TRITON_CACHE_DIR="/fast/triton", **step)
    assert json.loads(chosen.stdout)["env"]["TRITON_CACHE_DIR"] == "/fast/triton"  # a set value wins


def test_launch_outside_a_job_step_leaves_ranks_alone(recipes_dir):
    # The batch shell itself has SLURM_PROCID=0 but no step: nothing to derive there.
    result = launch(recipes_dir, "train", SLURM_PROCID="0", SLURM_NTASKS="2")
    assert json.loads(result.stdout)["env"]["RANK"] is None


def test_launch_refuses_a_multi_rank_step_without_rendezvous(recipes_dir):
    result = launch(recipes_dir, "train", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="2",
                    SLURM_LOCALID="1")
    assert result.returncode == 2
    assert "MASTER_ADDR/MASTER_PORT not set" in result.stderr


@pytest.mark.parametrize("driver, compat_first", [
    ("550.54.15", True),     # R550 < R580 (CUDA 13.0's branch): the forward-compatibility libraries
    ("575.57.08", True),
    ("580.65.06", False),    # R580 runs CUDA 13.0 itself
    ("590.10.01", False),
    (None, False),           # nvidia-smi fails (no GPU in this step): nothing changes
])
def test_launch_puts_cuda_compat_first_before_python_only_for_an_older_driver(recipes_dir, tmp_path, driver,
                                                                            compat_first):
    """The dynamic linker reads LD_LIBRARY_PATH once, as a process starts: launch.sh sets it before
    Python, for recipes and plain commands alike, from the first GPU's driver branch."""
    tools, compat = tmp_path / "bin", tmp_path / "compat"
    tools.mkdir()
    compat.mkdir()
    smi = f"#!/bin/sh\nprintf '{driver}\\n{driver}\\n'\n" if driver else "#!/bin/sh\nexit 9\n"
    (tools / "nvidia-smi").write_text(smi)
    (tools / "nvidia-smi").chmod(0o755)
    (recipes_dir / "show.py").write_text("import os, sys; print(os.environ.get('LD_LIBRARY_PATH'), *sys.argv[1:])")
    env = dict(PATH=f"{tools}:{os.environ['PATH']}", QUATRO_CUDA_COMPAT_DIR=str(compat), LD_LIBRARY_PATH="/usr/lib/x")
    expected = f"{compat}:/usr/lib/x" if compat_first else "/usr/lib/x"
    result = launch(recipes_dir, "show", "algorithm.delta=0.05", **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [expected, "algorithm.delta=0.05"]
    assert ("CUDA forward compatibility" in result.stderr) == compat_first
    command = launch(recipes_dir, "bash", "-c", "echo $LD_LIBRARY_PATH", **env)
    assert command.stdout.strip() == expected
    # the same driver without the compat folder in the image, or with it switched off: nothing
    for off in ({"QUATRO_CUDA_COMPAT_DIR": str(tmp_path / "absent")}, {"QUATRO_CUDA_COMPAT_DIR": ""}):
        assert launch(recipes_dir, "show", **{**env, **off}).stdout.split() == ["/usr/lib/x"]


def test_launch_compat_threshold_is_the_images_cuda_branch(recipes_dir, tmp_path):
    """The aligner image's CUDA 12.5 wants R555 (the Dockerfile sets QUATRO_CUDA_MIN_DRIVER per stack)."""
    tools, compat = tmp_path / "bin", tmp_path / "compat"
    tools.mkdir()
    compat.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\necho 550.54.15\n")
    (tools / "nvidia-smi").chmod(0o755)
    (recipes_dir / "show.py").write_text("import os; print(os.environ.get('LD_LIBRARY_PATH'))")
    env = dict(PATH=f"{tools}:{os.environ['PATH']}", QUATRO_CUDA_COMPAT_DIR=str(compat))
    assert launch(recipes_dir, "show", QUATRO_CUDA_MIN_DRIVER="555", **env).stdout.strip() == str(compat)
    assert launch(recipes_dir, "show", QUATRO_CUDA_MIN_DRIVER="535", **env).stdout.strip() == "None"


def test_launch_names_a_missing_recipe_and_runs_plain_commands(recipes_dir):
    missing = launch(recipes_dir, "trian")
    assert missing.returncode == 2 and f"no recipe 'trian' (looked for {recipes_dir}/trian.py)" in missing.stderr
    command = launch(recipes_dir, "bash", "-c", "echo plain command")  # docker run IMAGE bash -c ...
    assert command.stdout.strip() == "plain command"


# ---------------------------------------------------------------------------------------------
# sweep.sh and common.sh argument handling (they fail before anything reaches sbatch)
# ---------------------------------------------------------------------------------------------


def sweep(tmp_path, content, *args):
    sweep_file = tmp_path / "sweep.txt"
    sweep_file.write_text(content)
    return run("bash", "slurm/sweep.sh", *args, str(sweep_file), env={"QUATRO_RUNS_DIR": str(tmp_path)})


def test_sweep_rejects_run_dir_in_a_set(tmp_path):
    result = sweep(tmp_path, "seed=1\nseed=2 run.dir=/x\n")
    assert result.returncode == 2
    assert "run.dir is set per task by sweep.sh" in result.stderr and "seed=2 run.dir=/x" in result.stderr


def test_sweep_rejects_a_line_that_is_not_overrides(tmp_path):
    result = sweep(tmp_path, "seed=1\n--lr 3\n")
    assert result.returncode == 2 and "override '--lr' is not key=value" in result.stderr


@pytest.mark.parametrize("arg, ok", [("a.b=1", True), ("+a.b=1", True), ("++a.b=1", True), ("~a.b=1", True),
                                     ("algorithm@model.quatro.algorithm=gspo", True), ("+++a=1", False),
                                     ("--lr=3", False), ("a.b", False)])
def test_override_check_takes_hydra_prefixes(arg, ok):
    result = bash_common(f"quatro_check_overrides '{arg}'")
    assert (result.returncode == 0) == ok, result.stderr


def test_sweep_rejects_an_empty_sweep_file(tmp_path):
    result = sweep(tmp_path, "# only a comment\n\n")
    assert result.returncode == 2 and "has no override sets" in result.stderr


def bash_common(snippet: str, env=None):
    return run("bash", "-c", f'set -euo pipefail; source slurm/lib/common.sh; {snippet}', env=env)


def test_sweep_sets_skip_comments_and_blank_lines(tmp_path):
    (tmp_path / "s.txt").write_text("# header\n  a=1   b=2  \n\n   # indented comment\nc=3\n")
    result = bash_common(f"quatro_sweep_sets {tmp_path}/s.txt")
    assert result.stdout.splitlines() == ["a=1   b=2", "c=3"]


@pytest.mark.parametrize("args, key, expected", [
    (["a=1", "run.dir=/x", "b=2", "run.dir=/y"], "run.dir", "/y"),   # the last one wins
    (["+run.dir=/z"], "run.dir", "/z"),                              # Hydra's + prefix
    (["run.dir=/x", "++run.dir=/w"], "run.dir", "/w"),               # and ++
    (["--config-dir", "/c", "out=/o"], "out", "/o"),                # Hydra's flags are not keys
    (["--config-dir=out=/p", "-m"], "out", ""),
    (["output=/p"], "out", ""),                                      # a longer key is not out
    (["a=1"], "run.dir", ""),
])
def test_last_value_of_a_key(args, key, expected):
    result = run("bash", "-c", 'source slurm/lib/common.sh; quatro_last_value "$@"', "_", key, *args)
    assert result.stdout.rstrip("\n") == expected


def test_container_flags_with_pyxis_and_refusal_without(tmp_path):
    with_pyxis, without = tmp_path / "pyxis", tmp_path / "plain"
    for folder, help_text in ((with_pyxis, "--container-image=[USER@][REGISTRY#]IMAGE"), (without, "--label")):
        folder.mkdir()
        (folder / "srun").write_text(f"#!/bin/sh\necho '{help_text}'\n")
        (folder / "srun").chmod(0o755)
    snippet = ('QUATRO_ROOT=/repo QUATRO_RUN_DIR=/scratch/runs/r1 QUATRO_CONTAINER_IMAGE=/img/q.sqsh '
               'QUATRO_CONTAINER_MOUNTS=/data:/data; quatro_container_args; '
               'printf "%s\\n" "${QUATRO_CONTAINER_ARGS[@]}" "$QUATRO_PYTHON"')
    ok = bash_common(snippet, env={"PATH": f"{with_pyxis}:{os.environ['PATH']}"})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        "--container-image=/img/q.sqsh",
        "--container-mounts=/repo:/repo,/scratch/runs:/scratch/runs,/data:/data",
        f"--container-workdir={ROOT}",
        "--no-container-mount-home",  # compile caches and configs in $HOME stay out of the job
        "python3",                    # the image's one interpreter name (Dockerfile)
    ]
    refused = bash_common(snippet, env={"PATH": f"{without}:{os.environ['PATH']}"})
    assert refused.returncode == 2 and "no pyxis" in refused.stderr
    plain = bash_common("QUATRO_CONTAINER_IMAGE=; quatro_container_args; echo ${#QUATRO_CONTAINER_ARGS[@]}",
                        env={"PATH": f"{without}:{os.environ['PATH']}"})
    assert plain.stdout.strip() == "0"  # no image: the plain environment


@pytest.mark.parametrize("sweep_file", sorted((ROOT / "slurm" / "sweeps").glob("*.txt")), ids=lambda p: p.name)
def test_shipped_sweep_sets_are_valid_training_configs(sweep_file):
    from quatro_nemo.engine.config import load_config

    sets = bash_common(f"quatro_sweep_sets {sweep_file}").stdout.splitlines()
    assert len(sets) >= 2
    for line in sets:
        load_config(line.split())  # raises ConfigError naming the key for an unknown or bad override


def test_srun_passes_the_jobs_cpus_per_task_on():
    """srun of SLURM 22.05-23.02 does not inherit --cpus-per-task from sbatch: common.sh passes it."""
    snippet = 'quatro_srun_args; printf "%s\\n" "${QUATRO_SRUN_ARGS[@]}"'
    given = bash_common(snippet, env={"SLURM_CPUS_PER_TASK": "12", "QUATRO_RANK_EXIT_WAIT_S": "90"})
    assert given.stdout.splitlines() == ["--label", "--kill-on-bad-exit=0", "--wait=90", "--distribution=block",
                                         "--cpus-per-task=12"]
    unset = bash_common(f"unset SLURM_CPUS_PER_TASK; {snippet}")
    assert unset.stdout.splitlines() == ["--label", "--kill-on-bad-exit=0", "--wait=600", "--distribution=block"]


COMM_KEYS = ["QUATRO_DIST_TIMEOUT_MIN", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "QUATRO_CACHE_DIR"]


def test_comm_defaults_are_exported_and_yield_to_the_environment():
    show = "quatro_export_comm_defaults; for k in " + " ".join(COMM_KEYS) + '; do echo "$k=${!k}"; done'
    clean = {k: "" for k in COMM_KEYS}
    defaults = bash_common(f"unset {' '.join(COMM_KEYS)} TMPDIR; SLURM_JOB_ID=42; {show}", env=clean)
    assert defaults.stdout.splitlines() == ["QUATRO_DIST_TIMEOUT_MIN=30", "NCCL_IB_TIMEOUT=22", "NCCL_IB_RETRY_CNT=7",
                                            "QUATRO_CACHE_DIR=/tmp/quatro-42"]
    mine = {"QUATRO_DIST_TIMEOUT_MIN": "90", "NCCL_IB_TIMEOUT": "19", "NCCL_IB_RETRY_CNT": "3",
            "QUATRO_CACHE_DIR": "/scratch/c"}
    overridden = bash_common(f"SLURM_JOB_ID=42; {show}", env=mine)
    assert overridden.stdout.splitlines() == [f"{k}={v}" for k, v in mine.items()]


def test_gloo_follows_the_nccl_interface_and_compute_nodes_stay_offline():
    """megatron and vLLM build Gloo groups over all ranks: they must use the fabric NCCL is told to
    (the interface found without it: test_network_defaults.py); vLLM's usage reports and hub
    downloads are off unless the user says otherwise."""
    keys = ["GLOO_SOCKET_IFNAME", "VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE"]
    show = "quatro_export_comm_defaults; for k in " + " ".join(keys) + '; do echo "$k=${!k:-}"; done'
    given = bash_common(f"unset {' '.join(keys)}; SLURM_JOB_ID=1; {show}", env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert given.stdout.splitlines() == ["GLOO_SOCKET_IFNAME=ib0", "VLLM_NO_USAGE_STATS=1", "HF_HUB_OFFLINE=1"]
    mine = bash_common(f"SLURM_JOB_ID=1; {show}", env={"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1",
                                                      "HF_HUB_OFFLINE": "0"})
    assert mine.stdout.splitlines() == ["GLOO_SOCKET_IFNAME=eth1", "VLLM_NO_USAGE_STATS=1", "HF_HUB_OFFLINE=0"]


def test_default_run_directories_go_to_scratch_where_the_cluster_has_one():
    """A 7B checkpoint is ~107 GB: run directories go to $SCRATCH unless QUATRO_RUNS_DIR says otherwise."""
    show = "QUATRO_ROOT=/repo; quatro_runs_dir"
    assert bash_common(f"unset QUATRO_RUNS_DIR SCRATCH; {show}").stdout.strip() == "/repo/runs"
    assert bash_common(f"unset QUATRO_RUNS_DIR; {show}", env={"SCRATCH": "/scratch/u"}).stdout.strip() \
        == "/scratch/u/quatro-nemo/runs"
    assert bash_common(show, env={"SCRATCH": "/scratch/u", "QUATRO_RUNS_DIR": "/big"}).stdout.strip() == "/big"


# ---------------------------------------------------------------------------------------------
# quatro_nemo.megatron.parallel: which GPU a rank takes, and the collective timeout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("local_rank, visible, expected", [
    ("5", 8, 5),     # all of a node's GPUs visible: the local rank's own
    ("5", 1, 0),     # one GPU per task (CUDA_VISIBLE_DEVICES of one device): that one
    ("3", 2, 1),     # two GPUs per task, two ranks per task
    (None, 4, 2),    # no LOCAL_RANK: the global rank (6) modulo the visible count
])
def test_local_cuda_device(monkeypatch, local_rank, visible, expected):
    import torch

    from quatro_nemo.megatron.parallel import local_cuda_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert local_cuda_device(rank=6) == expected


def test_process_group_timeout_from_the_environment(monkeypatch):
    from datetime import timedelta

    from quatro_nemo.megatron.parallel import process_group_timeout

    monkeypatch.delenv("QUATRO_DIST_TIMEOUT_MIN", raising=False)
    assert process_group_timeout() is None  # torch's default
    monkeypatch.setenv("QUATRO_DIST_TIMEOUT_MIN", "45")
    assert process_group_timeout() == timedelta(minutes=45)
    for bad in ("0", "-3", "ten"):
        monkeypatch.setenv("QUATRO_DIST_TIMEOUT_MIN", bad)
        with pytest.raises(ValueError, match=f"QUATRO_DIST_TIMEOUT_MIN='{bad}' must be a positive number"):
            process_group_timeout()


# --------------------------------------------------------------------------------------------
# Interpreter lookup of the environment scripts (scripts/lib/env.sh: find_python)


def find_python(version: str, tmp_path: Path, **env: str):
    """find_python VERSION in a bash whose PATH holds only tmp_path/bin, pyenv at tmp_path/pyenv."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    script = f"source scripts/lib/env.sh && find_python {version}"
    return subprocess.run(["/bin/bash", "-c", script], cwd=ROOT, text=True, capture_output=True, timeout=60,
                          env={"PATH": str(tmp_path / "bin"), "PYENV_ROOT": str(tmp_path / "pyenv"),
                               "HOME": str(tmp_path), **env})


def link_python(path: Path) -> Path:
    """A working interpreter (this one) under the name the lookup searches for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(sys.executable)
    return path


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_find_python_says_what_to_install_when_there_is_none(version, tmp_path):
    result = find_python(version, tmp_path)
    assert result.returncode != 0 and result.stdout == ""
    for advice in (f"no Python {version} found", f"apt-get install python{version} python{version}-venv",
                   f"pyenv install {version}", f"point PYTHON at a python{version}",
                   f"{tmp_path / 'pyenv'}/versions/{version}.*/bin/python{version}"):
        assert advice in result.stderr, result.stderr


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_find_python_skips_a_shim_that_fails_and_takes_the_pyenv_build(version, tmp_path):
    shim = tmp_path / "bin" / f"python{version}"  # pyenv's shim for a version it has not selected
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'pyenv: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    build = link_python(tmp_path / "pyenv" / "versions" / f"{version}.1" / "bin" / f"python{version}")
    result = find_python(version, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(build)


def test_find_python_prefers_path_and_yields_to_python(tmp_path):
    on_path = link_python(tmp_path / "bin" / "python3.12")
    link_python(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12")
    assert find_python("3.12", tmp_path).stdout.strip() == str(on_path)
    assert find_python("3.12", tmp_path, PYTHON="/opt/my/python").stdout.strip() == "/opt/my/python"
