"""Shared reduction primitives of the algorithm level.

BatchNorm statistics and CrossEntropy are built from the same few pieces:

* ``tuple_reducer(("sum", "sum"))``: several reductions carried in one pass
  (BN's sum and sum of squares; CE's sum of exp and weighted sum of logits);
* ``shifted`` moments: sums of ``x - K`` and ``(x - K)^2`` for a per-channel shift K
  taken from the data, which keeps the variance accurate when |mean| >> std;
* ``online_logsumexp``: running max with a rescaled sum of exponentials
  (``m = max(m_a, m_b); s = s_a e^(m_a - m) + s_b e^(m_b - m)``), one pass over a row.

Index arithmetic is int32 unless a tensor has 2^31 elements or more.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import tvm_ffi
from tvm import te, tirx

from ..contracts.common import DTYPE_BYTES

INT32_LIMIT = 2**31 - 1
F32_LOWEST = -3.4028234663852886e38

_COMBINE = {
    "sum": lambda a, b: a + b,
    "min": lambda a, b: tirx.min(a, b),
    "max": lambda a, b: tirx.max(a, b),
}
_IDENTITY = {
    "sum": lambda dtype: tirx.const(0, dtype),
    "min": tirx.max_value,
    "max": tirx.min_value,
}


def index_dtype(numel: int) -> str:
    """int64 when flat offsets can pass 2^31 - 1, else int32 (cheaper on the GPU)."""
    return "int64" if numel > INT32_LIMIT else "int32"


def dims(shape: Sequence[int], dtype: str) -> list[tirx.IntImm]:
    return [tirx.IntImm(dtype, int(d)) for d in shape]


def _schedulable(arity: int, combine: Callable, identity: Callable) -> None:
    """Teach TensorIR's rfactor and cross-thread reduction this reducer.

    TensorIR recognizes a reduction block by matching its combiner against a registry
    that holds only sum, product, min, max, a pair of sums and argmax/argmin; tuples
    such as (sum, sum, min) or the online log-sum-exp must be registered, in every
    process that schedules or lowers them (MetaSchedule's builders import this module).
    """
    register = tvm_ffi.get_global_func("s_tir.schedule.RegisterReducer")
    callbacks = [
        tvm_ffi.convert(lambda lhs, rhs: list(combine(lhs, rhs))),
        tvm_ffi.convert(lambda values: list(identity(*[str(v.ty) for v in values]))),
    ]
    register(arity, *callbacks)
    # The registry is a C++ static that outlives the interpreter: were these the last
    # references, its destructor would call into a finalized Python at exit and
    # abort ("double free or corruption"). Keep them alive for good.
    for callback in callbacks:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))


def tuple_reducer(kinds: Sequence[str], name: str | None = None) -> te.CommReducer:
    """A reducer carrying ``len(kinds)`` independent reductions through one pass."""
    kinds = tuple(kinds)

    def combine(lhs, rhs):
        return tuple(_COMBINE[k](a, b) for k, a, b in zip(kinds, lhs, rhs))

    def identity(*dtypes):
        return tuple(_IDENTITY[k](d) for k, d in zip(kinds, dtypes))

    if kinds not in _REGISTERED:
        _REGISTERED.add(kinds)
        if len(kinds) > 1 and kinds != ("sum", "sum"):
            _schedulable(len(kinds), combine, identity)
    return te.comm_reducer(combine, identity, name=name or "_".join(kinds))


_REGISTERED: set = set()


DUAL_SUM = tuple_reducer(("sum", "sum"), name="dual_sum")
TRIPLE_SUM = tuple_reducer(("sum", "sum", "sum"), name="triple_sum")
BATCH_SUMS = tuple_reducer(("sum", "sum", "min"), name="batch_sums")


def online_logsumexp(extra_sums: int = 0) -> te.CommReducer:
    """Reducer over ``(s, m, *sums)``: rescaled sum of exp, running max, plain sums.

    The sum comes first on purpose: TVM's cross-thread lowering updates the
    components of a tuple one after another in place, so a component may only
    depend on the ones after it (argmax orders (index, value) for the same reason).
    ``s`` needs the old ``m``; ``m`` needs nothing else.

    The identity uses the lowest finite float32 for ``m`` rather than -inf so that
    combining two identities gives ``0 * e^0 = 0`` instead of ``0 * e^(-inf + inf)
    = NaN``; a NaN or +inf element still turns ``s`` into NaN through
    ``e^(x - m)``, as torch's logsumexp does.
    """

    def combine(lhs, rhs):
        m = tirx.max(lhs[1], rhs[1])
        s = lhs[0] * te.exp(lhs[1] - m) + rhs[0] * te.exp(rhs[1] - m)
        return (s, m) + tuple(a + b for a, b in zip(lhs[2:], rhs[2:]))

    def identity(*dtypes):
        # TensorIR asks every registered reducer of the arity for its identity while
        # matching a combiner, with that combiner's dtypes: (float32, int32) for the
        # gradient's (sum, min) over the targets. Give a valid constant for any dtype.
        lowest = tirx.const(F32_LOWEST, dtypes[1]) if "float" in dtypes[1] else tirx.min_value(dtypes[1])
        return (tirx.const(0, dtypes[0]), lowest) + tuple(tirx.const(0, d) for d in dtypes[2:])

    if ("online", extra_sums) not in _REGISTERED:
        _REGISTERED.add(("online", extra_sums))
        _schedulable(2 + extra_sums, combine, identity)
    return te.comm_reducer(combine, identity, name=f"online_lse_{extra_sums}")


ONLINE_LSE = [online_logsumexp(extra) for extra in range(3)]


def widen(value: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """``value`` (of ``dtype``) as float32, the accumulation type of every kernel.

    bfloat16 is widened by its bits (``bits << 16``): TVM's bf16 legalization on
    LLVM mistranslates a plain cast inside a tuple reduction (the let-bound form
    that (sum, sumsq) lowers to) into an integer conversion of the bits. On CUDA
    both forms compile to the same shift."""
    if dtype == "bfloat16":
        bits = tirx.Cast("uint32", tirx.reinterpret("uint16", value))
        return tirx.reinterpret("float32", bits << tirx.const(16, "uint32"))
    if dtype == "float32":
        return value
    return value.astype("float32")


# Cephes' expf: exp(x) = 2^n * exp(f), n = round(x / ln 2), |f| <= ln(2) / 2,
# exp(f) by a degree-7 polynomial; relative error about 2e-7 on [-88, 88].
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)


def poly_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """float32 exp from multiplies, adds and bit shifts, so LLVM vectorizes it.

    LLVM has no vector exp: ``llvm.exp.v16f32`` becomes 16 calls to ``expf``. This
    form keeps a whole row pass in SIMD registers. NaN stays NaN and -inf gives 0
    (below -87.3 the result is flushed to 0), as exp does."""
    f32 = "float32"
    c = lambda v: tirx.const(v, f32)  # noqa: E731
    clamped = tirx.max(tirx.min(x, c(88.3762626647950)), c(-87.3365478515625))
    n = tirx.floor(clamped * c(1.44269504088896341) + c(0.5))
    f = clamped - n * c(0.693359375) + n * c(2.12194440e-4)
    poly = c(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        poly = poly * f + c(coef)
    y = poly * f * f + f + c(1.0)
    scale = tirx.reinterpret(f32, (n.astype("int32") + tirx.const(127, "int32")) << tirx.const(23, "int32"))
    result = tirx.Select(x < c(-87.3365478515625), c(0.0), y * scale)
    # NaN in, NaN out. Tested on the bits: tirx.isnan inside a vectorized tuple
    # reduction is miscompiled by LLVM lowering (the select goes the wrong way).
    magnitude = tirx.reinterpret("int32", x) & tirx.const(0x7FFFFFFF, "int32")
    return tirx.Select(magnitude > tirx.const(0x7F800000, "int32"), x, result)


def logsumexp(row_max: tirx.PrimExpr, row_sumexp: tirx.PrimExpr) -> tirx.PrimExpr:
    return te.log(row_sumexp) + row_max


VECTOR_BYTES = 16  # one aligned 16-byte load (LDG.E.128): the granule of the padded and aligned decompositions


def granule(dtype: str) -> int:
    """Elements of ``dtype`` in one 16-byte granule (8 for 16-bit, 4 for float32)."""
    return VECTOR_BYTES // DTYPE_BYTES[dtype]
