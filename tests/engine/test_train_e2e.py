"""The training loop end to end on the tiny CPU task: every algorithm, exact resume after
SIGKILLs at random points, checkpoint-and-exit on SIGTERM/SIGUSR1, and parallel layouts under
torchrun."""
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from quatro_nemo.algos import ALGORITHMS
from quatro_nemo.engine.logging import deterministic_view, read_metrics

from .conftest import run_train

pytestmark = pytest.mark.slow


def finish(process, timeout=600):
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def train_records(run_dir):
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def assert_same_records(got_dir, expected_dir):
    """Every non-timing value of every record equal (bit-identical floats)."""
    got = deterministic_view(train_records(got_dir))
    expected = deterministic_view(train_records(expected_dir))
    assert [(r["step"], r["kind"]) for r in got] == [(r["step"], r["kind"]) for r in expected]
    differences = [(e["step"], e["kind"], key, e[key], g.get(key))
                   for g, e in zip(got, expected) for key in e if g.get(key) != e[key]]
    assert not differences, differences[:10]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, warm_cache):
    """One uninterrupted 5-step QUATRO run (K=2 inner loops, two mini-batches per loop). Five steps:
    a run signalled at its first logged step checkpoints at step 2 at the latest, its resumed run
    signalled at its first logged step again at step 4 at the latest, one before the end."""
    from .conftest import TINY

    run_dir = str(tmp_path_factory.mktemp("reference"))
    args = TINY + [f"warmstart.cache_dir={warm_cache}", f"run.dir={run_dir}", "trainer.steps=5",
                   "trainer.inner_loops=2", "trainer.mini_batch_prompts=4", "trainer.lr=3e-3"]
    code, output = finish(run_train(args))
    assert code == 0, output
    Path(run_dir, STDOUT).write_text(output)
    return args, run_dir


STDOUT = "stdout.txt"   # the reference run's output (stdout and stderr: a pipe, no terminal)


@pytest.fixture(scope="module")
def every_algorithm(tmp_path_factory, warm_cache):
    """One Hydra multirun (``-m algorithm=...``) of every algorithm, 2 steps each: the same loop
    for each job (job i in ``<run.dir>/<i>``), one process for all of them (the imports, ~9 s of
    CPU per process, paid once). Returns the sweep directory, the jobs' algorithms in order, and
    the command's output."""
    from .conftest import TINY

    sweep_dir = tmp_path_factory.mktemp("every_algorithm") / "sweep"
    algorithms = sorted(ALGORITHMS)
    code, output = finish(run_train(["-m", *TINY, f"warmstart.cache_dir={warm_cache}", f"run.dir={sweep_dir}",
                                     f"algorithm={','.join(algorithms)}", "trainer.steps=2"]), timeout=1200)
    assert code == 0, output[-4000:]
    return sweep_dir, algorithms, output


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_through_the_same_loop(algorithm, every_algorithm):
    sweep_dir, algorithms, output = every_algorithm
    run_dir = str(sweep_dir / str(algorithms.index(algorithm)))
    records = train_records(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in evals] == [0, 2]
    for record in train:
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["entropy"] > 0.0
        if record["optimizer_steps"] > 0:  # DAPO skips updates whose groups were all filtered
            assert record["grad_norm"] >= 0.0 and record["loss"] == record["loss"]  # not NaN
        assert all(v is None or isinstance(v, (int, float, str)) for v in record.values())
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    assert report["algorithm"] == algorithm and report["base"]["step"] == 0
    # the held-out before/after table is printed at the end, as in report.md (this job's table:
    # its rows, whose numbers are this run's, each printed on a line of the sweep's output)
    assert "| metric | base model (step 0) | trained (step 2) | change |" in output.splitlines()
    assert re.search(r"^\| reward/mean \| [0-9.]+ \| [0-9.]+ \| -?[0-9.]+ \|$", output, re.MULTILINE), output[-2000:]
    with open(os.path.join(run_dir, "report.md")) as f:
        table = [line for line in f.read().splitlines() if line.startswith("| reward/mean |")]
    assert table and table[0] in output.splitlines(), (table, output[-2000:])
    assert os.path.exists(os.path.join(run_dir, "config.yaml"))


def test_a_run_without_a_terminal_prints_one_line_per_logged_step(reference_run):
    """Where no tqdm bar shows (SLURM logs, pipes) rank 0 prints each logged step's own numbers:
    reward, KL to pi_ref, the engine's gap to the trainer, sampled tokens per second, step time and
    the ETA from the mean step time."""
    from quatro_nemo.engine.progress import format_duration

    args, run_dir = reference_run
    lines = [line for line in Path(run_dir, STDOUT).read_text().splitlines() if line.startswith("[quatro] step ")]
    records = [r for r in train_records(run_dir) if r["kind"] == "train"]
    assert len(lines) == len(records) == 5
    sequences = 8 * 4   # TINY: trainer.prompts_per_step x rollout.n
    for index, (line, record) in enumerate(zip(lines, records)):
        seconds = record["time/step"]
        expected = [f"[quatro] step {record['step']}/5", f"reward {record['reward/mean']:.3f}"]
        if "policy/kl_ref" in record:   # absent for a step without an update
            expected.append(f"kl_ref {record['policy/kl_ref']:.4f}")
        if "engine_gap/token_abs_mean" in record:   # the sampler measured its gap to the trainer
            expected.append(f"engine gap {record['engine_gap/token_abs_mean']:.4f}")
        mean = sum(r["time/step"] for r in records[:index + 1]) / (index + 1)
        expected += [f"{record['response_length/mean'] * sequences / seconds:,.0f} tok/s", f"step {seconds:.1f} s",
                     f"ETA {format_duration(mean * (5 - record['step']))}"]
        assert line.split(" | ") == expected
    assert lines[-1].endswith("ETA 0s")


def test_multirun_trains_each_job_in_its_own_run_directory(every_algorithm):
    """Hydra's -m: algorithm=cispo,...,quatro is one run per algorithm, job i in <run.dir>/<i>;
    nothing is written outside run.dir (no outputs/ or multirun/ where the command runs, the
    repository)."""
    from .conftest import REPO

    sweep_dir, algorithms, _ = every_algorithm
    assert sorted(os.listdir(sweep_dir)) == sorted([str(job) for job in range(len(algorithms))] + ["multirun.yaml"])
    for job, algorithm in enumerate(algorithms):
        run_dir = sweep_dir / str(job)
        with open(run_dir / "report.json") as f:
            assert json.load(f)["algorithm"] == algorithm
        assert [r["step"] for r in train_records(str(run_dir)) if r["kind"] == "train"] == [1, 2]
        assert not (run_dir / ".hydra").exists()
    assert not (REPO / "outputs").exists() and not (REPO / "multirun").exists()


def assert_same_step(got, expected, where, update_keys=("loss", "grad_norm", "policy/kl_old")):
    """One training record against another's: the same rewards and optimizer steps, entropy and,
    when there were updates, each of ``update_keys``, up to float32 reduction order. (With no
    reward at all, which this machine's short warm-start may earn, no mini-batch has a signal and
    neither run steps: tests/engine/test_learning_signal.py forces that case on purpose.)"""
    assert got["reward/mean"] == expected["reward/mean"], where
    assert got["optimizer_steps"] == expected["optimizer_steps"], where
    for key in ("entropy",) + (tuple(update_keys) if expected["optimizer_steps"] else ()):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (where, key)


def latest_complete_checkpoint(run_dir):
    """The step of the newest checkpoint with its COMPLETE marker (0: none)."""
    markers = Path(run_dir, "checkpoints").glob("step_*/COMPLETE")
    return max((int(marker.parent.name.split("_")[1]) for marker in markers), default=0)


def start_step(output):
    """The step a run started from, read from the loop's banner ("steps 3->4")."""
    match = re.search(r"steps (\d+)->\d+", output)
    assert match, output
    return int(match.group(1))


def test_sigkill_at_random_points_then_same_command_resumes_bit_identically(reference_run, tmp_path):
    """Two SIGKILLs at random points (seeded): after the checkpoints of two randomly drawn steps,
    each after a delay drawn uniformly from the uninterrupted run's time for the next step, so
    it lands in that step's rollout, log-probs, update or checkpoint writing. After each, the
    same command resumes from the last complete checkpoint (not from scratch, which would give
    the same records); the finished run's records equal the uninterrupted run's (same data,
    same RNG, same optimizer state). Each kill costs one more start of the run, so two kills
    keep the test under twice the time of one."""
    args, reference_dir = reference_run
    run_dir = str(tmp_path / "killed")
    args = [a if not a.startswith("run.dir=") else f"run.dir={run_dir}" for a in args]
    step_seconds = {r["step"]: r["time/step"] for r in train_records(reference_dir) if r["kind"] == "train"}
    rng = random.Random(18)
    for saved_step in sorted(rng.sample([1, 2, 3], 2)):
        resume_from = latest_complete_checkpoint(run_dir)
        process = run_train(args, start_new_session=True)  # its own process group, helpers included
        marker = os.path.join(run_dir, "checkpoints", f"step_{saved_step:06d}", "COMPLETE")
        deadline = time.time() + 300
        while not os.path.exists(marker):
            assert process.poll() is None, process.communicate()[0]
            assert time.time() < deadline, f"no checkpoint for step {saved_step}"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, step_seconds[saved_step + 1]))
        assert process.poll() is None, f"the run ended before the kill after step {saved_step}"
        os.killpg(process.pid, signal.SIGKILL)  # the run and its helper processes, as when a node dies
        output, _ = process.communicate(timeout=120)
        assert start_step(output) == resume_from
    resume_from = latest_complete_checkpoint(run_dir)
    code, output = finish(run_train(args))
    assert code == 0, output
    assert start_step(output) == resume_from > 0
    assert_same_records(run_dir, reference_dir)


def test_sigterm_then_sigusr1_each_checkpoint_and_exit_75_then_the_run_resumes(reference_run, tmp_path):
    """SIGTERM (what SLURM sends at preemption) as soon as the first step is logged, then, in the
    resumed run, SIGUSR1 (``#SBATCH --signal=USR1@...`` before the time limit) as soon as one more
    step is logged: each time the run checkpoints where it is and exits 75 (requeue); the third
    command finishes the run, whose records equal the uninterrupted run's. (One run signalled twice
    rather than one run per signal: a start of the run less.)"""
    args, reference_dir = reference_run
    run_dir = str(tmp_path / "signalled")
    args = [a if not a.startswith("run.dir=") else f"run.dir={run_dir}" for a in args]
    args = args + ["trainer.checkpoint_every=0"]  # only the signal (or the end) checkpoints
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def steps_logged():
        return open(metrics).read().count('"train"') if os.path.exists(metrics) else 0

    saved = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        logged_before = steps_logged()
        process = run_train(args)
        deadline = time.time() + 300
        while steps_logged() <= logged_before:
            assert process.poll() is None, process.communicate()[0]
            assert time.time() < deadline
            time.sleep(0.05)
        process.send_signal(sig)
        code, output = finish(process)
        assert code == 75, (sig, output)
        saved.append(latest_complete_checkpoint(run_dir))
        assert start_step(output) == (saved[-2] if len(saved) > 1 else 0), (sig, output)
    assert 0 < saved[0] < saved[1] < 5, saved
    code, output = finish(run_train(args))
    assert code == 0, output
    assert start_step(output) == saved[1]
    assert_same_records(run_dir, reference_dir)


def test_resume_at_another_layout_continues_the_run(reference_run, tmp_path):
    """Sharded checkpoints reshard: one step at each layout in turn, TP1 -> DP2 -> TP2 -> PP2, each
    resuming the previous layout's checkpoint, give the records of the uninterrupted
    single-process run: identical rollouts and rewards, and losses/gradient norms equal up to
    float32 reduction order. DP1 -> DP2 resumes from the routine checkpoint as saved; a TP/PP
    change is first refused with the command that converts, then made after
    ``recipes/convert_checkpoint.py reshard`` ran at the saved TP/PP sizes: once at another
    data-parallel size (one process for the DP2 checkpoint), once at the same. (A tied-embedding
    checkpoint saved at PP=2 is refused on load: docs/cluster.md, "Known limits".)"""
    from .conftest import CONVERT, run_recipe

    args, reference_dir = reference_run
    run_dir = str(tmp_path / "resharded")
    args = [a if not a.startswith("run.dir=") else f"run.dir={run_dir}" for a in args]
    args = [a for a in args if not a.startswith("trainer.steps=")]
    # (processes, overrides, processes of the conversion before it: 0 for none)
    layouts = [(1, [], 0), (2, [], 0), (2, ["parallel.tensor=2"], 1), (2, ["parallel.pipeline=2"], 2)]
    for step, (nproc, extra, convert_nproc) in enumerate(layouts, start=1):
        step_args = args + [f"trainer.steps={step}"] + extra
        if convert_nproc:
            code, output = finish(run_train(step_args, nproc=nproc))
            assert code != 0 and "recipes/convert_checkpoint.py reshard" in output, output[-3000:]
            code, output = finish(run_recipe(CONVERT, ["reshard", run_dir], nproc=convert_nproc))
            assert code == 0 and "model_optim_reshardable" in output, output[-3000:]
        code, output = finish(run_train(step_args, nproc=nproc))
        assert code == 0, f"layout {extra or nproc}: {output}"
    got = {(r["step"], r["kind"]): r for r in train_records(run_dir)}
    expected = {(r["step"], r["kind"]): r for r in train_records(reference_dir)}
    for step in range(1, 5):
        assert_same_step(got[(step, "train")], expected[(step, "train")], step)


def _first_step(run_dir):
    return next(r for r in train_records(run_dir) if r["kind"] == "train" and r["step"] == 1)


@pytest.mark.distributed
def test_torchrun_tp2_and_pp2_and_dp2_layouts_each_give_the_first_step_of_one_process(tmp_path, reference_run):
    """Three two-rank layouts in turn (TP2, PP2, DP2), not their eight-rank product, each against the
    first step of the module's one-process reference run (K = 2 inner loops, two mini-batches)."""
    reference_args, reference_dir = reference_run
    reference = _first_step(reference_dir)

    def tiny_args(run_dir, *extra):
        return [a for a in reference_args if not a.startswith(("run.dir=", "trainer.steps="))] + \
            [f"run.dir={run_dir}", *extra]

    common = ["trainer.steps=1"]   # with the reference's held-out evaluation at step 0, as it ran
    # dp2 builds its own warm-start cache under torchrun (the warm-start subprocess must not join
    # torchrun's agent store); the cached base must equal the single process's.
    fresh_cache = f"warmstart.cache_dir={tmp_path / 'fresh-cache'}"
    for name, extra in [("tp2", ["parallel.tensor=2"]), ("pp2", ["parallel.pipeline=2"]), ("dp2", [fresh_cache])]:
        run_dir = str(tmp_path / name)
        code, output = finish(run_train(tiny_args(run_dir, *common, *extra), nproc=2))
        assert code == 0, f"{name}: {output}"
        got = _first_step(run_dir)
        world = json.load(open(os.path.join(run_dir, "world.json")))
        assert len(world) == 2
        # identical rollouts (layout-independent sampling noise) -> identical rewards
        assert_same_step(got, reference, name, update_keys=("loss", "grad_norm", "policy/kl_ref"))


def test_token_budget_micro_batches_give_the_first_step_of_the_padded_run(tmp_path, tiny_args):
    """The loop's call sites pass the token budget (old/ref log-probs, training, evaluation): the
    same rollouts give the padded run's optimizer steps, loss, gradient norm, entropy and held-out
    numbers."""
    common = ["trainer.steps=1", "trainer.mini_batch_prompts=4"]
    padded = str(tmp_path / "padded")
    code, output = finish(run_train(tiny_args(padded, *common)))
    assert code == 0, output
    budget = str(tmp_path / "budget")
    code, output = finish(run_train(tiny_args(budget, *common, "parallel.max_tokens_per_micro_batch=100")))
    assert code == 0, output
    reference, got = _first_step(padded), _first_step(budget)
    assert sorted(got) == sorted(reference)
    assert_same_step(got, reference, "token budget", update_keys=("loss", "grad_norm", "policy/kl_ref", "policy/kl_old"))
    evals = [[r for r in train_records(d) if r["kind"] == "eval"] for d in (padded, budget)]
    assert [r["entropy"] for r in evals[1]] == pytest.approx([r["entropy"] for r in evals[0]], rel=1e-4)
