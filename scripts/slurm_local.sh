#!/usr/bin/env bash
# A throw-away local SLURM cluster for tests and for trying the templates in slurm/ on one machine.
#
#   bash scripts/slurm_local.sh install            # apt-get the Debian SLURM 22.05 + munge (root)
#   bash scripts/slurm_local.sh start [NODES]      # NODES=1: one node named after this host;
#                                                  # NODES>=2: fake nodes n1..nN on this host
#   eval "$(bash scripts/slurm_local.sh env)"      # SLURM_CONF for sbatch/squeue/scontrol
#   bash scripts/slurm_local.sh status
#   bash scripts/slurm_local.sh stop               # stops only the daemons this script started
#
# Everything lives under $SLURM_LOCAL_DIR (default: .slurm-local/ in the repository root): the
# config, munge key and socket, spool, logs and pid files. Ports are picked free at start, so it
# does not collide with a system SLURM or munge; clients find it through SLURM_CONF. It runs as
# root without systemd or cgroups (settings that were each found necessary are commented below).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${SLURM_LOCAL_DIR:-$ROOT/.slurm-local}
CONF=$STATE/etc/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket.2
CPUS_PER_NODE=${SLURM_LOCAL_CPUS:-8}      # declared, not physical: lets small test jobs overlap
MEM_PER_NODE_MB=${SLURM_LOCAL_MEM_MB:-8000}
FAKE_GPUS_PER_NODE=${SLURM_LOCAL_GPUS:-8} # /dev/null stand-ins so --gpus-per-node=8 is schedulable

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pid_alive() {  # pid_alive PIDFILE
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

cmd_install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "install needs root (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
}

node_names() {  # node_names NODES
    if [ "$1" = 1 ]; then
        hostname -s
    else
        seq -f 'n%g' 1 "$1"
    fi
}

write_config() {  # write_config NODES
    local nodes=$1 host ctld_port slurmd_port name
    host=$(hostname -s)
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    mkdir -p "$STATE"/{etc,log,run,spool/ctld,fake-gpus}
    for i in $(seq 0 $((FAKE_GPUS_PER_NODE - 1))); do
        ln -sf /dev/null "$STATE/fake-gpus/nvidia$i"
    done
    cat > "$CONF" <<EOF
# Written by scripts/slurm_local.sh; regenerated at every start.
ClusterName=quatro-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
MpiDefault=none
# No systemd or cgroups here: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Cores and memory are consumable, so several small jobs (array tasks) run side by side;
# DefMemPerCPU keeps a job that names no memory from taking the whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
# Declared CPUs/memory may differ from the hardware (small machines, fake nodes).
SlurmdParameters=config_overrides
# Without this each submission waits ~3 s before it is scheduled.
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MaxJobCount=10000
KillWait=10
MinJobAge=600
GresTypes=gpu
EOF
    : > "$STATE/etc/gres.conf"
    local gpu_files="$STATE/fake-gpus/nvidia[0-$((FAKE_GPUS_PER_NODE - 1))]"
    for name in $(node_names "$nodes"); do
        local port_line=""
        if [ "$nodes" != 1 ]; then
            port_line="Port=$(free_port)"   # several slurmd on one host need their own ports
        fi
        echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 $port_line CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Gres=gpu:$FAKE_GPUS_PER_NODE State=UNKNOWN" >> "$CONF"
        echo "NodeName=$name Name=gpu File=$gpu_files" >> "$STATE/etc/gres.conf"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
    echo "$nodes" > "$STATE/run/nodes"
}

start_munge() {
    pid_alive "$STATE/run/munged.pid" && return 0
    mkdir -p "$STATE/munge"
    if [ ! -s "$STATE/munge/munge.key" ]; then
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    fi
    chown -R munge:munge "$STATE/munge"
    chmod 755 "$STATE/munge"   # munged wants the socket dir searchable by all
    chmod 400 "$STATE/munge/munge.key"
    runuser -u munge -- munged \
        --key-file="$STATE/munge/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
        --seed-file="$STATE/munge/munged.seed"
    # the pid file lives in the munge-owned dir; keep a copy beside the others for stop/status
    for _ in $(seq 50); do
        [ -s "$STATE/munge/munged.pid" ] && break
        sleep 0.1
    done
    cp "$STATE/munge/munged.pid" "$STATE/run/munged.pid"
}

cmd_start() {
    local nodes=${1:-1}
    [[ $nodes =~ ^[1-9]$ ]] || die "NODES must be 1..9, got '$nodes'"
    [ "$(id -u)" = 0 ] || die "start needs root (slurmd runs jobs as the submitting user)"
    command -v slurmctld >/dev/null || die "SLURM is not installed: run '$0 install' first"
    if pid_alive "$STATE/run/slurmctld.pid"; then
        die "a local SLURM already runs from $STATE (stop it first: $0 stop)"
    fi
    rm -rf "$STATE/spool" "$STATE/log.previous"
    [ -d "$STATE/log" ] && mv "$STATE/log" "$STATE/log.previous"   # the last cluster's logs, for debugging
    write_config "$nodes"
    start_munge
    export SLURM_CONF=$CONF
    slurmctld -c -i -f "$CONF"      # -c: fresh state (no old jobs); -i: ignore state errors
    local name
    for name in $(node_names "$nodes"); do
        mkdir -p "$STATE/spool/$name"
        if [ "$nodes" = 1 ]; then
            slurmd -f "$CONF"
        else
            slurmd -f "$CONF" -N "$name"
        fi
    done
    for _ in $(seq 100); do
        if [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" = "$nodes" ]; then
            echo "local SLURM up: $nodes node(s), SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.2
    done
    sinfo -N -l >&2 || true
    tail -n 20 "$STATE"/log/*.log >&2 || true
    die "nodes did not become idle within 20 s (logs in $STATE/log)"
}

stop_pidfiles() {  # stop_pidfiles PIDFILE...: TERM each named process, wait, then KILL stragglers
    local pidfile pids=()
    for pidfile in "$@"; do
        [ -s "$pidfile" ] && pids+=("$(cat "$pidfile")")
        rm -f "$pidfile"
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "${pids[@]}" 2>/dev/null || break   # true while any of them lives
        sleep 0.1
    done
    local pid
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    done
    return 0
}

# Processes of this cluster's jobs: slurmstepd (it inherits slurmd's SLURM_CONF) and the job's
# own processes (submitted with this SLURM_CONF), recognised by SLURM_CONF=$CONF in their
# environment, so nothing of another cluster or of the machine is touched.
job_processes() {
    local dir pid environment
    for dir in /proc/[0-9]*; do
        pid=${dir#/proc/}
        [ "$pid" != $$ ] || continue
        environment=$( { tr '\0' '\n' < "$dir/environ"; } 2>/dev/null ) || continue
        grep -qx "SLURM_CONF=$CONF" <<< "$environment" || continue
        if [ "$(cat "$dir/comm" 2>/dev/null)" = slurmstepd ] || grep -q '^SLURM_JOB_ID=' <<< "$environment"; then
            echo "$pid"
        fi
    done
}

cmd_stop() {
    if pid_alive "$STATE/run/slurmctld.pid"; then
        # end running jobs first, so no job step outlives the daemons
        SLURM_CONF=$CONF scancel --quiet --full --state=RUNNING --state=PENDING 2>/dev/null || true
        sleep 1
    fi
    local pid
    for pid in $(job_processes); do   # left behind if a daemon died before its jobs ended
        kill -KILL "$pid" 2>/dev/null || true
    done
    # slurmd and slurmctld together, then munged (they authenticate through it while stopping)
    stop_pidfiles "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid"
    stop_pidfiles "$STATE/run/munged.pid"
    rm -f "$STATE/munge/munged.pid"
}

cmd_status() {
    local pidfile any=0
    for pidfile in "$STATE"/run/*.pid; do
        [ -e "$pidfile" ] || continue
        any=1
        if pid_alive "$pidfile"; then
            echo "running: $(basename "$pidfile" .pid) (pid $(cat "$pidfile"))"
        else
            echo "dead:    $(basename "$pidfile" .pid)"
        fi
    done
    [ "$any" = 1 ] || { echo "no local SLURM in $STATE"; return 1; }
    SLURM_CONF=$CONF sinfo -N || true
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start "${2:-1}" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 install | start [NODES] | stop | status | env" ;;
esac
