"""tvm_fusion: fused reduction kernels (BatchNorm statistics, CrossEntropy) on Apache TVM.

Three levels per operator: the contract (``tvm_fusion.contracts``), its map/reduce
decompositions as TE compute (``tvm_fusion.compute``) and TensorIR schedule
candidates (``tvm_fusion.schedules``), chosen per shape by dispatch.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys


def _mount_schedules() -> None:
    """Make the repository's top-level ``schedules/`` importable as ``tvm_fusion.schedules``.

    Installed, pyproject's package-dir maps it there; from a plain source checkout
    (PYTHONPATH at the repository root) this points the subpackage at the folder."""
    name = f"{__name__}.schedules"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = pathlib.Path(__file__).resolve().parent.parent / "schedules"
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"tvm_fusion: cannot find the schedules package at {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_mount_schedules()

from . import cpu_threads  # noqa: E402

cpu_threads.configure()  # before any parallel CPU kernel sizes TVM's thread pool

from .api import (  # noqa: E402
    OPS, bn_stats, build, check_targets, cross_entropy, explain, make_problem, tune, tune_many,
)
from .records import invalidate as reload_logs  # noqa: E402
from .contracts import TargetOutOfRangeError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "OPS",
    "TargetOutOfRangeError",
    "bn_stats",
    "build",
    "check_targets",
    "cross_entropy",
    "explain",
    "make_problem",
    "reload_logs",
    "tune",
    "tune_many",
]
