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


_TAGS = {
    "t": tuple,
    "s": set,
    "fs": frozenset,
    "d": dict,
    "b": lambda text: bytes.fromhex(text),
    "c": lambda parts: complex(*parts),
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
    tags, unhashable set members or dict keys, nesting deeper than the interpreter allows)."""
    try:
        return json.loads(text, object_pairs_hook=_untag)
    except (TypeError, RecursionError) as err:          # unhashable keys/members, deep nesting
        raise ValueError(f"not plain data: {type(err).__name__}") from None
