"""Semantic level of BatchNorm statistics: what ``bn_stats`` means and promises.

``bn_stats(x, layout)`` returns the per-channel mean and biased variance of ``x``
over every axis but the channel axis, in float32 whatever the input dtype (the
kernels accumulate in float32). These are the statistics BatchNorm uses in
training; normalizing with them gives each channel mean 0 and variance 1 over
the batch. (The running variance that BatchNorm keeps is the unbiased one,
``var * count / (count - 1)``; see :func:`unbiased_variance`.)

Every input is reduced to one of two canonical views, without copying:

* channels in the middle, ``(N, C, L)``: NCHW (``L = H * W``), (N, C, L), and
* channels last, ``(M, C)``: NHWC (``M = N * H * W``), (N, L, C) and (N, C).

Kernels only ever see a :class:`BNStatsProblem`; all argument checks live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .common import DTYPE_BYTES, FLOAT_DTYPES, check_choice, check_dtype, check_shape, numel

OP = "bn_stats"
LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class ChannelView:
    """The canonical view of a per-channel problem (bn_stats's, BatchNorm's forward
    and backward): ``shape`` is ``(N, C, L)`` when ``channels_last`` is False and
    ``(M, C)`` when it is True; ``input_shape`` and ``layout`` keep what the caller
    gave."""

    shape: tuple[int, ...]
    dtype: str
    channels_last: bool
    input_shape: tuple[int, ...]
    layout: str = "NCHW"

    @property
    def channels(self) -> int:
        return self.shape[-1] if self.channels_last else self.shape[1]

    @property
    def count(self) -> int:
        """Values per channel."""
        return numel(self.shape) // self.channels

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def view(self) -> str:
        return "mc" if self.channels_last else "ncl"


@dataclass(frozen=True)
class BNStatsProblem(ChannelView):
    """One bn_stats problem in canonical form (:class:`ChannelView`)."""

    op: ClassVar[str] = OP

    @property
    def num_inputs(self) -> int:
        """Parameters of the PrimFunc before its outputs: x."""
        return 1

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes a kernel must move: the input once, two float32 vectors out."""
        return self.numel * DTYPE_BYTES[self.dtype] + 2 * 4 * self.channels

    def key(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{OP}_{self.view}_{dims}_{self.dtype}"

    def describe(self) -> str:
        view = "(M, C)" if self.channels_last else "(N, C, L)"
        return (
            f"bn_stats of {self.layout} {tuple(self.input_shape)} {self.dtype}: "
            f"canonical view {view} = {self.shape}, {self.channels} channels x "
            f"{self.count} values, {self.bytes_moved / 1e6:.3f} MB moved at least"
        )


def check_flags(op: str, **flags: object) -> None:
    """Each option a bool, or a TypeError naming it."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {flag!r}")


def bn_stats_problem(shape: object, dtype: str, layout: str = "NCHW") -> BNStatsProblem:
    """Check the arguments of bn_stats and return the canonical problem."""
    dims = check_shape(OP, "x.shape", shape)
    check_dtype(OP, "x", dtype, FLOAT_DTYPES)
    check_choice(OP, "layout", layout, LAYOUTS)
    if len(dims) not in (2, 3, 4):
        raise ValueError(
            f"{OP}: x must have rank 2 (N, C), 3 (N, C, L) or 4 ({layout}), "
            f"got rank {len(dims)} with shape {dims}"
        )
    if numel(dims) == 0:
        raise ValueError(f"{OP}: x must not be empty, got shape {dims}")
    if layout == "NHWC" or len(dims) == 2:
        channels = dims[-1]
        canonical: tuple[int, ...] = (numel(dims) // channels, channels)
        channels_last = True
    else:
        canonical = (dims[0], dims[1], numel(dims[2:]))
        channels_last = False
    return BNStatsProblem(canonical, dtype, channels_last, dims, layout)


def reference(x: np.ndarray, layout: str = "NCHW") -> tuple[np.ndarray, np.ndarray]:
    """Float64 per-channel mean and biased variance (two-pass, so exact enough)."""
    problem = bn_stats_problem(x.shape, _dtype_name(x.dtype), layout)
    data = np.asarray(x, dtype=np.float64).reshape(problem.shape)
    axes = (0,) if problem.channels_last else (0, 2)
    mean = data.mean(axis=axes)
    centered = data - (mean if problem.channels_last else mean[None, :, None])
    var = (centered * centered).mean(axis=axes)
    return mean, var


def unbiased_variance(var: np.ndarray, count: int) -> np.ndarray:
    """Running-variance estimate BatchNorm keeps (torch's meaning): var * n / (n - 1)."""
    return var * count / max(count - 1, 1)


def _dtype_name(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    return "bfloat16" if name == "bfloat16" else name
