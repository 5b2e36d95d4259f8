"""Algorithm level of BatchNorm's input gradient from given sums: one map.

``map``  ``x, dy(SSS), mean_dy, mean_dy_xhat(S) -> coef(S) -> dx(SSS)``

1. per channel coefficients, the names ``bn_backward``'s ``dx`` uses, so schedules
   read alike: ``bn_dx_scale`` = weight * invstd, ``bn_dx_mean`` = mean_dy,
   ``bn_dx_xhat`` = mean_dy_xhat (copies into a block of the channel: a schedule
   keeps them in each thread's registers rather than reading a (C,) buffer per
   value);
2. ``dx``: the map ``scale * (dy - mean_term - xhat * xhat_term)`` with
   ``xhat = (x - mean) * invstd``, in float32, stored in x's dtype.

Block names are what schedules refer to.
"""

from __future__ import annotations

from tvm import te

from ..contracts.bn_backward_dx import BNBackwardDxProblem
from .bn_backward import backward_inputs
from .primitives import widen

ALGORITHMS = ("map",)
F32 = "float32"
COEFFICIENTS = ["bn_dx_scale", "bn_dx_mean", "bn_dx_xhat"]


def bn_backward_dx_te(problem: BNBackwardDxProblem, algorithm: str = "map") -> list[te.Tensor]:
    """TE tensors ``[x, dy, mean, invstd, (weight,) mean_dy, mean_dy_xhat, dx]``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"bn_backward_dx: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    shape, channels, x, dy, mean, invstd, weight = backward_inputs(problem)
    mean_dy = te.placeholder(channels, F32, name="mean_dy")
    mean_dy_xhat = te.placeholder(channels, F32, name="mean_dy_xhat")

    # 1. The channel's coefficients.
    scale = te.compute(channels, lambda c: invstd[c] * weight[c] if weight is not None else invstd[c],
                       name="bn_dx_scale")
    mean_term = te.compute(channels, lambda c: mean_dy[c], name="bn_dx_mean")
    xhat_term = te.compute(channels, lambda c: mean_dy_xhat[c], name="bn_dx_xhat")

    # 2. The map.
    def dx_body(*index):
        c = index[-1] if problem.channels_last else index[1]
        xhat = (widen(x[index], problem.dtype) - mean[c]) * invstd[c]
        value = scale[c] * (widen(dy[index], problem.dtype) - mean_term[c] - xhat * xhat_term[c])
        return value if problem.dtype == F32 else value.astype(problem.dtype)

    dx = te.compute(shape, dx_body, name="dx")
    params = [x, dy, mean, invstd] + ([weight] if weight is not None else []) + [mean_dy, mean_dy_xhat]
    return params + [dx]
