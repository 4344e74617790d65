"""Issue 28, second and third parts: resources the kernel holds for a sandbox that rlimits do not
count (kernel memory, disk reserved through stdout, CPU time of killed or short-lived
processes), shared host state (sync, inotify, message queues, sockets), and channels between
runs through the page cache. Each test fails on the code before issue 28 (commit 7e6e9af).

The cgroup tests need a cgroup the sandbox can create (root with cgroup v1, or a delegated
cgroup2): without one they skip with the reason, except as root, where they fail (CI runs as
root and must run them).
"""
import dataclasses
import errno
import json
import os
import time

import pytest
from host_checks import evict_from_page_cache, last_json, resident_pages

from quatro_nemo.rewards import seccomp_filter
from quatro_nemo.rewards.sandbox import (STATUS_CPU_LIMIT, STATUS_MEMORY_LIMIT, STATUS_OK, STATUS_TIMEOUT,
                                         CgroupParents, Sandbox)


@pytest.fixture(scope="module")
def cgroup_sandbox(sandbox, limits_in_effect):
    """The session's limits (wall clock loosened for a loaded machine) with per-run cgroups."""
    if sandbox.cgroups is None:
        _, reason = CgroupParents.find()
        if os.geteuid() == 0:
            pytest.fail(f"running as root but the sandbox has no cgroups: {reason}")
        pytest.skip(f"no per-run cgroups on this host: {reason}")
    return Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=30.0), self_check=False)


_OUTPUT_RESERVATION = """
import ctypes, json, os, stat
libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE = 1
report = {"fifo": stat.S_ISFIFO(os.fstat(1).st_mode) and stat.S_ISFIFO(os.fstat(2).st_mode)}
for fd in (1, 2):       # 256 MiB past the end of the file, which keeps its size
    result = libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(256 << 20))
    report[str(fd)] = 0 if result == 0 else ctypes.get_errno()
print(json.dumps(report))
"""


# Protection: stdout/stderr are pipes (never files on the host's temp disk) and seccomp refuses
# fallocate. Before, the reservation succeeded with status "ok" and the file size 0.
def test_output_cannot_reserve_host_disk(sandbox):
    result = sandbox.run(_OUTPUT_RESERVATION)
    assert result.status == STATUS_OK, result.stderr
    assert last_json(result.stdout) == {"fifo": True, "1": errno.EPERM, "2": errno.EPERM}


_HOST_STATE_AND_CACHE_PROBES = """
import ctypes, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
NR = json.loads(sys.argv[1])
report = {}

def outcome(name, result):
    report[name] = 0 if result >= 0 else ctypes.get_errno()

victim = os.open("/usr/bin/python3", os.O_RDONLY)              # a file every run reads
size = ctypes.c_size_t(1 << 20)
try:
    os.posix_fadvise(victim, 0, 0, os.POSIX_FADV_DONTNEED)     # evict it
    report["fadvise_dontneed"] = 0
except OSError as err:
    report["fadvise_dontneed"] = err.errno
outcome("readahead", libc.readahead(victim, ctypes.c_long(0), size))
page = ctypes.create_string_buffer(4096)
iovec = (ctypes.c_void_p * 2)(ctypes.addressof(page), 4096)
outcome("preadv2_nowait", libc.syscall(NR["preadv2"], victim, iovec, 1, 0, 0, 0x8))    # RWF_NOWAIT
mapped = ctypes.c_void_p(libc.mmap(None, size, 1, 1, victim, ctypes.c_long(0)))        # PROT_READ, MAP_SHARED
outcome("mincore", libc.mincore(mapped, size, (ctypes.c_ubyte * 256)()))
outcome("madvise_pageout", libc.madvise(mapped, size, 21))
outcome("madvise_cold", libc.madvise(mapped, size, 20))
outcome("madvise_dontneed", libc.madvise(mapped, size, 4))                                # allowed
outcome("cachestat", libc.syscall(NR["cachestat"], victim, (ctypes.c_uint64 * 2)(0, 1 << 20),
                                  (ctypes.c_uint64 * 8)(), 0))
outcome("sync", libc.syscall(NR["sync"]))
outcome("syncfs", libc.syncfs(victim))
outcome("fsync", libc.fsync(0))                                 # stdin: a host file
outcome("flock", libc.flock(victim, 2))                         # LOCK_EX on a shared /usr file
outcome("inotify", libc.inotify_init1(0))
outcome("fanotify", libc.fanotify_init(0, 0))
outcome("mq_open", libc.syscall(NR["mq_open"], b"q", 0o100 | 2, 0o600, None))
outcome("memfd_create", libc.syscall(NR["memfd_create"], b"m", 0))
open("/sandbox/x", "w").close()
outcome("setxattr", libc.setxattr(b"/sandbox/x", b"user.a", b"v" * 1000, ctypes.c_size_t(1000), 0))
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    report["tcp_socket"] = 0
except OSError as err:
    report["tcp_socket"] = err.errno
print(json.dumps(report))
"""


# Protection: seccomp (issue 28's additions). Before, every call here succeeded: a program could
# evict /usr pages or probe their residency (passing bits to a later run), stall on the host's
# unflushed writes, watch other sandboxes' file accesses, hold queues, memfds, xattrs and TCP
# buffers outside its limits.
def test_host_state_and_page_cache_probes_are_refused(sandbox):
    result = sandbox.run(_HOST_STATE_AND_CACHE_PROBES, argv=[json.dumps(seccomp_filter.syscall_numbers())])
    assert result.status == STATUS_OK, result.stderr
    report = last_json(result.stdout)
    allowed = {"madvise_dontneed": 0}
    assert report == {name: allowed.get(name, errno.EPERM) for name in report}, report
    assert len(report) == 18


# Protection: the run's cgroup counts kernel memory (tmpfs inodes and dentries here) in its
# memory limit (memory_bytes + scratch_bytes). Before, 40,000 empty files in the 8 MiB tmpfs
# held ~50 MiB of host kernel memory outside every limit and the run was "ok".
def test_kernel_memory_of_empty_files_is_counted(cgroup_sandbox):
    small = Sandbox(dataclasses.replace(cgroup_sandbox.config, memory_bytes=48 << 20), self_check=False)
    limit = small.config.memory_bytes + small.config.scratch_bytes
    program = ("n = 0\ntry:\n    while n < 200000:\n        open('f%07d' % n + 'x' * 200, 'w').close()\n        n += 1\n"
               "except OSError:\n    pass\nprint(n)\n")
    result = small.run(program)
    assert result.status == STATUS_MEMORY_LIMIT, (result.status, result.stdout, result.stderr[-300:])
    assert result.memory_peak_bytes <= limit


_SHORT_LIVED_BURNERS = """
import os, time
for _ in range(8):                # 8 x 0.6 CPU-s, each process far under RLIMIT_CPU (2 s)
    if os.fork() == 0:
        start = time.process_time()
        while time.process_time() - start < 0.6:
            pass
        os._exit(0)
    os.wait()
print("burned")
"""

_KILLED_BURNER = """
import os, time
if os.fork() == 0:
    os.setsid()
    while True:
        pass
time.sleep(100)
"""


# Protection: the CPU time of the whole cgroup, read during and after the run, so processes
# that exit under their own RLIMIT_CPU or die with the sandbox are charged. Before, the
# burners finished "ok" with 4.8 CPU-s of a 2 CPU-s limit, and a burner killed by the wall
# clock reported no CPU time.
def test_cpu_time_of_short_lived_and_killed_processes_is_charged(cgroup_sandbox):
    limit = cgroup_sandbox.config.cpu_time_s
    burners = cgroup_sandbox.run(_SHORT_LIVED_BURNERS)
    assert burners.status == STATUS_CPU_LIMIT, (burners.status, burners.cpu_s)
    assert limit <= burners.cpu_s < limit + 1.0
    killed = cgroup_sandbox.run(_KILLED_BURNER, timeout_s=2.0)
    assert killed.status == STATUS_TIMEOUT
    assert killed.cpu_s > 0.1, killed.cpu_s


def _cold_usr_file() -> str:
    """A file under /usr that neither the sandbox's warm-up nor Python reads (Debian's copyright
    notices), of at least 8 KiB."""
    for directory in sorted(os.listdir("/usr/share/doc")):
        path = os.path.join("/usr/share/doc", directory, "copyright")
        if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) >= 8192:
            return path
    pytest.skip("no /usr/share/doc/*/copyright of 8 KiB or more on this host")


# Protection: the pages a run was the first to bring into the host's page cache are dropped
# with its cgroup (memory.force_empty / memory.reclaim), so that a later run cannot read by
# their residency what an earlier one read (issue 28 passed bits between runs this way; the
# direct probes and evictions are refused by seccomp, see above). Before, the pages stayed.
def test_a_run_leaves_the_page_cache_as_it_found_it(cgroup_sandbox):
    path = _cold_usr_file()
    evict_from_page_cache(path)
    assert resident_pages(path) == 0
    result = cgroup_sandbox.run(f"with open({path!r}, 'rb') as f:\n    print(len(f.read()))")
    assert result.status == STATUS_OK and int(result.stdout) == os.path.getsize(path)
    deadline = time.monotonic() + 5.0                  # released when its last task is gone
    while resident_pages(path) and time.monotonic() < deadline:
        cgroup_sandbox.run("pass")                     # a run's end releases earlier runs' cgroups
    assert resident_pages(path) == 0
