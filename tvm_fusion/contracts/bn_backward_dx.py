"""Semantic level of BatchNorm's input gradient from given sums: SyncBatchNorm's ``dx``.

With the batch spread over several processes, the two per-channel sums of the
backward (``sum dy``, ``sum dy * xhat``) are summed over every rank before ``dx``
can be formed, so the map runs apart from the reduction, on the global means::

    xhat = (x - mean) * invstd
    dx   = weight * invstd * (dy - mean_dy - xhat * mean_dy_xhat)
    mean_dy = (sum over all ranks of dy) / N,  mean_dy_xhat = (sum of dy * xhat) / N

with ``N`` the global count of values per channel (``weight`` is 1 without affine).
``mean_dy`` and ``mean_dy_xhat`` arrive as (C,) float32 vectors, already divided
by ``N``: the global count lives on the device (gathered in the forward), and a
kernel constant would need it on the host. With the local sums and count this is
``bn_backward``'s training ``dx``. Inputs, in order: ``x``, ``dy`` (float16, bfloat16
or float32, same dtype and shape), ``mean``, ``invstd`` (C,) float32, ``weight``
(C,) float32 with ``affine``, ``mean_dy``, ``mean_dy_xhat`` (C,) float32. Output:
``dx`` (x's dtype). Everything is float32 before the final store.

Shapes and layouts are ``bn_stats``'s: (N, C), (N, C, L), NCHW (N, C, H, W) or NHWC
(N, H, W, C), reduced to the canonical (N, C, L) or (M, C) view. Any count of
values per channel (one value is fine here: the global count decides, not this
rank's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .bn_stats import ChannelView, bn_stats_problem, check_flags
from .common import DTYPE_BYTES

OP = "bn_backward_dx"


@dataclass(frozen=True)
class BNBackwardDxProblem(ChannelView):
    """One input-gradient map in bn_stats's canonical view, plus ``affine``."""

    affine: bool = True
    op: ClassVar[str] = OP

    @property
    def num_inputs(self) -> int:
        """Parameters before the output: x, dy, mean, invstd[, weight], mean_dy, mean_dy_xhat."""
        return 7 if self.affine else 6

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes: x and dy read once, dx written once, the per-channel vectors."""
        return 3 * self.numel * DTYPE_BYTES[self.dtype] + 4 * self.channels * (self.num_inputs - 2)

    def key(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{OP}_{self.view}_{dims}_{self.dtype}_{'affine' if self.affine else 'plain'}"

    def describe(self) -> str:
        view = "(M, C)" if self.channels_last else "(N, C, L)"
        return (f"bn_backward_dx ({'affine' if self.affine else 'no affine'}) of {self.layout} "
                f"{tuple(self.input_shape)} {self.dtype}: canonical view {view} = {self.shape}, {self.channels} "
                f"channels x {self.count} values, {self.bytes_moved / 1e6:.3f} MB moved at least")


def bn_backward_dx_problem(shape: object, dtype: str, layout: str = "NCHW", affine: bool = True
                           ) -> BNBackwardDxProblem:
    """Check the arguments of the map and return the canonical problem."""
    view = bn_stats_problem(shape, dtype, layout).__dict__  # shape, dtype and layout checks
    check_flags(OP, affine=affine)
    return BNBackwardDxProblem(**view, affine=affine)


def reference(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, invstd: np.ndarray, weight: np.ndarray | None,
              mean_dy: np.ndarray, mean_dy_xhat: np.ndarray, layout: str = "NCHW") -> np.ndarray:
    """Float64 ``dx``, shaped as ``x``."""
    problem = bn_backward_dx_problem(x.shape, np.dtype(x.dtype).name, layout, weight is not None)
    xs = np.asarray(x, dtype=np.float64).reshape(problem.shape)
    g = np.asarray(dy, dtype=np.float64).reshape(problem.shape)

    def per_channel(v):
        v = np.asarray(v, dtype=np.float64)
        return v if problem.channels_last else v[None, :, None]

    xhat = (xs - per_channel(mean)) * per_channel(invstd)
    scale = per_channel(invstd) * (per_channel(weight) if weight is not None else 1.0)
    dx = scale * (g - per_channel(mean_dy) - xhat * per_channel(mean_dy_xhat))
    return dx.reshape(x.shape)
