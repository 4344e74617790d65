"""Module-level functions for the fork server's tests (a call is pickled by reference, so the
server imports this module to run one)."""
import sys
import time


def report(what: str) -> int:
    """Say which call ran, and how: sys.argv is left alone, the module keeps its name."""
    print("called", what, __name__, flush=True)
    if what == "exit3":
        sys.exit(3)
    if what == "raise":
        raise ValueError("a named problem")
    if what == "message":
        sys.exit("stopped with a message")
    if what == "returns5":
        return 5
    sum(i * i for i in range(2_000_000))   # some CPU time
    return None


def sleep() -> None:
    print("sleeping", flush=True)
    time.sleep(60)


def fail_to_preload() -> None:
    raise RuntimeError("the preload failed")
