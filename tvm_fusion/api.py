"""The public API: bn_stats, cross_entropy and build.

The contract (semantic level) checks every argument before any kernel is built;
kernels hold no validation. The device follows the input; results come back in
the caller's kind (numpy, torch or TVM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import arrays, records, target_check, targets
from .arrays import signature
from .contracts import (
    TargetOutOfRangeError,
    bn_backward_dx_problem,
    bn_backward_problem,
    bn_forward_problem,
    bn_stats_problem,
    cross_entropy_problem,
)
from .contracts.common import check_bool, check_choice
from .contracts.cross_entropy_grad import cross_entropy_grad_problem
from .dispatch import kernel_for
from .kernel import Kernel

OPS = ("bn_stats", "cross_entropy")  # the calls
# What build, tune, explain and the CLI's tune/build/show take: the calls' kernels and
# the cross entropy gradient's and BatchNorm's (tvm_fusion.torch launches those).
KERNEL_OPS = OPS + ("cross_entropy_grad", "bn_forward", "bn_backward", "bn_backward_dx")

# The hot path: a launcher per call signature (every argument's kind, shape, dtype,
# device and layout, and the options), built once after the contract's checks.
# A call is a signature, one dictionary lookup, outputs allocated, the launch.
# Cleared when a tuning log changes in this process (records.invalidate).
_LAUNCHERS: dict[tuple, Callable[..., Any]] = records.register_cache({})


def bn_stats(x: Any, layout: str = "NCHW") -> tuple[Any, Any]:
    """Per-channel mean and biased variance of ``x`` in float32.

    ``x`` has rank 2 (N, C), 3 (N, C, L) or 4, in ``layout`` "NCHW" or "NHWC"
    (channels last), dtype float16, bfloat16 or float32.
    """
    try:
        launch = _LAUNCHERS.get(("bn_stats", signature(x), layout))
    except (TypeError, RuntimeError):  # an unhashable layout, or a nested tensor (no shape): the contract names it
        launch = None
    if launch is None:
        launch = _bn_stats_launcher(x, layout)
    return launch(x)


def _bn_stats_launcher(x: Any, layout: Any) -> Callable[[Any], tuple[Any, Any]]:
    arg = arrays.inspect(x, "bn_stats", "x")
    problem = bn_stats_problem(arg.shape, arg.dtype, layout)
    kind = arrays.Kind(arg)
    # A contiguous torch tensor of another rank than the kernel's goes in as it is,
    # the kernel compiled to take its shape: a view per call costs more host time
    # than the rest of the argument handling.
    as_called = kind.takes_as_called(arg, problem.shape)
    kernel = kernel_for(problem, targets.for_device(arg.device_type),
                        input_shapes=(("x", arg.shape),) if as_called else ())
    func = kernel.packed
    empty = kind.allocator((problem.channels,), "float32")
    adapt = kind.adapter(arg, arg.shape if as_called else problem.shape)

    if kernel.counted or kernel.workspace:  # then the workspace and a merged kernel's counter (single_launch)
        scratch = kind.scratch([w[1:] for w in kernel.workspace], counter=kernel.counted)

        def launch(x: Any) -> tuple[Any, Any]:
            mean, var = empty(), empty()
            func(adapt(x), mean, var, *scratch())
            return mean, var
    else:
        def launch(x: Any) -> tuple[Any, Any]:
            mean, var = empty(), empty()
            func(adapt(x), mean, var)
            return mean, var

    _LAUNCHERS[("bn_stats", signature(x), layout)] = launch
    return launch


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
    mean over no valid row is NaN, as in torch. A target outside [0, V) that is
    not ``ignore_index`` raises :class:`TargetOutOfRangeError` naming the first bad
    row; the kernel flags it rather than reading out of bounds. With
    ``check_targets`` (the default) the flag is read on the host: at once for
    numpy and TVM arrays and CPU tensors; for CUDA tensors without waiting for the
    GPU, so the error is raised by a later call or by :func:`check_targets`
    (``tvm_fusion.target_check`` says how). ``check_targets=False`` reads nothing.
    """
    key = None
    try:
        key = ("cross_entropy", ce_key(logits, target, weight, ignore_index, reduction, label_smoothing, check_targets))
        launch = _LAUNCHERS.get(key)
    except (TypeError, RuntimeError):  # an unhashable option, or a nested tensor (no shape): the contract names it
        key, launch = None, None
    if launch is None:
        launch = _cross_entropy_launcher(key, logits, target, weight, ignore_index, reduction,
                                         label_smoothing, check_targets)
    return launch(logits, target, weight)


def ce_key(logits: Any, target: Any, weight: Any, ignore_index: Any, reduction: Any, label_smoothing: Any,
           check_targets: Any) -> tuple:
    """What decides a cross entropy launcher (the gradient's too): each argument's
    signature and the options with their types (a float ignore_index or a numpy
    label_smoothing is checked by the contract, not served a launcher built for an
    int or a float)."""
    return (signature(logits), signature(target), signature(weight), ignore_index, type(ignore_index),
            reduction, label_smoothing, type(label_smoothing), check_targets is True)


def inspect_ce_arguments(op: str, logits: Any, target: Any, weight: Any, check_targets: Any):
    """The arrays of a cross entropy call described for the contract (``weight``'s
    None if absent), ``check_targets`` checked."""
    la = arrays.inspect(logits, op, "logits")
    ta = arrays.inspect(target, op, "target")
    wa = None if weight is None else arrays.inspect(weight, op, "weight")
    check_bool(op, "check_targets", check_targets)
    return la, ta, wa


def ce_inputs(kind: arrays.Kind, la: arrays.ArrayArg, ta: arrays.ArrayArg, wa: arrays.ArrayArg | None,
              batch: int, classes: int) -> Callable[[Any, Any, Any], list]:
    """A function from (logits, target, weight) to the kernel's input arguments, for
    every later call with these arguments' signatures (a weight made float32)."""
    adapt_logits, adapt_target = kind.adapter(la, (batch, classes)), kind.adapter(ta, (batch,))
    if wa is None:
        return lambda logits, target, weight: [adapt_logits(logits), adapt_target(target)]
    adapt_weight, to_float32 = kind.adapter(wa, (classes,)), wa.dtype != "float32"
    return lambda logits, target, weight: [
        adapt_logits(logits), adapt_target(target), adapt_weight(_as_float32(weight) if to_float32 else weight)]


def _cross_entropy_launcher(key, logits, target, weight, ignore_index, reduction, label_smoothing,
                            check_targets) -> Callable[[Any, Any, Any], Any]:
    """The contract's checks, dispatch's kernel and the launch for one signature."""
    op = "cross_entropy"
    la, ta, wa = inspect_ce_arguments(op, logits, target, weight, check_targets)
    problem = cross_entropy_problem(
        la.shape, la.dtype, ta.shape, ta.dtype,
        None if wa is None else wa.shape, "float32" if wa is None else wa.dtype,
        ignore_index, reduction, label_smoothing,
    )
    arrays.check_same_place(op, la, target=ta, weight=wa)
    kind = arrays.Kind(la)
    if problem.batch == 0:
        return keep(_LAUNCHERS, key, lambda logits, target, weight: _empty_batch_loss(la, reduction))
    kernel = kernel_for(problem, targets.for_device(la.device_type))
    func, batch, classes = kernel.packed, problem.batch, problem.classes
    # Outputs: ([row_loss,] loss, first_bad_row); the row losses of a sum or mean
    # are scratch, the loss (0-d for a sum or mean) is the caller's, and the flag
    # goes where the check reads it.
    (*_, (_, loss_shape, _), (_, flag_shape, flag_dtype)) = kernel.outputs
    # Scratch: the row losses of a sum or mean; then what goes after the outputs, the
    # workspace (a split batch stage's partials, kernel.compiled_form) and a merged
    # kernel's launch counter (single_launch).
    rows = len(kernel.outputs) == 3
    scratch = kind.scratch([kernel.outputs[0][1:]] * rows + [w[1:] for w in kernel.workspace],
                           counter=kernel.counted)
    new_loss = kind.allocator(loss_shape, "float32")
    new_flag = kind.allocator(flag_shape, flag_dtype)
    inputs = ce_inputs(kind, la, ta, wa, batch, classes)
    torch_cuda = kind.name == "torch" and kind.cuda
    deferred = check_targets and torch_cuda
    device_id = la.device_id  # not la itself: the launcher must not keep the first call's arrays alive
    sink = target_check.sink(device_id) if torch_cuda and not check_targets else None
    flag_at = -1 - len(kernel.workspace) - kernel.counted

    def launch(logits: Any, target: Any, weight: Any) -> Any:
        args = inputs(logits, target, weight)
        tail = scratch()
        if rows:
            args.append(tail[0])
        after = tail[rows:]
        loss = new_loss()
        if sink is not None:
            func(*args, loss, sink, *after)
        elif deferred:
            args += [loss, None, *after]
            target_check.launch_checked(func, args, flag_at, device_id, batch, classes, ignore_index, target)
        else:  # the host has the flag at once (a sync for TVM's CUDA tensors)
            flag = new_flag()
            func(*args, loss, flag, *after)
            if check_targets:
                row = kind.read_int(flag)
                if row < batch:
                    raise TargetOutOfRangeError(row, _target_value(target, row), classes, ignore_index)
        return loss

    return keep(_LAUNCHERS, key, launch)


def keep(cache: dict, key: Any, launch: Callable) -> Callable:
    """``launch``, kept in ``cache`` for later calls with ``key``. A key of None (one
    that could not be hashed, for an option the contract takes: a 0-d numpy int
    ``ignore_index``, as torch takes it) keeps nothing, and such a call builds its
    launcher each time rather than failing on the cache."""
    if key is not None:
        cache[key] = launch
    return launch


def check_targets() -> None:
    """Wait for the pending CUDA cross entropy calls and raise
    :class:`TargetOutOfRangeError` for the first that had a bad target."""
    target_check.check_targets()


def build(op: str, shape: Any, dtype: str = "float32", target: Any = "cuda", **options: Any) -> Kernel:
    """The compiled kernel that the API would use for one shape.

    ``build("bn_stats", shape=(N, C, H, W), dtype=..., target=..., layout="NCHW")``;
    ``build("cross_entropy", shape=(B, V), dtype=..., target=..., target_dtype="int64",
    weight=False, ignore_index=-100, reduction="mean", label_smoothing=0.0)``;
    ``build("cross_entropy_grad", ..., mode="fused")`` (or "from_lse") with the same
    options: the gradient kernel ``tvm_fusion.torch`` launches.
    """
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
    for spec in specs:
        if not isinstance(spec, (tuple, list)) or len(spec) != 4 or not isinstance(spec[3], dict):
            raise TypeError(f"tune_many: each spec is (op, shape, dtype, options dict), got {spec!r}")
    problems = [make_problem(op, shape, dtype, **options) for op, shape, dtype, options in specs]
    try:
        return run_tuner(problems, targets.resolve(target), trials, log_dir, progress)
    finally:
        records.invalidate()  # new records: dispatch and the launchers choose again


def explain(op: str, shape: Any, dtype: str = "float32", target: Any = "cuda",
            log_dir: str | None = None, **options: Any) -> str:
    """Which candidate and knobs dispatch picks for this shape, and why (a tuning
    record, or the registry's heuristic)."""
    from .dispatch import explain as explain_choice

    return explain_choice(make_problem(op, shape, dtype, **options), targets.resolve(target), log_dir)


# The per-channel ops: the contract's factory and its keyword options with their defaults.
CHANNEL_OPS = {
    "bn_stats": (bn_stats_problem, {"layout": "NCHW"}),
    "bn_forward": (bn_forward_problem, {"layout": "NCHW", "affine": True, "training": True, "track_running": True,
                                        "eps": 1e-5}),
    "bn_backward": (bn_backward_problem, {"layout": "NCHW", "affine": True, "training": True}),
    "bn_backward_dx": (bn_backward_dx_problem, {"layout": "NCHW", "affine": True}),
}


def make_problem(op: str, shape: Any, dtype: str, **options: Any):
    """The contract's problem for ``op`` from a shape, a dtype and keyword options
    (``cross_entropy_grad`` takes cross_entropy's options, ``mode``, "fused" or
    "from_lse", and ``in_place``)."""
    check_choice("build", "op", op, KERNEL_OPS)
    if op in CHANNEL_OPS:
        factory, defaults = CHANNEL_OPS[op]
        unknown = set(options) - set(defaults)
        if unknown:
            raise TypeError(f"{op}: unknown option(s) {sorted(unknown)}; known: {sorted(defaults)}")
        return factory(shape, dtype, **{**defaults, **options})
    if not isinstance(options.get("weight", False), bool):  # "no" was taken as a weight
        raise TypeError(f"{op}: the weight option is a bool (whether a class weight is passed), "
                        f"got {options['weight']!r}")
    known = {"target_dtype", "weight", "ignore_index", "reduction", "label_smoothing"}
    if op == "cross_entropy_grad":
        known |= {"mode", "in_place"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"{op}: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{op}: shape must be a tuple of sizes like (4096, 32000), got {shape!r}")
    shape = tuple(shape)
    batch = shape[0] if shape else None
    classes = shape[1] if len(shape) > 1 else None
    args = (
        shape, dtype, None if batch is None else (batch,), options.get("target_dtype", "int64"),
        (classes,) if options.get("weight") else None, "float32",
        options.get("ignore_index", -100), options.get("reduction", "mean"),
        options.get("label_smoothing", 0.0),
    )
    if op == "cross_entropy_grad":
        problem = cross_entropy_grad_problem(*args, mode=options.get("mode", "fused"),
                                             in_place=options.get("in_place", False))
    else:
        problem = cross_entropy_problem(*args)
    return _with_rows(op, problem)


def _with_rows(op: str, problem: Any) -> Any:
    """``problem`` if it has a row to build a kernel for. The contract takes B = 0 (the
    calls answer an empty batch without a kernel, as torch does); a kernel of no rows
    failed in a TVM schedule primitive (rfactor) with an error naming neither."""
    if problem.batch == 0:
        raise ValueError(f"{op}: a kernel needs at least one row (B > 0), got shape {problem.shape}; "
                         "tvm_fusion.cross_entropy answers an empty batch without one")
    return problem


def _as_float32(weight: Any) -> Any:
    if isinstance(weight, np.ndarray):
        return weight.astype(np.float32)
    if arrays.is_torch(weight):
        return weight.float()
    import tvm

    return tvm.runtime.tensor(weight.numpy().astype(np.float32), weight.device)


def _target_value(target: Any, row: int) -> int | None:
    try:
        if isinstance(target, np.ndarray):
            return int(target[row])
        if arrays.is_torch(target):
            return int(target[row].item())
        return int(target.numpy()[row])
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

    return tvm.runtime.tensor(value, arrays.tvm_device(like))
