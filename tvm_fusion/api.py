"""The public API: bn_stats, cross_entropy and build.

The contract (semantic level) checks every argument before any kernel is built;
kernels hold no validation. The device follows the input; results come back in
the caller's kind (numpy, torch or TVM).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays, targets
from .contracts import (
    TargetOutOfRangeError,
    bn_stats_problem,
    cross_entropy_problem,
)
from .contracts.common import check_bool, check_choice
from .dispatch import kernel_for
from .kernel import Kernel

OPS = ("bn_stats", "cross_entropy")


def bn_stats(x: Any, layout: str = "NCHW") -> tuple[Any, Any]:
    """Per-channel mean and biased variance of ``x`` in float32.

    ``x`` has rank 2 (N, C), 3 (N, C, L) or 4, in ``layout`` "NCHW" or "NHWC"
    (channels last), dtype float16, bfloat16 or float32.
    """
    arg = arrays.inspect(x, "bn_stats", "x")
    problem = bn_stats_problem(arg.shape, arg.dtype, layout)
    kernel = kernel_for(problem, targets.for_device(arg.device_type))
    x_t = arrays.to_tvm(arg)._create_view(problem.shape)
    mean, mean_t = arrays.empty(arg, (problem.channels,), "float32")
    var, var_t = arrays.empty(arg, (problem.channels,), "float32")
    with arrays.stream_context(arg):
        kernel(x_t, mean_t, var_t)
    return mean, var


def cross_entropy(
    logits: Any,
    target: Any,
    weight: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    check_targets: bool = True,
) -> Any:
    """Cross entropy of ``logits`` (B, V) against class indices ``target`` (B,).

    Same meaning as ``torch.nn.functional.cross_entropy``; the loss is float32. A
    mean over no valid row is NaN, as in torch. With ``check_targets`` (the
    default) a target outside [0, V) that is not ``ignore_index`` raises
    :class:`TargetOutOfRangeError` naming the first bad row; the kernel flags it
    rather than reading out of bounds, and checking costs one host round trip.
    """
    op = "cross_entropy"
    la = arrays.inspect(logits, op, "logits")
    ta = arrays.inspect(target, op, "target")
    wa = None if weight is None else arrays.inspect(weight, op, "weight")
    check_bool(op, "check_targets", check_targets)
    problem = cross_entropy_problem(
        la.shape, la.dtype, ta.shape, ta.dtype,
        None if wa is None else wa.shape, "float32" if wa is None else wa.dtype,
        ignore_index, reduction, label_smoothing,
    )
    for name, other in (("target", ta), ("weight", wa)):
        if other is not None and (other.device_type, other.device_id) != (la.device_type, la.device_id):
            raise ValueError(
                f"{op}: {name} must be on the same device as logits "
                f"({la.device_type}:{la.device_id}), got {other.device_type}:{other.device_id}"
            )
    if problem.batch == 0:
        return _empty_batch_loss(la, reduction)
    kernel = kernel_for(problem, targets.for_device(la.device_type))
    inputs = [arrays.to_tvm(la), arrays.to_tvm(ta)]
    if wa is not None:
        inputs.append(arrays.to_tvm(_as_float32(wa)))
    results = [arrays.empty(la, shape, dtype) for _, shape, dtype in kernel.outputs]
    with arrays.stream_context(la):
        kernel(*inputs, *(t for _, t in results))
    loss, first_bad = results[-2][0], results[-1][0]
    if check_targets:
        row = arrays.read_int(la.kind, first_bad)
        if row < problem.batch:
            raise TargetOutOfRangeError(row, _target_value(ta, row), problem.classes, ignore_index)
    return loss if reduction == "none" else arrays.scalar_view(la.kind, loss)


def build(op: str, shape: Any, dtype: str = "float32", target: Any = "cuda", **options: Any) -> Kernel:
    """The compiled kernel that the API would use for one shape.

    ``build("bn_stats", shape=(N, C, H, W), dtype=..., target=..., layout="NCHW")``;
    ``build("cross_entropy", shape=(B, V), dtype=..., target=..., target_dtype="int64",
    weight=False, ignore_index=-100, reduction="mean", label_smoothing=0.0)``.
    """
    check_choice("build", "op", op, OPS)
    problem = make_problem(op, shape, dtype, **options)
    return kernel_for(problem, targets.resolve(target))


def tune(
    op: str,
    shape: Any,
    dtype: str = "float32",
    target: Any = "cuda",
    trials: int = 32,
    log_dir: str = "tuning_logs",
    progress: Any = None,
    **options: Any,
):
    """Tune one shape with MetaSchedule (evolutionary search, XGBoost cost model) over
    the applicable candidates and their knobs; records go to ``<log_dir>/<target>/``.
    Returns a :class:`tvm_fusion.tuner.TuneResult`."""
    return tune_many([(op, shape, dtype, options)], target, trials, log_dir, progress)


def tune_many(
    specs: list[tuple[str, Any, str, dict[str, Any]]],
    target: Any = "cuda",
    trials: int = 32,
    log_dir: str = "tuning_logs",
    progress: Any = None,
):
    """Tune several shapes at once: one MetaSchedule task per shape and decomposition,
    the task scheduler sharing ``trials`` per shape among them."""
    from .tuner import tune as run_tuner

    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"tune: trials must be a positive int, got {trials!r}")
    problems = [make_problem(op, shape, dtype, **options) for op, shape, dtype, options in specs]
    return run_tuner(problems, targets.resolve(target), trials, log_dir, progress)


def explain(op: str, shape: Any, dtype: str = "float32", target: Any = "cuda",
            log_dir: str | None = None, **options: Any) -> str:
    """Which candidate and knobs dispatch picks for this shape, and why (a tuning
    record, or the registry's heuristic)."""
    from .dispatch import explain as explain_choice

    return explain_choice(make_problem(op, shape, dtype, **options), targets.resolve(target), log_dir)


def make_problem(op: str, shape: Any, dtype: str, **options: Any):
    """The contract's problem for ``op`` from a shape, a dtype and keyword options."""
    check_choice("build", "op", op, OPS)
    if op == "bn_stats":
        unknown = set(options) - {"layout"}
        if unknown:
            raise TypeError(f"bn_stats: unknown option(s) {sorted(unknown)}; known: ['layout']")
        return bn_stats_problem(shape, dtype, options.get("layout", "NCHW"))
    known = {"target_dtype", "weight", "ignore_index", "reduction", "label_smoothing"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"cross_entropy: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    shape = tuple(shape) if not isinstance(shape, (str, bytes)) else shape
    batch = shape[0] if isinstance(shape, tuple) and shape else None
    classes = shape[1] if isinstance(shape, tuple) and len(shape) > 1 else None
    return cross_entropy_problem(
        shape, dtype, None if batch is None else (batch,), options.get("target_dtype", "int64"),
        (classes,) if options.get("weight") else None, "float32",
        options.get("ignore_index", -100), options.get("reduction", "mean"),
        options.get("label_smoothing", 0.0),
    )


def _as_float32(arg: arrays.ArrayArg) -> arrays.ArrayArg:
    if arg.dtype == "float32":
        return arg
    if arg.kind == "numpy":
        obj = arg.obj.astype(np.float32)
    elif arg.kind == "torch":
        obj = arg.obj.float()
    else:
        import tvm

        obj = tvm.runtime.tensor(arg.obj.numpy().astype(np.float32), arrays.tvm_device(arg))
    return arrays.inspect(obj, "cross_entropy", "weight")


def _target_value(arg: arrays.ArrayArg, row: int) -> int | None:
    try:
        if arg.kind == "numpy":
            return int(arg.obj[row])
        if arg.kind == "torch":
            return int(arg.obj[row].item())
        return int(arg.obj.numpy()[row])
    except Exception:  # noqa: BLE001 - the row alone still names the problem
        return None


def _empty_batch_loss(like: arrays.ArrayArg, reduction: str) -> Any:
    """Zero rows: torch gives an empty loss, a sum of 0 and a mean of NaN."""
    value = np.full((0,) if reduction == "none" else (), 0.0 if reduction == "sum" else np.nan, np.float32)
    if like.kind == "numpy":
        return value
    if like.kind == "torch":
        import torch

        return torch.from_numpy(value).to(like.obj.device)
    import tvm

    return tvm.runtime.tensor(value.reshape(-1) if value.ndim == 0 else value, arrays.tvm_device(like))
