"""slurm/lib/common.sh's communication defaults, without a cluster: NCCL's and torch's allocator
settings and their overrides, and the network interface Gloo gets (or the job's refusal to start),
decided from fake ``ip``, ``getent`` and ``scontrol`` on PATH that describe a node's interfaces,
its name resolution and the job's nodes. Milliseconds per case."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
INTERFACES = [("lo", "127.0.0.1"), ("eno1", "192.168.7.5"), ("ib0", "10.1.0.5")]   # this (the first) node's


def fake_node(tmp_path: Path, hosts: Dict[str, str], nodes: List[Tuple[str, str]],
              interfaces: List[Tuple[str, str]] = INTERFACES) -> Path:
    """A folder of stand-ins: ``getent ahostsv4 NAME`` answers from ``hosts``; ``ip -o -4 addr show``
    lists ``interfaces`` as iproute2 prints them; ``scontrol`` knows the job's ``nodes`` (name,
    NodeAddr)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    cases = "".join(f"    {name}) echo '{ip}       STREAM {name}' ;;\n" for name, ip in hosts.items())
    lines = "".join(f"echo '{i}: {name}    inet {ip}/16 brd 0.0.0.0 scope global {name}'\n"
                    for i, (name, ip) in enumerate(interfaces, start=1))
    show_node = "".join(f"    {name}) echo 'NodeName={name} Arch=x86_64 NodeAddr={addr} NodeHostName={name}' ;;\n"
                        for name, addr in nodes)
    scripts = {
        "getent": f'#!/bin/bash\n[ "$1" = ahostsv4 ] || exit 2\ncase "$2" in\n{cases}    *) exit 2 ;;\nesac\n',
        "ip": f'#!/bin/bash\n[ "$*" = "-o -4 addr show" ] || exit 2\n{lines}',
        "scontrol": ('#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then\n'
                     + "".join(f"    echo {name}\n" for name, _ in nodes)
                     + 'elif [ "$1 $2 $3" = "show node -o" ]; then\n    case "$4" in\n' + show_node
                     + "    esac\nfi\n"),
    }
    for name, text in scripts.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    return tools


def gloo_interface(tools: Path, master_addr: str, **env: str) -> subprocess.CompletedProcess:
    """Run quatro_export_gloo_interface as quatro_run_recipe does (after the rendezvous is set)."""
    clean = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME") and not k.startswith("SLURM_")}
    nodes = subprocess.run([str(tools / "scontrol"), "show", "hostnames", "x"], capture_output=True, text=True).stdout
    snippet = ("set -euo pipefail; source slurm/lib/common.sh; quatro_export_gloo_interface; "
               'echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"')
    return subprocess.run(["bash", "-c", snippet], cwd=ROOT, text=True, capture_output=True, timeout=60,
                          env={**clean, "PATH": f"{tools}:{os.environ['PATH']}", "MASTER_ADDR": master_addr,
                               "SLURM_JOB_NODELIST": "x", "SLURM_JOB_NUM_NODES": str(len(nodes.split())), **env})


def test_gloo_takes_the_interface_that_holds_the_first_nodes_address(tmp_path):
    tools = fake_node(tmp_path, {"gpu001": "10.1.0.5", "gpu002": "10.1.0.6"}, [("gpu001", "gpu001"),
                                                                                ("gpu002", "gpu002")])
    result = gloo_interface(tools, "gpu001")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GLOO_SOCKET_IFNAME=ib0"
    # an address given as such needs no name resolution
    assert gloo_interface(tools, "192.168.7.5").stdout.strip() == "GLOO_SOCKET_IFNAME=eno1"


def test_a_loopback_first_node_with_a_node_elsewhere_stops_the_job_with_the_fix(tmp_path):
    """Debian's /etc/hosts maps the host's own name to 127.0.1.1: Gloo would bind there and the
    other node's ranks would wait for it until the collective timeout."""
    tools = fake_node(tmp_path, {"gpu001": "127.0.1.1", "gpu002": "10.1.0.6"}, [("gpu001", "gpu001"),
                                                                                 ("gpu002", "gpu002")])
    result = gloo_interface(tools, "gpu001")
    assert result.returncode == 2
    assert "loopback address 127.0.1.1, which node gpu002 cannot reach" in result.stderr
    assert "export NCCL_SOCKET_IFNAME=ib0" in result.stderr and "GLOO_SOCKET_IFNAME" in result.stderr
    # naming the interface is the fix
    fixed = gloo_interface(tools, "gpu001", NCCL_SOCKET_IFNAME="ib0")
    assert fixed.returncode == 0 and fixed.stdout.strip() == "GLOO_SOCKET_IFNAME=ib0"


def test_an_address_on_no_interface_of_a_multi_node_job_stops_it(tmp_path):
    tools = fake_node(tmp_path, {"gpu001": "10.9.9.9", "gpu002": "10.9.9.10"}, [("gpu001", "gpu001"),
                                                                                 ("gpu002", "gpu002")])
    result = gloo_interface(tools, "gpu001")
    assert result.returncode == 2
    assert "no interface of this node holds gpu001's address (10.9.9.9)" in result.stderr
    unresolved = gloo_interface(tools, "gpu009")
    assert unresolved.returncode == 2 and "(unresolved)" in unresolved.stderr


def test_nodes_that_are_all_this_machine_and_single_nodes_keep_gloos_own_choice(tmp_path):
    # the local test cluster of tests/slurm: fake nodes on 127.0.0.1 (lo holds it)
    (tmp_path / "a").mkdir()
    local = fake_node(tmp_path / "a", {}, [("n1", "127.0.0.1"), ("n2", "127.0.0.1")])
    result = gloo_interface(local, "127.0.0.1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GLOO_SOCKET_IFNAME=lo"
    # one node whose name resolves to 127.0.1.1, an address no interface lists: nothing to choose
    (tmp_path / "b").mkdir()
    single = fake_node(tmp_path / "b", {"gpu001": "127.0.1.1"}, [("gpu001", "gpu001")])
    result = gloo_interface(single, "gpu001")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GLOO_SOCKET_IFNAME="


def test_a_set_interface_wins_and_nccls_is_gloos_default(tmp_path):
    tools = fake_node(tmp_path, {"gpu001": "127.0.1.1", "gpu002": "10.1.0.6"}, [("gpu001", "gpu001"),
                                                                                 ("gpu002", "gpu002")])
    assert gloo_interface(tools, "gpu001", GLOO_SOCKET_IFNAME="eth1").stdout.strip() == "GLOO_SOCKET_IFNAME=eth1"
    both = gloo_interface(tools, "gpu001", GLOO_SOCKET_IFNAME="eth1", NCCL_SOCKET_IFNAME="ib0")
    assert both.stdout.strip() == "GLOO_SOCKET_IFNAME=eth1"
    assert gloo_interface(tools, "gpu001", NCCL_SOCKET_IFNAME="ib1").stdout.strip() == "GLOO_SOCKET_IFNAME=ib1"


DEFAULT_KEYS = ["NCCL_NVLS_ENABLE", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS"]


def comm_defaults(**env: str) -> Dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in DEFAULT_KEYS + ["PYTORCH_ALLOC_CONF"]}
    snippet = ("set -euo pipefail; source slurm/lib/common.sh; quatro_export_comm_defaults; "
               + "".join(f'echo "{k}=${{{k}-unset}}"; ' for k in DEFAULT_KEYS))
    result = subprocess.run(["bash", "-c", snippet], cwd=ROOT, text=True, capture_output=True, timeout=60,
                            env={**clean, "SLURM_JOB_ID": "7", "GLOO_SOCKET_IFNAME": "lo", **env})
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_nvls_and_allocator_defaults_and_the_users_settings_win():
    assert comm_defaults() == {"NCCL_NVLS_ENABLE": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                               "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    mine = {"NCCL_NVLS_ENABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
            "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert comm_defaults(**mine) == mine
    # torch reads PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF: a user's one is not shadowed or mixed
    assert comm_defaults(PYTORCH_ALLOC_CONF="expandable_segments:False")["PYTORCH_CUDA_ALLOC_CONF"] == "unset"
