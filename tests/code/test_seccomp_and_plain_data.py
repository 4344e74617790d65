"""The seccomp filter's syscall table against libseccomp, and the plain-data codec against
hand-written wire text."""
import ctypes
import ctypes.util
import errno
import math
import platform

import pytest

from quatro_nemo.rewards import plain_data, seccomp_filter

_SCMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}   # = AUDIT_ARCH_* (seccomp.h)


@pytest.mark.parametrize("machine", sorted(_SCMP_ARCH))
def test_syscall_numbers_match_libseccomp(machine):
    path = ctypes.util.find_library("seccomp")
    if path is None:
        pytest.skip("libseccomp not installed (Debian: libseccomp2)")
    libseccomp = ctypes.CDLL(path)
    resolve = libseccomp.seccomp_syscall_resolve_name_arch
    resolve.argtypes, resolve.restype = [ctypes.c_uint32, ctypes.c_char_p], ctypes.c_int
    ours = seccomp_filter.syscall_numbers(machine)
    named = set(seccomp_filter.DENIED_SYSCALLS) | set(seccomp_filter.ARGUMENT_RULES)
    theirs = {name: resolve(_SCMP_ARCH[machine], name.encode()) for name in named}
    # libseccomp: a negative pseudo-number for a call the architecture lacks, and an error for
    # one newer than the library (setxattrat, Linux 6.13, is newer than libseccomp 2.5)
    assert {name for name, number in theirs.items() if number >= 0} <= set(ours) <= named
    assert {name: number for name, number in ours.items() if theirs[name] >= 0} == \
        {name: number for name, number in theirs.items() if number >= 0}


def test_unknown_architecture_is_refused():
    with pytest.raises(RuntimeError, match="riscv64"):
        seccomp_filter.build_filter("riscv64")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x32 is an x86_64 ABI")
def test_x32_syscalls_are_denied(sandbox):
    # getpid through the x32 ABI: ENOSYS on kernels without x32, a PID with it; EPERM here.
    program = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.syscall(0x40000000 + 39), ctypes.get_errno())\n")
    assert sandbox.run(program).stdout.split() == ["-1", str(errno.EPERM)]


def _exact_types(value):
    """Every type inside `value` (what the judge's comparisons would dispatch on)."""
    kinds = {type(value)}
    if type(value) in (list, tuple, set, frozenset):
        for item in value:
            kinds |= _exact_types(item)
    elif type(value) is dict:
        for key, item in value.items():
            kinds |= _exact_types(key) | _exact_types(item)
    return kinds


def test_plain_data_wire_format():
    value = [None, True, 3, 2.5, "é\n", b"\x00\xff", (1, (2,)), {"a": [1], (1, 2): {3}}, frozenset({4}), 1 + 2j,
             10 ** 30]
    text = plain_data.encode(value)
    assert text == ('[null,true,3,2.5,"\\u00e9\\n",{"b":"00ff"},{"t":[1,{"t":[2]}]},{"d":[["a",[1]],[{"t":[1,2]},'
                    '{"s":[3]}]]},{"fs":[4]},{"c":[1.0,2.0]},1000000000000000000000000000000]')
    assert plain_data.decode(text) == value
    assert _exact_types(plain_data.decode(text)) <= {type(None), bool, int, float, str, bytes, tuple, list, dict,
                                                     set, frozenset, complex}
    assert math.isnan(plain_data.decode(plain_data.encode(float("nan"))))
    assert plain_data.decode(plain_data.encode([float("inf")])) == [float("inf")]


def test_plain_data_encoder_reduces_subclasses_and_refuses_objects():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    assert plain_data.encode(AlwaysEqual(5)) == "5"
    assert type(plain_data.decode(plain_data.encode(AlwaysEqual(5)))) is int
    with pytest.raises(plain_data.UnsupportedValue, match="object"):
        plain_data.encode(object())
    with pytest.raises(plain_data.UnsupportedValue):
        plain_data.encode([1, lambda: 0])


@pytest.mark.parametrize("text", [
    '{"x": 1}',                          # unknown tag
    '{"t": [1], "s": [2]}',              # two keys
    '{"s": [[1]]}',                      # unhashable set member
    '{"d": [[[1], 2]]}',                 # unhashable key
    '{"d": [[1]]}',                      # not a pair
    '{"b": "zz"}',                       # not hex
    '{"c": ["1", 2]}',                   # not numbers
    '{"t": 5}',                          # payload of the wrong type
    "[" * 100000 + "]" * 100000,         # deeper than the interpreter's recursion limit
    "[" * 65 + "]" * 65,                 # deeper than plain_data.MAX_DEPTH
    "1" * 100_001,                       # more digits than plain_data.MAX_INT_DIGITS
    '{"c": [1' + "0" * 400 + ', 0]}',    # a complex part beyond float (OverflowError)
    "0." + "1" * 5000,                   # a float literal longer than MAX_FLOAT_CHARS
    "not json",
])
def test_plain_data_decoder_refuses_anything_else(text):
    with pytest.raises(ValueError):
        plain_data.decode(text)
