"""Argument checks shared by the operator contracts.

Every message names the argument and the value it got, so that a user reading
only the exception knows what to change.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_ELEMENTS = 2**63 - 1  # the most an int64 index reaches
INDEX_DTYPES = ("int32", "int64")


def check_shape(op: str, name: str, shape: object) -> tuple[int, ...]:
    """Return ``shape`` as a tuple of non-negative ints, or raise naming ``name``."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"{op}: {name} must be a sequence of ints, got {shape!r}")
    dims = tuple(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) and not hasattr(dim, "__index__"):
            raise TypeError(f"{op}: {name} must contain ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"{op}: {name} must not have negative sizes, got {dims}")
    if numel(dims) > MAX_ELEMENTS:  # TVM's index arithmetic failed on it with an error naming neither
        raise ValueError(f"{op}: {name} {dims} has {numel(dims)} elements, more than an int64 index "
                         f"reaches (2**63 - 1)")
    return dims


def check_choice(op: str, name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{op}: {name} must be one of {allowed}, got {value!r}")
    return value


def check_dtype(op: str, name: str, dtype: str, allowed: Sequence[str]) -> str:
    if dtype not in allowed:
        raise TypeError(f"{op}: {name} dtype must be one of {', '.join(allowed)}, got {dtype}")
    return dtype


def check_int(op: str, name: str, value: object) -> int:
    """``value`` as an int: an int, or what ``operator.index`` takes (np.int64, a 0-d
    numpy int array, a one-element int tensor), not ``int()``'s truncation of a float
    tensor or array (``torch.tensor(3.5)`` was taken as 3; torch refuses it)."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int, got {value!r}") from None


def check_bool(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return value


def numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}
