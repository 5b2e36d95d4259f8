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

``padded_shifted``  ``shifted`` on the (N, C, L) view over the channel's 16-byte granules,
    L a multiple of a granule's e elements (G = L / e a plane, F = N G a channel),
    padded to a multiple of ``PAD_LANES``, Fp: ``granules[c, f, v]`` (a map a schedule
    inlines) reads granule min(f, F - 1), plane n = f' / G at granule f' mod G, and
    ``moments`` masks the pads by a select (d = 0). The padded domain splits evenly
    over any power-of-two block, so a lane's loads carry no guard; ``shifted`` split
    the same way guards every step (16x512x28x28 bf16 on 128 threads: 13 steps of
    16-byte loads, each behind a branch, one load in flight a lane).
Block names (``shift``, ``moments``, ``mean``, ``var``) are what schedules refer to.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.bn_stats import BNStatsProblem
from ..contracts.common import DTYPE_BYTES
from .primitives import DUAL_SUM, dims, granule, index_dtype, widen

ALGORITHMS = ("shifted", "shifted_sampled", "one_pass", "padded_shifted")
PAD_LANES = 1024  # padded_shifted pads a channel's granules to a multiple of a block's most threads
SHIFT_SAMPLES = 64


def bn_stats_te(problem: BNStatsProblem, algorithm: str = "shifted") -> list[te.Tensor]:
    """TE tensors ``[x, mean, var]`` for ``problem`` under ``algorithm``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"bn_stats: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    x = te.placeholder(dims(problem.shape, index_dtype(problem.numel)), problem.dtype, name="x")
    if algorithm == "padded_shifted":
        return [x, *padded_statistics(problem, x)]
    return [x, *statistics(problem, x, algorithm)]


def padded_granules(problem) -> tuple[int, int, int]:
    """``padded_shifted``'s (e, F, Fp): a granule's elements, a channel's granules and
    their count padded to a multiple of ``PAD_LANES``; a ValueError for a channels-last
    view or a plane that is not whole granules."""
    elements = granule(problem.dtype)
    if problem.channels_last or problem.shape[2] % elements:
        raise ValueError(f"bn_stats: padded_shifted needs the (N, C, L) view with L a multiple of {elements} for "
                         f"{problem.dtype}, got {problem.describe()}")
    count = problem.shape[0] * (problem.shape[2] // elements)
    return elements, count, -(-count // PAD_LANES) * PAD_LANES


def padded_statistics(problem, x: te.Tensor) -> tuple[te.Tensor, te.Tensor]:
    """``padded_shifted``'s ``(mean, var)`` per channel (see the module's docstring)."""
    idx = index_dtype(problem.numel)
    elements, count, padded = padded_granules(problem)
    E, G = tirx.IntImm(idx, elements), tirx.IntImm(idx, problem.shape[2] // elements)
    last, zero = tirx.IntImm(idx, count - 1), tirx.IntImm(idx, 0)

    def element(c, f, v):  # granule f of the channel, clamped into it: a whole aligned granule
        f = tirx.min(f, last)
        return x[tirx.floordiv(f, G), c, tirx.floormod(f, G) * E + v]

    granules = te.compute([tirx.IntImm(idx, problem.channels), tirx.IntImm(idx, padded), E], element, name="granules")
    channels = dims([problem.channels], idx)
    shift = te.compute(channels, lambda c: widen(x[zero, c, zero], problem.dtype), name="shift")
    f = te.reduce_axis((zero, tirx.IntImm(idx, padded)), name="f")
    v = te.reduce_axis((zero, E), name="v")

    def moments_body(c):
        d = tirx.Select(f < tirx.IntImm(idx, count), widen(granules[c, f, v], problem.dtype) - shift[c],
                        tirx.const(0.0, "float32"))
        return DUAL_SUM((d, d * d), axis=[f, v])

    total, total_sq = te.compute(channels, moments_body, name="moments")
    return finalize(problem, shift, total, total_sq)


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
    return finalize(problem, shift, total, total_sq)


def finalize(problem, shift: te.Tensor | None, total: te.Tensor, total_sq: te.Tensor,
             suffix: str = "") -> tuple[te.Tensor, te.Tensor]:
    """``(mean, var)`` from a channel's sums of ``d = x - shift`` (of x where ``shift``
    is None) and of ``d^2``; ``suffix`` ends the blocks' names."""
    channels = [total.shape[0]]
    count = float(problem.count)

    def mean_body(c):
        mean_d = total[c] / count
        return mean_d if shift is None else shift[c] + mean_d

    def var_body(c):
        mean_d = total[c] / count
        var = total_sq[c] / count - mean_d * mean_d
        # Clamp rounding below zero, but let NaN through (max(NaN, 0) would hide it).
        return tirx.Select(var < 0.0, tirx.const(0.0, "float32"), var)

    mean = te.compute(channels, mean_body, name="mean" + suffix)
    var = te.compute(channels, var_body, name="var" + suffix)
    return mean, var


# A part's bytes at most in ``parts`` (the shared memory a block of a grid-wide
# persistent kernel keeps it in: one block an SM of the H200's 227 KB).
PART_BYTES = 200 * 1024


def parts(problem, copies: int = 1) -> int:
    """How many parts ``part_statistics`` (and the backward's ``dual_reduce_parts`` and
    ``dual_reduce_half_parts``) cut each channel into along the first axis (N, or M
    channels-last): the fewest that divide it with ``copies`` tensors' parts in at most
    ``PART_BYTES``, else one row of it a part."""
    rows, per_row = problem.shape[0], copies * problem.count // problem.shape[0] * DTYPE_BYTES[problem.dtype]
    return next((p for p in range(1, rows + 1) if rows % p == 0 and rows // p * per_row <= PART_BYTES), rows)


def part_sums(problem, copies: int, values, name: str) -> tuple[te.Tensor, te.Tensor]:
    """Two sums per part of each channel (:func:`parts` for ``copies`` tensors), shape
    ``(parts, channels)``: ``values(index, c)`` gives the pair summed at a position of
    the canonical view, whose first axis the parts cut."""
    idx = index_dtype(problem.numel)
    count = parts(problem, copies)
    per = problem.shape[0] // count
    zero = tirx.IntImm(idx, 0)
    r = te.reduce_axis((zero, tirx.IntImm(idx, per)), name="r")
    inner = [] if problem.channels_last else [te.reduce_axis((zero, tirx.IntImm(idx, problem.shape[2])), name="l")]

    def body(p, c):
        index = (p * per + r, c, *inner)
        return DUAL_SUM(values(index, c), axis=[r, *inner])

    return te.compute(dims([count, problem.channels], idx), body, name=name)


def sum_parts(total: te.Tensor, total_sq: te.Tensor, name: str) -> tuple[te.Tensor, te.Tensor]:
    """Per channel, the sums of :func:`part_sums`' partials."""
    k = te.reduce_axis((tirx.IntImm(str(total.shape[0].ty), 0), total.shape[0]), name="k")
    return te.compute([total.shape[1]], lambda c: DUAL_SUM((total[k, c], total_sq[k, c]), axis=k), name=name)


def part_statistics(problem, x: te.Tensor, copies: int = 1) -> tuple[te.Tensor, te.Tensor, te.Tensor]:
    """``shift`` and the ``part_moments`` (sums of ``d = x - shift`` and ``d^2``) of
    each of a channel's :func:`parts` (for ``copies`` of a part on chip), shape
    ``(parts, channels)``: the first stage of ``shifted_parts`` and
    ``shifted_half_parts``, whose partials :func:`combine_parts` adds up."""
    idx = index_dtype(problem.numel)
    zero = tirx.IntImm(idx, 0)

    def first(c):  # K[c], the channel's first value
        return widen(x[(zero, c) if problem.channels_last else (zero, c, zero)], problem.dtype)

    shift = te.compute(dims([problem.channels], idx), first, name="shift")

    def values(index, c):
        d = widen(x[index], problem.dtype) - shift[c]
        return d, d * d

    return (shift, *part_sums(problem, copies, values, "part_moments"))


def combine_parts(problem, shift: te.Tensor, total: te.Tensor, total_sq: te.Tensor,
                  suffix: str = "") -> tuple[te.Tensor, te.Tensor]:
    """``(mean, var)`` per channel from :func:`part_statistics`' partials: their sums
    (block ``moments`` + ``suffix``), then :func:`finalize`."""
    return finalize(problem, shift, *sum_parts(total, total_sq, "moments" + suffix), suffix=suffix)
