"""Semantic level of the cross entropy gradient: d loss / d logits, two ways of getting it.

The forward is ``contracts.cross_entropy``'s (torch's ``F.cross_entropy``)::

    loss_i = (1 - eps) w[t_i] (lse_i - x_{i,t_i}) + eps / V sum_c w_c (lse_i - x_ic)

so, with ``p_iv = exp(x_iv - lse_i)`` and ``W = sum_c w_c`` (``V`` without weight)::

    d loss_i / d x_iv = (1 - eps) w[t_i] (p_iv - [v == t_i]) + eps / V (W p_iv - w_v)
                      = a_i p_iv - q_iv,   a_i = (1 - eps) w[t_i] + eps W / V,
                                           q_iv = (1 - eps) w[t_i] [v == t_i] + eps w_v / V

and ``dlogits[i, v] = s_i (a_i p_iv - q_iv)`` on the rows that are not ignored, with the
upstream gradient folded into ``s_i``: ``reduction="none"`` ``s_i = dloss[i]``;
``"sum"`` ``s_i = dloss`` (a scalar); ``"mean"`` ``s_i = dloss / sum_j w[t_j]`` over the
rows that are not ignored. Where torch's gradient is special, this one is too:

* an ignored row (or one whose target is out of range, which the forward flags) gets
  ``0 * p_iv``: zero, but NaN where its logits hold NaN or +inf (torch's log-softmax
  backward multiplies the row's zero gradient by ``p``); the upstream ``dloss[i]`` of
  an ignored row is never read, NaN or not;
* a mean over no valid row (loss NaN) has a gradient of zeros, not NaN;
* a mean whose valid rows have ``sum_j w[t_j] = 0`` (their targets weigh 0) is NaN on
  those rows.

Two modes (``mode``), the two kernels a training step can use:

``"fused"``
    The gradient written during the forward, for ``dloss = 1`` (Liger's kernel): the
    PrimFunc reads the logits and targets and writes the forward's outputs, the
    per-row log-sum-exp and ``dlogits``. A backward whose upstream gradient is not 1
    scales ``dlogits`` by it (by ``dloss[i]`` per row for ``"none"``).
``"from_lse"``
    A backward kernel from the forward's saved per-row log-sum-exp (Quack's): reads
    logits, targets, ``lse`` (B,) float32 and ``dloss`` ((1,) for mean and sum, (B,)
    for none, float32) and writes ``dlogits``.

``dlogits`` has the logits' dtype; everything before the store is float32.

``in_place`` (fused only): ``dlogits`` is written over the logits, the caller passing
one buffer for both. The kernel is built without the no-alias promise, its row loss
reads the target's logit from a stage (``target_logit``) that runs before the row's
statistics, and only candidates that read every logit of a row before a block-wide
barrier that precedes the row's first store apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .common import DTYPE_BYTES, check_choice, check_shape
from .cross_entropy import (
    CrossEntropyProblem,
    TargetOutOfRangeError,
    _dtype_name,
    check_arguments,
    describe_arguments,
    first_bad_row,
)

OP = "cross_entropy_grad"
MODES = ("fused", "from_lse")


@dataclass(frozen=True)
class CrossEntropyGradProblem:
    """One cross entropy gradient problem: the forward's fields plus ``mode``."""

    batch: int
    classes: int
    dtype: str
    target_dtype: str = "int64"
    has_weight: bool = False
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    mode: str = "fused"
    in_place: bool = False
    op: ClassVar[str] = OP

    @property
    def shape(self) -> tuple[int, int]:
        return (self.batch, self.classes)

    @property
    def numel(self) -> int:
        return self.batch * self.classes

    @property
    def num_inputs(self) -> int:
        """Parameters of the PrimFunc before its outputs: logits, target[, weight], and
        for ``from_lse`` lse, dloss."""
        return (3 if self.has_weight else 2) + (2 if self.mode == "from_lse" else 0)

    @property
    def dloss_shape(self) -> tuple[int, ...]:
        """Shape of the upstream gradient ``from_lse`` reads: (B,), or a scalar (0-d, as
        torch's ``grad_output`` of a reduced loss)."""
        return (self.batch,) if self.reduction == "none" else ()

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes a kernel must move: logits in and dlogits out once, targets, the
        weight, and the per-row float32 values (lse; the loss or dloss)."""
        rows = 4 * self.batch * (2 if self.mode == "fused" else 1)
        upstream = 4 * (self.batch if self.reduction == "none" else 1)
        weight = 4 * self.classes if self.has_weight else 0
        return (2 * self.numel * DTYPE_BYTES[self.dtype] + self.batch * DTYPE_BYTES[self.target_dtype]
                + weight + rows + upstream)

    @property
    def options_tag(self) -> str:
        return f"{self.mode}{'_inplace' if self.in_place else ''}_{self.forward().options_tag}"

    def forward(self) -> CrossEntropyProblem:
        """The forward problem with the same shape and options."""
        return CrossEntropyProblem(self.batch, self.classes, self.dtype, self.target_dtype, self.has_weight,
                                   self.ignore_index, self.reduction, self.label_smoothing)

    def key(self) -> str:
        return f"{OP}_{self.batch}x{self.classes}_{self.dtype}_{self.options_tag}"

    def canonical(self) -> CrossEntropyGradProblem:
        """The same shape, mode and placement with default options."""
        return CrossEntropyGradProblem(self.batch, self.classes, self.dtype, mode=self.mode, in_place=self.in_place)

    def describe(self) -> str:
        mode = f"{self.mode}, in place" if self.in_place else self.mode
        return (f"cross_entropy_grad ({mode}) of {describe_arguments(self)}; "
                f"{self.bytes_moved / 1e6:.3f} MB moved at least")


def cross_entropy_grad_problem(
    logits_shape: object,
    logits_dtype: str,
    target_shape: object | None = None,
    target_dtype: str = "int64",
    weight_shape: object | None = None,
    weight_dtype: str = "float32",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    mode: str = "fused",
    lse_shape: object | None = None,
    lse_dtype: str = "float32",
    dloss_shape: object | None = None,
    dloss_dtype: str = "float32",
    in_place: bool = False,
) -> CrossEntropyGradProblem:
    """Check the arguments of the gradient and return the problem they describe.

    The forward's arguments are checked as cross_entropy checks them; ``mode`` is
    ``"fused"`` or ``"from_lse"``. ``lse`` and ``dloss`` are inputs of ``from_lse``
    only (their shapes may be left out): ``lse`` (B,) float32, ``dloss`` float32 of
    shape (B,) for reduction="none", else (1,) or (). ``in_place`` (a bool, fused
    only): the gradient written over the logits."""
    fields = check_arguments(OP, logits_shape, logits_dtype, target_shape, target_dtype, weight_shape,
                             weight_dtype, ignore_index, reduction, label_smoothing)
    check_choice(OP, "mode", mode, MODES)
    if not isinstance(in_place, bool):
        raise TypeError(f"{OP}: in_place must be a bool, got {in_place!r}")
    if in_place and mode != "fused":
        raise ValueError(f"{OP}: in_place=True writes the gradient over the logits during the forward, "
                         f"which only mode='fused' does; got mode={mode!r}")
    batch, reduction = fields[0], fields[6]
    if mode == "fused":
        for name, given in (("lse", lse_shape), ("dloss", dloss_shape)):
            if given is not None:
                raise ValueError(
                    f"{OP}: {name} is not an input of mode='fused' (it computes the lse and "
                    f"takes dloss = 1), got {name}.shape {tuple(given)}; use mode='from_lse'"
                )
        return CrossEntropyGradProblem(*fields, mode, in_place)
    if lse_shape is not None:
        lshape = check_shape(OP, "lse.shape", lse_shape)
        if lshape != (batch,):
            raise ValueError(f"{OP}: lse.shape must be (B,) = ({batch},), got {lshape}")
    if lse_dtype != "float32":
        raise TypeError(f"{OP}: lse dtype must be float32 (the forward saves it so), got {lse_dtype}")
    if dloss_shape is not None:
        dshape = check_shape(OP, "dloss.shape", dloss_shape)
        wanted = [(batch,)] if reduction == "none" else [(), (1,)]
        if dshape not in wanted:
            shown = f"({batch},)" if reduction == "none" else "() or (1,)"
            raise ValueError(
                f"{OP}: dloss.shape must be {shown} for reduction={reduction!r}, got {dshape}"
            )
    if dloss_dtype != "float32":
        raise TypeError(f"{OP}: dloss dtype must be float32, got {dloss_dtype}")
    return CrossEntropyGradProblem(*fields, mode)


def reference_lse(logits: np.ndarray) -> np.ndarray:
    """Float64 log-sum-exp of every row (NaN for a row holding NaN, +inf or only -inf,
    as the kernels give)."""
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        row_max = x.max(axis=1, keepdims=True)
        return np.log(np.exp(x - row_max).sum(axis=1)) + row_max[:, 0]


def reference_grad(
    logits: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    dloss: np.ndarray | float | None = None,
) -> np.ndarray:
    """Float64 ``d loss / d logits`` with torch's meaning (the module docstring says
    where it is special); ``dloss`` is the upstream gradient (1 when None: a scalar for
    mean and sum, (B,) for none). Raises on out-of-range targets, as the forward's
    reference does."""
    x = np.asarray(logits, dtype=np.float64)
    t = np.asarray(target)
    dtype = _dtype_name(np.asarray(logits).dtype)
    check_arguments(OP, x.shape, "float32" if dtype == "float64" else dtype,  # float64 in: for checks
                    t.shape, _dtype_name(t.dtype), None if weight is None else np.shape(weight),
                    "float32", ignore_index, reduction, label_smoothing)
    batch, classes = x.shape
    t = t.astype(np.int64)
    bad = first_bad_row(t, classes, ignore_index)
    if bad is not None:
        raise TargetOutOfRangeError(bad, int(t[bad]), classes, ignore_index)
    w = np.ones(classes) if weight is None else np.asarray(weight, dtype=np.float64)
    eps = float(label_smoothing)
    valid = t != ignore_index
    safe_t = np.where(valid, t, 0)
    w_t = np.where(valid, w[safe_t], 0.0)
    if dloss is None:
        dloss = np.ones(batch) if reduction == "none" else 1.0
    up = np.asarray(dloss, dtype=np.float64)
    if reduction == "none":
        up = up.reshape(batch)
    else:
        up = np.full(batch, float(up.reshape(-1)[0]) if up.size else 1.0)
    if reduction == "mean":
        denom = w_t.sum()
        scale = up / denom if denom != 0 else np.full(batch, np.nan)
    else:
        scale = up
    scale = np.where(valid, scale, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.exp(x - reference_lse(x)[:, None])
        a = (1 - eps) * w_t + eps * w.sum() / classes
        onehot = np.zeros_like(x)
        onehot[np.arange(batch), safe_t] = 1.0
        q = (1 - eps) * w_t[:, None] * onehot + eps / classes * w[None, :]
        return (scale * a)[:, None] * p - scale[:, None] * q
