"""Python values <-> JSON, exactly, without pickle and without importing anything."""

import base64
import enum
import functools
import re
import reprlib
from typing import Any

import ml_dtypes
import numpy as np

# Python types whose leaves are saved by value.
SCALAR_TYPES = {
    type(None): "None",
    bool: "bool",
    int: "int",
    float: "float",
    complex: "complex",
    str: "str",
    bytes: "bytes",
}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")

# Past this many bits an int is written in hexadecimal: fewer than 640
# decimal digits, which every Python converts whatever its limit.
DECIMAL_BITS = 2048
# How deep an encoded value may nest (JSON arrays and objects, the value
# itself being level 1): 64 nested tuples, lists or dicts. Readers refuse deeper
# values: reading, comparing or printing them would recurse without bound.
MAX_DEPTH = 128
# For showing malformed values in messages: a few levels, a few items.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def qualified_name(obj: Any) -> str:
    """`module.qualname` of a function or class, as far as it can be told."""
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qualname is None:
        qualname = type(obj).__qualname__
    return f"{module}.{qualname}"


def is_named_callable(obj: Any) -> bool:
    return isinstance(obj, functools.partial) or (
        callable(obj) and hasattr(obj, "__qualname__")
    )


def clean_repr(obj: Any) -> str:
    """`repr` without memory addresses, which differ from run to run."""
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not break a save
        text = f"<{qualified_name(type(obj))}>"
    # A description only: a lone surrogate (a file name from `os.fsdecode`,
    # shown with `str`) is written as its escape, which UTF-8 can hold.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _ADDRESS.sub("", text)


def encode(value: Any) -> Any:
    """Encodes a value as JSON: exactly for literals, as a description otherwise."""
    kind = type(value)
    if kind is int and value.bit_length() > DECIMAL_BITS:
        return {"int": hex(value)}
    if value is None or kind in (bool, int, str):
        return value
    exact = _ENCODE.get(kind)
    if exact is not None:
        return exact(value)
    if isinstance(value, np.dtype):
        return {"dtype": str(value)}
    if isinstance(value, np.generic):
        item = value.item()
        if not isinstance(item, np.generic):  # longdouble's item is itself
            return {"numpy": [str(value.dtype), encode(item)]}
    if isinstance(value, enum.Enum):
        return {"enum": f"{qualified_name(kind)}.{value.name}"}
    if isinstance(value, type) or is_named_callable(value):
        return {"callable": describe_callable(value)}
    return {"object": qualified_name(kind), "repr": clean_repr(value)}


# Values of these exact types, encoded exactly.
_ENCODE: dict[type, Any] = {
    float: lambda v: {"float": repr(v)},
    complex: lambda v: {"complex": [repr(v.real), repr(v.imag)]},
    bytes: lambda v: {"bytes": base64.b64encode(v).decode("ascii")},
    tuple: lambda v: {"tuple": [encode(x) for x in v]},
    list: lambda v: {"list": [encode(x) for x in v]},
    dict: lambda v: {"dict": [[encode(k), encode(x)] for k, x in v.items()]},
}


def describe_callable(fn: Any) -> str:
    """A stable, readable name for a callable, such as `functools.partial(f, 2)`."""
    if isinstance(fn, functools.partial):
        args = [clean_repr(a) for a in fn.args]
        args += [f"{k}={clean_repr(v)}" for k, v in fn.keywords.items()]
        return f"functools.partial({describe_callable(fn.func)}, {', '.join(args)})"
    return qualified_name(fn)


def scalar_type(encoded: Any) -> str | None:
    """The Python type name of an encoded scalar, or None if it is not one."""
    if encoded is None:
        return "None"
    if isinstance(encoded, bool):
        return "bool"
    if isinstance(encoded, int):
        return "int"
    if isinstance(encoded, str):
        return "str"
    if isinstance(encoded, dict) and len(encoded) == 1:
        (tag,) = encoded
        if tag in ("float", "complex", "bytes", "int"):
            return tag
    return None


def decode_scalar(encoded: Any) -> Any:
    """Decodes an encoded scalar exactly. Raises ValueError on anything else."""
    kind = scalar_type(encoded)
    if kind == "int" and isinstance(encoded, dict):
        text = _checked_str(encoded["int"])
        if not _HEX_INT.fullmatch(text):
            raise ValueError(f"not a hexadecimal integer: {_SHORT.repr(text)}")
        return int(text, 16)
    if kind in ("None", "bool", "int", "str"):
        return encoded
    if kind == "float":
        return float(_checked_str(encoded["float"]))
    if kind == "complex":
        real, imag = encoded["complex"]
        return complex(float(_checked_str(real)), float(_checked_str(imag)))
    if kind == "bytes":
        return base64.b64decode(_checked_str(encoded["bytes"]), validate=True)
    raise ValueError(f"not an encoded Python scalar: {encoded!r}")


class Unrebuildable(ValueError):
    """A value a save can write but a rebuild cannot make (a datetime64
    scalar, recorded as text): not damage."""


# The kinds of numpy scalars a rebuild makes, by `np.dtype.kind`: the value's
# encoded type for each. ml_dtypes' types (bfloat16, int4...) are kind `V`
# too, and are told apart by `ml_dtypes.iinfo`/`finfo`.
_NUMPY_VALUES = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}


def decode_numpy(body: Any) -> Any:
    """A numpy scalar from its record `[dtype, encoded value]`, checked before
    anything is made (its dtype as a save spells it, a value of its kind, in
    range and of at most its size) and made only if it encodes back to the
    very record: nothing is allocated past what the record's text holds.
    Raises `ValueError` for damage, `Unrebuildable` for what a save writes
    but a rebuild cannot make."""
    if not (type(body) is list and len(body) == 2 and type(body[0]) is str):
        raise ValueError("not a [dtype, value] pair")
    text, encoded = body
    if text.startswith(("[", "(")):
        raise Unrebuildable(f"a numpy scalar of structured dtype {_SHORT.repr(text)}")
    dtype = saved_dtype(text)
    kind = _numpy_kind(dtype)
    if kind in ("datetime", "object"):
        raise Unrebuildable(f"a numpy {dtype} scalar, recorded as text,")
    found = scalar_type(encoded)
    if found != kind:
        raise ValueError(
            f"a {dtype} scalar recorded with {_a(found or 'malformed')} value"
        )
    value = decode_scalar(encoded)
    _check_range(dtype, kind, value)
    made = _make(dtype, kind, value)
    if encode(made) != {"numpy": body}:
        raise ValueError(
            f"the {dtype} scalar {_SHORT.repr(value)} does not read back as "
            "recorded (a save records the value a scalar holds)"
        )
    return made


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def saved_dtype(text: Any) -> np.dtype:
    """The numpy dtype a save spells `text` (`str(dtype)`), other than structured
    and object dtypes, which a save refuses. Raises `ValueError` for
    anything else: other spellings (`U2` for `<U2`, `M8[s]`), unknown names."""
    if not isinstance(text, str):
        raise ValueError(f"dtype {_SHORT.repr(text)} is not a string")
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError, OverflowError, MemoryError, SyntaxError):
        raise ValueError(f"unknown dtype {_SHORT.repr(text)}") from None
    if str(dtype) != text:
        raise ValueError(
            f"dtype {_SHORT.repr(text)} is spelled {str(dtype)!r} where a save "
            "writes it"
        )
    if dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise ValueError(f"dtype {_SHORT.repr(text)} is one a save refuses")
    return dtype


def _numpy_kind(dtype: np.dtype) -> str:
    if dtype.kind in _NUMPY_VALUES:
        return _NUMPY_VALUES[dtype.kind]
    if dtype.kind == "S" or (dtype.kind == "V" and dtype.type is np.void):
        return "bytes"
    if dtype.kind == "U":
        return "str"
    if dtype.kind in "Mm":
        return "datetime"
    if dtype.kind == "V":  # ml_dtypes
        try:
            ml_dtypes.iinfo(dtype)
            return "int"
        except (TypeError, ValueError):
            pass
        try:
            ml_dtypes.finfo(dtype)
            return "float"
        except (TypeError, ValueError):
            pass
    return "object"


def _check_range(dtype: np.dtype, kind: str, value: Any) -> None:
    if kind == "int":
        info = ml_dtypes.iinfo(dtype) if dtype.kind == "V" else np.iinfo(dtype)
        if not int(info.min) <= value <= int(info.max):
            raise ValueError(
                f"{value if abs(value).bit_length() < 64 else '<a huge int>'} is "
                f"out of range for {dtype} ({info.min} to {info.max})"
            )
    elif kind in ("float", "complex"):
        finfo = ml_dtypes.finfo(dtype) if dtype.kind == "V" else np.finfo(dtype)
        parts = (value.real, value.imag) if kind == "complex" else (value,)
        limit = float(finfo.max)
        if any(abs(p) > limit and abs(p) != float("inf") for p in parts):
            raise ValueError(f"{value!r} is out of range for {dtype}")
    elif kind == "str":
        # Numpy holds 4 bytes a character: the record's text is at most that.
        if len(value) > dtype.itemsize // 4:
            raise ValueError(f"a string of {len(value)} characters is no {dtype}")
    elif kind == "bytes" and len(value) > dtype.itemsize:
        raise ValueError(f"{len(value)} bytes are no {dtype}")


def _make(dtype: np.dtype, kind: str, value: Any) -> Any:
    if kind == "bytes" and dtype.type is np.void:
        return np.void(value)
    return dtype.type(value)


def _checked_str(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"expected a string, found {_SHORT.repr(text)}")
    return text


def is_text(text: str) -> bool:
    """Whether `text` is valid Unicode, which UTF-8 can hold: no lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_text(encoded: Any) -> str | None:
    """The first string of an encoded value (keys too) that is not valid Unicode."""
    stack = [encoded]
    while stack:
        node = stack.pop()
        if type(node) is str:
            if not is_text(node):
                return node
        elif type(node) is dict:
            stack.extend(node)
            stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
    return None


def too_deep(encoded: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether an encoded value nests more than `limit` JSON levels deep."""
    if type(encoded) not in (dict, list):
        return False
    stack = [(encoded, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if type(node) is dict else node
        stack.extend((c, depth + 1) for c in children if type(c) in (dict, list))
    return False


def describe(encoded: Any) -> str:
    """Human-readable text for an encoded value, for messages and `inspect`."""
    try:
        return _describe(encoded)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return _SHORT.repr(encoded)


def _describe(encoded: Any) -> str:
    if scalar_type(encoded) is not None:
        value = decode_scalar(encoded)
        if type(value) is int and value.bit_length() > DECIMAL_BITS:
            return f"<int of {value.bit_length()} bits>"
        return repr(value)
    if isinstance(encoded, dict) and len(encoded) >= 1:
        tag = next(iter(encoded))
        if tag == "object":
            return str(encoded.get("repr"))
        shown = _DESCRIBE.get(tag)
        if shown is not None:
            return shown(encoded[tag])
    return repr(encoded)


def _tuple_text(body) -> str:
    items = [_describe(v) for v in body]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


# How each tag of an encoded value reads, from its body.
_DESCRIBE: dict[str, Any] = {
    "tuple": _tuple_text,
    "list": lambda body: "[" + ", ".join(_describe(v) for v in body) + "]",
    "dict": lambda body: (
        "{" + ", ".join(f"{_describe(k)}: {_describe(v)}" for k, v in body) + "}"
    ),
    "dtype": lambda body: f"dtype({body!r})",
    "numpy": lambda body: f"{body[0]}({_describe(body[1])})",
    "enum": str,
    "callable": str,
}
