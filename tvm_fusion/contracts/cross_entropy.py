"""Semantic level of CrossEntropy: what ``cross_entropy`` means and promises.

The meaning is torch's ``F.cross_entropy`` for logits ``(B, V)`` and integer class
targets ``(B,)``::

    lse_i    = log(sum_c exp(x_ic))
    nll_i    = w[t_i] * (lse_i - x_{i,t_i})
    smooth_i = sum_c w_c * (lse_i - x_ic)              (w = 1 without weight)
    loss_i   = (1 - eps) * nll_i + eps / V * smooth_i   (0 where t_i == ignore_index)

``reduction="none"`` returns ``loss`` (B,); ``"sum"`` its sum; ``"mean"`` its sum
divided by ``sum_i w[t_i]`` over the rows that are not ignored. A mean over no
valid row is 0 / 0 = NaN, as in torch. A target outside [0, V) that is not
``ignore_index`` is an error naming the first such row; kernels flag it instead of
reading out of bounds. NaN and inf in the logits propagate as in torch (a row
holding +inf or NaN gives NaN). The loss is float32 whatever the logits dtype.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .common import (
    DTYPE_BYTES,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_choice,
    check_dtype,
    check_int,
    check_shape,
)

OP = "cross_entropy"
REDUCTIONS = ("none", "mean", "sum")
MAX_ROWS = 2**31 - 1  # the first bad row (and B, its "none") is reported as an int32


class TargetOutOfRangeError(ValueError):
    """A target is outside [0, V) and is not ignore_index."""

    def __init__(self, row: int, value: int | None, classes: int, ignore_index: int):
        shown = "?" if value is None else str(value)
        super().__init__(
            f"{OP}: target[{row}] = {shown} is outside [0, {classes}) and is not "
            f"ignore_index ({ignore_index}); row {row} is the first such row"
        )
        self.row = row
        self.value = value


@dataclass(frozen=True)
class CrossEntropyProblem:
    """One cross_entropy problem: shapes, dtypes and every option that shapes a kernel."""

    batch: int
    classes: int
    dtype: str
    target_dtype: str = "int64"
    has_weight: bool = False
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    op: ClassVar[str] = OP

    @property
    def shape(self) -> tuple[int, int]:
        return (self.batch, self.classes)

    @property
    def numel(self) -> int:
        return self.batch * self.classes

    @property
    def num_inputs(self) -> int:
        """Parameters of the PrimFunc before its outputs: logits, target[, weight]."""
        return 3 if self.has_weight else 2

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes a kernel must move: logits and targets once, the loss out."""
        out = 4 * (self.batch if self.reduction == "none" else 1)
        weight = 4 * self.classes if self.has_weight else 0
        return (
            self.numel * DTYPE_BYTES[self.dtype]
            + self.batch * DTYPE_BYTES[self.target_dtype]
            + weight
            + out
        )

    @property
    def options_tag(self) -> str:
        tags = [self.reduction, self.target_dtype]
        if self.has_weight:
            tags.append("w")
        if self.ignore_index != -100:
            tags.append(f"ig{self.ignore_index}")
        if self.label_smoothing:
            tags.append(f"ls{self.label_smoothing:g}")
        return "_".join(tags)

    def key(self) -> str:
        return f"{OP}_{self.batch}x{self.classes}_{self.dtype}_{self.options_tag}"

    def canonical(self) -> CrossEntropyProblem:
        """The same shape with default options: the problem tuning records are keyed by."""
        return CrossEntropyProblem(self.batch, self.classes, self.dtype)

    def describe(self) -> str:
        return f"cross_entropy of {describe_arguments(self)}; {self.bytes_moved / 1e6:.3f} MB moved at least"


def describe_arguments(problem) -> str:
    """The shapes, dtypes and options of a cross entropy problem (the forward's or the
    gradient's), in words."""
    return (
        f"({problem.batch}, {problem.classes}) {problem.dtype} logits, "
        f"{problem.target_dtype} targets, weight={'yes' if problem.has_weight else 'no'}, "
        f"ignore_index={problem.ignore_index}, reduction={problem.reduction!r}, "
        f"label_smoothing={problem.label_smoothing:g}"
    )


def cross_entropy_problem(
    logits_shape: object,
    logits_dtype: str,
    target_shape: object | None = None,
    target_dtype: str = "int64",
    weight_shape: object | None = None,
    weight_dtype: str = "float32",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> CrossEntropyProblem:
    """Check the arguments of cross_entropy and return the problem they describe."""
    return CrossEntropyProblem(*check_arguments(
        OP, logits_shape, logits_dtype, target_shape, target_dtype, weight_shape, weight_dtype,
        ignore_index, reduction, label_smoothing,
    ))


def check_arguments(
    op: str,
    logits_shape: object,
    logits_dtype: str,
    target_shape: object | None,
    target_dtype: str,
    weight_shape: object | None,
    weight_dtype: str,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> tuple:
    """The checks cross_entropy and its gradient share, messages prefixed by ``op``.

    Returns ``(batch, classes, dtype, target_dtype, has_weight, ignore_index,
    reduction, label_smoothing)``, the fields both problems start with."""
    shape = check_shape(op, "logits.shape", logits_shape)
    if len(shape) != 2:
        raise ValueError(f"{op}: logits must have rank 2 (B, V), got shape {shape}")
    batch, classes = shape
    if batch > MAX_ROWS:  # TVM failed on the flag's int32 constant with an error naming neither
        raise ValueError(f"{op}: logits may have at most 2**31 - 1 rows (B), the first bad target's row is "
                         f"an int32; got shape {shape}")
    if classes == 0:
        raise ValueError(f"{op}: logits must have at least one class (V > 0), got shape {shape}")
    check_dtype(op, "logits", logits_dtype, FLOAT_DTYPES)
    if target_shape is not None:
        tshape = check_shape(op, "target.shape", target_shape)
        if tshape != (batch,):
            raise ValueError(
                f"{op}: target.shape must be (B,) = ({batch},) to match logits {shape}, got {tshape}"
            )
    if target_dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{op}: target must hold integer class indices (int32 or int64), got {target_dtype}"
        )
    has_weight = weight_shape is not None
    if has_weight:
        wshape = check_shape(op, "weight.shape", weight_shape)
        if wshape != (classes,):
            raise ValueError(
                f"{op}: weight.shape must be (V,) = ({classes},) to match logits {shape}, "
                f"got {wshape}"
            )
        check_dtype(op, "weight", weight_dtype, FLOAT_DTYPES)
    ignore_index = check_int(op, "ignore_index", ignore_index)
    if not -(2**63) <= ignore_index < 2**63:  # torch's ignore_index is an int64 (its op schema's int)
        raise ValueError(f"{op}: ignore_index must fit in int64, got {ignore_index}")
    check_choice(op, "reduction", reduction, REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):  # np.float32 too
        raise TypeError(f"{op}: label_smoothing must be a float, got {label_smoothing!r}")
    label_smoothing = float(label_smoothing)
    if not (0.0 <= label_smoothing <= 1.0) or math.isnan(label_smoothing):
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return (batch, classes, logits_dtype, target_dtype, has_weight, ignore_index, reduction,
            label_smoothing)


def first_bad_row(target: np.ndarray, classes: int, ignore_index: int) -> int | None:
    """Index of the first target outside [0, V) that is not ignore_index, else None."""
    t = np.asarray(target).astype(np.int64, copy=False)
    bad = (t != ignore_index) & ((t < 0) | (t >= classes))
    rows = np.flatnonzero(bad)
    return int(rows[0]) if rows.size else None


def reference(
    logits: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> np.ndarray:
    """Float64 cross entropy with torch's meaning; raises on out-of-range targets."""
    problem = cross_entropy_problem(
        logits.shape, _dtype_name(logits.dtype), target.shape, _dtype_name(target.dtype),
        None if weight is None else weight.shape,
        "float32" if weight is None else _dtype_name(weight.dtype),
        ignore_index, reduction, label_smoothing,
    )
    batch, classes = problem.shape
    t = np.asarray(target).astype(np.int64)
    bad = first_bad_row(t, classes, ignore_index)
    if bad is not None:
        raise TargetOutOfRangeError(bad, int(t[bad]), classes, ignore_index)
    x = np.asarray(logits, dtype=np.float64)
    w = np.ones(classes) if weight is None else np.asarray(weight, dtype=np.float64)
    valid = t != ignore_index
    safe_t = np.where(valid, t, 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        row_max = x.max(axis=1, keepdims=True)
        lse = np.log(np.exp(x - row_max).sum(axis=1)) + row_max[:, 0]
        logp = x - lse[:, None]
        w_t = np.where(valid, w[safe_t], 0.0)
        nll = -w_t * logp[np.arange(batch), safe_t]
        smooth = -(logp * w[None, :]).sum(axis=1)
        eps = label_smoothing
        loss = np.where(valid, (1 - eps) * nll + eps / classes * smooth, 0.0)
        if reduction == "none":
            return loss
        if reduction == "sum":
            return np.asarray(loss.sum())
        return np.asarray(loss.sum() / w_t.sum())


def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name
