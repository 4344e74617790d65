# shellcheck shell=bash
# What every environment script shares (scripts/bootstrap.sh, setup_cluster_env.sh,
# setup_aligner_env.sh): find the interpreter, install a lock file with uv, skip all of it when
# nothing changed. Each environment installs exactly one lock of requirements/locks/ (refreshed
# by scripts/lock.sh; docs/development.md).

# find_python VERSION: $PYTHON if set, else pythonVERSION on PATH, else a pyenv build of it.
# Fails with what to install when there is none.
find_python() {
    local version=$1 candidate pyenv=${PYENV_ROOT:-$HOME/.pyenv}
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
        return
    fi
    # a pyenv shim on PATH for a version that pyenv has not selected exits non-zero: skipped
    for candidate in "python$version" "$pyenv"/versions/"$version".*/bin/"python$version"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import venv' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    {
        echo "no Python $version found (looked for a python$version on PATH that runs and has venv,"
        echo "and for $pyenv/versions/$version.*/bin/python$version)."
        echo "Install it, e.g. 'apt-get install python$version python$version-venv' or"
        echo "'pyenv install $version', or point PYTHON at a python$version."
    } >&2
    return 1
}

# fingerprint FILE...: one hash of the given files, for the stamp that skips an unchanged install.
fingerprint() {
    cat "$@" | sha256sum | cut -d' ' -f1
}

# install_lock VENV LOCK VERSION: make VENV with Python VERSION if missing, put uv in it from
# requirements/locks/uv.txt (pip, hash-checked), then install every pinned, hash-checked package
# of LOCK with uv. --no-deps: the lock is complete, and it may override a pin of a package
# (requirements/cluster-overrides.txt) that a dependency check would reinstate.
install_lock() {
    local venv=$1 lock=$2 version=$3 python
    shift 3
    if [ ! -x "$venv/bin/python" ]; then
        python=$(find_python "$version")
        "$python" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --require-hashes --no-deps -r requirements/locks/uv.txt
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" --require-hashes --no-deps -r "$lock" "$@"
}

# checkout_env VENV LOCK VERSION STAMP [uv arguments]: an environment that runs this checkout's
# quatro_nemo (a .pth file, nothing installed into the source tree), built from LOCK unless the
# stamp file VENV/STAMP says that LOCK, the scripts and any file among the uv arguments are
# unchanged since the last build (then < 1 s).
checkout_env() {
    local venv=$1 lock=$2 version=$3 stamp=$1/$4 want site argument
    local inputs=("$lock" requirements/locks/uv.txt scripts/lib/env.sh "scripts/$(basename "$0")")
    shift 4
    for argument in "$@"; do
        if [ -f "$argument" ]; then inputs+=("$argument"); fi
    done
    want=$(fingerprint "${inputs[@]}")
    if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    install_lock "$venv" "$lock" "$version" "$@"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pwd > "$site/quatro_nemo_checkout.pth"
    echo "$want" > "$stamp"
}
