"""FoldBatchNorm: fold inference BatchNorm into the conv or linear layer before it.

Pattern::

    z = conv1d / conv2d(x, W)  or  matmul(x, W)      [z = z + b]
    y = batch_norm(z, gamma, beta, rm, rv, eps, training=False)[0]

With s = gamma / sqrt(rv + eps) per output channel the BN is an affine map, so::

    W' = W * s (per output channel: W's axis 0 for OIHW / OIW, its last axis for matmul)
    b' = (b - rm) * s + beta                (b = 0 without a bias)
    y  = conv(x, W') + b'   /   matmul(x, W') + b'

Grouped convolutions fold the same way (OIHW keeps every output channel on axis 0).
The contract, checked at each BN, the reason recorded in ``.report`` otherwise:
inference mode; the input is the conv / matmul (+ bias) and nothing else uses it;
W, b, gamma, beta, rm, rv are constants (a reshape or transpose of one counts);
rv finite and non-negative; NCHW / NCW data with OIHW / OIW kernels and BN over
axis 1, or a 2-D matmul with BN over its output features. The new weights keep W's
dtype; the arithmetic is float64.

Given a CUDA target, a BN after a grouped convolution stays. Fused with the folded
bias, such a conv gets TVM's default GPU reduction schedule (DLight): a thread block
per output element. Unfused, it gets a thread per output element. With the fold, the
whole small ResNet's inference took 4.817 ms on the H200, against 0.823 ms unfolded
(results/benchmarks.csv, relax_* rows).

Not used: TVM's ``FoldBatchnormToConv2D`` (conv2d only, no linear, no reasons given)
and ``FoldConstant`` to see through reshaped constants (it compiles and runs every
constant subgraph; a reshape or transpose is read with numpy instead).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from .. import targets
from .graph import Bindings, Plan, dtype_of, rewrite_bindings, shape_of
from .report import Decision, record

CONVS = {"relax.nn.conv1d": ("NCW", "OIW"), "relax.nn.conv2d": ("NCHW", "OIHW")}  # data, kernel layout
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Kept(Exception):
    """A BN that stays: the message is the reason."""


@tvm.ir.transform.module_pass(opt_level=0, name="tvm_fusion.FoldBatchNorm")
class FoldBatchNorm:
    """Fold inference BatchNorm into the preceding conv1d / conv2d / linear (matmul).

    ``target``: the target the graph will be built for, if known (on CUDA the BN
    after a grouped conv stays, see above). After a run, ``.report`` holds one
    :class:`Decision` per batch norm: "folded", or "kept" with the reason (also
    logged as a warning).
    """

    def __init__(self, target: Any = None) -> None:
        self.target = None if target is None else targets.resolve(target)
        self.report: list[Decision] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        self.report = []
        plans = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, relax.Function):
                continue
            graph = Bindings(gvar.name_hint, func)
            plans[gvar.name_hint] = plan = {}
            for var in list(graph.value):
                call = graph.call(var, "relax.nn.batch_norm")
                if call is None:
                    continue
                try:
                    plan[var], how = self._fold(graph, call)
                except _Kept as kept:
                    record(self.report, graph.where(var), "kept", str(kept))
                else:
                    record(self.report, graph.where(var), "folded", how)
        return rewrite_bindings(mod, plans)

    def _fold(self, graph: Bindings, bn: tvm.ir.Call) -> tuple[Plan, str]:
        if bn.attrs.training:
            raise _Kept("training mode: it normalizes with the batch's statistics, unknown before the run")
        z = bn.args[0]
        shape = shape_of(z)
        if shape is None:
            raise _Kept(f"symbolic shape {z.ty}")
        layer, bias = self._layer(graph, z)
        if self._grouped_on_cuda(layer):
            raise _Kept(f"grouped {layer.op.name} on CUDA: fused with the folded bias, TVM's default GPU "
                        "schedule gives it a thread block per output element (slower than keeping the BN)")
        channel_axis = 1 if layer.op.name in CONVS else len(shape) - 1
        if int(bn.attrs.axis) % len(shape) != channel_axis:
            raise _Kept(f"BN axis {int(bn.attrs.axis)} is not the {layer.op.name} output's channel axis")
        channels = shape[channel_axis]
        per_channel = [1] * len(shape)
        per_channel[channel_axis] = channels
        gamma, beta, mean, variance = (
            _constant(graph, expr, name).astype(np.float64)
            for expr, name in zip(bn.args[1:], ("gamma", "beta", "running_mean", "running_var"))
        )
        weight = _constant(graph, layer.args[1], f"the {layer.op.name} weight")
        if str(weight.dtype) not in FLOAT_DTYPES:
            raise _Kept(f"the {layer.op.name} weight is {weight.dtype}: rescaling it needs floating point")
        old_bias = np.zeros(channels) if bias is None else graph.constant(bias)
        if not np.all(np.isfinite(variance)) or np.any(variance < 0):
            bad = int(np.flatnonzero(~np.isfinite(variance) | (variance < 0))[0])
            raise _Kept(f"running_var[{bad}] = {variance[bad]:g} is not finite and non-negative")
        if bias is not None and (1,) * (len(shape) - old_bias.ndim) + old_bias.shape != tuple(per_channel):
            raise _Kept(f"the bias of shape {old_bias.shape} is not one value per output channel")
        # 1. s = gamma / sqrt(rv + eps); 2. W' = W * s per output channel; 3. b' = (b - rm) * s + beta
        scale = (gamma if bn.attrs.scale else 1.0) / np.sqrt(variance + float(bn.attrs.epsilon))
        shift = (old_bias.reshape(-1) - mean) * scale + (beta if bn.attrs.center else 0.0)
        out_axis = 0 if layer.op.name in CONVS else weight.ndim - 1
        scale_shape = [1] * weight.ndim
        scale_shape[out_axis] = channels
        new_weight = relax.const((weight.astype(np.float64) * scale.reshape(scale_shape)).astype(weight.dtype))
        new_bias = relax.const(shift.reshape(per_channel).astype(dtype_of(z)))

        def plan(bb: relax.BlockBuilder, remap) -> relax.Expr:
            rebuilt = tvm.ir.Call(layer.op, [remap(layer.args[0]), new_weight], layer.attrs, layer.ty_args)
            # Outputs 1 and 2 of an inference BN are its running statistics, unchanged.
            return relax.Tuple([R.add(rebuilt, new_bias), remap(bn.args[3]), remap(bn.args[4])])

        return plan, f"into the {layer.op.name} before it ({'with' if bias is not None else 'no'} bias)"

    def _grouped_on_cuda(self, layer: tvm.ir.Call) -> bool:
        cuda = self.target is not None and self.target.kind.name == "cuda"
        return cuda and layer.op.name in CONVS and int(layer.attrs.groups) > 1

    def _layer(self, graph: Bindings, z: relax.Expr) -> tuple[tvm.ir.Call, relax.Expr | None]:
        """(the conv / matmul call, the bias added to it or None) that produce ``z``."""
        produced, bias = z, None
        add = graph.call(z, "relax.add")
        if add is not None:
            for layer_out, other in (add.args, add.args[::-1]):
                if _layer_call(graph, layer_out) is not None and graph.constant(other) is not None:
                    produced, bias = layer_out, other
                    break
        layer = _layer_call(graph, produced)
        if layer is None:
            what = graph.source(z)
            raise _Kept(f"its input {_name(z)} is {what}, not conv1d / conv2d / matmul (+ constant bias)")
        for inner in [produced] + ([z] if bias is not None else []):
            users = graph.users.get(inner, [])
            if len(users) != 1:
                raise _Kept(f"{_name(inner)} has {len(users)} users; folding would change the others")
        if layer.op.name in CONVS:
            data_layout, kernel_layout = CONVS[layer.op.name]
            given = (layer.attrs.data_layout, layer.attrs.kernel_layout, layer.attrs.out_layout)
            if given != (data_layout, kernel_layout, data_layout):
                raise _Kept(f"layouts {'/'.join(map(str, given))}: folding needs {data_layout}/{kernel_layout}")
        elif len(shape_of(layer.args[1]) or ()) != 2:
            raise _Kept("the matmul's weight is not a 2-D (in, out) matrix")
        return layer, bias


def _layer_call(graph: Bindings, expr: relax.Expr) -> tvm.ir.Call | None:
    return graph.call(expr, *CONVS, "relax.matmul")


def _constant(graph: Bindings, expr: relax.Expr, what: str) -> np.ndarray:
    value = graph.constant(expr)
    if value is None:
        source = graph.source(expr)
        raise _Kept(f"{what} is {source}, not a constant; bind parameters first (relax.transform.BindParams)")
    return value


def _name(expr: relax.Expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else type(expr).__name__
