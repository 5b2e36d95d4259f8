"""Dispatch: which candidate and knobs a problem gets on a target, and why.

Order: a tuning record for this exact problem (the fastest across decompositions and
logs), else a record for the same shape with default options (its candidate and
knobs reapplied to these options), else the registry's heuristic: the first
applicable candidate in ``DISPATCH_ORDER`` that prefers the shape, default knobs.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import tvm
from tvm.target import Target

from . import records, registry
from .compute import ALGORITHMS, prim_func
from .contracts import CrossEntropyProblem, Problem
from .kernel import Kernel, build_kernel, schedule_for
from .registry import ANNOTATED_BLOCK, CANDIDATE_ANNOTATION, KNOB_ANNOTATION, Knobs


@dataclasses.dataclass(frozen=True)
class Choice:
    candidate: str
    knobs: Knobs
    source: str  # "record", "record (default options)" or "heuristic"
    reason: str
    mod: tvm.IRModule | None = None  # the record's scheduled module, when exact


@dataclasses.dataclass(frozen=True)
class Found:
    candidate: str
    knobs: Knobs
    seconds: float
    mod: tvm.IRModule
    path: str


def best_record(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> Found | None:
    """The fastest tuning record of ``problem`` on ``target`` in the searched logs."""
    best: Found | None = None
    algorithms = {c.algorithm for c in registry.applicable(problem, target)}
    for path, db in records.databases(log_dir, target):
        for algorithm in ALGORITHMS[problem.op]:
            if algorithm not in algorithms:
                continue
            mod = tvm.IRModule({"main": prim_func(problem, algorithm)})
            if not db.has_workload(mod):
                continue
            record = db.query_tuning_record(mod, target, "main")
            if record is None or not record.run_secs:
                continue
            seconds = statistics.median(float(s) for s in record.run_secs)
            if best is None or seconds < best.seconds:
                sch = tvm.s_tir.Schedule(mod)
                record.trace.apply_to_schedule(sch, remove_postproc=False)
                candidate, knobs = _annotations(sch, problem.op)
                best = Found(candidate, knobs, seconds, sch.mod, str(path))
    return best


def _annotations(sch: tvm.s_tir.Schedule, op: str) -> tuple[str, Knobs]:
    notes = sch.get(sch.get_sblock(ANNOTATED_BLOCK[op])).annotations
    name = str(notes[CANDIDATE_ANNOTATION])
    cand = registry.get(name)
    values = {k[len(KNOB_ANNOTATION):]: int(v) for k, v in notes.items() if k.startswith(KNOB_ANNOTATION)}
    return name, cand.knobs(**values)


_CHOICES: dict[tuple, Choice] = {}
_KERNELS: dict[tuple, Kernel] = {}


def _cache_key(problem: Problem, target: Target, log_dir: str | os.PathLike | None) -> tuple:
    """The problem, the target and the state of every searched log."""
    logs = tuple(
        (str(path), (path / records.RECORDS).stat().st_mtime)
        for path in (records.folder(base, target) for base in records.search_paths(log_dir))
        if (path / records.RECORDS).exists()
    )
    return (problem, str(target), logs)


def choose(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> Choice:
    """The choice for ``problem``, cached until a searched log changes."""
    key = _cache_key(problem, target, log_dir)
    if key not in _CHOICES:
        _CHOICES[key] = _choose(problem, target, log_dir)
    return _CHOICES[key]


def _choose(problem: Problem, target: Target, log_dir: str | os.PathLike | None) -> Choice:
    found = best_record(problem, target, log_dir)
    if found is not None:
        return Choice(found.candidate, found.knobs, "record",
                      f"tuning record in {found.path}: {found.seconds * 1e3:.4f} ms", found.mod)
    if isinstance(problem, CrossEntropyProblem) and problem != problem.canonical():
        found = best_record(problem.canonical(), target, log_dir)
        if found is not None and registry.get(found.candidate).applies(problem):
            return Choice(found.candidate, found.knobs, "record (default options)",
                          f"tuning record of the same shape with default options in {found.path} "
                          f"({found.seconds * 1e3:.4f} ms); its candidate and knobs reapplied")
    cand = registry.default_candidate(problem, target)
    names = [c.name for c in registry.applicable(problem, target)]
    return Choice(cand.name, cand.default_for(problem, target), "heuristic",
                  f"no tuning record; first of the applicable candidates {names} in dispatch "
                  f"order that prefers this shape, with its default knobs")


def kernel_for(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> Kernel:
    """The compiled kernel of the choice (looked up once per problem and log state:
    the eager API calls this on every call)."""
    key = _cache_key(problem, target, log_dir)
    if key not in _KERNELS:
        choice = choose(problem, target, log_dir)
        _KERNELS[key] = build_kernel(problem, target, choice.candidate, choice.knobs, choice.source, mod=choice.mod)
    return _KERNELS[key]


def explain(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> str:
    choice = choose(problem, target, log_dir)
    return f"{problem.describe()}\n-> {choice.candidate} [{choice.knobs}] ({choice.source}): {choice.reason}"


__all__ = ["Choice", "best_record", "choose", "explain", "kernel_for", "schedule_for"]
