"""Trusted judge of assertion-style tests (HumanEval(+) ``check(candidate)``, MBPP(+) asserts),
run inside the sandbox next to, but out of reach of, the program under test.

    python3 -I -B /code/judge.py    # stdin: the tests (JSON), stdout: one verdict line per case

The judge and the program are two processes. The judge runs the test code (prelude, setup,
cases) in its own namespace; every name the tests call that the program is to provide (the entry
point, and any other name the tests use but do not define) is a proxy that sends the call's
arguments as plain data to the program's process (function_runner.py) and turns the reply back
into plain data (quatro_nemo/rewards/plain_data.py). So the assertions compare values the
judge's own builtins built, with the judge's own ``==``; the program never holds the tests, the
expected values or the verdict channel:

- the judge forks the program's process first, then reads the tests from its stdin; the child
  replaces its stdin and stdout with pipes to the judge before running the program, so it holds
  neither the tests nor the verdict channel (the judge's stdout);
- the judge makes itself non-dumpable (prctl PR_SET_DUMPABLE 0) before anything else, so the
  program, with the same uid, cannot open /proc/<judge>/{mem,fd,environ}, nor ptrace it (which
  the sandbox's seccomp filter denies anyway);
- the program can kill the judge or stall it; then verdicts are missing and the case fails.

Verdict lines: ``{"case": i, "status": s}`` with s one of "passed", "wrong_answer" (the test
raised, e.g. AssertionError), "error" (the program raised or failed to load), "no_result" (the
program's process ended without replying); the latter adds "signal", "exit_code", "cpu_s". The
judge stops after a case whose program process ended, or at the first failure when asked.
When the tests use numpy, its broadcasting comparisons (``testing.assert_allclose``,
``allclose``, ...) are replaced in the judge's process by versions that check shape and type
first (``_strict_numpy_comparisons``): an empty list must not pass for a float.
Standard library only (plus what the tests import): this file is copied into the sandbox.
"""
import builtins
import ctypes
import json
import os
import sys

sys.path.insert(0, "/code")
import plain_data  # noqa: E402  (lives next to this file in /code)

_PR_SET_DUMPABLE = 4


class CandidateRaised(BaseException):
    """The program's function raised, or its reply is not plain data. A BaseException, so that
    a test's ``except Exception`` cannot mistake it for an exception it expects."""


class ProgramEnded(BaseException):
    """The program's process ended (or replied garbage) during a call."""


class LoadFailed(BaseException):
    """The program did not load (it raised, or its process ended, at top level)."""


def _make_undumpable() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit(f"judge: prctl(PR_SET_DUMPABLE, 0) failed (errno {ctypes.get_errno()})")


class Program:
    """The program's process: forked from the judge before the judge reads the tests, so the
    copy of the judge's memory it starts with holds none of them; it replaces its stdin and
    stdout (the tests, the verdict channel) with pipes, closes every other descriptor, and runs
    function_runner.py (one Python start saved per run compared with exec-ing a new
    interpreter)."""

    def __init__(self):
        to_program, self._requests = os.pipe()
        self._replies, from_program = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.dup2(to_program, 0)
                os.dup2(from_program, 1)
                os.closerange(3, 1 << 20)
                import function_runner
                function_runner.main()
            finally:
                os._exit(0)
        os.close(to_program)
        os.close(from_program)
        self._reader = os.fdopen(self._replies, "r", encoding="utf-8")
        self.loaded = False
        self.load_failure = None           # {"status": ..., ...} once loading failed

    def _wait_until_loaded(self) -> None:
        try:
            first = self._read()
        except ProgramEnded:
            self.load_failure = dict(status="no_result", **self.stop())
            return
        if first == ["loaded"]:
            self.loaded = True
        else:
            self.load_failure = {"status": "error", "detail": repr(first)[:200]}

    def _read(self):
        line = self._reader.readline()
        if not line:
            raise ProgramEnded("no reply")
        try:
            reply = plain_data.decode(line)
        except ValueError as err:
            raise ProgramEnded(f"garbled reply: {err}") from None
        if type(reply) is not list or not reply or type(reply[0]) is not str:
            raise ProgramEnded("garbled reply")
        return reply

    def call(self, name, args, kwargs):
        if not self.loaded and self.load_failure is None:
            self._wait_until_loaded()
        if self.load_failure is not None:
            raise LoadFailed()
        try:
            request = plain_data.encode([name, list(args), dict(kwargs)])
        except (plain_data.UnsupportedValue, ValueError) as err:
            raise CandidateRaised(f"argument is not plain data: {err}") from None
        try:
            os.write(self._requests, (request + "\n").encode("utf-8"))
        except BrokenPipeError:
            raise ProgramEnded("program closed its input") from None
        reply = self._read()
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        raise CandidateRaised(f"{name}: {reply[0]} {reply[1:]!r:.200}")

    def stop(self) -> dict:
        """Kill the program's process and report how it ended."""
        os.close(self._requests)
        self._reader.close()
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        _, status, usage = os.wait4(self.pid, 0)
        self.pid = None
        return {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                "cpu_s": usage.ru_utime + usage.ru_stime}


def _proxy(program, name):
    def call_program(*args, **kwargs):
        return program.call(name, args, kwargs)
    call_program.__name__ = name
    return call_program


def _global_names(code) -> set:
    """Every global (or attribute) name a compiled test refers to, nested functions included.
    A superset of the names it reads without binding: binding a proxy or a module to one it
    binds itself, or to an attribute name, is harmless (the test's own binding wins)."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _global_names(constant)
    return names


def _names_to_provide(codes, namespace, entry_point):
    """Names the tests may read that neither the judge's namespace nor builtins define: the
    program's (stdlib modules are imported instead). (The code objects' names, not an ``ast``
    walk: importing ast costs more than the rest of the judge.)"""
    free = set().union(*map(_global_names, codes)) - set(namespace) - set(dir(builtins))
    return ({entry_point} if entry_point else set()) | free


class _StdlibModule:
    """A standard module the tests use without importing it (HumanEval's and MBPP's tests may
    rely on the program's ``import math``), imported at its first attribute access: binding
    every attribute-like name to an imported module would import needlessly."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        return getattr(__import__(self._name), attribute)


def _bind_names(names, namespace, program) -> None:
    stdlib = getattr(sys, "stdlib_module_names", ())
    for name in names:
        namespace[name] = _StdlibModule(name) if name in stdlib else _proxy(program, name)


# numpy comparisons that broadcast: an empty or wrongly shaped answer would pass them (EvalPlus's
# ``assertion`` calls assert_allclose; ``assert_allclose([], 2.5)`` compares nothing and passes).
_ASSERTING_NUMPY_COMPARISONS = ("testing.assert_allclose", "testing.assert_array_almost_equal",
                                "testing.assert_almost_equal", "testing.assert_array_equal",
                                "testing.assert_array_less")
_BOOLEAN_NUMPY_COMPARISONS = ("allclose", "isclose", "array_equiv")
_NUMERIC_KINDS = "iufc"                   # numpy dtype kinds: int, unsigned, float, complex


def _comparable(numpy, actual, desired) -> bool:
    """Same shape, and numbers where numbers are expected (a bool only for a bool)."""
    actual, desired = numpy.asarray(actual), numpy.asarray(desired)
    if actual.shape != desired.shape:
        return False
    if desired.dtype.kind in _NUMERIC_KINDS:
        return actual.dtype.kind in _NUMERIC_KINDS
    return actual.dtype.kind == desired.dtype.kind


def _strict_numpy_comparisons() -> None:
    """Make the broadcasting comparisons above check shape and type before tolerance: the
    asserting ones raise AssertionError, the boolean ones return False. (The judge's own numpy:
    the program's process is another one.)"""
    import numpy

    def strict(owner, name, asserting):
        original = getattr(owner, name)

        def compare(*args, **kwargs):
            if len(args) >= 2 and not _comparable(numpy, args[0], args[1]):
                if asserting:
                    raise AssertionError(f"{name}: shapes or types differ")
                return numpy.False_
            return original(*args, **kwargs)

        setattr(owner, name, compare)

    for path in _ASSERTING_NUMPY_COMPARISONS + _BOOLEAN_NUMPY_COMPARISONS:
        *parents, name = path.split(".")
        owner = numpy
        for parent in parents:
            owner = getattr(owner, parent)
        strict(owner, name, path in _ASSERTING_NUMPY_COMPARISONS)


def _run_case(code, namespace, program) -> dict:
    try:
        exec(code, namespace)
        return {"status": "passed"}
    except CandidateRaised:
        return {"status": "error"}
    except LoadFailed:
        return dict(program.load_failure)
    except ProgramEnded:
        return dict(status="no_result", **program.stop())
    except BaseException:                  # AssertionError, or the test failing on a wrong value
        return {"status": "wrong_answer"}


def main() -> None:
    _make_undumpable()
    program = Program()                    # before the tests are read: see Program
    tests = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)                       # the tests' text is gone from fd 0
    os.close(null)
    verdicts = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)                          # the tests' own prints go to stderr
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    namespace = {"__name__": "__main__"}
    preamble = [compile(tests.get(part, ""), "<tests>", "exec") for part in ("prelude", "setup")]
    codes = [compile(case, f"<case {index}>", "exec") for index, case in enumerate(tests["cases"])]
    if any(name == "numpy" or name.startswith("numpy.") for name in set().union(*map(_global_names, preamble + codes))):
        _strict_numpy_comparisons()
    for code in preamble:
        exec(code, namespace)
    _bind_names(_names_to_provide(codes, namespace, tests.get("entry_point")), namespace, program)
    for index, code in enumerate(codes):
        verdict = dict(case=index, **_run_case(code, namespace, program))
        verdicts.write(json.dumps(verdict) + "\n")
        verdicts.flush()
        ended = verdict["status"] == "no_result" and program.load_failure is None
        if ended or (verdict["status"] != "passed" and tests.get("stop_on_failure")):
            break


if __name__ == "__main__":
    main()
