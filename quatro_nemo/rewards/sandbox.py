"""Run one untrusted Python program in a bubblewrap sandbox with kernel resource limits.

Isolation is done by the operating system, not by Python: every program runs as

    [drop to uid/gid 65534 when the caller is root]
    bwrap --unshare-all --unshare-user --seccomp FD --info-fd FD ...   # bubblewrap
      /init -c '"$@"; exit $?'                    # PID 1: an execute-only copy of /bin/sh
        prlimit --cpu --as --fsize --nproc ...    # util-linux: setrlimit(2) before exec
          python3 -I -B /code/program.py          # a system interpreter, isolated mode

- new user, PID, network, IPC, UTS and cgroup namespaces: no network interface but a loopback
  that only the sandbox itself can reach, no view of other processes, no way back to the
  caller's uid;
- a fresh mount namespace holding only `/usr` (read-only, plus the linker cache and
  /etc/alternatives symlinks), `/proc` of the new PID namespace, a minimal `/dev`, the program
  files (read-only, `/code`) and size-limited tmpfs mounts for the working directory
  (`/sandbox`) and `/dev/shm`; `/` and `/dev` themselves are remounted read-only, so every
  writable place has a size;
- a seccomp filter (quatro_nemo/rewards/seccomp_filter.py) denying ptrace, process_vm_*,
  the keyrings, SysV IPC and io_uring;
- PID 1 is a shell the sandbox can execute but not read, which makes the kernel mark it
  non-dumpable: the program (same uid) cannot ptrace it, open /proc/1/mem or /proc/1/fd;
- rlimits on the program: CPU seconds (SIGXCPU, then SIGKILL), address space, size of any file it
  writes (stdout and stderr are files, so this bounds output too), processes, open files, no core;
- teardown: when the program exits, PID 1 exits and the kernel kills every process left in the
  PID namespace; on the wall-clock timeout the caller SIGKILLs the sandbox's PID 1 itself
  (host PID from bwrap's --info-fd, through a pidfd), then waits for bwrap, which returns only
  once the namespace is empty. It does not rely on the parent-death signal.

See docs/sandbox.md for what this does and does not protect against and how it was measured.
bubblewrap: https://github.com/containers/bubblewrap (the sandbox of Flatpak).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from typing import Dict, List, Optional

from quatro_nemo.rewards.seccomp_filter import build_filter

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


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed execution. Validated at construction (ValueError names the key)."""

    wall_timeout_s: float = 10.0          # wall clock, then SIGKILL of the sandbox's PID 1
    cpu_time_s: int = 10                  # RLIMIT_CPU soft limit (hard = soft + 1)
    memory_bytes: int = 1 << 30           # RLIMIT_AS (virtual address space) per process
    max_output_bytes: int = 4 << 20       # stdout, stderr and any file it writes (RLIMIT_FSIZE)
    max_processes: int = 32               # RLIMIT_NPROC, counted per sandbox (own user namespace)
    max_open_files: int = 64              # RLIMIT_NOFILE
    scratch_bytes: int = 64 << 20         # size of the tmpfs working directory /sandbox
    shm_bytes: int = 16 << 20             # size of the tmpfs /dev/shm (POSIX shared memory)
    python_executable: str = "/usr/bin/python3"   # must lie under one of readonly_paths
    bwrap_executable: str = "bwrap"
    prlimit_executable: str = "prlimit"
    shell_executable: str = "/bin/sh"     # copied execute-only to be the sandbox's PID 1
    readonly_paths: tuple = ("/usr",)     # host directories visible read-only inside
    sandbox_uid: int = NOBODY_UID         # uid/gid the sandbox runs as when the caller is root

    def __post_init__(self) -> None:
        for key in ("wall_timeout_s", "cpu_time_s", "memory_bytes", "max_output_bytes",
                    "max_processes", "max_open_files", "scratch_bytes", "shm_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SandboxConfig.{key} must be > 0, got {getattr(self, key)!r}")
        if self.sandbox_uid <= 0:
            raise ValueError(f"SandboxConfig.sandbox_uid must be an unprivileged uid, got {self.sandbox_uid}")
        object.__setattr__(self, "readonly_paths", tuple(self.readonly_paths))
        for path in self.readonly_paths:
            if not os.path.isabs(path) or not os.path.isdir(path):
                raise ValueError(f"SandboxConfig.readonly_paths: {path!r} is not an existing absolute directory")
        for key in ("python_executable", "shell_executable"):
            path = os.path.realpath(getattr(self, key))
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise ValueError(f"SandboxConfig.{key}: {getattr(self, key)!r} is not an executable file")
        python = os.path.realpath(self.python_executable)
        if not any(python.startswith(os.path.realpath(p) + os.sep) for p in self.readonly_paths):
            raise ValueError(f"SandboxConfig.python_executable: {python!r} is not under readonly_paths "
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
        self._init_path = _execute_only_copy(self.config.shell_executable)
        weakref.finalize(self, shutil.rmtree, os.path.dirname(self._init_path), True)
        if self_check:
            result = self.run("print('sandbox ok')")
            if result.status != STATUS_OK or result.stdout.strip() != "sandbox ok":
                raise RuntimeError(f"the sandbox does not work on this host ({result.status}, exit "
                                   f"{result.exit_code}): {result.stderr.strip()[-2000:]}; see docs/sandbox.md")

    # -- command line -------------------------------------------------------------------------
    def _bwrap_args(self, code_dir: str, seccomp_fd: int, info_fd: int) -> List[str]:
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
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(cfg.shm_bytes), "--tmpfs", "/dev/shm",
                 "--size", str(cfg.scratch_bytes), "--tmpfs", "/sandbox",
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
            paths = {k: os.path.join(host_dir, k) for k in ("stdin", "stdout", "stderr")}
            with open(paths["stdin"], "wb") as f:
                f.write(_utf8(stdin))
            with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                    open(paths["stderr"], "wb") as ferr:
                returncode, timed_out, cpu_s, wall_s = self._execute(code_dir, fin, fout, ferr, argv or [],
                                                                     timeout_s, cpu_time_s)
            output_sizes = [os.path.getsize(paths[k]) for k in ("stdout", "stderr")]
            stdout = _read_bounded(paths["stdout"], cfg.max_output_bytes)
            stderr = _read_bounded(paths["stderr"], cfg.max_output_bytes)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
        output_exceeded = max(output_sizes) > cfg.max_output_bytes
        status = classify(returncode, timed_out, output_exceeded, cpu_s, cpu_time_s)
        return ExecutionResult(status=status, exit_code=_exit_code(returncode), stdout=stdout, stderr=stderr,
                               wall_s=wall_s, cpu_s=cpu_s)

    def _execute(self, code_dir, fin, fout, ferr, argv, timeout_s, cpu_time_s):
        """Start bwrap, wait for it up to `timeout_s`, kill the sandbox's PID 1 on timeout.
        Returns (bwrap's return code, timed out, CPU seconds of the whole tree, wall seconds)."""
        seccomp_read, seccomp_write = os.pipe()
        info_read, info_write = os.pipe()
        pid1 = None
        try:
            os.write(seccomp_write, self._seccomp_filter)  # < 1 KiB: fits the pipe buffer
            os.close(seccomp_write)
            command = (self._bwrap_args(code_dir, seccomp_read, info_write)
                       + [PID1_PATH, "-c", _PID1_SHELL, "sh"] + self._limit_args(cpu_time_s)
                       + [self.config.python_executable, "-I", "-B", "/code/program.py"] + list(argv))
            start = time.monotonic()
            # user/group/extra_groups are applied by _posixsubprocess in C between fork and
            # exec (no preexec_fn, so this is safe from many threads at once).
            proc = subprocess.Popen(command, stdin=fin, stdout=fout, stderr=ferr, close_fds=True,
                                    pass_fds=(seccomp_read, info_write), start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin"}, user=self._drop_to_uid,
                                    group=self._drop_to_uid,
                                    extra_groups=[] if self._drop_to_uid is not None else None)
            os.close(info_write)
            info_write = None
            deadline = start + timeout_s
            pid1 = _open_sandbox_pid1(info_read, proc.pid, deadline)
            bwrap_pidfd = os.pidfd_open(proc.pid)
            try:
                timed_out = not select.select([bwrap_pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]
            finally:
                os.close(bwrap_pidfd)
            if timed_out:
                _kill_sandbox(pid1, proc.pid)
            # Reap bwrap ourselves for its rusage (Popen.wait would discard it). bwrap exits after
            # reaping PID 1, whose exit waits until every process of the namespace is gone.
            _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            wall_s = time.monotonic() - start
        finally:
            for fd in (seccomp_read, info_read, info_write, pid1):
                if fd is not None:
                    os.close(fd)
        return proc.returncode, timed_out, usage.ru_utime + usage.ru_stime, wall_s


def _open_sandbox_pid1(info_read: int, bwrap_pid: int, deadline: float) -> Optional[int]:
    """A pidfd of the sandbox's PID 1, from bwrap's --info-fd JSON; None if bwrap ended or the
    deadline passed before it wrote it (then the program has not started: bwrap lets its child
    run only after writing the info)."""
    data = b""
    while True:
        ready = select.select([info_read], [], [], max(0.0, deadline - time.monotonic()))[0]
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


def _read_bounded(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


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


def classify(returncode: int, timed_out: bool, output_exceeded: bool, cpu_s: float, cpu_limit_s: float) -> str:
    """Status of a finished run from facts the program cannot fake: our own timer, the sizes of
    its output files, the kernel's CPU accounting and its termination signal."""
    if timed_out:
        return STATUS_TIMEOUT
    if output_exceeded:
        return STATUS_OUTPUT_LIMIT     # RLIMIT_FSIZE stopped a write (CPython ignores SIGXFSZ)
    if returncode == 0:
        return STATUS_OK
    sig = _signal_of(returncode)
    if killed_by_cpu_limit(sig, cpu_s, cpu_limit_s):
        return STATUS_CPU_LIMIT
    if sig is not None:
        return STATUS_SIGNALED
    return STATUS_ERROR
