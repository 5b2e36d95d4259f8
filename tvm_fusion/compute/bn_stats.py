"""Algorithm level of bn_stats: map (cast, square) + dual reduction per channel.

Two decompositions of the same contract, as TE compute:

``one_pass``  ``x(SRR) -> (sum, sumsq)(S) -> mean, var``
    mean = sum / n, var = sumsq / n - mean^2. One read of x, but the subtraction
    cancels catastrophically when |mean| >> std.
``shifted``   the same with ``d = x - K[c]``, K[c] the channel's first value
    mean = K + sum(d) / n, var = sum(d^2) / n - (sum(d) / n)^2. Exact in the
    cancellation case (mean 1000, std 0.01) for the price of one extra read per
    channel, so every kernel candidate uses it unless it says otherwise.
``shifted_sampled``  the same with K[c] the mean of the channel's first
    ``SHIFT_SAMPLES`` values. A long float32 sum of same-sign d drifts: with K one
    value 3 std from the mean, 16k-row partials of bf16 put a mean 5e-4 and a
    variance 4e-3 off (relative, 1M x 24); the mean of 8 values keeps K near the
    mean. For candidates whose partials are long (the CPU's).

Block names (``shift``, ``moments``, ``mean``, ``var``) are what schedules refer to.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.bn_stats import BNStatsProblem
from .primitives import DUAL_SUM, dims, index_dtype, widen

ALGORITHMS = ("shifted", "shifted_sampled", "one_pass")
SHIFT_SAMPLES = 64


def bn_stats_te(problem: BNStatsProblem, algorithm: str = "shifted") -> list[te.Tensor]:
    """TE tensors ``[x, mean, var]`` for ``problem`` under ``algorithm``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"bn_stats: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    x = te.placeholder(dims(problem.shape, index_dtype(problem.numel)), problem.dtype, name="x")
    return [x, *statistics(problem, x, algorithm)]


def statistics(problem, x: te.Tensor, algorithm: str) -> tuple[te.Tensor, te.Tensor]:
    """``(mean, var)`` of ``x`` per channel: the stages above, for any problem with the
    canonical view (``shape``, ``channels_last``, ``channels``, ``count``) and a dtype."""
    idx = index_dtype(problem.numel)
    shift = None
    channels = dims([problem.channels], idx)
    count = float(problem.count)

    if problem.channels_last:
        m = te.reduce_axis((tirx.IntImm(idx, 0), x.shape[0]), name="m")

        def value(c):
            return widen(x[m, c], problem.dtype)

        def first(c):
            return widen(x[tirx.IntImm(idx, 0), c], problem.dtype)

        samples = min(SHIFT_SAMPLES, problem.shape[0])

        def sample(c, s):
            return widen(x[s, c], problem.dtype)

        axes = [m]
    else:
        n = te.reduce_axis((tirx.IntImm(idx, 0), x.shape[0]), name="n")
        l = te.reduce_axis((tirx.IntImm(idx, 0), x.shape[2]), name="l")

        def value(c):
            return widen(x[n, c, l], problem.dtype)

        def first(c):
            zero = tirx.IntImm(idx, 0)
            return widen(x[zero, c, zero], problem.dtype)

        samples = min(SHIFT_SAMPLES, problem.shape[2])

        def sample(c, s):
            return widen(x[tirx.IntImm(idx, 0), c, s], problem.dtype)

        axes = [n, l]

    if algorithm == "shifted_sampled":
        s_axis = te.reduce_axis((tirx.IntImm(idx, 0), tirx.IntImm(idx, samples)), name="s")
        shift_sum = te.compute(channels, lambda c: te.sum(sample(c, s_axis), axis=s_axis), name="shift_sum")
        shift = te.compute(channels, lambda c: shift_sum[c] / float(samples), name="shift")
    elif algorithm == "shifted":
        shift = te.compute(channels, first, name="shift")
    if shift is not None:

        def moments_body(c):
            d = value(c) - shift[c]
            return DUAL_SUM((d, d * d), axis=axes)

    else:
        def moments_body(c):
            v = value(c)
            return DUAL_SUM((v, v * v), axis=axes)

    total, total_sq = te.compute(channels, moments_body, name="moments")

    def mean_body(c):
        mean_d = total[c] / count
        return mean_d if shift is None else shift[c] + mean_d

    def var_body(c):
        mean_d = total[c] / count
        var = total_sq[c] / count - mean_d * mean_d
        # Clamp rounding below zero, but let NaN through (max(NaN, 0) would hide it).
        return tirx.Select(var < 0.0, tirx.const(0.0, "float32"), var)

    mean = te.compute(channels, mean_body, name="mean")
    var = te.compute(channels, var_body, name="var")
    return mean, var
