"""Torch's label-smoothed cross entropy written with Relax operators.

Relax has no cross entropy over class indices with label smoothing; TVM's PyTorch
importer writes ``nll_loss(log_softmax(x))`` and drops the smoothing. With the
contract's notation (logp = log_softmax(x), w = weight or 1, valid_i = t_i != ignore)::

    loss = keep * nll_loss(logp, t, w, reduction, ignore)
         + spread * reduce_i(valid_i * sum_c w_c * -logp[i, c])     keep = 1 - eps, spread = eps / V

where ``reduce`` is nll_loss's own reduction (the mean divides by sum_i valid_i
w[t_i], as nll_loss does). ``tvm_fusion.relax.import_exported`` emits exactly this
expression and :class:`~tvm_fusion.relax.FuseReductions` recognizes exactly this
expression (structurally, from the same function), so the two cannot drift apart.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from .graph import dtype_of


def label_smoothed_nll(
    logp: relax.Expr,
    target: relax.Expr,
    weight: relax.Expr | None,
    reduction: str,
    ignore_index: int,
    keep: relax.Expr,
    spread: relax.Expr,
) -> relax.Expr:
    """``keep * nll_loss(...) + spread * smoothing(...)`` over log-probabilities ``logp`` (B, V)."""
    nll = R.nn.nll_loss(logp, target, weight, reduction, ignore_index)
    smoothing = _smoothing(logp, target, weight, reduction, ignore_index)
    return R.add(R.multiply(nll, keep), R.multiply(smoothing, spread))


def _smoothing(logp, target, weight, reduction: str, ignore_index: int) -> relax.Expr:
    """Per row sum_c w_c * -logp[i, c], zero on ignored rows, reduced like nll_loss."""
    dtype, index_dtype = dtype_of(logp), dtype_of(target)
    valid = R.not_equal(target, relax.const(ignore_index, index_dtype))
    weighted = logp if weight is None else R.multiply(logp, weight)
    row = R.where(valid, R.negative(R.sum(weighted, axis=[1])), relax.const(0.0, dtype))
    if reduction == "none":
        return row
    if reduction == "sum":
        return R.sum(row)
    if weight is None:
        denominator = R.astype(valid, dtype)
    else:
        safe_target = R.where(valid, target, relax.const(0, index_dtype))
        denominator = R.where(valid, R.take(weight, safe_target, axis=0), relax.const(0.0, dtype))
    return R.divide(R.sum(row), R.sum(denominator))
