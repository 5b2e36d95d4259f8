"""Algorithm level of BatchNorm's backward: one dual reduction per channel, then a map.

``dual_reduce``  ``x, dy(SRR) -> (sum dy, sum dy * xhat)(S) -> dbias, dweight, coef(S)
-> dx(SSS)``

1. ``grad_sums``: per channel, ``sum dy`` and ``sum dy * xhat`` with
   ``xhat = (x - mean) * invstd``, in float32 (one read of x and dy);
2. ``dbias``, ``dweight``: the two sums (torch's gradients of bias and weight);
3. per channel coefficients (``bn_dx_scale`` = weight * invstd, ``bn_dx_mean`` =
   sum dy / n, ``bn_dx_xhat`` = sum dy * xhat / n, from the sums, not the outputs: on
   a GPU every thread reads them, and only one thread writes an output; eval needs
   the scale only);
4. ``dx``: the map ``scale * (dy - mean_term - xhat * xhat_term)``, in x's dtype
   (a second read of x and dy, unless a schedule keeps them on chip).

``dual_reduce_parts``  the same sums per part of each channel (its first axis cut in
``bn_stats.parts`` for x and dy together, ``part_grad_sums``), added up twice: for the
map's coefficients (``grad_sums_map``) and for ``dbias`` and ``dweight``
(``grad_sums``): a grid-wide persistent schedule computes the first in every block of a
channel after its grid barrier, the second in a kernel after it
(``bn_backward_grid_persistent``).

``dual_reduce_half_parts``  ``dual_reduce_parts`` with parts of at most half the bytes,
so that a schedule keeps two parts of x and dy on chip at once: the ones it reduces and
maps, and the next ones it copies in meanwhile (``bn_backward_grid_pipelined``).

Block names are what schedules refer to.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.bn_backward import BNBackwardProblem
from .bn_stats import part_sums, sum_parts
from .primitives import DUAL_SUM, dims, index_dtype, widen

ALGORITHMS = ("dual_reduce", "dual_reduce_parts", "dual_reduce_half_parts")
# The parts decompositions, and how many part-sized copies (of x and dy) each keeps
# on chip (``bn_stats.parts``).
PART_COPIES = {"dual_reduce_parts": 2, "dual_reduce_half_parts": 4}
F32 = "float32"


def dx_coefficients(problem: BNBackwardProblem) -> list[str]:
    """The per-channel blocks ``dx`` reads (a schedule puts them at its channel)."""
    return ["bn_dx_scale"] + (["bn_dx_mean", "bn_dx_xhat"] if problem.training else [])


def backward_inputs(problem) -> tuple:
    """``(shape, channels, x, dy, mean, invstd, weight or None)``: the placeholders every
    BatchNorm backward reads (``bn_backward``'s and ``bn_backward_dx``'s), on the
    problem's canonical view."""
    idx = index_dtype(problem.numel)
    shape = dims(problem.shape, idx)
    channels = dims([problem.channels], idx)
    x = te.placeholder(shape, problem.dtype, name="x")
    dy = te.placeholder(shape, problem.dtype, name="dy")
    mean = te.placeholder(channels, F32, name="mean")
    invstd = te.placeholder(channels, F32, name="invstd")
    weight = te.placeholder(channels, F32, name="weight") if problem.affine else None
    return shape, channels, x, dy, mean, invstd, weight


def bn_backward_te(problem: BNBackwardProblem, algorithm: str = "dual_reduce") -> list[te.Tensor]:
    """TE tensors ``[x, dy, mean, invstd, (weight,) dx, dweight, dbias]``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"bn_backward: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    shape, channels, x, dy, mean, invstd, weight = backward_inputs(problem)
    idx = index_dtype(problem.numel)
    count = float(problem.count)

    if problem.channels_last:
        m = te.reduce_axis((tirx.IntImm(idx, 0), shape[0]), name="m")
        axes = [m]

        def at(c):
            return (m, c)

        def channel_of(*index):
            return index[1]
    else:
        n = te.reduce_axis((tirx.IntImm(idx, 0), shape[0]), name="n")
        l = te.reduce_axis((tirx.IntImm(idx, 0), shape[2]), name="l")
        axes = [n, l]

        def at(c):
            return (n, c, l)

        def channel_of(*index):
            return index[1]

    def sums_body(c):
        g = widen(dy[at(c)], problem.dtype)
        xhat = (widen(x[at(c)], problem.dtype) - mean[c]) * invstd[c]
        return DUAL_SUM((g, g * xhat), axis=axes)

    if algorithm in PART_COPIES:
        def values(index, c):
            g = widen(dy[index], problem.dtype)
            return g, g * ((widen(x[index], problem.dtype) - mean[c]) * invstd[c])

        partials = part_sums(problem, PART_COPIES[algorithm], values, "part_grad_sums")
        sum_dy, sum_dy_xhat = sum_parts(*partials, "grad_sums")
        map_dy, map_dy_xhat = sum_parts(*partials, "grad_sums_map")
    else:
        sum_dy, sum_dy_xhat = te.compute(channels, sums_body, name="grad_sums")
        map_dy, map_dy_xhat = sum_dy, sum_dy_xhat
    dbias = te.compute(channels, lambda c: sum_dy[c], name="dbias")
    dweight = te.compute(channels, lambda c: sum_dy_xhat[c], name="dweight")
    scale = te.compute(channels, lambda c: invstd[c] * weight[c] if weight is not None else invstd[c],
                       name="bn_dx_scale")
    if problem.training:
        mean_term = te.compute(channels, lambda c: map_dy[c] / count, name="bn_dx_mean")
        xhat_term = te.compute(channels, lambda c: map_dy_xhat[c] / count, name="bn_dx_xhat")

    def dx_body(*index):
        c = channel_of(*index)
        g = widen(dy[index], problem.dtype)
        if problem.training:
            xhat = (widen(x[index], problem.dtype) - mean[c]) * invstd[c]
            g = g - mean_term[c] - xhat * xhat_term[c]
        value = scale[c] * g
        return value if problem.dtype == F32 else value.astype(problem.dtype)

    dx = te.compute(shape, dx_body, name="dx")
    params = [x, dy, mean, invstd] + ([weight] if weight is not None else [])
    return params + [dx, dweight, dbias]
