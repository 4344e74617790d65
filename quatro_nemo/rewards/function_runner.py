"""Runs inside the sandbox, in the process of the program under test: loads the program and
calls its functions on request. Nothing here is trusted (the program can replace any of it); it
only turns calls into plain-data results (quatro_nemo/rewards/plain_data.py) for the trusted
side, which decodes and judges them (quatro_nemo/rewards/code.py, judge.py).

    python3 -I -B /code/function_runner.py     # /code holds solution.py, setup.py, plain_data.py

Protocol, one JSON line each way: stdin carries requests ``[name, [args...], {kwargs}]`` (the
trainer's file, or the judge's pipe), stdout carries one reply per request, in order:
``["ok", value]``, ``["raised", "ExceptionName"]`` or ``["unsupported", "why"]``. The first reply
line is ``["loaded"]`` or ``["load_failed", "ExceptionName"]`` (setup, then the program, run in one
namespace named ``__main__``, as in HumanEval's harness). The program itself sees stdin as
/dev/null and its stdout goes to stderr, so its own prints cannot garble the replies.

``name`` is a method of a fresh ``Solution()`` when the program defines that class with it
(APPS's LeetCode-style problems, hendrycks/apps eval/testing_util.py), else a global function.
"""
import os
import sys

sys.path.insert(0, "/code")
import plain_data  # noqa: E402  (lives next to this file in /code)

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)          # big-int results are data too (CPU-limited here)


def _reply(stream, message) -> None:
    try:
        line = plain_data.encode(message)
    except (plain_data.UnsupportedValue, ValueError, RecursionError) as err:
        line = plain_data.encode(["unsupported", str(err)[:200]])
    stream.write(line + "\n")
    stream.flush()


def _resolve(namespace, name):
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)    # APPS's order: the LeetCode-style class first
    function = namespace.get(name)
    if callable(function):
        return function
    raise NameError(f"the program defines no function {name!r}")


def main() -> None:
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)                          # the program's prints go to stderr
    os.close(null)
    namespace = {"__name__": "__main__"}
    try:
        for name in ("setup.py", "solution.py"):
            with open("/code/" + name, encoding="utf-8") as f:
                exec(compile(f.read(), name, "exec"), namespace)
    except BaseException as err:           # SyntaxError, sys.exit(0) at top level, ...
        _reply(replies, ["load_failed", type(err).__name__])
        return
    _reply(replies, ["loaded"])
    for line in requests:
        try:
            name, args, kwargs = plain_data.decode(line)
            reply = ["ok", _resolve(namespace, name)(*args, **kwargs)]
        except BaseException as err:       # includes SystemExit from the program
            reply = ["raised", type(err).__name__]
        _reply(replies, reply)


if __name__ == "__main__":
    main()
