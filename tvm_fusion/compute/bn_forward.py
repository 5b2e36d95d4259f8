"""Algorithm level of BatchNorm's forward: statistics -> finalize -> normalize (a map).

``shifted`` / ``shifted_sampled`` (training): bn_stats's decomposition of the same
name gives ``mean`` and ``var`` per channel, then

1. finalize, per channel: ``save_mean``, ``save_invstd = 1 / sqrt(var + eps)``, the
   running statistics' update (``running_mean_out``, ``running_var_out``, with the
   device scalar ``momentum`` and the unbiased variance), and the map's
   coefficients ``bn_scale = invstd * weight`` and ``bn_shift = mean``;
2. ``y = (x - bn_shift) * bn_scale + bias``, in x's dtype. Not ``x * bn_scale +
   (bias - mean * bn_scale)``, one operation fewer: when |mean| >> std the product
   ``x * bn_scale`` is large and its rounding stays in ``y`` (x = 1000 + 0.02 z in
   float32 put ``y`` 6.5e-3 off), while ``x - mean`` is exact there.

``shifted_parts`` (training): ``shifted``'s sums taken per part of each channel (its
first axis cut in ``bn_stats.parts``, ``part_moments``), then the parts added up twice,
for the map's coefficients (``moments_map`` -> ``mean_map``, ``var_map``) and for the
per-channel outputs (``moments`` -> ``mean``, ``var``): a grid-wide persistent schedule
computes the first in every block of a channel after its grid barrier and the second
in a kernel after it (``bn_forward_grid_persistent``).

``shifted_half_parts`` (training): ``shifted_parts`` with parts of at most half the
bytes, so that a schedule keeps two parts of a block on chip at once: the one it
reduces and maps, and the next one it copies in meanwhile
(``bn_forward_grid_pipelined``); or so that a block takes half the bytes and two blocks
share an SM (``bn_forward_cluster_half``).

``shifted_quarter_parts`` (training): ``shifted_parts`` with parts of at most a quarter
of the bytes (50 KB), up to four blocks an SM (``bn_forward_cluster_quarter``).

``running`` (eval): the same map, ``mean`` and ``var`` read from the running
statistics (no reduction).

Block names are what schedules refer to.
"""

from __future__ import annotations

from tvm import te, tirx

from ..contracts.bn_forward import BNForwardProblem
from .bn_stats import combine_parts, part_statistics, statistics
from .primitives import dims, index_dtype, widen

ALGORITHMS = ("shifted", "shifted_sampled", "shifted_parts", "shifted_half_parts", "shifted_quarter_parts", "running")
# The parts decompositions, and how many copies of a part of x each keeps on chip
# (``bn_stats.parts``).
PART_COPIES = {"shifted_parts": 1, "shifted_half_parts": 2, "shifted_quarter_parts": 4}
F32 = "float32"


def channel_outputs(problem: BNForwardProblem) -> list[str]:
    """The per-channel outputs, in the PrimFunc's order after ``y``."""
    return ["save_mean", "save_invstd"] + (["running_mean_out", "running_var_out"] if problem.updates_running else [])


def bn_forward_te(problem: BNForwardProblem, algorithm: str | None = None) -> list[te.Tensor]:
    """TE tensors, parameters then outputs, for ``problem`` under ``algorithm``
    (training: "shifted" by default; eval: "running")."""
    algorithm = algorithm or default_algorithm(problem)
    if algorithm not in ALGORITHMS or (algorithm == "running") == problem.training:
        training = [a for a in ALGORITHMS if a != "running"]
        wanted = ", ".join(training[:-1]) + " or " + training[-1] if problem.training else "running"
        raise ValueError(f"bn_forward: {'training' if problem.training else 'eval'} takes algorithm {wanted}, "
                         f"got {algorithm!r}")
    idx = index_dtype(problem.numel)
    shape = dims(problem.shape, idx)
    channels = dims([problem.channels], idx)
    x = te.placeholder(shape, problem.dtype, name="x")
    params = [x]
    weight = bias = running_mean = running_var = momentum = None
    if problem.affine:
        weight, bias = te.placeholder(channels, F32, name="weight"), te.placeholder(channels, F32, name="bias")
        params += [weight, bias]
    if problem.track_running:
        running_mean = te.placeholder(channels, F32, name="running_mean")
        running_var = te.placeholder(channels, F32, name="running_var")
        params += [running_mean, running_var]
    if problem.updates_running:
        momentum = te.placeholder([], F32, name="momentum")
        params.append(momentum)

    if algorithm in PART_COPIES:  # the map's own sum of the partials (module docstring)
        partials = part_statistics(problem, x, PART_COPIES[algorithm])
        mean, var = combine_parts(problem, *partials)
        map_mean, map_var = combine_parts(problem, *partials, suffix="_map")
    else:
        mean, var = statistics(problem, x, algorithm) if problem.training else (running_mean, running_var)
        map_mean, map_var = mean, var
    eps = tirx.const(problem.eps, F32)
    save_mean = te.compute(channels, lambda c: mean[c], name="save_mean")
    save_invstd = te.compute(channels, lambda c: tirx.rsqrt(var[c] + eps), name="save_invstd")

    def scale_value(c):
        invstd = tirx.rsqrt(map_var[c] + eps)
        return invstd * weight[c] if weight is not None else invstd

    scale = te.compute(channels, scale_value, name="bn_scale")
    shift = te.compute(channels, lambda c: map_mean[c], name="bn_shift")

    def y_body(*index):
        c = index[-1] if problem.channels_last else index[1]
        value = (widen(x[index], problem.dtype) - shift[c]) * scale[c]
        if bias is not None:
            value = value + bias[c]
        return value if problem.dtype == F32 else value.astype(problem.dtype)

    y = te.compute(shape, y_body, name="y")
    outputs = [y, save_mean, save_invstd]
    if problem.updates_running:
        m = momentum[()]
        unbiased = float(problem.count) / float(problem.count - 1)
        outputs.append(te.compute(channels, lambda c: (1.0 - m) * running_mean[c] + m * mean[c],
                                  name="running_mean_out"))
        outputs.append(te.compute(channels, lambda c: (1.0 - m) * running_var[c] + m * (var[c] * unbiased),
                                  name="running_var_out"))
    return params + outputs


def default_algorithm(problem: BNForwardProblem) -> str:
    return "shifted" if problem.training else "running"
