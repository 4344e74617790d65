"""Run one untrusted Python program in a bubblewrap sandbox with kernel resource limits.

Isolation is done by the operating system, not by Python: every program runs as

    [drop to uid/gid 65534 when the caller is root]
    bwrap --unshare-all --unshare-user ...        # bubblewrap (Debian package `bubblewrap`)
      /bin/sh -c '"$@"; exit $?'                  # PID 1 of the sandbox (see _PID1_SHELL)
        prlimit --cpu --as --fsize --nproc ...    # util-linux: setrlimit(2) before exec
          python3 -I -B /code/program.py          # a system interpreter, isolated mode

- new user, PID, network, IPC, UTS and cgroup namespaces: no network interface but a loopback
  that only the sandbox itself can reach, no view of other processes (the parent seen inside is
  the sandbox's own init, which the kernel does not let it kill), no way back to the caller's uid;
- a fresh mount namespace holding only `/usr` (read-only, plus the linker cache and
  /etc/alternatives symlinks), `/proc` of the new PID namespace, a minimal `/dev`, the program
  files (read-only, `/code`) and a size-limited tmpfs as the throw-away working directory
  (`/sandbox`); the project, `/home`, `/root`, the rest of `/etc`, `/tmp` of the host are not
  there at all;
- rlimits on the program: CPU seconds (SIGXCPU, then SIGKILL), address space, size of any file it
  writes (stdout and stderr are files, so this bounds output too), processes, open files, no core;
- when the program exits, PID 1 exits and the kernel kills every process left in the PID
  namespace (children that `setsid()` or double-fork included); on the wall-clock timeout the
  caller SIGKILLs bwrap's process group and `--die-with-parent` takes PID 1 down the same way.

See docs/sandbox.md for what this does and does not protect against and how it was measured.
bubblewrap: https://github.com/containers/bubblewrap (the sandbox of Flatpak).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

NOBODY_UID = 65534  # `nobody` on Debian/Ubuntu/RHEL; the overflow uid of user namespaces
_LIBRARY_LOOKUP_PATHS = ("/etc/ld.so.cache", "/etc/alternatives")

# Inside the sandbox a POSIX shell is PID 1 (bwrap --as-pid-1) and runs the rlimited program as
# its child. As the namespace's init it cannot be killed from inside (the kernel drops signals
# to an init without handlers), and when it exits the kernel SIGKILLs every process left in the
# namespace: daemonised children die with the program. The trailing `exit` keeps the shell from
# exec-ing the program in its place (which would make the program PID 1 and immune to SIGXCPU).
# "$@" is the command; nothing is interpolated into the script.
_PID1_SHELL = '"$@"; exit $?'

# Status of one execution, from the caller's point of view.
STATUS_OK = "ok"                          # exited with code 0
STATUS_ERROR = "error"                    # non-zero exit code (exception, assertion, sys.exit(n))
STATUS_TIMEOUT = "timeout"                # wall-clock limit: we killed the process group
STATUS_CPU_LIMIT = "cpu_limit"            # RLIMIT_CPU: SIGXCPU from the kernel
STATUS_OUTPUT_LIMIT = "output_limit"      # wrote more than max_output_bytes to stdout/stderr
STATUS_SIGNALED = "signaled"              # killed by another signal


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed execution. Validated at construction (ValueError names the key)."""

    wall_timeout_s: float = 10.0          # wall clock, then SIGKILL of the whole process group
    cpu_time_s: int = 10                  # RLIMIT_CPU soft limit (hard = soft + 1)
    memory_bytes: int = 1 << 30           # RLIMIT_AS (virtual address space)
    max_output_bytes: int = 4 << 20       # RLIMIT_FSIZE: stdout, stderr and any file it writes
    max_processes: int = 32               # RLIMIT_NPROC, counted per sandbox (own user namespace)
    max_open_files: int = 64              # RLIMIT_NOFILE
    scratch_bytes: int = 64 << 20         # size of the tmpfs working directory /sandbox
    python_executable: str = "/usr/bin/python3"   # must lie under one of readonly_paths
    bwrap_executable: str = "bwrap"
    prlimit_executable: str = "prlimit"
    readonly_paths: tuple = ("/usr",)     # host directories visible read-only inside
    sandbox_uid: int = NOBODY_UID         # uid/gid the sandbox runs as when the caller is root

    def __post_init__(self) -> None:
        for key in ("wall_timeout_s", "cpu_time_s", "memory_bytes", "max_output_bytes",
                    "max_processes", "max_open_files", "scratch_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SandboxConfig.{key} must be > 0, got {getattr(self, key)!r}")
        if self.sandbox_uid <= 0:
            raise ValueError(f"SandboxConfig.sandbox_uid must be an unprivileged uid, got {self.sandbox_uid}")
        object.__setattr__(self, "readonly_paths", tuple(self.readonly_paths))
        for path in self.readonly_paths:
            if not os.path.isabs(path) or not os.path.isdir(path):
                raise ValueError(f"SandboxConfig.readonly_paths: {path!r} is not an existing absolute directory")
        python = os.path.realpath(self.python_executable)
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"SandboxConfig.python_executable: {self.python_executable!r} is not an executable file")
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

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def _resolve_tool(name: str, key: str) -> str:
    path = shutil.which(name)
    if path is None:
        hint = " (Debian/Ubuntu: apt-get install bubblewrap)" if "bwrap" in name else ""
        raise RuntimeError(f"SandboxConfig.{key}: {name!r} not found on PATH{hint}; see docs/sandbox.md")
    return os.path.realpath(path)


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
        if self_check:
            result = self.run("print('sandbox ok')")
            if result.status != STATUS_OK or result.stdout.strip() != "sandbox ok":
                raise RuntimeError(f"the sandbox does not work on this host ({result.status}, exit "
                                   f"{result.exit_code}): {result.stderr.strip()[-2000:]}; see docs/sandbox.md")

    # -- command line -------------------------------------------------------------------------
    def _bwrap_args(self, code_dir: str) -> List[str]:
        cfg = self.config
        uid = str(cfg.sandbox_uid)
        args = [self._bwrap,
                "--unshare-all", "--unshare-user",      # user, pid, net, ipc, uts, cgroup namespaces
                "--disable-userns",                      # no nested user namespaces inside
                "--as-pid-1",                            # our shell is init (see _PID1_SHELL)
                "--die-with-parent",                     # bwrap killed -> sandbox init SIGKILLed
                "--new-session",                         # setsid: no TIOCSTI into a terminal
                "--cap-drop", "ALL",
                "--uid", uid, "--gid", uid,
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
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
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(cfg.scratch_bytes), "--tmpfs", "/sandbox",
                 "--ro-bind", code_dir, "/code",
                 "--chdir", "/sandbox", "--"]
        return args

    def _limit_args(self) -> List[str]:
        cfg = self.config
        return [self._prlimit,
                f"--cpu={cfg.cpu_time_s}:{cfg.cpu_time_s + 1}",
                f"--as={cfg.memory_bytes}",
                f"--fsize={cfg.max_output_bytes}",
                f"--nproc={cfg.max_processes}",
                f"--nofile={cfg.max_open_files}",
                "--core=0", "--"]

    # -- execution ----------------------------------------------------------------------------
    def run(self, program: str, stdin: str = "", files: Optional[Dict[str, str]] = None,
            argv: Optional[List[str]] = None, timeout_s: Optional[float] = None) -> ExecutionResult:
        """Run `program` (Python source) with `stdin`; `files` (name -> text) sit next to it in /code.

        The program's working directory is an empty tmpfs, discarded afterwards. Returns its exit
        status and its stdout/stderr (each at most `max_output_bytes`, decoded leniently).
        """
        cfg = self.config
        timeout_s = cfg.wall_timeout_s if timeout_s is None else timeout_s
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
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(path, 0o644)
            command = (self._bwrap_args(code_dir) + ["/bin/sh", "-c", _PID1_SHELL, "sh"] + self._limit_args()
                       + [cfg.python_executable, "-I", "-B", "/code/program.py"] + list(argv or []))
            paths = {k: os.path.join(host_dir, k) for k in ("stdin", "stdout", "stderr")}
            with open(paths["stdin"], "w", encoding="utf-8") as f:
                f.write(stdin)
            with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                    open(paths["stderr"], "wb") as ferr:
                start = time.monotonic()
                # user/group/extra_groups are applied by _posixsubprocess in C between fork and
                # exec (no preexec_fn, so this is safe from many threads at once).
                proc = subprocess.Popen(command, stdin=fin, stdout=fout, stderr=ferr, close_fds=True,
                                        start_new_session=True, env={"PATH": "/usr/bin:/bin"},
                                        user=self._drop_to_uid, group=self._drop_to_uid,
                                        extra_groups=[] if self._drop_to_uid is not None else None)
                timed_out = False
                try:
                    returncode = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_process_group(proc.pid)
                    returncode = proc.wait()
                wall_s = time.monotonic() - start
            stdout = _read_bounded(paths["stdout"], cfg.max_output_bytes)
            stderr = _read_bounded(paths["stderr"], cfg.max_output_bytes)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
        return ExecutionResult(status=_classify(returncode, timed_out, stderr), exit_code=_exit_code(returncode),
                               stdout=stdout, stderr=stderr, wall_s=wall_s)


def _kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_bounded(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _exit_code(returncode: int) -> Optional[int]:
    """bwrap reports a program killed by signal N as exit code 128 + N (like a shell)."""
    if returncode < 0 or returncode > 128:
        return None
    return returncode


def _signal_of(returncode: int) -> Optional[int]:
    if returncode < 0:                 # bwrap itself was killed (by us, on timeout)
        return -returncode
    if returncode > 128:
        return returncode - 128
    return None


def _classify(returncode: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return STATUS_TIMEOUT
    if returncode == 0:
        return STATUS_OK
    sig = _signal_of(returncode)
    if sig == signal.SIGXCPU:
        return STATUS_CPU_LIMIT        # RLIMIT_CPU soft limit (the hard one sends SIGKILL)
    if sig == signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return STATUS_OUTPUT_LIMIT     # CPython ignores SIGXFSZ, so the write fails with EFBIG
    if sig is not None:
        return STATUS_SIGNALED
    return STATUS_ERROR
