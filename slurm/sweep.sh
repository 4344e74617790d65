#!/bin/bash
# Submit an ablation sweep as one SLURM job array: one array task per override set.
#
#   bash slurm/sweep.sh [--template=slurm/quatro_1p5b.sh] [--max-parallel=N] [--name=NAME] \
#       [sbatch options ...] SWEEP_FILE [key=value ...]
#
#   bash slurm/sweep.sh slurm/sweeps/delta_inner_lr.txt
#   bash slurm/sweep.sh --max-parallel=4 --time=12:00:00 slurm/sweeps/algorithm_seed.txt trainer.steps=200
#
# SWEEP_FILE holds one override set per line (whitespace-separated key=value; blank lines and
# lines starting with # are skipped). Overrides after SWEEP_FILE apply to every task; a task's
# own line wins over them. Each task runs the template (the same one you would sbatch by hand,
# with its resources, requeue and resume) in its own run directory
# <runs>/sweeps/<name>-<timestamp>/task-<i>; the sweep file is copied there at submission, so
# editing it afterwards does not change a running sweep. Options starting with -- other than the
# three above go to sbatch (use the --opt=value form). Prints the array job id.
set -euo pipefail

QUATRO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/lib/common.sh
source "$QUATRO_ROOT/slurm/lib/common.sh"

template=$QUATRO_ROOT/slurm/quatro_1p5b.sh
max_parallel=""
name=""
sbatch_options=()
while [ $# -gt 0 ] && [[ $1 == -* ]]; do
    case $1 in
        --template=*) template=${1#*=} ;;
        --max-parallel=*) max_parallel=${1#*=} ;;
        --name=*) name=${1#*=} ;;
        --*=*) sbatch_options+=("$1") ;;
        *) quatro_die "option '$1': use the --option=value form" ;;
    esac
    shift
done
[ $# -ge 1 ] || quatro_die "usage: slurm/sweep.sh [options] SWEEP_FILE [key=value ...]"
sweep_file=$1
shift
quatro_check_overrides "$@"
[ -f "$template" ] || quatro_die "template '$template' not found"
[[ -z $max_parallel || $max_parallel =~ ^[1-9][0-9]*$ ]] || quatro_die "--max-parallel must be a positive integer"

mapfile -t sets < <(quatro_sweep_sets "$sweep_file")
[ "${#sets[@]}" -gt 0 ] || quatro_die "sweep file '$sweep_file' has no override sets"
for set_line in "${sets[@]}"; do
    read -r -a set_overrides <<< "$set_line"
    quatro_check_overrides "${set_overrides[@]}"
    [ -z "$(quatro_last_value run.dir "${set_overrides[@]}")" ] \
        || quatro_die "sweep file '$sweep_file': run.dir is set per task by sweep.sh, remove it from: $set_line"
done

name=${name:-$(basename "$sweep_file" .txt)}
sweep_dir=$(quatro_runs_dir)/sweeps/$name-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$sweep_dir"
sweep_dir=$(cd "$sweep_dir" && pwd)
cp "$sweep_file" "$sweep_dir/sweep.txt"
for i in "${!sets[@]}"; do
    printf 'task-%s\t%s\n' "$i" "${sets[$i]}"
done > "$sweep_dir/tasks.tsv"

array="0-$((${#sets[@]} - 1))${max_parallel:+%$max_parallel}"
job_id=$(cd "$QUATRO_ROOT" && \
    QUATRO_ROOT=$QUATRO_ROOT QUATRO_SWEEP_FILE=$sweep_dir/sweep.txt QUATRO_SWEEP_DIR=$sweep_dir \
    sbatch --parsable --array="$array" "${sbatch_options[@]}" "$template" "$@")
echo "$job_id" > "$sweep_dir/array_job_id"
echo "submitted sweep $name: array job $job_id, ${#sets[@]} tasks, run dirs under $sweep_dir" >&2
echo "$job_id"
