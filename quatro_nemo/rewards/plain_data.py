"""Plain data across the sandbox boundary: one JSON line per value, decoded into builtins only.

A program under test hands its results to the trusted side (the judge in the sandbox, or the
trainer) only through this encoding, so what arrives is data, never an object of the program's
(an ``__eq__`` that always returns True, a poisoned ``__hash__``...). The encoder runs in the
program's process and is therefore untrusted: it only has to be honest for honest programs.
The decoder runs on the trusted side and can only build None, bool, int, float, complex, str,
bytes, list, tuple, dict, set and frozenset, whatever the bytes it is given.

Wire format: JSON, where lists are arrays, None/bool/int/float/str are JSON values (floats keep
their decimal point, NaN/Infinity as Python's json writes them), and every JSON object is a tag
with exactly one key: {"t": [...]} tuple, {"s": [...]} set, {"fs": [...]} frozenset,
{"d": [[key, value], ...]} dict (keys of any plain type), {"b": "<hex>"} bytes, {"c": [re, im]}
complex. Standard library only: this file is also copied into the sandbox.
"""
import json
import re

_SCALARS = (type(None), bool, int, float, str)
_NUMPY_SCALAR_MODULE = "numpy"


class UnsupportedValue(TypeError):
    """A value that is not plain data (the case fails: the test cannot see it)."""


def _plain(value):
    """The JSON-ready form of `value`. Subclasses of builtins become their base type and numpy
    scalars their Python value (what an honest ``==`` would compare); anything else raises."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [_plain(item) for item in value]
    if kind is tuple:
        return {"t": [_plain(item) for item in value]}
    if kind is dict:
        return {"d": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if kind is set:
        return {"s": [_plain(item) for item in value]}
    if kind is frozenset:
        return {"fs": [_plain(item) for item in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if kind.__module__ == _NUMPY_SCALAR_MODULE and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return _plain(value.item())
    for base in (bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return _plain(base(value))
    raise UnsupportedValue(f"not plain data: {kind.__module__}.{kind.__qualname__}")


def encode(value) -> str:
    """One line of JSON (no newline inside)."""
    return json.dumps(_plain(value), separators=(",", ":"))


# Bounds of what the trusted side decodes, decided here and checked before (depth) or while
# (numbers, set and dict members) decoding, never left to the interpreter's defaults (its
# recursion limit, its 4,300-digit int() limit) or to luck (sets of integers with equal hashes
# make set construction quadratic: hash(n) == hash(n + k * (2**61 - 1))).
MAX_DEPTH = 64                   # nested arrays/objects
MAX_INT_DIGITS = 100_000         # digits of one integer (converted in chunks: no int() limit)
MAX_FLOAT_CHARS = 4000           # characters of one float literal (Python's repr needs <= 24)
MAX_EQUAL_HASHES = 16            # members of one set / keys of one dict sharing a hash value
_INT_CHUNK_DIGITS = 4000         # < CPython's default int() limit of 4,300 digits

_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)    # unrolled: linear, no backtracking
_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")
_NUMBER_RE = re.compile(r"[-+.0-9eE]+")
_BRACKETS_AS_SQUARE = str.maketrans("{}", "[]")


def _check_depth(skeleton):
    """ValueError when arrays/objects nest deeper than MAX_DEPTH in `skeleton` (the text with
    its strings blanked). At most MAX_DEPTH + 1 linear passes, each removing the innermost
    bracket pairs."""
    brackets = _NOT_BRACKET_RE.sub("", skeleton).translate(_BRACKETS_AS_SQUARE)
    for _ in range(MAX_DEPTH):
        if "[]" not in brackets:
            return
        brackets = brackets.replace("[]", "")
    if "[]" in brackets:
        raise ValueError(f"not plain data: nested deeper than {MAX_DEPTH}")


def _int_from_digits(literal):
    """int(literal) for up to MAX_INT_DIGITS digits, by halves (each int() call below the
    interpreter's digit limit, which stays as it is)."""
    digits = literal.lstrip("-")
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"not plain data: an integer of more than {MAX_INT_DIGITS} digits")

    def convert(part):
        if len(part) <= _INT_CHUNK_DIGITS:
            return int(part)
        half = len(part) // 2
        return convert(part[:half]) * 10 ** (len(part) - half) + convert(part[half:])

    value = convert(digits)
    return -value if literal.startswith("-") else value


def _float_from_literal(literal):
    if len(literal) > MAX_FLOAT_CHARS:
        raise ValueError(f"not plain data: a float literal of more than {MAX_FLOAT_CHARS} characters")
    return float(literal)


def _check_hashes(members):
    """ValueError when more than MAX_EQUAL_HASHES members share a hash (an honest set has a few
    at most: hash(-1) == hash(-2)); building the set is then linear."""
    counts = {}
    for member in members:
        key = hash(member)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > MAX_EQUAL_HASHES:
            raise ValueError(f"not plain data: more than {MAX_EQUAL_HASHES} members with one hash value")


def _complex(parts):
    try:
        return complex(*parts)
    except OverflowError:
        raise ValueError("not plain data: complex part out of range") from None


def _set(members):
    _check_hashes(members)
    return set(members)


def _frozenset(members):
    _check_hashes(members)
    return frozenset(members)


def _dict(pairs):
    _check_hashes([key for key, _ in pairs])
    return dict(pairs)


_TAGS = {
    "t": tuple,
    "s": _set,
    "fs": _frozenset,
    "d": _dict,
    "b": lambda text: bytes.fromhex(text),
    "c": _complex,
}
_TAG_PAYLOAD = {"t": list, "s": list, "fs": list, "d": list, "b": str, "c": list}


def _untag(pairs):
    if len(pairs) != 1 or pairs[0][0] not in _TAGS:
        raise ValueError(f"unknown tagged object {[k for k, _ in pairs][:3]}")
    tag, payload = pairs[0]
    if type(payload) is not _TAG_PAYLOAD[tag]:
        raise ValueError(f"tag {tag!r} needs a {_TAG_PAYLOAD[tag].__name__}")
    if tag == "d" and not all(type(item) is list and len(item) == 2 for item in payload):
        raise ValueError("tag 'd' needs [key, value] pairs")
    if tag == "c" and not (len(payload) == 2 and all(type(x) in (int, float) for x in payload)):
        raise ValueError("tag 'c' needs [real, imag]")
    return _TAGS[tag](payload)


def decode(text: str):
    """The plain value encoded in `text`. Raises ValueError for anything else (bad JSON, unknown
    tags, unhashable set members or dict keys, and anything beyond the bounds above). Linear in
    len(text) up to a factor of MAX_DEPTH (the depth check) and MAX_EQUAL_HASHES (set members)."""
    skeleton = _STRING_RE.sub('""', text)
    _check_depth(skeleton)
    longest_number = max(map(len, _NUMBER_RE.findall(skeleton)), default=0)
    # json's own int() and float() (fast) unless a number is long enough to need the bounds
    bounded = ({} if longest_number <= _INT_CHUNK_DIGITS else
               {"parse_int": _int_from_digits, "parse_float": _float_from_literal})
    try:
        return json.loads(text, object_pairs_hook=_untag, **bounded)
    except (TypeError, RecursionError, OverflowError) as err:   # unhashable keys/members
        raise ValueError(f"not plain data: {type(err).__name__}") from None
