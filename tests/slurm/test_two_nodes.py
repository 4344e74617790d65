"""The training template across two (fake) SLURM nodes: one rank per node, one rendezvous."""
from __future__ import annotations

import re

import pytest

from pathlib import Path

from .slurm_cluster import expected_master_port, read_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def test_ranks_on_two_nodes_agree_on_the_rendezvous(local_slurm, recipe, tmp_path):
    local_slurm.ensure(2)
    run_dir = tmp_path / "two-nodes"
    job_id = local_slurm.sbatch(
        "--job-name=test-two-nodes", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
        "--cpus-per-task=1", "--mem=1500M", "--time=20", f"--output={local_slurm.log_dir}/%x-%j.out",
        "slurm/quatro_7b.sh", *recipe.tiny, f"run.dir={run_dir}", env=recipe.env)
    final = local_slurm.wait_done([job_id], timeout=300)[job_id]
    assert final["JobState"] == "COMPLETED", Path(final["StdOut"]).read_text()[-3000:]

    ranks = sorted(read_jsonl(run_dir / "slurm_ranks.jsonl"), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["world_size"], r["node"]) for r in ranks] == [
        (0, 0, 2, "n1"), (1, 0, 2, "n2")]
    # MASTER_ADDR is the first node's NodeAddr (fake nodes all listen on 127.0.0.1).
    assert {(r["master_addr"], r["master_port"]) for r in ranks} == {("127.0.0.1", expected_master_port(job_id))}
    world = (run_dir / "world.json").read_text()
    for r in ranks:
        assert re.search(rf'"pid": {r["pid"]}\b', world), (r, world)
