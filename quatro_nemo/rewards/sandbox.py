"""Run one untrusted Python program in a bubblewrap sandbox with kernel resource limits.

Isolation is done by the operating system, not by Python: every program runs as

    [drop to uid/gid 65534 when the caller is root]
    bwrap --unshare-all --unshare-user --seccomp FD --info-fd FD --block-fd FD ...   # bubblewrap
      /init -c '"$@"; exit $?'                    # PID 1: an execute-only copy of /bin/sh, in the run's cgroup
        prlimit --cpu --as --fsize --nproc ...    # util-linux: setrlimit(2) before exec
          python3 -I -B /code/program.py          # a system interpreter, isolated mode

- new user, PID, network, IPC, UTS and cgroup namespaces: no network (and no sockets at all),
  no view of other processes, no way back to the caller's uid;
- a fresh mount namespace holding only `/usr` (read-only, plus the linker cache and
  /etc/alternatives symlinks), `/proc` of the new PID namespace, a minimal `/dev`, the program
  files (read-only, `/code`) and one size-limited tmpfs that is both `/dev/shm` and the working
  directory (`/sandbox`); `/` and `/dev` themselves are remounted read-only, so every writable
  place has a size;
- one cgroup per run where the caller may create one (cgroup2 delegated, or v1 as root): a
  memory limit that counts kernel memory and tmpfs, a task limit, and the CPU time of every
  process that ran in it, polled during the run; the pages it was first to bring into the page
  cache are dropped with it (see CgroupParents, RunCgroup);
- a seccomp filter (quatro_nemo/rewards/seccomp_filter.py) denying ptrace, process_vm_*,
  the keyrings, SysV IPC, io_uring, and host state or page-cache probes (issue 28);
- stdout and stderr are pipes the caller reads while it waits (never host files), bounded by
  max_output_bytes;
- PID 1 is a shell the sandbox can execute but not read, which makes the kernel mark it
  non-dumpable: the program (same uid) cannot ptrace it, open /proc/1/mem or /proc/1/fd;
- rlimits on the program: CPU seconds (SIGXCPU, then SIGKILL), address space, size of any file it
  writes, processes, open files, no core;
- teardown: when the program exits, PID 1 exits and the kernel kills every process left in the
  PID namespace; on the wall-clock timeout the caller SIGKILLs the sandbox's PID 1 itself
  (host PID from bwrap's --info-fd, through a pidfd), then waits for bwrap, which returns only
  once the namespace is empty. It does not rely on the parent-death signal.

See docs/sandbox.md for what this does and does not protect against and how it was measured.
bubblewrap: https://github.com/containers/bubblewrap (the sandbox of Flatpak).
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from quatro_nemo.rewards.seccomp_filter import build_filter
from quatro_nemo.validation import Choice, ConfigError, check_choice

_log = logging.getLogger(__name__)
NOBODY_UID = 65534  # `nobody` on Debian/Ubuntu/RHEL; the overflow uid of user namespaces
_LIBRARY_LOOKUP_PATHS = ("/etc/ld.so.cache", "/etc/alternatives")

# PID 1 of the sandbox (bwrap --as-pid-1) is a POSIX shell that runs the rlimited program as its
# child. As the namespace's init it cannot be signalled from inside (the kernel drops signals to
# an init without handlers), and when it exits the kernel SIGKILLs every process left in the
# namespace. The trailing `exit` keeps the shell from exec-ing the program in its place (which
# would make the program PID 1 and immune to SIGXCPU). "$@" is the command; nothing is
# interpolated. The shell binary is an execute-only copy (mode 0111): exec of a file the process
# may not read makes the kernel mark it non-dumpable (fs/exec.c would_dump), so the program,
# though it has the same uid, can neither ptrace PID 1 nor open its /proc/1/{mem,fd,environ}.
_PID1_SHELL = '"$@"; exit $?'
PID1_PATH = "/init"

# Status of one execution, from the caller's point of view.
STATUS_OK = "ok"                          # exited with code 0
STATUS_ERROR = "error"                    # non-zero exit code (exception, assertion, sys.exit(n))
STATUS_TIMEOUT = "timeout"                # wall-clock limit: we killed the sandbox
STATUS_CPU_LIMIT = "cpu_limit"            # killed by RLIMIT_CPU (SIGXCPU, or SIGKILL at the hard limit)
STATUS_OUTPUT_LIMIT = "output_limit"      # tried to write more than max_output_bytes to stdout/stderr
STATUS_SIGNALED = "signaled"              # killed by another signal
STATUS_MEMORY_LIMIT = "memory_limit"      # the run's cgroup hit memory.max: the kernel's OOM killer struck


class CgroupMode(Choice):
    """``SandboxConfig.cgroups``: whether each run gets its own cgroup (module doc)."""

    auto = "auto"            # where the caller may create one; else rlimits only (said once)
    required = "required"    # refuse to start without one
    off = "off"              # never try: rlimits only


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed execution. Validated at construction (ConfigError names the key)."""

    wall_timeout_s: float = 10.0          # wall clock, then SIGKILL of the sandbox's PID 1
    cpu_time_s: int = 10                  # RLIMIT_CPU soft limit (hard = soft + 1)
    memory_bytes: int = 1 << 30           # RLIMIT_AS (virtual address space) per process
    max_output_bytes: int = 4 << 20       # stdout, stderr and any file it writes (RLIMIT_FSIZE)
    max_processes: int = 32               # RLIMIT_NPROC, counted per sandbox (own user namespace)
    max_open_files: int = 64              # RLIMIT_NOFILE
    scratch_bytes: int = 64 << 20         # size of the tmpfs working directory /sandbox
    cgroups: CgroupMode = CgroupMode.auto  # per-run cgroups: auto | required | off (CgroupMode)
    python_executable: str = "/usr/bin/python3"   # must lie under one of readonly_paths
    bwrap_executable: str = "bwrap"
    prlimit_executable: str = "prlimit"
    shell_executable: str = "/bin/sh"     # copied execute-only to be the sandbox's PID 1
    readonly_paths: tuple = ("/usr",)     # host directories visible read-only inside
    sandbox_uid: int = NOBODY_UID         # uid/gid the sandbox runs as when the caller is root

    def __post_init__(self) -> None:
        for key in ("wall_timeout_s", "cpu_time_s", "memory_bytes", "max_output_bytes",
                    "max_processes", "max_open_files", "scratch_bytes"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"SandboxConfig.{key} must be > 0, got {getattr(self, key)!r}")
        # a run config reaches this field as task.verifier_options.cgroups (task.verifier=code: the
        # options go to CodeVerifier, whose extra keywords override SandboxConfig's fields)
        object.__setattr__(self, "cgroups", check_choice(
            "SandboxConfig.cgroups (task.verifier_options.cgroups in a run config)", self.cgroups, CgroupMode))
        if self.sandbox_uid <= 0:
            raise ConfigError(f"SandboxConfig.sandbox_uid must be an unprivileged uid, got {self.sandbox_uid}")
        object.__setattr__(self, "readonly_paths", tuple(self.readonly_paths))
        for path in self.readonly_paths:
            if not os.path.isabs(path) or not os.path.isdir(path):
                raise ConfigError(f"SandboxConfig.readonly_paths: {path!r} is not an existing absolute directory")
        for key in ("python_executable", "shell_executable"):
            path = os.path.realpath(getattr(self, key))
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise ConfigError(f"SandboxConfig.{key}: {getattr(self, key)!r} is not an executable file")
        python = os.path.realpath(self.python_executable)
        if not any(python.startswith(os.path.realpath(p) + os.sep) for p in self.readonly_paths):
            raise ConfigError(f"SandboxConfig.python_executable: {python!r} is not under readonly_paths "
                              f"{self.readonly_paths}, so it would not exist inside the sandbox")


@dataclasses.dataclass
class ExecutionResult:
    status: str                    # one of the STATUS_* constants
    exit_code: Optional[int]       # the program's exit code, or None when killed by a signal
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float = 0.0             # user + system CPU of everything that ran in the sandbox

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    memory_peak_bytes: Optional[int] = None   # the run's cgroup's peak charge (None without cgroups)


# -- per-run cgroups -------------------------------------------------------------------------------
_CGROUP_V1_CONTROLLERS = ("memory", "pids", "cpuacct")
_run_numbers = itertools.count(1)         # next() is atomic under the GIL: safe from many threads
_cgroup_notice_given = False


def _mounted_cgroups() -> Dict[str, str]:
    """Mount point per cgroup controller ("unified" for cgroup2), from /proc/self/mountinfo
    (mounts whose root is the hierarchy's root only)."""
    mounts: Dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            root, mount_point, fs_type = fields[3], fields[4], fields[separator + 1]
            if root != "/":
                continue
            if fs_type == "cgroup2":
                mounts.setdefault("unified", mount_point)
            elif fs_type == "cgroup":
                for option in fields[separator + 3].split(","):
                    mounts.setdefault(option, mount_point)
    return mounts


def _own_cgroups() -> Dict[str, str]:
    """This process's cgroup path per v1 controller, and under "unified" its cgroup2 path."""
    paths: Dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in (controllers.split(",") if controllers else ["unified"]):
                paths[controller] = path
    return paths


def _write(path: str, value: Any) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(text: str, key: str) -> int:
    """The value of `key` in a "key value" per line cgroup file (memory.events, cpu.stat)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class CgroupParents:
    """Where this process may create one cgroup per sandboxed run: under its own cgroup, in
    cgroup2 when the memory and pids controllers are delegated there, else in the v1 memory,
    pids and cpuacct hierarchies when it can create directories in them (root). ``find``
    returns None and the reason when neither works."""

    def __init__(self, version: int, parents: Dict[str, str]):
        self.version, self.parents = version, parents     # controller (or "unified") -> directory

    @classmethod
    def find(cls) -> Tuple[Optional["CgroupParents"], str]:
        try:
            mounts, own = _mounted_cgroups(), _own_cgroups()
        except OSError as err:
            return None, f"cannot read /proc/self/cgroup or mountinfo ({err})"
        reasons = []
        if "unified" in mounts and "unified" in own:
            parent = mounts["unified"] + own["unified"].rstrip("/")
            try:
                delegated = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
            except OSError:
                delegated = set()
            if {"memory", "pids"} <= delegated and cls._can_create({"unified": parent}):
                return cls(2, {"unified": parent}), ""
            reasons.append(f"cgroup2 {parent}: memory and pids not delegated ({sorted(delegated)})")
        if all(c in mounts and c in own for c in _CGROUP_V1_CONTROLLERS):
            parents = {c: mounts[c] + own[c].rstrip("/") for c in _CGROUP_V1_CONTROLLERS}
            if cls._can_create(parents):
                return cls(1, parents), ""
            reasons.append(f"cgroup v1 {sorted(parents.values())}: cannot create cgroups (not root?)")
        else:
            reasons.append("no cgroup v1 memory, pids and cpuacct hierarchies")
        return None, "; ".join(reasons)

    def remove_stale(self) -> None:
        """Remove the empty run cgroups that processes which no longer exist left behind."""
        for directory in self.parents.values():
            for name in os.listdir(directory):
                parts = name.split("-")
                if name.startswith("quatro-sandbox-") and len(parts) == 4 and parts[2].isdigit() \
                        and not os.path.exists(f"/proc/{parts[2]}"):
                    try:
                        os.rmdir(os.path.join(directory, name))
                    except OSError:
                        pass

    @staticmethod
    def _can_create(parents: Dict[str, str]) -> bool:
        probe = f"quatro-sandbox-probe-{os.getpid()}"
        try:
            for directory in parents.values():
                os.mkdir(os.path.join(directory, probe))
                os.rmdir(os.path.join(directory, probe))
            return True
        except OSError:
            return False

    def create(self, memory_bytes: int, max_tasks: int) -> "RunCgroup":
        name = f"quatro-sandbox-{os.getpid()}-{next(_run_numbers)}"       # unique in this process
        return RunCgroup(self.version, {c: os.path.join(d, name) for c, d in self.parents.items()},
                         memory_bytes, max_tasks)


class RunCgroup:
    """One run's cgroup: memory.max (everything the kernel charges to it: process memory,
    tmpfs pages and inodes, kernel objects such as xattrs and socket buffers, memfds; no swap),
    pids.max, and the CPU time of every process that ever ran in it (cpu.stat / cpuacct.usage),
    which includes processes killed or already exited."""

    def __init__(self, version: int, directories: Dict[str, str], memory_bytes: int, max_tasks: int):
        self.version, self.directories = version, directories
        for directory in directories.values():
            os.mkdir(directory)
        try:
            if version == 2:
                self._set("unified", "memory.max", memory_bytes)
                self._set("unified", "memory.swap.max", 0, optional=True)
                self._set("unified", "pids.max", max_tasks)
            else:
                self._set("memory", "memory.limit_in_bytes", memory_bytes)
                self._set("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                self._set("pids", "pids.max", max_tasks)
        except OSError:
            _releaser.release(self, evict=False)
            raise

    def _path(self, controller: str, name: str) -> str:
        return os.path.join(self.directories["unified" if self.version == 2 else controller], name)

    def _set(self, controller: str, name: str, value: int, optional: bool = False) -> None:
        path = self._path(controller, name)
        if optional and not os.path.exists(path):
            return
        _write(path, value)

    def add(self, pid: int) -> None:
        for directory in self.directories.values():
            _write(os.path.join(directory, "cgroup.procs"), pid)

    def cpu_seconds(self) -> float:
        if self.version == 2:
            return _keyed(_read(self._path("cpu", "cpu.stat")), "usage_usec") / 1e6
        return int(_read(self._path("cpuacct", "cpuacct.usage"))) / 1e9

    def oom_killed(self) -> bool:
        if self.version == 2:
            return _keyed(_read(self._path("memory", "memory.events")), "oom_kill") > 0
        return _keyed(_read(self._path("memory", "memory.oom_control")), "oom_kill") > 0

    def memory_peak(self) -> Optional[int]:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(self._path("memory", name)))
        except (OSError, ValueError):
            return None

    def release(self, evict: bool) -> bool:
        """Once no task is left: drop the pages charged to the run when `evict` (v1
        memory.force_empty, v2 memory.reclaim; the page-cache pages of host files it was the
        first to read leave the cache with it, so a later run cannot tell by their residency
        what this one read), then remove the directories. False while tasks remain (the kernel
        releases killed tasks a little after their namespace is gone): try again later."""
        try:
            if any(_read(os.path.join(d, "cgroup.procs")).strip() for d in self.directories.values() if os.path.isdir(d)):
                return False
            if evict:
                if self.version == 2:
                    _write(self._path("memory", "memory.reclaim"), 1 << 40)
                else:
                    _write(self._path("memory", "memory.force_empty"), 0)
        except OSError:
            pass                      # best effort: a page that cannot be dropped stays
        for directory in self.directories.values():
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno == errno.EBUSY:
                    return False
                _log.warning("sandbox: cannot remove cgroup %s: %s", directory, err)
        return True


class _CgroupReleaser:
    """Releases run cgroups: at once when their tasks are gone, else at later runs' ends (and at
    exit), so that no run waits for the kernel to finish killing another's processes."""

    def __init__(self):
        self._pending: List[Tuple[RunCgroup, bool]] = []
        self._lock = threading.Lock()
        atexit.register(self.release_pending, _CGROUP_EXIT_WAIT_S)

    def release(self, cgroup: RunCgroup, evict: bool) -> None:
        with self._lock:
            self._pending.append((cgroup, evict))
        self.release_pending()

    def release_pending(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            left = [(cgroup, evict) for cgroup, evict in pending if not cgroup.release(evict)]
            with self._lock:
                self._pending.extend(left)
            if not left or time.monotonic() >= deadline:
                return
            time.sleep(0.05)


_CGROUP_EXIT_WAIT_S = 5.0
_releaser = _CgroupReleaser()


def _find_cgroups(mode: CgroupMode) -> Optional[CgroupParents]:
    """The cgroup parents for `mode` (SandboxConfig.cgroups); says once per process when runs
    fall back to rlimits alone."""
    global _cgroup_notice_given
    if mode is CgroupMode.off:
        return None
    parents, reason = CgroupParents.find()
    if parents is not None:
        parents.remove_stale()
    if parents is None:
        if mode is CgroupMode.required:
            raise RuntimeError(f"SandboxConfig.cgroups='required' but no cgroup can be created: {reason}")
        if not _cgroup_notice_given:
            _cgroup_notice_given = True
            _log.warning("sandbox: no per-run cgroups (%s); runs are bounded by rlimits only: kernel memory "
                         "(tmpfs inodes, socket buffers), and CPU time of killed or short-lived processes, "
                         "are not counted (docs/sandbox.md)", reason)
    return parents


def _resolve_tool(name: str, key: str) -> str:
    path = shutil.which(name)
    if path is None:
        hint = " (Debian/Ubuntu: apt-get install bubblewrap)" if "bwrap" in name else ""
        raise RuntimeError(f"SandboxConfig.{key}: {name!r} not found on PATH{hint}; see docs/sandbox.md")
    return os.path.realpath(path)


def _execute_only_copy(executable: str) -> str:
    """A private copy of `executable` with mode 0111 in a directory of mode 0711 (see _PID1_SHELL)."""
    directory = tempfile.mkdtemp(prefix="quatro_sandbox_init_")
    os.chmod(directory, 0o711)
    path = os.path.join(directory, "init")
    shutil.copyfile(os.path.realpath(executable), path)
    os.chmod(path, 0o111)
    return path


class Sandbox:
    """Runs Python programs under bubblewrap + rlimits. Thread-safe: one instance serves a pool.

    Construction checks that the tools exist and runs one trivial program, so a host where
    unprivileged user namespaces are disabled fails at start-up with bubblewrap's own message.
    """

    def __init__(self, config: Optional[SandboxConfig] = None, self_check: bool = True):
        self.config = config or SandboxConfig()
        self._bwrap = _resolve_tool(self.config.bwrap_executable, "bwrap_executable")
        self._prlimit = _resolve_tool(self.config.prlimit_executable, "prlimit_executable")
        if not any(self._prlimit.startswith(os.path.realpath(p) + os.sep) for p in self.config.readonly_paths):
            raise ValueError(f"SandboxConfig.prlimit_executable: {self._prlimit!r} is not under readonly_paths")
        self._drop_to_uid = self.config.sandbox_uid if os.geteuid() == 0 else None
        self._seccomp_filter = build_filter()
        self.cgroups = _find_cgroups(self.config.cgroups)     # None: rlimits only
        self._init_path = _execute_only_copy(self.config.shell_executable)
        weakref.finalize(self, shutil.rmtree, os.path.dirname(self._init_path), True)
        # The self-check is also the warm-up: what it reads stays in the page cache (the other
        # runs' first reads are evicted after them, see RunCgroup.evict).
        self._evict_after_runs = False
        if self_check:
            result = self.run(_WARM_UP, timeout_s=max(self.config.wall_timeout_s, _WARM_UP_S),
                              cpu_time_s=max(self.config.cpu_time_s, _WARM_UP_S))
            if result.status != STATUS_OK or result.stdout.strip() != "sandbox ok":
                raise RuntimeError(f"the sandbox does not work on this host ({result.status}, exit "
                                   f"{result.exit_code}): {result.stderr.strip()[-2000:]}; see docs/sandbox.md")
        self._evict_after_runs = True

    # -- command line -------------------------------------------------------------------------
    def _bwrap_args(self, code_dir: str, seccomp_fd: int, info_fd: int, block_fd: int) -> List[str]:
        cfg = self.config
        uid = str(cfg.sandbox_uid)
        args = [self._bwrap,
                "--unshare-all", "--unshare-user",      # user, pid, net, ipc, uts, cgroup namespaces
                "--disable-userns",                      # no nested user namespaces inside
                "--as-pid-1",                            # our shell is init (see _PID1_SHELL)
                "--die-with-parent",                     # a further layer; teardown does not need it
                "--new-session",                         # setsid: no TIOCSTI into a terminal
                "--cap-drop", "ALL",
                "--uid", uid, "--gid", uid,
                "--seccomp", str(seccomp_fd),            # seccomp_filter.py, on PID 1 and below
                "--info-fd", str(info_fd),               # {"child-pid": host PID of PID 1}
                "--block-fd", str(block_fd),             # PID 1 waits here until it is in its cgroup
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
                "--setenv", "TMPDIR", "/sandbox",
                "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8"]
        for path in cfg.readonly_paths:
            args += ["--ro-bind", path, path]
        # Shared-library lookup: the linker cache and the alternatives symlinks (Debian points
        # e.g. libblas.so.3, needed by numpy, through /etc/alternatives). No other /etc file.
        for path in _LIBRARY_LOOKUP_PATHS:
            args += ["--ro-bind-try", path, path]
        # Merged-/usr systems have /bin, /lib, ... as symlinks into /usr: recreate them; older
        # layouts have them as directories of system binaries and libraries: bind read-only.
        for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        # Every writable mount has a size; the tmpfs bwrap builds the root in, and the one of
        # --dev, are remounted read-only once populated.
        # One tmpfs is both /dev/shm (POSIX shared memory, semaphores) and, through a link, the
        # working directory /sandbox: one size for both (--dev makes /dev/shm a directory).
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(cfg.scratch_bytes), "--tmpfs", "/dev/shm", "--symlink", "/dev/shm", "/sandbox",
                 "--ro-bind", code_dir, "/code",
                 "--ro-bind", self._init_path, PID1_PATH,
                 "--remount-ro", "/dev", "--remount-ro", "/",
                 "--chdir", "/sandbox", "--"]
        return args

    def _limit_args(self, cpu_time_s: float) -> List[str]:
        cfg = self.config
        cpu_rlimit = max(1, math.ceil(cpu_time_s))
        return [self._prlimit,
                f"--cpu={cpu_rlimit}:{cpu_rlimit + 1}",
                f"--as={cfg.memory_bytes}",
                f"--fsize={cfg.max_output_bytes + 1}",    # one byte more: an attempt is visible
                f"--nproc={cfg.max_processes}",
                f"--nofile={cfg.max_open_files}",
                "--core=0", "--"]

    # -- execution ----------------------------------------------------------------------------
    def run(self, program: str, stdin: str = "", files: Optional[Dict[str, str]] = None,
            argv: Optional[List[str]] = None, timeout_s: Optional[float] = None,
            cpu_time_s: Optional[float] = None) -> ExecutionResult:
        """Run `program` (Python source) with `stdin`; `files` (name -> text) sit next to it in /code.

        The program's working directory is an empty tmpfs, discarded afterwards. Returns its exit
        status and its stdout/stderr (each at most `max_output_bytes`, decoded leniently). When
        this returns, no process of the program is alive. `timeout_s` and `cpu_time_s` override
        the configured limits for this run (e.g. scaled by the number of test cases it holds).
        """
        cfg = self.config
        timeout_s = cfg.wall_timeout_s if timeout_s is None else timeout_s
        cpu_time_s = cfg.cpu_time_s if cpu_time_s is None else cpu_time_s
        host_dir = tempfile.mkdtemp(prefix="quatro_sandbox_")
        try:
            code_dir = os.path.join(host_dir, "code")
            os.mkdir(code_dir)
            os.chmod(host_dir, 0o711)                      # the sandbox uid must reach /code
            os.chmod(code_dir, 0o755)
            for name, text in {"program.py": program, **(files or {})}.items():
                if os.sep in name or name.startswith("."):
                    raise ValueError(f"sandbox file name {name!r} must be a plain file name")
                path = os.path.join(code_dir, name)
                with open(path, "wb") as f:
                    f.write(_utf8(text))
                os.chmod(path, 0o644)
            stdin_path = os.path.join(host_dir, "stdin")
            with open(stdin_path, "wb") as f:
                f.write(_utf8(stdin))
            with open(stdin_path, "rb") as fin:
                run = self._execute(code_dir, fin, argv or [], timeout_s, cpu_time_s)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
        status = classify(run.returncode, run.timed_out, run.output_exceeded, run.cpu_s, cpu_time_s,
                          run.oom_killed)
        return ExecutionResult(status=status, exit_code=_exit_code(run.returncode),
                               stdout=bytes(run.outputs[0]).decode("utf-8", errors="replace"),
                               stderr=bytes(run.outputs[1]).decode("utf-8", errors="replace"),
                               wall_s=run.wall_s, cpu_s=run.cpu_s, memory_peak_bytes=run.memory_peak_bytes)

    def _execute(self, code_dir, fin, argv, timeout_s, cpu_time_s) -> "_Run":
        """Start bwrap (its child, the sandbox's PID 1, waits on --block-fd until it is in the
        run's cgroup), then watch it: collect stdout and stderr from pipes (never on the host's
        disk; past max_output_bytes the sandbox is killed), poll the cgroup's CPU time, and kill
        the sandbox's PID 1 at the wall-clock deadline, over the CPU limit or the output limit."""
        cfg = self.config
        seccomp_read, seccomp_write = os.pipe()
        info_read, info_write = os.pipe()
        block_read, block_write = os.pipe()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        run = _Run()
        _releaser.release_pending()                       # earlier runs' cgroups whose tasks are gone now
        cgroup = (self.cgroups.create(cfg.memory_bytes + cfg.scratch_bytes, cfg.max_processes + 1)
                  if self.cgroups is not None else None)
        parent_fds = [seccomp_read, info_read, block_read, block_write, out_read, err_read]
        child_fds = [info_write, out_write, err_write]
        pid1 = proc = None
        try:
            os.write(seccomp_write, self._seccomp_filter)  # < 2 KiB: fits the pipe buffer
            os.close(seccomp_write)
            command = (self._bwrap_args(code_dir, seccomp_read, info_write, block_read)
                       + [PID1_PATH, "-c", _PID1_SHELL, "sh"] + self._limit_args(cpu_time_s)
                       + [self.config.python_executable, "-I", "-B", "/code/program.py"] + list(argv))
            start = time.monotonic()
            # user/group/extra_groups are applied by _posixsubprocess in C between fork and
            # exec (no preexec_fn, so this is safe from many threads at once).
            proc = subprocess.Popen(command, stdin=fin, stdout=out_write, stderr=err_write, close_fds=True,
                                    pass_fds=(seccomp_read, info_write, block_read), start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin"}, user=self._drop_to_uid,
                                    group=self._drop_to_uid,
                                    extra_groups=[] if self._drop_to_uid is not None else None)
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            deadline = start + timeout_s
            pid1 = _open_sandbox_pid1(info_read, proc.pid, deadline)
            if pid1 is not None and cgroup is not None:
                cgroup.add(_pid_of(pid1))
            if pid1 is not None or cgroup is None:         # else it stays blocked until killed
                os.write(block_write, b"x")                 # PID 1 may exec the program now
            run.timed_out, run.output_exceeded, run.cpu_exceeded = self._watch(
                proc.pid, pid1, (out_read, err_read), run.outputs, deadline, cpu_time_s, cgroup)
            # Reap bwrap ourselves for its rusage (Popen.wait would discard it). bwrap exits after
            # reaping PID 1, whose exit waits until every process of the namespace is gone.
            _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = run.returncode = os.waitstatus_to_exitcode(wait_status)
            run.wall_s = time.monotonic() - start
            run.cpu_s = usage.ru_utime + usage.ru_stime
            _drain(out_read, run.outputs[0], cfg.max_output_bytes)
            _drain(err_read, run.outputs[1], cfg.max_output_bytes)
            run.output_exceeded |= max(map(len, run.outputs)) > cfg.max_output_bytes
            if cgroup is not None:
                run.cpu_s = max(run.cpu_s, cgroup.cpu_seconds())
                run.oom_killed = cgroup.oom_killed()
                run.memory_peak_bytes = cgroup.memory_peak()
        except BaseException:
            if proc is not None and proc.returncode is None:   # never release a PID 1 outside its cgroup
                _kill_sandbox(pid1, proc.pid)
                os.waitpid(proc.pid, 0)
            raise
        finally:
            for fd in parent_fds + child_fds + ([pid1] if pid1 is not None else []):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if cgroup is not None:
                _releaser.release(cgroup, evict=self._evict_after_runs)
        for buffer in run.outputs:
            del buffer[cfg.max_output_bytes:]
        return run

    def _watch(self, bwrap_pid, pid1, output_fds, outputs, deadline, cpu_time_s, cgroup):
        """Until bwrap exits: read the output pipes, and kill the sandbox at the deadline, when
        the cgroup's CPU time passes `cpu_time_s`, or when an output passes max_output_bytes.
        Returns (timed out, output exceeded, CPU exceeded)."""
        limit = self.config.max_output_bytes
        bwrap_pidfd = os.pidfd_open(bwrap_pid)
        poller = select.poll()                 # not select(): the trainer may hold fds >= FD_SETSIZE
        for fd in (bwrap_pidfd,) + tuple(output_fds):
            poller.register(fd, select.POLLIN)
        timed_out = output_exceeded = cpu_exceeded = False
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                wait_s = deadline - now if cgroup is None else min(deadline - now, _CPU_POLL_S)
                ready = {fd for fd, _ in poller.poll(wait_s * 1000)}
                for index, fd in enumerate(output_fds):
                    if fd in ready:
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            poller.unregister(fd)
                        outputs[index].extend(chunk)
                        output_exceeded |= len(outputs[index]) > limit
                if output_exceeded:
                    break
                if cgroup is not None and cgroup.cpu_seconds() > cpu_time_s:
                    cpu_exceeded = True
                    break
                if bwrap_pidfd in ready:
                    return False, False, False
        finally:
            os.close(bwrap_pidfd)
        _kill_sandbox(pid1, bwrap_pid)
        return timed_out, output_exceeded, cpu_exceeded


_WARM_UP_S = 60.0                 # wall and CPU limit of the warm-up (numpy's first import is slow)
_CPU_POLL_S = 0.05                # how often the cgroup's CPU time is read during a run
# The self-check: the interpreter and the modules the harness (judge, runner, plain data) and
# typical test programs import, so that their pages are cached outside any run's cgroup.
_WARM_UP = ("import bisect, collections, ctypes, decimal, fractions, functools, heapq, itertools, json, math, "
            "random, re, string, typing\ntry:\n    import numpy\nexcept ImportError:\n    pass\n"
            "print('sandbox ok')\n")


@dataclasses.dataclass
class _Run:
    returncode: int = 0
    timed_out: bool = False
    output_exceeded: bool = False
    cpu_exceeded: bool = False
    oom_killed: bool = False
    cpu_s: float = 0.0
    wall_s: float = 0.0
    memory_peak_bytes: Optional[int] = None
    outputs: Tuple[bytearray, bytearray] = dataclasses.field(default_factory=lambda: (bytearray(), bytearray()))


def _drain(fd: int, buffer: bytearray, limit: int) -> None:
    """Read what is left in an output pipe after the sandbox ended, up to `limit` + 1 bytes (every
    writer is gone, so this ends; O_NONBLOCK guards against a writer we do not know of)."""
    os.set_blocking(fd, False)
    try:
        while len(buffer) <= limit:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            buffer.extend(chunk)
    except BlockingIOError:
        return


def _pid_of(pidfd: int) -> int:
    """The PID a pidfd refers to (the Pid: line of /proc/self/fdinfo/<pidfd>)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise RuntimeError("pidfd without a Pid line")


def _open_sandbox_pid1(info_read: int, bwrap_pid: int, deadline: float) -> Optional[int]:
    """A pidfd of the sandbox's PID 1, from bwrap's --info-fd JSON; None if bwrap ended or the
    deadline passed before it wrote it (then the program has not started: bwrap lets its child
    run only after writing the info)."""
    data = b""
    while True:
        poller = select.poll()
        poller.register(info_read, select.POLLIN)
        ready = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        chunk = os.read(info_read, 4096) if ready else b""
        if not chunk:
            break
        data += chunk
    try:
        child_pid = int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None
    try:
        pidfd = os.pidfd_open(child_pid)
    except ProcessLookupError:
        return None
    # The pidfd pins one process; make sure it is bwrap's child and not a reused PID.
    try:
        with open(f"/proc/{child_pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        parent = None
    if parent != bwrap_pid:
        os.close(pidfd)
        return None
    return pidfd


def _kill_sandbox(pid1: Optional[int], bwrap_pid: int) -> None:
    """SIGKILL the sandbox's PID 1 (the kernel then kills the whole PID namespace); without one
    (bwrap still setting up), SIGKILL bwrap's process group."""
    if pid1 is not None:
        try:
            signal.pidfd_send_signal(pid1, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
    try:
        os.killpg(bwrap_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _utf8(text: str) -> bytes:
    """UTF-8 of `text`; a lone surrogate (valid in a str, e.g. from a model's response) is
    written as its three bytes (invalid UTF-8, which the program then meets) instead of raising
    UnicodeEncodeError in the trainer."""
    return text.encode("utf-8", "surrogatepass")


def _exit_code(returncode: int) -> Optional[int]:
    """bwrap reports a program killed by signal N as exit code 128 + N (like a shell)."""
    if returncode < 0 or returncode > 128:
        return None
    return returncode


def _signal_of(returncode: int) -> Optional[int]:
    if returncode < 0:                 # bwrap itself was killed
        return -returncode
    if returncode > 128:
        return returncode - 128
    return None


def killed_by_cpu_limit(sig: Optional[int], cpu_s: float, cpu_limit_s: float) -> bool:
    """RLIMIT_CPU's soft limit sends SIGXCPU; a program that ignores it gets SIGKILL at the hard
    limit (soft + 1 s), which the CPU time it used tells apart from other SIGKILLs."""
    return sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit_s)


def classify(returncode: int, timed_out: bool, output_exceeded: bool, cpu_s: float, cpu_limit_s: float,
             oom_killed: bool = False) -> str:
    """Status of a finished run from facts the program cannot fake: our own timer, the bytes it
    wrote to its output pipes, the kernel's CPU accounting (the cgroup's where there is one, which
    counts killed and short-lived processes too), the cgroup's OOM kills and the termination
    signal."""
    if timed_out:
        return STATUS_TIMEOUT
    if output_exceeded:
        return STATUS_OUTPUT_LIMIT
    if oom_killed:
        return STATUS_MEMORY_LIMIT
    sig = _signal_of(returncode)
    if cpu_s > cpu_limit_s or killed_by_cpu_limit(sig, cpu_s, cpu_limit_s):
        return STATUS_CPU_LIMIT
    if returncode == 0:
        return STATUS_OK
    if sig is not None:
        return STATUS_SIGNALED
    return STATUS_ERROR
