"""compile_exported: a ``torch.export`` program -> a Relax VM executable with our kernels."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .. import targets
from ..contracts.common import check_choice
from .fold_batchnorm import FoldBatchNorm
from .fuse_reductions import FuseReductions
from .importer import import_exported
from .report import Decision

MODES = ("train", "eval")


@dataclass
class CompiledProgram:
    """The executable, the Relax module it was built from, and what the passes did."""

    executable: relax.VMExecutable = field(repr=False)
    target: tvm.target.Target
    imported: tvm.IRModule = field(repr=False)  # straight from the importer
    mod: tvm.IRModule = field(repr=False)  # after the passes
    outputs: list[str]  # main's outputs, in order (train mode adds the running statistics)
    report: list[Decision]

    def run(self, *inputs: Any, device: Any = None) -> dict[str, np.ndarray]:
        """Run main on numpy arrays or torch tensors; outputs by name, as numpy arrays."""
        device = device or device_of(self.target)
        vm = relax.VirtualMachine(self.executable, device)
        args = [tvm.runtime.tensor(np.asarray(_numpy(x)), device) for x in inputs]
        result = vm["main"](*args)
        values = [result] if isinstance(result, tvm.runtime.Tensor) else list(result)
        return {name: value.numpy() for name, value in zip(self.outputs, values)}


def compile_exported(
    program: Any,
    target: Any = "llvm",
    mode: str = "train",
    log_dir: str | os.PathLike | None = None,
) -> CompiledProgram:
    """Import ``program``, apply the passes for ``mode`` and build it for ``target``.

    ``program``: a ``torch.export.ExportedProgram`` or the path of one saved with
    ``torch.export.save`` (.pt2). ``mode="train"``: FuseReductions, and main also
    returns each BatchNorm's new running mean and variance (see ``.outputs``);
    ``mode="eval"``: FoldBatchNorm, then FuseReductions for the loss (and any BN
    the program still runs in training mode). The rest of the graph goes through
    TVM's default Relax pipeline for the target. ``log_dir``: tuning logs for
    FuseReductions.
    """
    import torch

    check_choice("compile_exported", "mode", mode, MODES)
    target = targets.resolve(target)
    if isinstance(program, (str, os.PathLike)):
        path = pathlib.Path(program)
        if not path.is_file():
            raise FileNotFoundError(f"compile_exported: no exported program at {str(path)!r}")
        program = torch.export.load(path)
    imported = import_exported(program, running_stats=mode == "train")
    passes = ([FoldBatchNorm(target)] if mode == "eval" else []) + [FuseReductions(target, log_dir)]
    mod, report = imported.mod, []
    for graph_pass in passes:
        mod = graph_pass(mod)
        report += graph_pass.report
    with target:
        executable = tvm.compile(mod, target)
    return CompiledProgram(executable, target, imported.mod, mod, imported.outputs, report)


def device_of(target: tvm.target.Target) -> Any:
    """Device 0 of the target's kind: the GPU for cuda, the host CPU for llvm."""
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value
