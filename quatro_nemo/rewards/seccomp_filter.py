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
  ``perf_event_open``, ``bpf``: kernel attack surface that no grader needs.

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
)

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
    }, 0x40000000),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "keyctl": 219, "add_key": 217, "request_key": 218,
        "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197,
        "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192,
        "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "perf_event_open": 241, "bpf": 280,
    }, None),
}

# linux/filter.h opcodes and linux/seccomp.h return values
_LOAD_WORD_ABS = 0x20            # BPF_LD | BPF_W | BPF_ABS
_JUMP_IF_EQUAL = 0x15            # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_GREATER_EQUAL = 0x35    # BPF_JMP | BPF_JGE | BPF_K
_RETURN = 0x06                   # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000          # SECCOMP_RET_ALLOW
_RET_DENY = 0x00050000 | errno.EPERM   # SECCOMP_RET_ERRNO | EPERM
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...


def syscall_numbers(machine: Optional[str] = None) -> Dict[str, int]:
    return dict(_architecture(machine)[1])


def _architecture(machine: Optional[str]):
    machine = machine or platform.machine()
    if machine not in _ARCHITECTURES:
        raise RuntimeError(f"the sandbox's seccomp filter knows {sorted(_ARCHITECTURES)}, not {machine!r}: "
                           "add its syscall numbers to quatro_nemo/rewards/seccomp_filter.py")
    return _ARCHITECTURES[machine]


def build_filter(machine: Optional[str] = None, denied=DENIED_SYSCALLS) -> bytes:
    """The filter as bwrap reads it: an array of ``struct sock_filter {u16 code; u8 jt; u8 jf;
    u32 k;}`` in native byte order. Layout:

        load arch; if arch != native: deny
        load nr; [x86_64: if nr >= x32 bit: deny]
        if nr == denied[0]: deny ... if nr == denied[-1]: deny
        allow
        deny: return EPERM
    """
    audit_arch, numbers, x32_first = _architecture(machine)
    body: List[Tuple[int, int]] = [(_JUMP_IF_EQUAL, numbers[name]) for name in denied]
    if x32_first is not None:
        body.insert(0, (_JUMP_IF_GREATER_EQUAL, x32_first))
    # (code, jt, jf, k); jumps are relative to the next instruction; "deny" is the last one
    program = [(_LOAD_WORD_ABS, 0, 0, _OFFSET_ARCH)]
    deny_index = 3 + len(body) + 1                 # arch load, arch check, nr load, body, allow
    program.append((_JUMP_IF_EQUAL, 0, deny_index - 2, audit_arch))      # true: next; false: deny
    program.append((_LOAD_WORD_ABS, 0, 0, _OFFSET_NR))
    for code, k in body:
        program.append((code, deny_index - len(program) - 1, 0, k))      # true: deny; false: next
    program.append((_RETURN, 0, 0, _RET_ALLOW))
    program.append((_RETURN, 0, 0, _RET_DENY))
    if any(jt > 255 or jf > 255 for _, jt, jf, _ in program):
        raise ValueError("seccomp filter too long for 8-bit jumps")
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in program)
