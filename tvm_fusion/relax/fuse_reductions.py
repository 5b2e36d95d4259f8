"""FuseReductions: BatchNorm statistics and cross entropy in a Relax graph -> our kernels.

Patterns (each rewritten to one ``call_tir`` of the kernel dispatch picks for its
shape, the PrimFunc keeping its ``tvm_fusion.*`` attributes):

1. ``R.nn.batch_norm(x, gamma, beta, rm, rv, training=True)`` -> ``bn_stats`` on the
   canonical view of ``x`` (NCHW-like (N, C, L) for axis 1, (M, C) for the last
   axis), then Relax operators for the rest, in float32::

       y   = (x - mean) * (gamma * rsqrt(var + eps)) + beta
       rm' = (1 - momentum) * rm + momentum * mean
       rv' = (1 - momentum) * rv + momentum * var * n / (n - 1)

   The running variance is torch's unbiased one; TVM's own legalization (and its
   docstring) update it with the biased variance.
2. ``nll_loss(log_softmax(x), t[, w])`` over (B, V) logits -> ``cross_entropy``,
   and the label-smoothed form of :mod:`.cross_entropy_form` -> ``cross_entropy``
   with that ``label_smoothing``.
3. ``cross_entropy_with_logits(log_softmax(x), one_hot(t, on, off, V))``: this op
   is ``-sum(p * y) / B`` over *log-probabilities* and soft labels, so it is our
   cross entropy (mean, label_smoothing = V * off) only when ``p`` is a log_softmax
   and ``y`` a one-hot whose rows sum to 1. Equal for targets in [0, V): a target
   outside gives a zero one-hot row there, and our kernel flags it instead.

Kept, with the reason in ``.report`` (and a logged warning): symbolic shapes, a
channel axis that is neither 1 nor last, one value per channel, nll_loss over
anything but a log_softmax over the class axis, rank other than 2,
cross_entropy_with_logits over raw logits or soft labels, and the ~20 operators
that torch's own decomposition makes of a cross entropy (TVM's importer by
default). Inference-mode batch norm is FoldBatchNorm's, and is not reported here.

Not used: TVM's dataflow pattern language, because the label-smoothed form is
compared as a whole expression against the very builder that emitted it.

The kernels do not surface ``first_bad_row`` in the graph: a target outside
[0, V) is not read out of bounds, but it does not raise either.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax import op as R
from tvm.relax.type import TensorType

from .. import make_problem, targets
from ..contracts import Problem
from ..dispatch import choose
from ..kernel import schedule_for
from .cross_entropy_form import label_smoothed_nll
from .graph import Bindings, Plan, dtype_of, rewrite_bindings, shape_of
from .report import Decision, record

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
OPAQUE = 8  # relax OpPatternKind::kOpaque: FuseOps must not merge a scheduled kernel
# How far keep + spread * V may be from 1 for the constants of a label-smoothed form:
# 8 units in the last place at 1 in the logits' dtype (the constants are rounded to it).
COEFFICIENT_TOLERANCE = {"float32": 8 * 2.0**-23, "float16": 8 * 2.0**-10, "bfloat16": 8 * 2.0**-7}


@tvm.ir.transform.module_pass(opt_level=0, name="tvm_fusion.FuseReductions")
class FuseReductions:
    """Replace training BatchNorm statistics and cross entropy with our fused kernels.

    ``target``: "llvm", "cuda", a target dict or a Target (the kernels are scheduled
    for it). ``log_dir``: tuning logs that dispatch searches first (one folder per
    target, as ``tuning_logs/``); without, it searches ``$TVM_FUSION_LOG_DIR`` and
    the shipped logs, then falls back to the registry's heuristic. After a run,
    ``.report`` lists a :class:`Decision` per operator looked at.
    """

    def __init__(self, target: Any, log_dir: str | pathlib.Path | None = None):
        self.target = targets.resolve(target)
        if log_dir is not None and not pathlib.Path(log_dir).is_dir():
            raise ValueError(f"FuseReductions: log_dir must be an existing folder, got {log_dir!r}")
        self.log_dir = None if log_dir is None else pathlib.Path(log_dir)
        self.report: list[Decision] = []
        self._kernels: dict[Problem, tuple[tirx.PrimFunc, str]] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        self.report = []
        plans = {}
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                graph = Bindings(gvar.name_hint, func)
                plans[gvar.name_hint] = dict(
                    planned for var in list(graph.value) if (planned := self._plan(graph, var)) is not None
                )
        return rewrite_bindings(mod, plans)

    def _plan(self, graph: Bindings, var: relax.Var) -> tuple[relax.Var, Plan] | None:
        """(the binding to replace, how) when ``var`` is bound to an operator we fuse."""
        for op_name, plan in (
            ("relax.nn.batch_norm", self._batch_norm),
            ("relax.nn.nll_loss", self._nll_loss),
            ("relax.nn.cross_entropy_with_logits", self._with_logits),
            ("relax.nn.log_softmax", self._decomposed_loss),
        ):
            call = graph.call(var, op_name)
            if call is not None:
                return plan(graph, var, call)
        return None

    # -- BatchNorm -------------------------------------------------------------------
    def _batch_norm(self, graph: Bindings, var: relax.Var, call: tvm.ir.Call) -> tuple[relax.Var, Plan] | None:
        attrs = call.attrs
        if not attrs.training:
            return None  # inference mode uses running statistics: FoldBatchNorm's case
        x = call.args[0]
        shape, dtype = shape_of(x), dtype_of(x)
        axis = int(attrs.axis) % len(shape) if shape else None
        reason = None
        if shape is None:
            reason = f"symbolic shape {x.ty}: the kernel is built per static shape"
        elif dtype not in FLOAT_DTYPES:
            reason = f"dtype {dtype}: the kernel takes {', '.join(FLOAT_DTYPES)}"
        elif axis not in (1, len(shape) - 1):
            reason = f"channel axis {axis} of rank {len(shape)} is neither 1 nor the last"
        elif np.prod(shape) // shape[axis] < 2:
            reason = "one value per channel: torch refuses training BN there (unbiased variance n/(n-1))"
        if reason:
            record(self.report, graph.where(var), "kept", reason)
            return None
        channels, count = shape[axis], int(np.prod(shape)) // shape[axis]
        if axis == 1:
            view = shape if len(shape) == 2 else (shape[0], channels, count // shape[0])
        else:
            view = (count, channels)
        gvar_name, kernel, how = self._kernel(make_problem("bn_stats", view, dtype))
        record(self.report, graph.where(var), "fused", f"bn_stats on the {view} view: {gvar_name} = {how}")
        per_channel = [1] * len(shape)
        per_channel[axis] = channels

        def plan(bb: relax.BlockBuilder, remap) -> relax.Expr:
            x, gamma, beta, rm, rv = (remap(a) for a in call.args)
            # 1. mean and biased variance per channel: our kernel on the canonical view
            gvar = bb.add_func(kernel, gvar_name)
            flat = x if view == shape else bb.emit(R.reshape(x, view))
            stats = bb.emit(relax.call_tir(gvar, [flat], [TensorType((channels,), "float32")] * 2))
            mean, biased = bb.emit(relax.TupleGetItem(stats, 0)), bb.emit(relax.TupleGetItem(stats, 1))
            # 2. y = (x - mean) * (gamma * rsqrt(var + eps)) + beta, in float32; (x - mean)
            #    first, since x * scale - mean * scale cancels when |mean| >> std
            scale = R.rsqrt(R.add(biased, _f32(attrs.epsilon)))
            if attrs.scale:
                scale = R.multiply(scale, _as_f32(gamma))
            centered = R.subtract(_as_f32(x), R.reshape(mean, per_channel))
            y = R.multiply(centered, R.reshape(scale, per_channel))
            if attrs.center:
                y = R.add(y, R.reshape(_as_f32(beta), per_channel))
            # 3. running statistics, torch's update: the variance is the unbiased one
            momentum = float(attrs.momentum)
            unbiased = R.multiply(biased, _f32(count / (count - 1)))
            new_mean = R.add(R.multiply(_as_f32(rm), _f32(1 - momentum)), R.multiply(mean, _f32(momentum)))
            new_var = R.add(R.multiply(_as_f32(rv), _f32(1 - momentum)), R.multiply(unbiased, _f32(momentum)))
            outputs = [(y, dtype), (new_mean, dtype_of(rm)), (new_var, dtype_of(rv))]
            return relax.Tuple([_from_f32(value, out_dtype) for value, out_dtype in outputs])

        return var, plan

    # -- cross entropy ---------------------------------------------------------------
    def _nll_loss(self, graph: Bindings, var: relax.Var, call: tvm.ir.Call) -> tuple[relax.Var, Plan] | None:
        logp, target = call.args[0], call.args[1]
        weight = call.args[2] if len(call.args) > 2 else None
        log_softmax = graph.call(logp, "relax.nn.log_softmax")
        logits = None if log_softmax is None else log_softmax.args[0]
        shape = None if logits is None else shape_of(logits)
        if log_softmax is None or shape is None or len(shape) != 2 or not _is_last(log_softmax.attrs.axis, 2):
            what = "not log_softmax over the class axis of static (B, V) logits"
            record(self.report, graph.where(var), "kept", f"its predictions are {what}: no log-sum-exp to fuse")
            return None
        reduction, ignore_index = str(call.attrs.reduction), int(call.attrs.ignore_index)
        anchor, smoothing = var, 0.0
        smoothed = self._label_smoothing(graph, var, logp, target, weight, reduction, ignore_index, shape[1])
        if smoothed is not None:
            anchor, smoothing = smoothed
        options = dict(weight=weight is not None, ignore_index=ignore_index, reduction=reduction,
                       label_smoothing=smoothing)
        return self._cross_entropy(graph.where(var), anchor, logits, target, weight, options)

    def _label_smoothing(self, graph, nll_var, logp, target, weight, reduction, ignore_index, classes):
        """(binding, eps) when ``nll_var`` is the nll_loss of the label-smoothed form, else None."""
        scaled = graph.sole_user(nll_var)
        keep = graph.call(scaled, "relax.multiply")
        if keep is None or not keep.args[0].same_as(nll_var):
            return None
        total = graph.sole_user(scaled)
        add = graph.call(total, "relax.add")
        spread = None if add is None else graph.call(add.args[1], "relax.multiply")
        if spread is None or not add.args[0].same_as(scaled):
            return None
        keep_value, spread_value = graph.constant(keep.args[1]), graph.constant(spread.args[1])
        if keep_value is None or spread_value is None or keep_value.size != 1 or spread_value.size != 1:
            return None
        expected = label_smoothed_nll(logp, target, weight, reduction, ignore_index, keep.args[1], spread.args[1])
        leaves = [logp, target] + ([weight] if weight is not None else [])
        if not tvm_ffi.structural_equal(graph.expand(total, leaves), expected):
            return None
        keep_value, spread_value = float(keep_value), float(spread_value)
        if abs((1.0 - keep_value) - spread_value * classes) > COEFFICIENT_TOLERANCE[dtype_of(logp)]:
            return None  # keep * nll + spread * smooth, but not 1 - eps and eps / V
        # The constants carry at most 7 significant digits (float32); beyond them,
        # 1 - keep is the constant's rounding, not the program's label_smoothing.
        return total, float(f"{1.0 - keep_value:.7g}")

    def _with_logits(self, graph: Bindings, var: relax.Var, call: tvm.ir.Call) -> tuple[relax.Var, Plan] | None:
        predictions, labels = call.args
        log_softmax = graph.call(predictions, "relax.nn.log_softmax")
        one_hot = graph.call(labels, "relax.one_hot")
        shape = None if log_softmax is None else shape_of(log_softmax.args[0])
        reason = None
        if log_softmax is None or shape is None or len(shape) != 2 or not _is_last(log_softmax.attrs.axis, 2):
            reason = ("predictions are not log_softmax over the last axis of (B, V) logits: "
                      "-sum(x * y) / B of raw logits is not a cross entropy")
        elif one_hot is None or not _is_last(one_hot.attrs.axis, 2):
            reason = "labels are soft (not a one_hot of class indices): the kernel takes class indices"
        elif not all(isinstance(v, tirx.FloatImm) for v in one_hot.args[1:]):
            reason = "the one_hot's on / off values are not float constants"
        else:
            on, off = float(one_hot.args[1].value), float(one_hot.args[2].value)
            row_sum = on + (shape[1] - 1) * off
            if off < 0 or abs(row_sum - 1.0) > COEFFICIENT_TOLERANCE["float32"]:
                reason = f"one-hot rows sum to {row_sum:g} (off value {off:g}): not a label-smoothed distribution"
        if reason:
            record(self.report, graph.where(var), "kept", reason)
            return None
        options = dict(weight=False, reduction="mean", label_smoothing=float(f"{shape[1] * off:.7g}"))
        return self._cross_entropy(graph.where(var), var, log_softmax.args[0], one_hot.args[0], None, options)

    def _decomposed_loss(self, graph: Bindings, var: relax.Var, call: tvm.ir.Call) -> None:
        """No rewrite, a diagnostic: torch's decomposition of cross entropy gathers from log_softmax."""
        if any(graph.call(user, "relax.gather_elements") is not None for user in graph.users[var] if user is not None):
            record(self.report, graph.where(var), "kept",
                   "a cross entropy decomposed by torch.export (log_softmax, gather_elements, where, sum) "
                   "is not matched; import with tvm_fusion.relax.import_exported to keep it whole")

    def _cross_entropy(self, where, var, logits, target, weight, options) -> tuple[relax.Var, Plan] | None:
        """Replace binding ``var`` by our kernel's loss; ``where`` names the loss in reports."""
        shape, dtype, target_dtype = shape_of(logits), dtype_of(logits), dtype_of(target)
        reason = None
        if dtype not in FLOAT_DTYPES or target_dtype not in INDEX_DTYPES:
            reason = f"logits {dtype} / targets {target_dtype}: the kernel takes float logits and int targets"
        elif shape[0] == 0:
            reason = "empty batch"
        if reason:
            record(self.report, where, "kept", reason)
            return None
        problem = make_problem("cross_entropy", shape, dtype, target_dtype=target_dtype, **options)
        gvar_name, kernel, how = self._kernel(problem)
        record(self.report, where, "fused", f"{problem.describe()}: {gvar_name} = {how}")
        outputs = list(kernel.params[2 + int(problem.has_weight) :])
        loss_dtype = dtype_of(var)

        def plan(bb: relax.BlockBuilder, remap) -> relax.Expr:
            gvar = bb.add_func(kernel, gvar_name)
            args = [remap(logits), remap(target)]
            if weight is not None:
                args.append(_as_f32(remap(weight)))
            result = bb.emit(relax.call_tir(gvar, args, [TensorType(b.shape, b.dtype) for b in outputs]))
            if problem.reduction == "none":
                loss = relax.TupleGetItem(result, 0)
            else:
                loss = R.reshape(relax.TupleGetItem(result, 1), [])
            return _from_f32(loss, loss_dtype)

        return var, plan

    # -- kernels -----------------------------------------------------------------------
    def _kernel(self, problem: Problem) -> tuple[str, tirx.PrimFunc, str]:
        """(GlobalVar name, scheduled PrimFunc, how dispatch chose it) for ``problem``."""
        if problem not in self._kernels:
            choice = choose(problem, self.target, self.log_dir)
            mod = choice.mod
            if mod is None:  # a heuristic pick, or a record's knobs for other options
                mod = schedule_for(problem, self.target, choice.candidate, choice.knobs)[0].mod
            func = mod["main"].without_attr("global_symbol")
            func = func.with_attrs({"op_pattern": OPAQUE, "tirx.is_scheduled": True})
            self._kernels[problem] = func, f"{choice.candidate} [{choice.knobs}] ({choice.source})"
        func, how = self._kernels[problem]
        return "tvm_fusion_" + re.sub(r"\W", "_", problem.key()), func, how


def _is_last(axis: int, rank: int) -> bool:
    return int(axis) % rank == rank - 1


def _as_f32(operand: relax.Expr) -> relax.Expr:
    return operand if dtype_of(operand) == "float32" else R.astype(operand, "float32")


def _from_f32(result: relax.Expr, dtype: str) -> relax.Expr:
    return result if dtype == "float32" else R.astype(result, dtype)


def _f32(value: float) -> relax.Expr:
    return relax.const(value, "float32")
