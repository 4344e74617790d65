"""What the host sees of a sandboxed run: its process table and its shared-memory total."""
import ctypes
import json
import os
import signal
import threading
import time


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def processes_with(marker: str) -> list:
    """PIDs (host view) whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def assert_no_survivors(marker: str, grace_s: float = 2.0) -> None:
    deadline = time.monotonic() + grace_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = processes_with(marker)
    for pid in survivors:                      # clean up what a weakened sandbox let escape
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not survivors, f"sandboxed processes outlived the sandbox: {survivors}"


def shmem_bytes() -> int:
    """Host memory held by tmpfs files and SysV/POSIX shared memory (/proc/meminfo Shmem)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem line in /proc/meminfo")


class ShmemPeak:
    """Largest growth of the host's Shmem over its value at entry, sampled every 20 ms."""

    def __enter__(self):
        self.baseline = shmem_bytes()
        self.peak_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak_growth = max(self.peak_growth, shmem_bytes() - self.baseline)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def evict_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_pages(path: str) -> int:
    """Pages of `path` in the host's page cache (mincore(2) of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)                   # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vector = (ctypes.c_ubyte * ((size + 4095) // 4096))()
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(page & 1 for page in vector)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
