#!/bin/bash
# Compute the pre-registered studies in the background, over as many working periods as they
# take (issue 40): study=design, then study=adaptive_lr, at the lowest CPU and I/O priority.
#
#   bash scripts/study_background.sh start    # detached (its own session: survives the shell); returns at once
#   bash scripts/study_background.sh status   # running / paused / stopped, runs done / total, CPU hours left
#   bash scripts/study_background.sh pause    # SIGSTOP to all of it, while a benchmark or a timing runs
#   bash scripts/study_background.sh resume   # SIGCONT
#   bash scripts/study_background.sh stop     # the running trainings checkpoint and exit 75; waits for them
#
# Each study is `recipes/study.py study=NAME publish=true` (nice 19, ionice idle): runs already
# kept in docs/study_results/NAME/metrics/ with their identity are done, on any machine; each run
# that finishes is kept in runs/study_NAME/metrics/ and copied to docs/study_results/NAME/metrics/
# (with the invocation records), to `git add` and commit. This script never commits. `stop` sends
# SIGTERM to the study, which stops its runs (they checkpoint at their next step and exit 75: the
# next `start` resumes them), records the invocation and exits 75; the next study is not started.
# A study that ends with failed runs (exit 1) is followed by the next; its failures run again at
# the next start. Progress: runs/study_NAME/progress.json (written by the study as runs end).
#
# Settings (environment): QUATRO_STUDIES (default "design adaptive_lr"), QUATRO_STUDY_STATE (this
# script's pid, log and state; default runs/study_background), QUATRO_STUDY_OUT (the studies'
# directories, <this>/study_NAME; default runs), QUATRO_STUDY_RESULTS (<this>/NAME; default
# docs/study_results), QUATRO_STUDY_ARGS (more recipes/study.py arguments), PYTHON (default .venv/bin/python).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
read -r -a STUDIES <<< "${QUATRO_STUDIES:-design adaptive_lr}"
STATE=${QUATRO_STUDY_STATE:-$ROOT/runs/study_background}
OUT=${QUATRO_STUDY_OUT:-$ROOT/runs}
RESULTS=${QUATRO_STUDY_RESULTS:-$ROOT/docs/study_results}
read -r -a EXTRA <<< "${QUATRO_STUDY_ARGS:-}"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
STOPPED_EXIT_CODE=75

die() { echo "study_background: $*" >&2; exit 2; }
say() { echo "[$(date -u +%Y-%m-%dT%H:%M:%SZ)] $*"; }
pid() { cat "$STATE/pid" 2>/dev/null; }
alive() { local p; p=$(pid) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
paused() { [ "$(ps -o stat= -p "$(pid)" 2>/dev/null | cut -c1)" = T ]; }
set_state() { echo "$1" > "$STATE/state"; }

chain() {   # the detached session: each study in turn
    echo $$ > "$STATE/pid"
    set_state running
    local child="" stopping="" code name
    trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
    for name in "${STUDIES[@]}"; do
        [ -z "$stopping" ] || break
        echo "$name" > "$STATE/current"
        say "study=$name: starting"
        (cd "$ROOT" && exec "$PYTHON" recipes/study.py "study=$name" publish=true "results=$RESULTS/$name" \
            "out=$OUT/study_$name" "${EXTRA[@]}") &
        child=$!
        code=0; wait "$child" || code=$?
        while kill -0 "$child" 2>/dev/null; do code=0; wait "$child" || code=$?; done   # a trapped signal ends wait early
        child=""
        say "study=$name: exit $code"
        if [ "$code" = "$STOPPED_EXIT_CODE" ] || [ -n "$stopping" ]; then
            set_state stopped
            say "stopped; kept metrics to commit: git status --short $RESULTS"
            exit "$STOPPED_EXIT_CODE"
        elif [ "$code" != 0 ] && [ "$code" != 1 ]; then
            set_state "failed (study=$name, exit $code)"
            exit "$code"
        fi
    done
    set_state finished
    say "every study finished; kept metrics to commit: git status --short $RESULTS"
}

start() {
    alive && { echo "already running (pid $(pid)); see: bash $0 status"; return 0; }
    mkdir -p "$STATE"
    rm -f "$STATE/pid"
    [ -x "$PYTHON" ] || die "no Python at $PYTHON (set PYTHON)"
    local priority=(nice -n 19)
    if command -v ionice > /dev/null; then priority+=(ionice -c 3); fi
    setsid "${priority[@]}" bash "$0" _chain >> "$STATE/log" 2>&1 < /dev/null &
    local waited=0
    until [ -s "$STATE/pid" ] || [ $waited -ge 100 ]; do sleep 0.1; waited=$((waited + 1)); done
    alive || die "did not start; see $STATE/log"
    echo "started (pid $(pid), session and process group of its own, nice 19, ionice idle): ${STUDIES[*]}"
    echo "log: $STATE/log; progress: bash $0 status"
}

status() {
    local state="not started"
    [ -f "$STATE/state" ] && state=$(cat "$STATE/state")
    if alive; then
        paused && state=paused
    elif [ "$state" = running ] || [ "$state" = paused ]; then
        state="not running (ended without a record; see $STATE/log)"
    fi
    echo "state: $state${STATE:+ (state directory $STATE)}"
    local name
    for name in "${STUDIES[@]}"; do
        local progress="$OUT/study_$name/progress.json"
        [ -f "$progress" ] || { echo "study=$name: no progress yet"; continue; }
        "$PYTHON" - "$progress" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
failed = f", failed this invocation: {sorted(p['runs_failed'])}" if p["runs_failed"] else ""
print(f"study={p['study']}: {p['runs_done']}/{p['runs_total']} runs done, {p['cpu_hours_left']} CPU hours left "
      f"(estimate: {p['cpu_hours_estimated_from']}'s timings, dedicated core); {p['state']} at {p['updated']}{failed}")
EOF
    done
    if command -v git > /dev/null && git -C "$ROOT" rev-parse > /dev/null 2>&1; then
        local new
        new=$(git -C "$ROOT" status --short -- "$RESULTS" 2>/dev/null | wc -l)
        echo "uncommitted files under $RESULTS: $new (git status --short $RESULTS; git add them and commit)"
    fi
}

signal_group() { kill "-$1" -- "-$(pid)"; }

case "${1:-}" in
    start) start ;;
    status) status ;;
    pause)
        alive || die "not running"
        signal_group STOP && set_state paused && echo "paused (pid $(pid)); resume with: bash $0 resume" ;;
    resume)
        alive || die "not running"
        signal_group CONT && set_state running && echo "resumed" ;;
    stop)
        alive || { echo "not running"; exit 0; }
        signal_group CONT          # a paused study must run to stop cleanly
        kill -TERM "$(pid)"
        echo "stopping: the running trainings checkpoint and exit 75 ..."
        while alive; do sleep 1; done
        status ;;
    _chain) chain ;;
    *) die "usage: bash scripts/study_background.sh start|status|pause|resume|stop" ;;
esac
