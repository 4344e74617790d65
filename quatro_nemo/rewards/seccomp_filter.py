"""The sandbox's seccomp filter: a classic-BPF program, assembled here, that bubblewrap installs
(``bwrap --seccomp FD``) on the sandbox's PID 1 and so on every process in it.

It denies (EPERM) the system calls that reach other processes or kernel state the rlimits do
not bound, and allows everything else:

- ``ptrace``, ``process_vm_readv``/``process_vm_writev``, ``pidfd_getfd``: reading or steering
  another process of the sandbox (its PID 1, the judge); PID 1 and the judge are also
  non-dumpable, which covers /proc/<pid>/mem, where seccomp cannot look;
- ``keyctl``, ``add_key``, ``request_key``: the kernel keyrings, including the session keyring
  the sandbox inherits from the trainer (Kerberos/AFS tokens where logins create one);
- SysV IPC (``shmget``/``shmat``/..., ``semget``/..., ``msgget``/...): segments and queues live
  in the IPC namespace outside any rlimit (a fresh namespace has an unlimited shmmax);
- ``io_uring_*`` (requests that bypass later seccomp checks), ``userfaultfd``,
  ``perf_event_open``, ``bpf``: kernel attack surface that no grader needs;
- POSIX message queues (``mq_*``, a per-uid quota shared by every sandbox) and
  ``memfd_create``/``memfd_secret`` (memory outside any address space), ``setxattr`` and its
  variants (user extended attributes on the tmpfs: kernel memory beyond the tmpfs size);
- state shared with the host or with other runs that no test program needs (issue 28):
  ``sync``/``syncfs``/``sync_file_range``/``fsync``/``fdatasync`` (wait, unkillable, on the host
  file system's journal and unflushed writes: the program's and stdin files are host files;
  on its tmpfs they do nothing anyway), ``fallocate`` (reserves disk without growing a file),
  ``flock`` (a lock on a shared read-only /usr file is a signal to concurrent sandboxes), ``inotify_*``/``fanotify_*`` (watch other sandboxes'
  and the trainer's file accesses), and the page-cache probes and evictions ``mincore``,
  ``cachestat``, ``fadvise64`` (``POSIX_FADV_DONTNEED``), ``readahead``, ``preadv2``/``pwritev2``
  (``RWF_NOWAIT`` tells whether a page is cached), ``process_madvise``.

``socket`` and ``socketpair`` are refused too: no network at all, not even the network
namespace's loopback, whose TCP buffers are host-wide memory, and no AF_UNIX socket buffers
(not charged to the run's memory cgroup); test programs talk through pipes. ``madvise`` is
checked on its advice (the low 32 bits of the argument): ``MADV_COLD`` and ``MADV_PAGEOUT``,
which evict file pages from the cache, are refused.

Any other architecture value in ``seccomp_data`` (e.g. 32-bit ``int 0x80`` calls on x86_64) and
x86_64's x32 ABI are denied wholesale. Instructions, offsets and return values follow seccomp(2)
and ``linux/filter.h``, ``linux/seccomp.h``, ``linux/audit.h``; the syscall numbers are
``arch/x86/entry/syscalls/syscall_64.tbl`` and ``include/uapi/asm-generic/unistd.h`` (aarch64),
checked against libseccomp in tests/code/test_seccomp_filter.py.
"""
from __future__ import annotations

import errno
import platform
import struct
from typing import Dict, List, Optional, Tuple

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "keyctl", "add_key", "request_key",
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd", "perf_event_open", "bpf",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "memfd_create", "memfd_secret", "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
    "sync", "syncfs", "sync_file_range", "fsync", "fdatasync", "fallocate", "flock",
    "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch", "fanotify_init", "fanotify_mark",
    "mincore", "cachestat", "fadvise64", "readahead", "preadv2", "pwritev2", "process_madvise",
    "socket", "socketpair",
)
_MADV_COLD, _MADV_PAGEOUT = 20, 21
# syscall -> (argument index, allowed values or None, denied values or None)
ARGUMENT_RULES = {
    "madvise": (2, None, (_MADV_COLD, _MADV_PAGEOUT)),
}

# machine (platform.machine()) -> (AUDIT_ARCH_* value, syscall numbers, lowest x32 number or None)
_ARCHITECTURES: Dict[str, Tuple[int, Dict[str, int], Optional[int]]] = {
    "x86_64": (0xC000003E, {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "keyctl": 250, "add_key": 248, "request_key": 249,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 323, "perf_event_open": 298, "bpf": 321,
        "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
        "mq_getsetattr": 245, "memfd_create": 319, "memfd_secret": 447,
        "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
        "sync": 162, "syncfs": 306, "sync_file_range": 277, "fsync": 74, "fdatasync": 75, "fallocate": 285,
        "flock": 73,
        "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254, "inotify_rm_watch": 255,
        "fanotify_init": 300, "fanotify_mark": 301,
        "mincore": 27, "cachestat": 451, "fadvise64": 221, "readahead": 187, "preadv2": 327, "pwritev2": 328,
        "process_madvise": 440, "socket": 41, "socketpair": 53, "madvise": 28,
    }, 0x40000000),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "keyctl": 219, "add_key": 217, "request_key": 218,
        "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197,
        "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192,
        "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "perf_event_open": 241, "bpf": 280,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "memfd_create": 279, "memfd_secret": 447,
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463,
        "sync": 81, "syncfs": 267, "sync_file_range": 84, "fsync": 82, "fdatasync": 83, "fallocate": 47,
        "flock": 32,
        "inotify_init1": 26, "inotify_add_watch": 27, "inotify_rm_watch": 28,   # no inotify_init
        "fanotify_init": 262, "fanotify_mark": 263,
        "mincore": 232, "cachestat": 451, "fadvise64": 223, "readahead": 213, "preadv2": 286, "pwritev2": 287,
        "process_madvise": 440, "socket": 198, "socketpair": 199, "madvise": 233,
    }, None),
}

# linux/filter.h opcodes and linux/seccomp.h return values
_LOAD_WORD_ABS = 0x20            # BPF_LD | BPF_W | BPF_ABS
_JUMP_IF_EQUAL = 0x15            # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_GREATER_EQUAL = 0x35    # BPF_JMP | BPF_JGE | BPF_K
_RETURN = 0x06                   # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000          # SECCOMP_RET_ALLOW
_RET_DENY = 0x00050000 | errno.EPERM   # SECCOMP_RET_ERRNO | EPERM
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; __u64 ip; __u64 args[6]
_OFFSET_ARGS = 16                # low 32 bits of args[i] at 16 + 8 i (little-endian: x86_64, aarch64)


def syscall_numbers(machine: Optional[str] = None) -> Dict[str, int]:
    return dict(_architecture(machine)[1])


def _architecture(machine: Optional[str]):
    machine = machine or platform.machine()
    if machine not in _ARCHITECTURES:
        raise RuntimeError(f"the sandbox's seccomp filter knows {sorted(_ARCHITECTURES)}, not {machine!r}: "
                           "add its syscall numbers to quatro_nemo/rewards/seccomp_filter.py")
    return _ARCHITECTURES[machine]


def build_filter(machine: Optional[str] = None, denied=DENIED_SYSCALLS, rules=None) -> bytes:
    """The filter as bwrap reads it: an array of ``struct sock_filter {u16 code; u8 jt; u8 jf;
    u32 k;}`` in native byte order. Layout (names this architecture lacks are left out):

        load arch; if arch != native: deny
        load nr; [x86_64: if nr >= x32 bit: deny]
        if nr == denied[0]: deny ... if nr == denied[-1]: deny
        for each rule (syscall, i, allowed, refused):
            if nr != syscall: next rule
            load low word of args[i]; allowed: if == a: allow ...; deny
                                      refused: if == r: deny ...; allow
        allow: return ALLOW
        deny: return EPERM
    """
    audit_arch, numbers, x32_first = _architecture(machine)
    rules = ARGUMENT_RULES if rules is None else rules
    # (code, jump if true, jump if false, k) with jumps as labels: None (next), "allow", "deny",
    # ("rule", j); resolved to offsets relative to the next instruction at the end.
    program: List[Tuple[int, object, object, int]] = [
        (_LOAD_WORD_ABS, None, None, _OFFSET_ARCH),
        (_JUMP_IF_EQUAL, None, "deny", audit_arch),
        (_LOAD_WORD_ABS, None, None, _OFFSET_NR)]
    if x32_first is not None:
        program.append((_JUMP_IF_GREATER_EQUAL, "deny", None, x32_first))
    program += [(_JUMP_IF_EQUAL, "deny", None, numbers[name]) for name in denied if name in numbers]
    labels: Dict[object, int] = {}
    rule_names = [name for name in rules if name in numbers]
    for j, name in enumerate(rule_names):
        index, allowed, refused = rules[name]
        labels[("rule", j)] = len(program)
        program.append((_JUMP_IF_EQUAL, None, ("rule", j + 1) if j + 1 < len(rule_names) else "allow", numbers[name]))
        program.append((_LOAD_WORD_ABS, None, None, _OFFSET_ARGS + 8 * index))
        if allowed is not None:
            program += [(_JUMP_IF_EQUAL, "allow", None, value) for value in allowed]
            program.append((_RETURN, None, None, _RET_DENY))
        else:
            program += [(_JUMP_IF_EQUAL, "deny", None, value) for value in refused]
            program.append((_RETURN, None, None, _RET_ALLOW))
    labels["allow"] = len(program)
    program.append((_RETURN, None, None, _RET_ALLOW))
    labels["deny"] = len(program)
    program.append((_RETURN, None, None, _RET_DENY))

    def offset(label, position):
        return 0 if label is None else labels[label] - position - 1

    assembled = [(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(program)]
    if any(not 0 <= jt <= 255 or not 0 <= jf <= 255 for _, jt, jf, _ in assembled):
        raise ValueError("seccomp filter too long for 8-bit jumps")
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in assembled)
