"""Semantic level of BatchNorm's backward: d loss / d x, d weight, d bias.

BatchNorm normalizes ``xhat = (x - mean) * invstd`` per channel and returns
``y = weight * xhat + bias``. Given the upstream gradient ``dy`` (x's shape and
dtype), torch's ``F.batch_norm`` backward is, per channel over its ``n`` values::

    dbias   = sum dy                      dweight = sum dy * xhat
    training (mean, invstd of the batch): dx = weight * invstd * (dy - dbias / n - xhat * dweight / n)
    eval     (running mean, invstd):       dx = weight * invstd * dy

(``weight`` is 1 without affine parameters; ``invstd = 1 / sqrt(var + eps)``, from
the biased batch variance in training, the running variance in eval.) The two sums
are one dual reduction per channel, which is also the whole of ``dweight`` and
``dbias``; ``dx`` is then a map. Inputs: ``x``, ``dy`` (float16, bfloat16 or
float32, same dtype and shape), ``mean`` and ``invstd`` (C,) float32, and with
``affine`` the ``weight`` (C,) float32. Outputs: ``dx`` (x's dtype), ``dweight`` and
``dbias`` (C,) float32. Everything is float32 before the final store.

Shapes and layouts are ``bn_stats``'s: (N, C), (N, C, L), NCHW (N, C, H, W) or NHWC
(N, H, W, C), reduced to the canonical (N, C, L) or (M, C) view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .bn_stats import ChannelView, bn_stats_problem, check_flags
from .common import DTYPE_BYTES

OP = "bn_backward"


@dataclass(frozen=True)
class BNBackwardProblem(ChannelView):
    """One BatchNorm backward in bn_stats's canonical view, plus ``affine`` and
    ``training``."""

    affine: bool = True
    training: bool = True
    op: ClassVar[str] = OP

    @property
    def num_inputs(self) -> int:
        """Parameters before the outputs: x, dy, mean, invstd[, weight]."""
        return 5 if self.affine else 4

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes: x and dy read once, dx written once (a kernel that keeps
        them on chip between the sums and the map), the per-channel vectors."""
        return 3 * self.numel * DTYPE_BYTES[self.dtype] + 4 * self.channels * (5 if self.affine else 4)

    def key(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        flags = ("affine" if self.affine else "plain") + ("_train" if self.training else "_eval")
        return f"{OP}_{self.view}_{dims}_{self.dtype}_{flags}"

    def describe(self) -> str:
        view = "(M, C)" if self.channels_last else "(N, C, L)"
        return (
            f"bn_backward ({'training' if self.training else 'eval'}, "
            f"{'affine' if self.affine else 'no affine'}) of {self.layout} {tuple(self.input_shape)} "
            f"{self.dtype}: canonical view {view} = {self.shape}, {self.channels} channels x "
            f"{self.count} values, {self.bytes_moved / 1e6:.3f} MB moved at least"
        )


def bn_backward_problem(shape: object, dtype: str, layout: str = "NCHW", affine: bool = True,
                        training: bool = True) -> BNBackwardProblem:
    """Check the arguments of the backward and return the canonical problem."""
    view = bn_stats_problem(shape, dtype, layout).__dict__  # shape, dtype and layout checks
    check_flags(OP, affine=affine, training=training)
    problem = BNBackwardProblem(**view, affine=affine, training=training)
    if training and problem.count < 2:
        raise ValueError(f"{OP}: expected more than 1 value per channel when training, got input size "
                         f"{tuple(problem.input_shape)}")
    return problem


def reference(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, invstd: np.ndarray, weight: np.ndarray | None,
              layout: str = "NCHW", training: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (dx, dweight, dbias), shaped as the inputs and (C,)."""
    problem = bn_backward_problem(x.shape, _dtype_name(x.dtype), layout, weight is not None, training)
    xs = np.asarray(x, dtype=np.float64).reshape(problem.shape)
    g = np.asarray(dy, dtype=np.float64).reshape(problem.shape)
    axes = (0,) if problem.channels_last else (0, 2)

    def per_channel(v):
        v = np.asarray(v, dtype=np.float64)
        return v if problem.channels_last else v[None, :, None]

    xhat = (xs - per_channel(mean)) * per_channel(invstd)
    dbias = g.sum(axis=axes)
    dweight = (g * xhat).sum(axis=axes)
    scale = per_channel(invstd) * (per_channel(weight) if weight is not None else 1.0)
    if training:
        n = problem.count
        dx = scale * (g - per_channel(dbias) / n - xhat * per_channel(dweight) / n)
    else:
        dx = scale * g
    return dx.reshape(x.shape), dweight, dbias


def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name
