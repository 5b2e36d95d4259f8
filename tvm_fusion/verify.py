"""A compiled kernel against its operator's float64 reference, on fresh random data.

MetaSchedule's runner times a configuration on random arguments and keeps the time; it
never looks at the outputs. A configuration that races or leaves an element unwritten
can then be the fastest record of its problem, and dispatch would serve it: the
parts of ``cross_entropy_split_row`` that did not divide a row's chunks raced so on the
H100 (60 failures of the GPU suite, 2026-12-06), and a tune would have timed them like
any other. :func:`tuner.tune` checks each problem's best record here before it reports
it, and rejects a wrong one (``records.reject``: dispatch then skips it).

:func:`check` fills the kernel's inputs by name (logits scaled so that a row's
probabilities are far from uniform, targets with a row ignored where the option exists,
BatchNorm data off zero), its outputs with NaN (-7777 for integers) so that an element
left unwritten fails, runs it once, and compares every output the operator's reference
gives (``tvm_fusion.contracts``). The tolerances find a wrong reduction or an unwritten
element, not the last rounding: an output stored in 16 bits within that format's step,
a float32 one within 1e-4; the suite's per-candidate tests hold the tight ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from .contracts import bn_backward, bn_backward_dx, bn_forward, bn_stats, cross_entropy, cross_entropy_grad
from .contracts.common import numel
from .kernel import Kernel

POISON_INT = -7777
# Relative step of each stored format, and of float32 results (accumulation over many values).
RTOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2, "int32": 0.0, "int64": 0.0}


def _host(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as a numpy array of ``dtype`` (bfloat16: ml_dtypes', which comes with
    apache-tvm)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16)
    return values.astype(dtype)


def _f64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def inputs_for(kernel: Kernel, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random inputs for ``kernel``'s parameters, by name."""
    problem = kernel.problem
    found: dict[str, np.ndarray] = {}
    for name, shape, dtype in kernel.params[: kernel.num_inputs]:
        shape = tuple(int(s) for s in shape)
        if name == "logits":
            values = gen.standard_normal(shape) * 3.0
        elif name == "target":
            values = gen.integers(0, problem.classes, size=shape)
            if values.size > 1:
                values.reshape(-1)[gen.integers(0, values.size)] = problem.ignore_index  # one row ignored
        elif name in ("weight", "bias", "running_mean", "running_var", "dloss"):
            values = gen.random(shape) + 0.5
        elif name == "momentum":
            values = np.full(shape, 0.1)
        elif name == "x":
            values = gen.standard_normal(shape) * 2.0 + 1.0
        elif name == "dy":
            values = gen.standard_normal(shape)
        elif name in ("mean", "mean_dy", "mean_dy_xhat"):
            values = gen.random(shape) * 0.5 + 0.25
        elif name == "invstd":
            values = gen.random(shape) + 0.25
        elif name == "lse":
            values = cross_entropy_grad.reference_lse(found["logits"])  # the logits come first
        else:
            raise ValueError(f"verify: no random input for parameter {name!r} of {kernel.candidate}")
        found[name] = _host(values, dtype)
    return found


def expected(kernel: Kernel, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 reference of each output the operator defines, by name."""
    problem = kernel.problem
    op = problem.op
    if op.startswith("cross_entropy"):
        options = dict(weight=given.get("weight"), ignore_index=problem.ignore_index, reduction=problem.reduction,
                       label_smoothing=problem.label_smoothing)
    if op == "cross_entropy":
        loss = cross_entropy.reference(given["logits"], given["target"], **options)
        return {"loss": loss} if problem.reduction != "none" else {"loss": loss, "row_loss": loss}
    if op == "cross_entropy_grad":
        if problem.mode == "from_lse":
            return {"dlogits": cross_entropy_grad.reference_grad(given["logits"], given["target"],
                                                                 dloss=given["dloss"], **options)}
        return {"dlogits": cross_entropy_grad.reference_grad(given["logits"], given["target"], **options),
                "loss": cross_entropy.reference(given["logits"], given["target"], **options),
                "lse": cross_entropy_grad.reference_lse(given["logits"])}
    layout = "NHWC" if problem.channels_last else "NCHW"
    x = given["x"].reshape(problem.input_shape)
    if op == "bn_stats":
        mean, var = bn_stats.reference(x, layout)
        return {"mean": mean, "var": var}
    if op == "bn_forward":
        momentum = float(given["momentum"].reshape(-1)[0]) if "momentum" in given else 0.1
        return bn_forward.reference(x, given.get("weight"), given.get("bias"), given.get("running_mean"),
                                    given.get("running_var"), momentum, problem)
    dy = given["dy"].reshape(problem.input_shape)
    if op == "bn_backward":
        dx, dweight, dbias = bn_backward.reference(x, dy, given["mean"], given["invstd"], given.get("weight"),
                                                   layout, problem.training)
        found = {"dx": dx}
        if problem.affine:
            found.update(dweight=dweight, dbias=dbias)
        return found
    if op == "bn_backward_dx":
        return {"dx": bn_backward_dx.reference(x, dy, given["mean"], given["invstd"], given.get("weight"),
                                               given["mean_dy"], given["mean_dy_xhat"], layout)}
    raise ValueError(f"verify: no reference for operator {op!r}")


def check(kernel: Kernel, seed: int = 0, device: Any = None) -> str | None:
    """None when ``kernel``'s outputs match the float64 reference on fresh random
    inputs, else what is off (the output, how many values, the worst one)."""
    gen = np.random.default_rng(seed)
    given = inputs_for(kernel, gen)
    device = device or (tvm.cuda(0) if kernel.target.kind.name == "cuda" else tvm.cpu(0))
    args = [tvm.runtime.tensor(np.ascontiguousarray(given[name]), device)._create_view(tuple(shape))
            for name, shape, _ in kernel.params[: kernel.num_inputs]]
    outs = [tvm.runtime.tensor(_host(np.full(numel(shape), POISON_INT if dtype.startswith("int") else np.nan), dtype),
                               device)._create_view(tuple(shape))
            for _, shape, dtype in kernel.outputs]
    try:
        kernel(*args, *outs)
        device.sync()
    except Exception as err:  # noqa: BLE001 - any failure to run is the answer
        return f"{kernel.describe()}: the kernel failed to run ({type(err).__name__}: {str(err)[:200]})"
    got = {name: (out, dtype) for (name, _, dtype), out in zip(kernel.outputs, outs)}
    for name, want in expected(kernel, given).items():
        if name not in got:
            continue
        out, dtype = got[name]
        off = _mismatch(_f64(out.numpy()).reshape(np.shape(want)), _f64(want), RTOL.get(dtype, 1e-4))
        if off:
            return f"{kernel.describe()}: {name} {off}"
    return None


def _mismatch(actual: np.ndarray, want: np.ndarray, rtol: float) -> str | None:
    """What is off between ``actual`` and ``want`` (NaN must match NaN), or None. The
    absolute part of the bound is ``rtol`` times the largest reference value, so that
    values near zero of a large output are not judged by their own size."""
    nan_a, nan_w = np.isnan(actual), np.isnan(want)
    if not np.array_equal(nan_a, nan_w):
        at = np.flatnonzero((nan_a != nan_w).ravel())
        return f"has NaN where the reference has none, or none where it has (at {at.size} values, first {int(at[0])})"
    finite = ~nan_w & np.isfinite(want)
    if not finite.any():
        return None
    scale = float(np.abs(want[finite]).max())
    err = np.where(finite, np.abs(actual - np.where(finite, want, 0.0)), 0.0)
    bad = err > rtol * (scale + np.abs(np.where(finite, want, 0.0))) + 1e-6
    if not bad.any():
        return None
    worst = int(np.argmax(np.where(bad, err, -1.0).ravel()))
    return (f"off at {int(bad.sum())} of {bad.size} values; worst at flat index {worst}: "
            f"{actual.ravel()[worst]!r} against {want.ravel()[worst]!r}")
