"""Compiled kernels and the in-process cache that keeps them.

A :class:`Kernel` is one candidate with one set of knobs, compiled for one problem
and target. ``build_kernel`` compiles it once per process: a second call with the
same (problem, target, candidate, knobs) returns the cached kernel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
import tvm.support.nvcc  # noqa: F401  (registers the CUDA JIT callback used at load on a GPU)
from tvm.target import Target

from . import registry, targets
from .compute import prim_func
from .contracts import Problem
from .registry import Knobs


@dataclass
class Kernel:
    """A compiled kernel for one problem; call it with TVM tensors (inputs, then outputs)."""

    problem: Problem
    target: Target
    candidate: str
    knobs: Knobs
    source: str  # "record", "heuristic" or "explicit": how the candidate was chosen
    mod: tvm.IRModule = field(repr=False)
    executable: Any = field(repr=False)

    def __post_init__(self) -> None:
        self._func = self.executable["main"]

    def __call__(self, *tensors: Any) -> None:
        self._func(*tensors)

    @property
    def params(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of every parameter, inputs first then outputs."""
        func = self.mod["main"]
        return [(p.name, tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]

    @property
    def num_inputs(self) -> int:
        if self.problem.op == "bn_stats":
            return 1
        return 3 if self.problem.has_weight else 2

    @property
    def outputs(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.params[self.num_inputs :]

    def device_source(self) -> str:
        """Generated CUDA source (or LLVM IR on the CPU)."""
        mod = self.executable.mod
        if self.target.kind.name == "cuda":
            return "\n".join(m.inspect_source() for m in mod.imports)
        return mod.inspect_source("ll")

    def describe(self) -> str:
        return f"{self.problem.key()} on {targets.key(self.target)}: {self.candidate} [{self.knobs}] ({self.source})"


_CACHE: dict[tuple, Kernel] = {}
_LOCK = threading.Lock()


def schedule_for(problem: Problem, target: Target, candidate: str, knobs: Knobs | None = None):
    """The scheduled IRModule of ``candidate`` for ``problem`` (knobs default if None)."""
    cand = registry.get(candidate)
    if cand.target_kind != target.kind.name:
        raise ValueError(f"candidate {candidate} is for {cand.target_kind}, not {target.kind.name}")
    if not cand.applies(problem):
        raise ValueError(f"candidate {candidate} does not apply to {problem.describe()}")
    knobs = knobs or cand.default_for(problem, target)
    sch = cand.apply(prim_func(problem, cand.algorithm), target, knobs=knobs)
    if sch is None:
        raise ValueError(f"candidate {candidate} declined {problem.describe()}")
    return sch, knobs


def build_kernel(
    problem: Problem,
    target: Target,
    candidate: str,
    knobs: Knobs | None = None,
    source: str = "explicit",
    mod: tvm.IRModule | None = None,
) -> Kernel:
    """Compile (or fetch from the cache) ``candidate`` for ``problem`` on ``target``.

    ``mod`` is an already scheduled module (a tuning record's); else the candidate
    schedules the problem with ``knobs``."""
    cand = registry.get(candidate)
    knobs = knobs or cand.default_for(problem, target)
    cache_key = (problem, str(target), candidate, knobs, None if mod is None else tvm_ffi.structural_hash(mod))
    with _LOCK:
        if cache_key in _CACHE:
            return _CACHE[cache_key]
    if mod is None:
        sch, knobs = schedule_for(problem, target, candidate, knobs)
        mod = sch.mod
    with target:
        executable = tvm.compile(mod, target=target)
    kernel = Kernel(problem, target, candidate, knobs, source, mod, executable)
    with _LOCK:
        return _CACHE.setdefault(cache_key, kernel)


def cache_size() -> int:
    return len(_CACHE)
