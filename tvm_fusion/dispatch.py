"""Dispatch: which candidate and knobs a problem gets on a target, and why.

Order: a tuning record for this exact problem (the fastest across decompositions and
logs), else a record for the same shape with default options (its candidate and
knobs reapplied to these options) or, for a gradient written in place, one of the
same problem out of place (``_stand_ins``), else, when a cost-model file lies beside the
target's logs in a searched folder (``cost_model_<target key>.json``, see
:mod:`tvm_fusion.cost_model`), its fastest predicted candidate and knobs, else the
registry's heuristic: the first applicable candidate in ``DISPATCH_ORDER`` that
prefers the shape, default knobs. The heuristic also goes before the cost model where
its pick is a candidate the model was trained without, which it cannot rank:
``cross_entropy_split_row`` on few long rows, measured after the shipped model.

Whichever way it was chosen, the kernel is the candidate's schedule of today at the
chosen knobs: a record names the candidate and knobs and times them, but its module
(``Choice.mod``, kept for inspection) keeps the schedule code it was tuned with, so a
fix to a candidate's schedule (a stage that now merges into one launch, a loop now
unrolled) would never reach the shapes that were tuned.
"""

from __future__ import annotations

import dataclasses
import os

import tvm
from tvm.target import Target

from . import cost_model, records, registry
from .compute import ALGORITHMS, prim_func
from .contracts import CrossEntropyGradProblem, CrossEntropyProblem, Problem
from .kernel import Kernel, build_kernel, schedule_for
from .registry import Knobs


@dataclasses.dataclass(frozen=True)
class Choice:
    candidate: str
    knobs: Knobs
    source: str  # "record", "record (default options)", "record (out of place)", "cost model" or "heuristic";
    # a record's source + " (one-launch twin)" where dispatch took its candidate's twin (_twin)
    reason: str
    mod: tvm.IRModule | None = None  # the record's scheduled module, when exact


@dataclasses.dataclass(frozen=True)
class Found:
    candidate: str
    knobs: Knobs
    seconds: float
    mod: tvm.IRModule
    path: str
    note: str = ""


# A tuned record displaces the registry's default only when the runner measured it at
# least this much faster than the default's own record (the tuner always measures the
# default): smaller gaps are ties within the timing noise. On the H200, cross_entropy
# 4096x32000's fastest record (online, 128 threads) beat the default's (256 threads) by
# 0.5% in the runner, and both took 0.0694 ms under graph replay (results/benchmarks.csv).
MIN_GAIN = 0.01


def best_record(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> Found | None:
    """The fastest tuning record of ``problem`` on ``target`` in the searched logs, or
    the default pick's own record when none beats it by ``MIN_GAIN``."""
    found = records_of(problem, target, log_dir)
    if not found:
        return None
    best = min(found, key=lambda f: f.seconds)
    default = registry.default_candidate(problem, target)
    knobs = default.default_for(problem, target)
    defaults = [f for f in found if f.candidate == default.name and f.knobs == knobs]
    if defaults:
        kept = min(defaults, key=lambda f: f.seconds)
        if best.seconds > kept.seconds * (1 - MIN_GAIN):
            return dataclasses.replace(kept, note=f"; the fastest record ({best.candidate}, {best.seconds * 1e3:.4f} ms) "
                                                  f"is within {MIN_GAIN:.0%} of it, so the default pick stays")
    return best


def records_of(problem: Problem, target: Target, log_dir: str | os.PathLike | None) -> list[Found]:
    """Every measured record of ``problem`` on ``target``, with its candidate and knobs,
    but those of a configuration rejected for wrong outputs (``records.rejected``)."""
    found = []
    algorithms = {c.algorithm for c in registry.applicable(problem, target)}
    rejected = records.rejected(log_dir, target)
    key = problem.key()
    for path, log in records.databases(log_dir, target):
        for algorithm in ALGORITHMS[problem.op]:
            if algorithm not in algorithms:
                continue
            mod = tvm.IRModule({"main": prim_func(problem, algorithm)})
            db = log.database_for(mod)
            if db is None:
                continue
            for record in db.get_top_k(db.commit_workload(mod), RECORDS_READ):
                if record.run_secs:
                    one = Found(*registry.replayed_choice(record, problem.op), str(path))
                    if (key, one.candidate, str(one.knobs)) not in rejected:
                        found.append(one)
    return found


RECORDS_READ = 64  # per workload and log: the fastest ones, a tune's worth

# Cleared by records.invalidate() when a log is written in this process (tune,
# records.merge) or on request: no file is looked at per lookup.
_CHOICES: dict[tuple, Choice] = records.register_cache({})
_KERNELS: dict[tuple, Kernel] = records.register_cache({})


def _cache_key(problem: Problem, target: Target, log_dir: str | os.PathLike | None) -> tuple:
    """The problem, the target and where logs are searched."""
    return (problem, str(target), None if log_dir is None else str(log_dir), os.environ.get(records.LOG_DIR_ENV))


def choose(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> Choice:
    """The choice for ``problem``, cached until :func:`records.invalidate`."""
    key = _cache_key(problem, target, log_dir)
    if key not in _CHOICES:
        _CHOICES[key] = _choose(problem, target, log_dir)
    return _CHOICES[key]


def _choose(problem: Problem, target: Target, log_dir: str | os.PathLike | None) -> Choice:
    found = best_record(problem, target, log_dir)
    if found is not None:
        return _twin(Choice(found.candidate, found.knobs, "record",
                            f"tuning record in {found.path}: {found.seconds * 1e3:.4f} ms{found.note}", found.mod),
                     problem, target)
    for relative, source, what in _stand_ins(problem):
        found = best_record(relative, target, log_dir)
        if found is not None and registry.get(found.candidate).applies(problem):
            return _twin(Choice(found.candidate, found.knobs, source,
                                f"tuning record of {what} in {found.path} ({found.seconds * 1e3:.4f} ms); "
                                f"its candidate and knobs reapplied"), problem, target)
    cand = registry.default_candidate(problem, target)
    names = [c.name for c in registry.applicable(problem, target)]
    heuristic = (f"no tuning record; first of the applicable candidates {names} in dispatch "
                 f"order that prefers this shape, with its default knobs")
    found = cost_model.find(target, log_dir)
    if found is not None and found[1].covers(problem.op) and not found[1].covers_candidate(problem.op, cand):
        # The heuristic's pick is newer than the model, which cannot rank it against the rest.
        return Choice(cand.name, cand.default_for(problem, target), "heuristic",
                      f"{heuristic}; the cost model in {found[0]} was trained without {cand.name}")
    predicted = _cost_model_choice(problem, target, found)
    if predicted is not None:
        return predicted
    return Choice(cand.name, cand.default_for(problem, target), "heuristic", heuristic)


def _twin(choice: Choice, problem: Problem, target: Target) -> Choice:
    """A record's choice, or where its candidate has a one-launch twin that applies
    (:func:`registry.one_launch_twin`: the same row kernel at the same knobs, its first
    kernel folded in), the twin. The small-batch fused gradients: on an H100 every twin
    timed was 0.7-2.5 us faster than its base at the same knobs under graph replay
    (128x32000 fp16 ``block_per_row`` at the shipped record's knobs 14.74 us, its twin
    13.61; rows "probe: row targets A/B", 2026-12-07T07:45Z)."""
    twin = registry.one_launch_twin(choice.candidate, problem, target)
    if twin is None:
        return choice
    return Choice(twin.name, choice.knobs, f"{choice.source} (one-launch twin)",
                  f"{choice.reason}; for {choice.candidate}, whose one-launch twin {twin.name} runs the same "
                  f"row kernel at these knobs")


def _stand_ins(problem: Problem) -> list[tuple[Problem, str, str]]:
    """Problems whose records stand in for ``problem``'s when it has none of its own, as
    (problem, ``Choice.source``, what it is): a cross entropy of the same shape with
    default options; a gradient written over the logits (``in_place``), its
    out-of-place twin. The twin moves the same bytes (one read of the logits, one
    write of the gradient), and no tune has timed a gradient in place: without the
    twin, in-place 8192x128256 bf16 took the heuristic's ``cross_entropy_grad_online``
    at 512 threads, 2.4205 ms under graph replay; with it, the twin record's
    ``cross_entropy_grad_head_in_shared`` in place, 1.7712 (1.6189 out of place; H100,
    2026-12-06, rows "probe: in-place fused gradient" of results/benchmarks.csv). Only
    a record whose candidate applies to ``problem`` is taken."""
    found = []
    if isinstance(problem, CrossEntropyProblem) and problem != problem.canonical():
        found.append((problem.canonical(), "record (default options)", "the same shape with default options"))
    if isinstance(problem, CrossEntropyGradProblem) and problem.in_place:
        found.append((dataclasses.replace(problem, in_place=False), "record (out of place)",
                      "the same problem out of place"))
    return found


def _cost_model_choice(problem: Problem, target: Target,
                       found: tuple[os.PathLike, cost_model.CostModel] | None) -> Choice | None:
    """The fastest predicted (candidate, knobs) of the cost model ``found``
    (``cost_model.find``: its path and the model), or None without a model file for the
    target or a regressor for the operator."""
    if found is None:
        return None
    path, model = found
    chosen = model.choose(problem, target)
    if chosen is None:
        return None
    pick, ranked = chosen
    why = f"predicted {pick.seconds * 1e3:.4f} ms"
    if len(ranked) > 1:
        why += f"; second best {ranked[1].candidate} [{ranked[1].knobs}] {ranked[1].seconds * 1e3:.4f} ms"
    return Choice(pick.candidate, pick.knobs, "cost model",
                  f"no tuning record; cost model in {path}: {why} ({len(ranked)} configurations ranked)")


def kernel_for(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None,
               input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> Kernel:
    """The compiled kernel of the choice (the API's launchers call this once per
    call signature); ``input_shapes``: inputs it takes in their caller's shape
    (``kernel.build_kernel``)."""
    key = (*_cache_key(problem, target, log_dir), input_shapes)
    if key not in _KERNELS:
        choice = choose(problem, target, log_dir)
        try:
            kernel = build_kernel(problem, target, choice.candidate, choice.knobs, choice.source,
                                  input_shapes=input_shapes)
        except (ValueError, RuntimeError):  # today's schedule refuses the record's knobs (a ScheduleError
            # is a RuntimeError): the record's own module, as it was tuned
            if choice.mod is None:
                raise
            kernel = build_kernel(problem, target, choice.candidate, choice.knobs, choice.source, mod=choice.mod,
                                  input_shapes=input_shapes)
        _KERNELS[key] = kernel
    return _KERNELS[key]


def explain(problem: Problem, target: Target, log_dir: str | os.PathLike | None = None) -> str:
    choice = choose(problem, target, log_dir)
    return f"{problem.describe()}\n-> {choice.candidate} [{choice.knobs}] ({choice.source}): {choice.reason}"


__all__ = ["Choice", "best_record", "choose", "explain", "kernel_for", "records_of", "schedule_for"]
