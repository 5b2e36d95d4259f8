"""Import a ``torch.export`` program into Relax with torch's meaning kept.

``tvm.relax.frontend.torch.from_exported_program`` (TVM 0.27) loses meaning in
three places this module fixes, through its ``custom_convert_map``:

* with ``run_ep_decomposition=True`` (its default) torch decomposes
  ``F.cross_entropy`` into some twenty gather / where / sum operators, and the
  training batch norm's new running variance comes out as zeros;
* with ``run_ep_decomposition=False`` ``aten.batch_norm`` is read with its
  arguments shifted by one (``momentum`` := the training flag, ``eps`` :=
  momentum, always in training mode), and ``aten.cross_entropy_loss`` drops
  ``label_smoothing`` and any ``reduction`` / ``ignore_index`` given positionally,
  as ``torch.export`` gives them.

So this importer runs without decomposition and converts both operators itself:
batch norm as ``R.nn.batch_norm`` with the program's own training flag, momentum and
eps; cross entropy as ``nll_loss(log_softmax(x))``, or with label smoothing as the
form in :mod:`.cross_entropy_form`. Both are what :class:`FuseReductions` looks for.

Not done: the ``num_batches_tracked`` increment is not returned; a BatchNorm with
``momentum=None`` (a cumulative average) does not export to a constant momentum.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from .cross_entropy_form import label_smoothed_nll
from .graph import dtype_of

REDUCTIONS = ("none", "mean", "sum")  # aten's reduction enum: 0, 1, 2


class Imported(NamedTuple):
    mod: tvm.IRModule
    outputs: list[str]  # the name of each output of main, in order


def import_exported(program: Any, running_stats: bool = False) -> Imported:
    """``program`` (a ``torch.export.ExportedProgram``) as a Relax module, parameters bound.

    With ``running_stats``, main also returns the new running mean and variance of
    each training-mode BatchNorm, after the program's own outputs, named after the
    buffers (``"layer1.bn.running_mean"``, ...).
    """
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"program must be a torch.export.ExportedProgram, got {type(program).__name__}")
    signature = program.graph_signature
    stat_buffers: list[tuple[str, str] | None] = []  # per batch norm, in graph order
    mod = from_exported_program(
        program,
        run_ep_decomposition=False,
        custom_convert_map={
            "batch_norm.default": functools.partial(_batch_norm, stat_buffers=stat_buffers),
            "cross_entropy_loss.default": _cross_entropy,
        },
    )
    kinds = (torch.export.graph_signature.OutputKind.USER_OUTPUT, torch.export.graph_signature.OutputKind.LOSS_OUTPUT)
    outputs = [spec.arg.name for spec in signature.output_specs if spec.kind in kinds]
    if running_stats:
        mod = _return_running_stats(mod, [pair is not None for pair in stat_buffers])
        outputs += [signature.inputs_to_buffers[name] for pair in stat_buffers if pair for name in pair]
    return Imported(mod, outputs)


def _arguments(node) -> dict[str, Any]:
    """An aten call's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def _batch_norm(node, importer, stat_buffers: list) -> relax.Var:
    """``aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)``."""
    args = _arguments(node)
    x = importer.env[args["input"]]
    channels, dtype = int(importer.shape_of(x)[1]), dtype_of(x)

    def vector(name: str, fill: float) -> relax.Expr:
        given = args[name]
        return importer.env[given] if given is not None else relax.const(np.full(channels, fill), dtype)

    tracked = args["running_mean"] is not None
    bn = importer.block_builder.emit(
        R.nn.batch_norm(
            x, vector("weight", 1.0), vector("bias", 0.0), vector("running_mean", 0.0),
            vector("running_var", 1.0), axis=1, epsilon=args["eps"], center=args["bias"] is not None,
            scale=args["weight"] is not None, momentum=args["momentum"], training=args["training"],
        )
    )
    stat_buffers.append(
        (args["running_mean"].name, args["running_var"].name) if args["training"] and tracked else None
    )
    return importer.block_builder.emit(relax.TupleGetItem(bn, 0))


def _cross_entropy(node, importer) -> relax.Var:
    """``aten.cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)``."""
    args = _arguments(node)
    logits, target = importer.env[args["self"]], importer.env[args["target"]]
    weight = None if args["weight"] is None else importer.env[args["weight"]]
    reduction, ignore_index = REDUCTIONS[args["reduction"]], args["ignore_index"]
    smoothing = float(args["label_smoothing"])
    shape = importer.shape_of(logits)
    bb = importer.block_builder
    logp = bb.emit(R.nn.log_softmax(logits, axis=1 if len(shape) >= 2 else 0))
    if smoothing == 0.0:
        return bb.emit(R.nn.nll_loss(logp, target, weight, reduction, ignore_index))
    if len(shape) < 2:
        raise ValueError(f"cross_entropy: label_smoothing needs batched logits (B, V, ...), got shape {tuple(shape)}")
    dtype = dtype_of(logits)
    keep = relax.const(1.0 - smoothing, dtype)
    spread = relax.const(smoothing / int(shape[1]), dtype)
    return bb.emit(label_smoothed_nll(logp, target, weight, reduction, ignore_index, keep, spread))


def _return_running_stats(mod: tvm.IRModule, tracked: list[bool]) -> tvm.IRModule:
    """``mod`` whose main also returns outputs 1 and 2 (new running mean, var) of each
    tracked batch norm, in graph order."""
    func = mod["main"]
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError(
            "running_stats: main must be one dataflow block (no control flow or side effects), "
            f"got {len(blocks)} block(s)"
        )
    norms = [b.var for b in blocks[0].bindings if _is_batch_norm(b.value)]
    if len(norms) != len(tracked):
        raise ValueError(f"running_stats: found {len(norms)} batch norms in main, converted {len(tracked)}")
    result = func.body.body
    fields = (
        [relax.TupleGetItem(result, i) for i in range(len(result.ty.fields))]
        if isinstance(result.ty, relax.TupleType)
        else [result]
    )
    stats = [relax.TupleGetItem(bn, i) for bn, keep in zip(norms, tracked) if keep for i in (1, 2)]
    bb = relax.BlockBuilder()
    with bb.function("main", list(func.params), attrs=dict(func.attrs) if func.attrs else None):
        with bb.dataflow():
            for binding in blocks[0].bindings:
                bb.emit_normalized(binding)
            output = bb.emit_output(relax.Tuple(fields + stats))
        bb.emit_func_output(output)
    return bb.get()


def _is_batch_norm(value: relax.Expr) -> bool:
    return isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.nn.batch_norm"
