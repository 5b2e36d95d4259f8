"""Relax graph integration: our fused kernels inside whole models.

* :class:`FuseReductions` (training): BatchNorm statistics and cross entropy ->
  ``call_tir`` of the kernel dispatch picks per shape.
* :class:`FoldBatchNorm` (inference): BatchNorm folded into the conv / linear
  before it, with a reason for every BN it keeps.
* :func:`import_exported`: torch.export -> Relax, keeping label smoothing and
  BatchNorm's arguments that TVM's importer loses.
* :func:`compile_exported`: all of it, from an ExportedProgram or a .pt2 file.
* :mod:`tvm_fusion.relax.model`: a small ResNet with its loss, end to end.

torch is needed only where a torch program comes in: the importer,
``compile_exported`` and the model.
"""

from .exported import CompiledProgram, compile_exported
from .fold_batchnorm import FoldBatchNorm
from .fuse_reductions import FuseReductions
from .graph import count_ops
from .importer import import_exported
from .report import Decision

__all__ = [
    "CompiledProgram",
    "Decision",
    "FoldBatchNorm",
    "FuseReductions",
    "compile_exported",
    "count_ops",
    "import_exported",
]
