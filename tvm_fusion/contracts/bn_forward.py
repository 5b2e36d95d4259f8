"""Semantic level of BatchNorm's forward: ``F.batch_norm``'s meaning, in one problem.

Per channel, over its ``n`` values (every axis but the channel's)::

    training:  mean, var = the batch's mean and biased variance
               invstd = 1 / sqrt(var + eps)
               running_mean <- (1 - momentum) * running_mean + momentum * mean
               running_var  <- (1 - momentum) * running_var  + momentum * var * n / (n - 1)
    eval:      mean, invstd from running_mean and 1 / sqrt(running_var + eps)
    both:      y = (x - mean) * invstd * weight + bias      (weight 1, bias 0 without affine)

``momentum`` is a float32 scalar on the device, an input of the kernel (torch's
``momentum=None`` cumulative average passes ``1 / num_batches_tracked`` there, with
no host sync); the running statistics are updated only in training with
``track_running`` (both running buffers given). Inputs, in order: ``x``;
``weight``, ``bias`` (C,) float32 with ``affine``; ``running_mean``, ``running_var``
(C,) float32 with ``track_running``; ``momentum`` () float32 in training with
``track_running``. Outputs: ``y`` (x's dtype), ``save_mean`` and ``save_invstd``
(C,) float32 (what the backward reads), and in training with ``track_running`` the
new ``running_mean_out``, ``running_var_out`` (the caller may pass the running
buffers themselves: each element is read, then written, by one thread). Eval needs
``track_running``. Everything is float32 before the final store.

Shapes and layouts are ``bn_stats``'s; training with one value per channel is
torch's error (a ``ValueError`` naming the input size).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .bn_stats import ChannelView, bn_stats_problem, check_flags
from .common import DTYPE_BYTES

OP = "bn_forward"


@dataclass(frozen=True)
class BNForwardProblem(ChannelView):
    """One BatchNorm forward in bn_stats's canonical view."""

    affine: bool = True
    training: bool = True
    track_running: bool = True
    eps: float = 1e-5
    op: ClassVar[str] = OP

    @property
    def updates_running(self) -> bool:
        return self.training and self.track_running

    @property
    def num_inputs(self) -> int:
        """x[, weight, bias][, running_mean, running_var][, momentum]."""
        return 1 + 2 * self.affine + 2 * self.track_running + self.updates_running

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes: x read once and y written once (a kernel that keeps a channel on
        chip between the statistics and the map), the per-channel vectors."""
        vectors = 2 + 2 * self.affine + 2 * self.track_running + 2 * self.updates_running
        return 2 * self.numel * DTYPE_BYTES[self.dtype] + 4 * self.channels * vectors

    def key(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        flags = ("affine" if self.affine else "plain") + ("_train" if self.training else "_eval")
        flags += "_running" if self.track_running else ""
        return f"{OP}_{self.view}_{dims}_{self.dtype}_{flags}_eps{self.eps:g}"

    def describe(self) -> str:
        view = "(M, C)" if self.channels_last else "(N, C, L)"
        mode = "training" if self.training else "eval"
        return (f"bn_forward ({mode}, {'affine' if self.affine else 'no affine'}, "
                f"{'running statistics' if self.track_running else 'no running statistics'}, eps {self.eps:g}) of "
                f"{self.layout} {tuple(self.input_shape)} {self.dtype}: canonical view {view} = {self.shape}, "
                f"{self.channels} channels x {self.count} values, {self.bytes_moved / 1e6:.3f} MB moved at least")


def bn_forward_problem(shape: object, dtype: str, layout: str = "NCHW", affine: bool = True, training: bool = True,
                       track_running: bool = True, eps: float = 1e-5) -> BNForwardProblem:
    """Check the arguments of the forward and return the canonical problem."""
    view = bn_stats_problem(shape, dtype, layout).__dict__  # shape, dtype and layout checks
    check_flags(OP, affine=affine, training=training, track_running=track_running)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):  # np.float32 too, as torch takes it
        raise TypeError(f"{OP}: eps must be a number, got {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{OP}: eps must be a finite number >= 0, got {eps!r}")
    if training and eps == 0:  # torch's rule: a constant channel would divide by sqrt(0)
        raise ValueError(f"{OP}: eps must be positive when training, got {eps!r}")
    if not training and not track_running:
        raise ValueError(f"{OP}: eval mode normalizes with the running statistics: track_running must be True "
                         "(torch's eval without running statistics uses the batch's: pass training=True)")
    problem = BNForwardProblem(**view, affine=affine, training=training, track_running=track_running,
                               eps=float(eps))
    if training and problem.count < 2:
        raise ValueError(f"{OP}: expected more than 1 value per channel when training, got input size "
                         f"{tuple(problem.input_shape)}")
    return problem


def reference(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, running_mean: np.ndarray | None,
              running_var: np.ndarray | None, momentum: float, problem: BNForwardProblem) -> dict[str, np.ndarray]:
    """Float64 outputs by name (``y`` shaped as x; the rest (C,))."""
    data = np.asarray(x, dtype=np.float64).reshape(problem.shape)
    axes = (0,) if problem.channels_last else (0, 2)

    def per_channel(v):
        v = np.asarray(v, dtype=np.float64)
        return v if problem.channels_last else v[None, :, None]

    if problem.training:
        mean = data.mean(axis=axes)
        var = ((data - per_channel(mean)) ** 2).mean(axis=axes)
    else:
        mean, var = np.asarray(running_mean, np.float64), np.asarray(running_var, np.float64)
    invstd = 1.0 / np.sqrt(var + problem.eps)
    y = (data - per_channel(mean)) * per_channel(invstd)
    if problem.affine:
        y = y * per_channel(weight) + per_channel(bias)
    out = {"y": y.reshape(x.shape), "save_mean": mean, "save_invstd": invstd}
    if problem.updates_running:
        n = problem.count
        out["running_mean_out"] = (1 - momentum) * np.asarray(running_mean, np.float64) + momentum * mean
        out["running_var_out"] = (1 - momentum) * np.asarray(running_var, np.float64) + momentum * var * n / (n - 1)
    return out
