# shellcheck shell=bash
# The logic every sbatch template in slurm/ shares. Sourced, never run: it only defines functions.
#
# A template sets its #SBATCH resources, then calls
#
#     quatro_run_recipe RECIPE RUN_DIR_KEY [TEMPLATE_DEFAULT ...] -- [USER_ARG ...]
#
# which, on the first node of the allocation:
#   1. builds the argument list: the template's defaults, minus any key the user sets, then the
#      user's arguments, then (array task of slurm/sweep.sh) this task's line of the sweep file;
#   2. picks the run directory (the value of RUN_DIR_KEY, e.g. run.dir, if given, else
#      runs/<job name>-<job id>; a sweep task gets <sweep dir>/task-<index>) and appends one JSON line per start and per end to
#      <run dir>/slurm_launches.jsonl (launch.sh adds one per rank to slurm_ranks.jsonl);
#   3. refuses to start once the job has been requeued more than QUATRO_MAX_RESTARTS times;
#   4. exports MASTER_ADDR (address of the first node) and MASTER_PORT (from the job id and
#      restart count, so jobs sharing a node do not collide), NCCL and threading defaults;
#   5. starts one process per task with srun (slurm/lib/launch.sh turns SLURM_PROCID/NTASKS/
#      LOCALID into RANK/WORLD_SIZE/LOCAL_RANK), inside the container QUATRO_CONTAINER_IMAGE
#      through pyxis/enroot when set, else in the plain environment;
#   6. forwards USR1 (sent by `#SBATCH --signal=B:USR1@N` before the time limit, or by hand:
#      `scancel --batch --signal=USR1 JOB`) to the ranks, which checkpoint and exit 75;
#   7. on exit code 75 requeues the job (`scontrol requeue`), and the restarted job resumes from
#      the run directory's newest checkpoint. Exit 0 ends the job; any other code is a real
#      failure and is returned as is, never requeued. After a SIGTERM (scancel, or preemption,
#      which SLURM requeues by itself under --requeue) it does not requeue either.
#
# Environment (all optional):
#   QUATRO_ROOT             repository root (default: the submit directory)
#   QUATRO_RUNS_DIR         where default run directories go (default: $SCRATCH/quatro-nemo/runs where the
#                           cluster sets SCRATCH, else $QUATRO_ROOT/runs; a 7B checkpoint is ~107 GB)
#   QUATRO_CONTAINER_IMAGE  container image for pyxis/enroot (e.g. a .sqsh file or registry#image)
#   QUATRO_CONTAINER_MOUNTS extra mounts SRC:DST[,SRC:DST...] (data, checkpoints, HF cache)
#   QUATRO_CONTAINER_PYTHON python inside the container (default: python3, the image's one interpreter name)
#   QUATRO_MAX_RESTARTS     most requeues a job may go through (default: 20)
#   QUATRO_RANK_EXIT_WAIT_S seconds the other ranks get after the first one exits (default: 600)
#   QUATRO_REQUEUE_WAIT_S   seconds the batch shell waits for SLURM after `scontrol requeue` (default: 300)
#   QUATRO_MASTER_PORT      rendezvous port (default: 20000 + 10 * (job id mod 2000) + restart mod 10)
#   QUATRO_DIST_TIMEOUT_MIN minutes a collective may wait before the ranks abort (default: 30; torch's
#                           own is 10, shorter than a sharded checkpoint save on a busy filesystem)
#   QUATRO_CACHE_DIR        per-job compile caches, node-local (default: ${TMPDIR:-/tmp}/quatro-<job id>);
#                           launch.sh puts each rank's TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
#                           VLLM_CACHE_ROOT, XDG_CACHE_HOME, XDG_CONFIG_HOME, CUDA_CACHE_PATH and
#                           FLASHINFER_WORKSPACE_BASE under it unless they are set (and HOME when it
#                           is not writable: the container does not mount it)
#   GLOO_SOCKET_IFNAME      the interface of megatron's and vLLM's Gloo groups (default: NCCL_SOCKET_IFNAME,
#                           else the interface holding the first node's address; see quatro_export_gloo_interface)
#   NCCL_NVLS_ENABLE        default 0 (no NVLink SHARP buffers); PYTORCH_CUDA_ALLOC_CONF default
#                           expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set (reasons below)
#   VLLM_NO_USAGE_STATS, HF_HUB_OFFLINE  default 1: no usage reports, no hub downloads from the ranks
#   NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT   InfiniBand verbs timeout exponent and retries (defaults 22, 7:
#                           ~17 s per attempt, for congested fabrics); NCCL_SOCKET_IFNAME, NCCL_IB_HCA
#                           and other fabric settings pass through from the environment or template
#   SLURM_CPUS_PER_TASK     (from #SBATCH --cpus-per-task) passed on to srun explicitly: srun of
#                           SLURM 22.05-23.02 does not inherit it

QUATRO_EXIT_REQUEUE=75            # EX_TEMPFAIL: checkpoint saved, requeue me (docs/interfaces.md)

quatro_die() {
    echo "quatro-slurm: error: $*" >&2
    exit 2
}

quatro_log() {
    echo "quatro-slurm [$(date -u +%H:%M:%S)] $*"
}

# quatro_override_key ARG: the key of a key=value override (a leading +, ++ or ~ is Hydra
# syntax); empty for anything else (Hydra's own flags, such as --config-dir DIR or -m, and their values).
quatro_override_key() {
    case $1 in
        -*) echo "" ;;
        *=*) local key=${1%%=*}; key=${key#++}; echo "${key#[+~]}" ;;
        *) echo "" ;;
    esac
}

# quatro_check_overrides ARG...: every argument must look like key=value.
quatro_check_overrides() {
    local arg
    for arg in "$@"; do
        [[ $arg =~ ^(\+\+|[+~])?[A-Za-z_][A-Za-z0-9_.@/-]*= ]] \
            || quatro_die "override '$arg' is not key=value"
    done
}

# quatro_last_value KEY ARG...: the value the last KEY=value among ARGs sets; empty if none does.
quatro_last_value() {
    local key=$1 value="" arg
    shift
    for arg in "$@"; do
        [ "$(quatro_override_key "$arg")" = "$key" ] && value=${arg#*=}
    done
    echo "$value"
}

# quatro_sets_key KEY ARG...: true if an argument is a KEY=value override.
quatro_sets_key() {
    local key=$1 arg
    shift
    for arg in "$@"; do
        [ "$(quatro_override_key "$arg")" = "$key" ] && return 0
    done
    return 1
}

# quatro_sweep_sets FILE: the override sets of a sweep file, one per line, in order.
# A line holds whitespace-separated key=value overrides; blank lines and lines starting with #
# are skipped. Array task i runs the i-th printed line (0-based).
quatro_sweep_sets() {
    [ -f "$1" ] || quatro_die "sweep file '$1' not found"
    grep -v -E '^[[:space:]]*(#|$)' "$1" | sed -E 's/^[[:space:]]+//; s/[[:space:]]+$//' || true
}

# quatro_json_line KEY VALUE ...: one JSON object with string values (no quotes or backslashes
# expected in them: job ids, host names, paths).
quatro_json_line() {
    local out="{" sep=""
    while [ $# -ge 2 ]; do
        out+="$sep\"$1\": \"${2//\"/\\\"}\""
        sep=", "
        shift 2
    done
    echo "$out}"
}

quatro_first_node() {
    scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
}

# The address the other ranks reach the first node at: its NodeAddr (equal to the host name on
# most clusters; differs for fake nodes in tests).
quatro_node_addr() {
    local addr
    addr=$(scontrol show node -o "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    echo "${addr:-$1}"
}

quatro_export_rendezvous() {
    local first
    first=$(quatro_first_node)
    MASTER_ADDR=$(quatro_node_addr "$first")
    # Distinct for jobs sharing a node, and for each restart of a requeued job (which may start
    # again on the same node before every process of its predecessor is gone).
    MASTER_PORT=${QUATRO_MASTER_PORT:-$((20000 + (SLURM_JOB_ID % 2000) * 10 + ${SLURM_RESTART_COUNT:-0} % 10))}
    export MASTER_ADDR MASTER_PORT
}

# Defaults for GPU runs; any of them set in the environment (or in the template) wins.
# QUATRO_USR1_LEAD_S: the N of the batch script's own `#SBATCH --signal=...USR1@N` (SLURM runs a
# copy of the template, its #SBATCH lines included), which rank 0 prints at start-up beside the
# seconds the planner says a step, an evaluation and a save take (quatro_nemo/engine/preemption_lead.py).
quatro_export_usr1_lead() {
    local lead
    lead=$(sed -n 's/^#SBATCH[[:space:]]\{1,\}--signal=[^@]*USR1@\([0-9]\{1,\}\).*/\1/p' "$0" 2>/dev/null | tail -n 1) || lead=""
    if [ -n "$lead" ]; then
        export QUATRO_USR1_LEAD_S=$lead
    fi
}

quatro_export_comm_defaults() {
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # One hardware work queue per GPU, so kernels start in the order they are issued. megatron's
    # communication overlaps are written for it (the sequence-parallel reduce-scatter before the
    # weight gradient, megatron/core/tensor_parallel/layers.py; overlapped gradient reduction,
    # megatron/core/distributed/distributed_data_parallel.py); this project turns none of them on,
    # so nothing here needs it. Kept as the setting megatron's own runs use.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # No NVLink SHARP: on NVSwitch systems (HGX H100/H200) NCCL allocates NVLS buffers for each
    # communicator it enables NVLS on, GPU memory that the planner's reserve (cluster.reserve_gb)
    # does not budget, across megatron's and vLLM's many groups; NeMo-Framework-Launcher turns
    # it off by default for memory (launcher_scripts/conf/config.yaml, env_vars). The collectives
    # here are small next to the compute (weight pushes, gradient reduction at TP 2): 1 enables it.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
    # Expandable segments: torch's allocator maps physical pages into a growing segment instead
    # of caching fixed blocks, so memory freed between phases (training state offloaded, logits
    # released) returns whole to the driver for vLLM to wake into, with less fragmentation at
    # the phase boundaries. vLLM 0.32's sleep-mode pool is not affected: CuMemAllocator.
    # use_memory_pool turns expandable segments off while it allocates and restores them after
    # (vllm/device_allocator/cumem.py; pytorch#147851). torch reads PYTORCH_ALLOC_CONF first,
    # then PYTORCH_CUDA_ALLOC_CONF: either one set by the user is kept as it is.
    if [ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
        export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    fi
    # A rank that dies makes the others abort (after the collective timeout) instead of hanging.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # Collective timeout (read by quatro_nemo.megatron.parallel), and InfiniBand retries that ride
    # out a congested fabric instead of failing the job.
    export QUATRO_DIST_TIMEOUT_MIN=${QUATRO_DIST_TIMEOUT_MIN:-30}
    export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
    export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
    # Compile caches per job on node-local disk, not in a $HOME shared by every rank of every node.
    export QUATRO_CACHE_DIR=${QUATRO_CACHE_DIR:-${TMPDIR:-/tmp}/quatro-$SLURM_JOB_ID}
    quatro_export_gloo_interface
    # Compute nodes report nothing and download nothing (weights and tokenizers are on disk).
    export VLLM_NO_USAGE_STATS=${VLLM_NO_USAGE_STATS:-1}
    export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
}

# quatro_ipv4 HOST: the IPv4 address HOST resolves to here (HOST itself if it is one); empty if none.
quatro_ipv4() {
    if [[ $1 =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
        echo "$1"
    else
        getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}' || true
    fi
}

# quatro_interface_of IPV4: the network interface of this machine that holds that address.
quatro_interface_of() {
    ip -o -4 addr show 2>/dev/null | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}' || true
}

# GLOO_SOCKET_IFNAME: megatron's Gloo groups and vLLM's Gloo world group connect every rank to
# every other; without it Gloo binds to the address the host name resolves to, which on many
# clusters is a loopback (Debian's 127.0.1.1 line in /etc/hosts) or management address: the
# first collective then hangs until the timeout. Chosen in this order: GLOO_SOCKET_IFNAME as set;
# NCCL_SOCKET_IFNAME (an interface name: the fabric NCCL is told to use); else the interface
# that holds MASTER_ADDR's address on this, the first node (the address every rank already
# reaches for the rendezvous). Refused, before any rank starts, when that address is a loopback
# one while a node of the job is elsewhere, or when no interface holds it in a multi-node job:
# set one of the two variables then (`ip -o -4 addr` lists the interfaces, e.g. ib0 for IPoIB).
# Nodes that all resolve to loopback addresses are one machine (a single node, or the local
# test cluster of tests/slurm): Gloo's own choice works there.
quatro_export_gloo_interface() {
    if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then
        return 0
    fi
    if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
        export GLOO_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME
        return 0
    fi
    local address interface="" node remote=""
    address=$(quatro_ipv4 "${MASTER_ADDR:-}")
    if [ -n "$address" ]; then
        interface=$(quatro_interface_of "$address")
    fi
    if [[ $address == 127.* ]]; then
        for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
            [[ $(quatro_ipv4 "$(quatro_node_addr "$node")") == 127.* ]] || remote=$node
        done
    fi
    local fix="set NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME to the interface of the cluster network"
    fix+=" (ip -o -4 addr lists them), e.g. export NCCL_SOCKET_IFNAME=ib0 in the template"
    if [ -n "$remote" ]; then
        quatro_die "Gloo would bind to $MASTER_ADDR's loopback address $address, which node $remote cannot reach: $fix"
    fi
    if [ -z "$interface" ] && [[ $address != 127.* ]] && [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
        quatro_die "no interface of this node holds $MASTER_ADDR's address (${address:-unresolved}): $fix"
    fi
    if [ -n "$interface" ]; then
        export GLOO_SOCKET_IFNAME=$interface
    fi
}

# Sets QUATRO_SRUN_ARGS: srun's flags for the ranks (labelled output, no kill on the first exit,
# QUATRO_RANK_EXIT_WAIT_S for the others, block distribution: consecutive ranks on one node, which
# megatron's tensor-parallel groups and vLLM's engines assume; and the job's --cpus-per-task, which
# srun of SLURM 22.05-23.02 does not inherit from sbatch).
quatro_srun_args() {
    QUATRO_SRUN_ARGS=(--label --kill-on-bad-exit=0 "--wait=${QUATRO_RANK_EXIT_WAIT_S:-600}" --distribution=block)
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        QUATRO_SRUN_ARGS+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
    fi
}

# Sets QUATRO_CONTAINER_ARGS (srun flags) for pyxis/enroot, or leaves it empty.
quatro_container_args() {
    QUATRO_CONTAINER_ARGS=()
    [ -n "${QUATRO_CONTAINER_IMAGE:-}" ] || return 0
    srun --help 2>&1 | grep -q -- '--container-image' \
        || quatro_die "QUATRO_CONTAINER_IMAGE is set but this srun has no pyxis (--container-image); unset it to run in the plain environment"
    local mounts="$QUATRO_ROOT:$QUATRO_ROOT"
    if [[ $QUATRO_RUN_DIR != "$QUATRO_ROOT"/* ]]; then
        mounts+=",$(dirname "$QUATRO_RUN_DIR"):$(dirname "$QUATRO_RUN_DIR")"
    fi
    mounts+=${QUATRO_CONTAINER_MOUNTS:+,$QUATRO_CONTAINER_MOUNTS}
    QUATRO_CONTAINER_ARGS=(
        "--container-image=$QUATRO_CONTAINER_IMAGE"
        "--container-mounts=$mounts"
        "--container-workdir=$PWD"
        "--no-container-mount-home"
    )
    export QUATRO_PYTHON=${QUATRO_CONTAINER_PYTHON:-python3}
}

# quatro_runs_dir: where run directories go by default (QUATRO_RUNS_DIR, else scratch, else the checkout).
quatro_runs_dir() {
    if [ -n "${QUATRO_RUNS_DIR:-}" ]; then
        echo "$QUATRO_RUNS_DIR"
    elif [ -n "${SCRATCH:-}" ]; then
        echo "$SCRATCH/quatro-nemo/runs"
    else
        echo "$QUATRO_ROOT/runs"
    fi
}

quatro_default_run_dir() {
    if [ -n "${QUATRO_SWEEP_DIR:-}" ]; then
        echo "$QUATRO_SWEEP_DIR/task-$SLURM_ARRAY_TASK_ID"
    elif [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
        echo "$(quatro_runs_dir)/$SLURM_JOB_NAME-${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
    else
        echo "$(quatro_runs_dir)/$SLURM_JOB_NAME-$SLURM_JOB_ID"
    fi
}

quatro_record() {  # quatro_record KEY VALUE ...: one line in <run dir>/slurm_launches.jsonl
    quatro_json_line job_id "$SLURM_JOB_ID" restart_count "${SLURM_RESTART_COUNT:-0}" \
        time "$(date -u +%FT%TZ)" "$@" >> "$QUATRO_RUN_DIR/slurm_launches.jsonl"
}

# quatro_run_recipe RECIPE RUN_DIR_KEY [DEFAULT ...] -- [USER_ARG ...]: see the top of this file.
# RUN_DIR_KEY is the key naming the output directory (both recipes take key=value overrides):
# run.dir (train) or out (evaluate).
quatro_run_recipe() {
    local recipe=$1 run_dir_key=$2 arg
    shift 2
    local -a defaults=() user=() overrides=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
        defaults+=("$1")
        shift
    done
    [ $# -gt 0 ] && shift
    user=("$@")
    [ -n "${SLURM_JOB_ID:-}" ] || quatro_die "not inside a SLURM job: submit with sbatch"

    if [ -n "${QUATRO_SWEEP_FILE:-}" ]; then
        [ -n "${SLURM_ARRAY_TASK_ID:-}" ] || quatro_die "QUATRO_SWEEP_FILE is set but this is not an array task"
        local -a sets=() sweep_set=()
        mapfile -t sets < <(quatro_sweep_sets "$QUATRO_SWEEP_FILE")
        [ "$SLURM_ARRAY_TASK_ID" -lt "${#sets[@]}" ] \
            || quatro_die "array task $SLURM_ARRAY_TASK_ID but $QUATRO_SWEEP_FILE has ${#sets[@]} override sets"
        read -r -a sweep_set <<< "${sets[$SLURM_ARRAY_TASK_ID]}"
        user+=("${sweep_set[@]}")
    fi
    for arg in "${defaults[@]}"; do
        quatro_sets_key "$(quatro_override_key "$arg")" "${user[@]}" || overrides+=("$arg")
    done
    overrides+=("${user[@]}")

    QUATRO_RUN_DIR=$(quatro_last_value "$run_dir_key" "${overrides[@]}")
    if [ -z "$QUATRO_RUN_DIR" ]; then
        QUATRO_RUN_DIR=$(quatro_default_run_dir)
        overrides+=("$run_dir_key=$QUATRO_RUN_DIR")
    fi
    mkdir -p "$QUATRO_RUN_DIR"
    QUATRO_RUN_DIR=$(cd "$QUATRO_RUN_DIR" && pwd)

    local restarts=${SLURM_RESTART_COUNT:-0} max_restarts=${QUATRO_MAX_RESTARTS:-20}
    if [ "$restarts" -gt "$max_restarts" ]; then
        quatro_record event refused reason "restart $restarts > QUATRO_MAX_RESTARTS=$max_restarts"
        quatro_log "job was requeued $restarts times (> QUATRO_MAX_RESTARTS=$max_restarts): giving up"
        exit 1
    fi

    export QUATRO_RANK_LOG=$QUATRO_RUN_DIR/slurm_ranks.jsonl
    quatro_export_usr1_lead
    quatro_export_rendezvous
    quatro_export_comm_defaults
    quatro_container_args
    quatro_srun_args
    quatro_log "job $SLURM_JOB_ID (restart $restarts): $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"
    quatro_log "run dir $QUATRO_RUN_DIR; Gloo interface ${GLOO_SOCKET_IFNAME:-(chosen by Gloo)}"
    quatro_log "$recipe ${overrides[*]}"
    quatro_record event start nodes "$SLURM_JOB_NODELIST" ntasks "$SLURM_NTASKS" \
        master_addr "$MASTER_ADDR" master_port "$MASTER_PORT" recipe "$recipe" \
        overrides "${overrides[*]}"

    QUATRO_GOT_USR1=0
    QUATRO_GOT_TERM=0
    trap 'QUATRO_GOT_USR1=1; quatro_log "USR1: ranks checkpoint and exit"; kill -USR1 "$QUATRO_SRUN_PID" 2>/dev/null || true' USR1
    trap 'QUATRO_GOT_TERM=1; quatro_log "TERM: job cancelled or preempted"' TERM
    srun "${QUATRO_SRUN_ARGS[@]}" "${QUATRO_CONTAINER_ARGS[@]}" \
        bash "$QUATRO_ROOT/slurm/lib/launch.sh" "$recipe" "${overrides[@]}" &
    QUATRO_SRUN_PID=$!
    # `wait` returns early when a trapped signal arrives: wait again until srun has ended,
    # then once more for its exit status (bash keeps it).
    while kill -0 "$QUATRO_SRUN_PID" 2>/dev/null; do
        wait "$QUATRO_SRUN_PID" || true
    done
    local rc=0
    wait "$QUATRO_SRUN_PID" || rc=$?
    trap - USR1 TERM

    if [ "$rc" = 0 ]; then
        quatro_record event end exit_code 0 action "done"
        quatro_log "finished"
        return 0
    fi
    if [ "$rc" = "$QUATRO_EXIT_REQUEUE" ] && [ "$QUATRO_GOT_TERM" = 0 ]; then
        if [ "$restarts" -ge "$max_restarts" ]; then
            quatro_record event end exit_code "$rc" action "gave up (QUATRO_MAX_RESTARTS=$max_restarts)"
            quatro_log "checkpointed, but the restart limit QUATRO_MAX_RESTARTS=$max_restarts is reached"
            exit 1
        fi
        quatro_record event end exit_code "$rc" action requeue usr1 "$QUATRO_GOT_USR1"
        quatro_log "checkpoint saved (exit $rc): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        # SLURM now ends this run of the job itself; finishing first would race with the requeue
        # (a late "batch script done" could be taken for the next run's end).
        sleep "${QUATRO_REQUEUE_WAIT_S:-300}"
        exit 0
    fi
    quatro_record event end exit_code "$rc" action failed
    quatro_log "ranks exited with code $rc: not requeued"
    exit "$rc"
}
