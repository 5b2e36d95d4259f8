"""The tuner: MetaSchedule's evolutionary search with the XGBoost cost model, over the
union of the applicable candidates' design spaces.

One task per (problem, decomposition): candidates scheduling the same compute share
a task, whose space is the union of their ``tunable=True`` spaces (a ``ScheduleFn``
each), so the cost model learns across candidates and knobs; MetaSchedule's task
scheduler shares the trial budget among tasks and shapes. Every record's trace
carries the candidate's name and knob values as annotations of the root block.

What stock MetaSchedule needs to tune these kernels at all (seen on the H200): an
argument allocator that gives the runner valid class indices (the stock one fills
int64 targets with random bits, so the kernel is asked to read far out of bounds
and the runner dies), and builds in a process that has imported this
package (TVM only knows our tuple reducers once they are registered there; stock
builds also timed out at 30 s).

:func:`grid_records` times every configuration of every applicable candidate
instead of searching, with the same builder and runner, into the same database: the
cost model's training data (:mod:`tvm_fusion.cost_model`).

Builds run in this process (:class:`InProcessBuilder`): one of these kernels builds
in about 0.1 s on the CPU, while the stock LocalBuilder starts a fresh pool of worker
processes for every batch, each importing TVM: on a 2-core machine that start-up was
nearly all of a tune's time. A grid, thousands of configurations, builds on a
:class:`PoolBuilder` instead where there are more than 2 cores: its worker processes
start once, and build the next batch while the runner times this one. A CUDA tune does
too (:class:`PooledBuilder`): the default and :data:`POOLED_SEEDS` of the cost model's
seeds in one batch, then each search batch; :func:`tune` starts the runner on a thread
meanwhile. On the H200 host a CUDA build (NVRTC) took 1.4 s, one after another 18 of a
profiled tune's 29-34 s, and the runner's start (its worker process importing this
package) 8-9 s before the tune began. In the H200 tunes of four held-out shapes at 8
trials (at 2a53cd5 and again at cc02430) the best came from the measurements before
the search, never from the search.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import pathlib
import sys
import tarfile
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import psutil
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object
from tvm.target import Target

from . import cost_model, launch_order, records, registry, targets
from .compute import prim_func
from .contracts import Problem
from .timing import copies_for, time_gpu

RUN_TIMEOUT_S = 60
IGNORED_FRACTION = 0.05
RANDOM_BLOCK = 1 << 20


def build_module(mod: tvm.IRModule, target: Target) -> Any:
    """MetaSchedule's ``default_build`` (which calls the deprecated ``tvm.driver.build``,
    that is ``tvm.tirx.build``) without its first step, an import of
    ``tvm.s_tir.tensor_intrin``: these kernels use no tensor intrinsics, and that import
    parses 248 TVMScript functions, 32 s once per process on the CI machine (each
    parse walks ``inspect.stack()`` over every loaded module). Through
    ``launch_order``'s pipeline, as ``kernel.build_kernel`` builds: a marked loop runs
    backwards in the trial as in the shipped kernel."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm.tirx.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target,
                          pipeline=launch_order.PIPELINE)


TENSOR_INTRINSICS = "tvm.s_tir.tensor_intrin"


@contextlib.contextmanager
def no_tensor_intrinsics():
    """While inside, ``import tvm.s_tir.tensor_intrin`` finds an empty module. Every
    ``ms.TuneContext`` makes that import for its side effect, registering tensor-core
    intrinsics that these kernels' spaces never use (their schedule rules are their
    own). It is the same 248 TVMScript parses as in :func:`build_module`. In a
    one-shape BN tune on the H200 host at least 28 of the command's 90 s came before
    the tuning loop (21 s); on the 2-core CI machine the import was 91 of 106 s. A process that has imported the real
    module keeps it, and the placeholder is taken out on leaving, so a later real
    import works as usual."""
    if TENSOR_INTRINSICS in sys.modules:
        yield
        return
    placeholder = types.ModuleType(TENSOR_INTRINSICS, "placeholder: tvm_fusion's tasks use no tensor intrinsics")
    sys.modules[TENSOR_INTRINSICS] = placeholder
    try:
        yield
    finally:
        if sys.modules.get(TENSOR_INTRINSICS) is placeholder:
            del sys.modules[TENSOR_INTRINSICS]


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """MetaSchedule builder that compiles each candidate here, one after another, and
    exports it for the runner; a failed build is reported in its result, not raised."""

    def __init__(self):
        super().__init__()

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        from tvm.s_tir.meta_schedule.builder.local_builder import default_export

        results = []
        for item in build_inputs:
            try:
                with item.target:
                    results.append(ms.builder.BuilderResult(default_export(build_module(item.mod, item.target)), None))
            except Exception as err:  # noqa: BLE001 -- recorded as a failed trial, as LocalBuilder does
                results.append(ms.builder.BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}"))
        return results


def _build_exported(mod_json: str, target_config: dict) -> str:
    """A pool worker's build: the module from its JSON, built and exported for the runner."""
    from tvm.s_tir.meta_schedule.builder.local_builder import default_export

    target = Target(target_config)
    with tvm.transform.PassContext(opt_level=3), target:
        return default_export(build_module(tvm.ir.load_json(mod_json), target))


def _import_package() -> None:
    """Pool worker start-up: register this package's reducers and candidates there."""
    from . import registry as _registry  # noqa: F401


class PoolBuilder:
    """Builds on ``workers`` processes that live as long as this object (started once,
    each importing TVM and this package once), so a grid's builds run side by side
    while the runner times the batch before. :meth:`submit` returns futures of
    ``BuilderResult``; a failed build is reported in its result, not raised.

    The workers are TVM's popen workers (``PopenPoolExecutor``, as MetaSchedule's
    LocalBuilder uses): fresh interpreters that never import the caller's script. A
    ``multiprocessing`` spawn pool re-runs an unguarded script in each worker, so a
    script calling ``tune`` at its top level without ``if __name__ == "__main__"``
    tuned again in every worker (seen on the H200: the pool broke at its first build)."""

    def __init__(self, workers: int):
        from tvm.support.popen_pool import PopenPoolExecutor

        self._pool = PopenPoolExecutor(max_workers=workers, initializer=_import_package)
        # Start them now (each imports TVM and this package), not at the first build:
        # a submit while no thread is idle starts another thread, each with its worker.
        self._pending: list[concurrent.futures.Future] = [self._pool.submit(int) for _ in range(workers)]

    def submit(self, mods: Sequence[Any], target: Target) -> list[Any]:
        config = target.export()
        futures = [self._pool.submit(_build_exported, tvm.ir.save_json(mod), config) for mod in mods]
        self._pending = [f for f in self._pending if not f.done()] + futures
        return futures

    @staticmethod
    def result(future: Any) -> ms.builder.BuilderResult:
        try:
            return ms.builder.BuilderResult(future.result(), None)
        except Exception as err:  # noqa: BLE001 -- a failed trial, as LocalBuilder reports it
            return ms.builder.BuilderResult(None, f"PoolBuilder: {type(err).__name__}: {err}")

    def close(self) -> None:
        # A queued build would start its worker anew: cancel it. One already running
        # may be starting its worker on a pool thread, and TVM's shutdown kills workers
        # without waiting for that (a worker killed between its process and its pipes
        # raised AttributeError '_writer' in CI, a pool closed just after it opened).
        concurrent.futures.wait([f for f in self._pending if not f.cancel()])
        self._pool.shutdown(wait=True)


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule builder on a :class:`PoolBuilder`: a search batch's candidates
    compile side by side; a failed build is reported in its result, not raised."""

    def __init__(self, pool: PoolBuilder):
        super().__init__()
        self.pool = pool

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        futures = [self.pool.submit([item.mod], item.target)[0] for item in build_inputs]
        return [PoolBuilder.result(future) for future in futures]


def alloc_valid_arguments(device: Any, args_info: Sequence[Any], alloc_repeat: int) -> list[list[Any]]:
    """Runner argument allocator: real-valued floats, class indices in [0, V).

    The logits (first 2-D float) give V; the first integer vector is the target,
    with about 5% of its rows set to ignore_index (-100). Outputs get any values.
    Floats repeat a block of RANDOM_BLOCK random values: drawing a fresh normal for
    each of the 10^9 logits of an 8192x128256 problem takes tens of seconds per trial.

    The runner's worker process outlives its trials, and keeps what this made
    (:data:`_ARGUMENTS`, at most :data:`ARGUMENT_CACHE_BYTES` beyond the arguments of
    the call at hand): a later trial's argument of the same dtype, shape and role (a
    target or not) and the same place among its equals (the logits and their gradient
    stay two buffers) is the same tensor, its values as the last kernel left them (any
    real values, as an output's). Filling fresh ones took most of a trial on large
    inputs: on the 2-core CPU machine 42 s for the logits and gradient of 16384x50257
    bf16 (numpy's resize and the copy into the tensor), and on the H200 host the
    gradient tunes of that shape and of 8192x128256 bf16, 16 trials each, did not
    finish in 150 s at 0538344."""
    rng = np.random.default_rng()
    classes = next((info[2][1] for info in args_info if len(info[2]) == 2 and "float" in info[1]), None)
    repeated, used = [], set()
    for copy in range(alloc_repeat):
        args, target_done, seen = [], False, {}
        for _, dtype, shape in args_info:
            shape = tuple(int(d) for d in shape)
            is_target = classes is not None and not target_done and "int" in dtype and len(shape) == 1
            target_done = target_done or is_target
            nth = seen[dtype, shape] = seen.get((dtype, shape), -1) + 1
            target_classes = classes if is_target else None
            key = (str(device), dtype, shape, target_classes, copy, nth)
            tensor = _ARGUMENTS.pop(key, None)  # re-inserted: the dict's order is least recently used first
            if tensor is None:
                tensor = _new_argument(device, dtype, shape, target_classes, rng)
            _ARGUMENTS[key] = tensor
            used.add(key)
            args.append(tensor)
        repeated.append(args)
    _evict(used)
    return repeated


ARGUMENT_CACHE_BYTES = 8 << 30
# (device, dtype, shape, V for a target else None, copy, nth of its dtype and shape) -> tensor, oldest first
_ARGUMENTS: dict[tuple, Any] = {}


def _new_argument(device: Any, dtype: str, shape: tuple[int, ...], classes: int | None, rng: Any) -> Any:
    """One runner argument: class indices in [0, classes) with some -100 for a target
    (``classes`` given), zeros for other integers, normal values for floats."""
    if "int" in dtype:
        values = np.zeros(shape)
        if classes is not None:
            values = rng.integers(0, classes, shape)
            values[rng.random(shape) < IGNORED_FRACTION] = -100
        data, view = values.astype(dtype), dtype
    else:
        block = rng.standard_normal(min(RANDOM_BLOCK, int(np.prod(shape))), dtype=np.float32)
        if dtype == "bfloat16":  # numpy has no bfloat16: copy the top 16 bits
            block, view = (block.view(np.uint32) >> 16).astype(np.uint16), "uint16"
        else:
            block, view = block.astype(dtype), dtype
        data = np.resize(block, shape)
    tensor = tvm.runtime.empty(shape, dtype, device)
    tensor._create_view(shape, view).copyfrom(data)
    return tensor


def _argument_bytes(key: tuple) -> int:
    _, dtype, shape, *_ = key
    return int(np.prod(shape)) * ((tvm.runtime.DataType(dtype).bits + 7) // 8)


def _evict(used: set[tuple]) -> None:
    """Drop the least recently used arguments outside ``used`` until those left
    outside it take at most :data:`ARGUMENT_CACHE_BYTES`."""
    spare_keys = [key for key in _ARGUMENTS if key not in used]
    spare = sum(map(_argument_bytes, spare_keys))
    for key in spare_keys:
        if spare <= ARGUMENT_CACHE_BYTES:
            break
        spare -= _argument_bytes(key)
        del _ARGUMENTS[key]


def graph_replay_evaluator(rt_mod: Any, device: Any, evaluator_config: Any, repeated_args: list) -> list[float]:
    """Runner evaluator that times a candidate the way ``tvm-fusion bench`` does: CUDA
    graph replay (no launch overhead) cycling over copies of the arguments, enough of
    them that a small problem is read from HBM rather than a warm L2.

    The stock time_evaluator launches the same arguments back to back: a kernel of a
    few microseconds is then timed by its launch cost (two launches for the grid-split
    candidates) and read from L2, and on the H200 the tuner's picks for 8x3x224x224
    and 128x32000 came out 17% and 10% slower than the best under graph replay.
    Without torch or a CUDA device it falls back to the stock evaluator."""
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

    try:
        import torch

        on_cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type() and torch.cuda.is_available()
    except ImportError:
        on_cuda = False
    if not on_cuda:
        return run_evaluator_common(rt_mod, device, evaluator_config, repeated_args)
    func, first = rt_mod["main"], repeated_args[0]
    nbytes = sum(t.numel() * tvm.runtime.DataType(str(t.dtype)).itemsize for t in first)
    sets = [first] + [[t.copyto(device) for t in first] for _ in range(copies_for(nbytes) - 1)]
    median_ms, _ = time_gpu([lambda args=args: func(*args) for args in sets])
    return [median_ms * 1e-3]


def workers() -> int:
    """Search threads: the cores this machine has, at most 8 (16 on the GPU host,
    2 on the CI machines)."""
    return max(1, min(8, psutil.cpu_count(logical=False) or os.cpu_count() or 1))


def tasks_for(problem: Problem, target: Target) -> list[ms.TuneContext]:
    """One TuneContext per decomposition that has applicable candidates."""
    by_algorithm: dict[str, list[registry.Candidate]] = {}
    for cand in registry.applicable(problem, target):
        by_algorithm.setdefault(cand.algorithm, []).append(cand)
    postprocs = [KnobsMatch(problem, target)] + ([ms.postproc.VerifyGPUCode()] if target.kind.name == "cuda" else [])
    contexts = []
    for algorithm, cands in by_algorithm.items():
        spaces = [
            ms.space_generator.ScheduleFn(
                _space_fn(cand, problem, target), sch_rules=[], postprocs=postprocs, mutator_probs={}
            )
            for cand in cands
        ]
        # The union takes the candidates' own (empty) rules and postprocs too: by default
        # it adds the target's, whose RewriteUnboundBlock stops on a block bound to
        # blockIdx alone (BatchNorm's per-channel finalize), so no bn_forward or
        # bn_backward task with two candidates could be tuned.
        space = spaces[0] if len(spaces) == 1 else ms.space_generator.SpaceGeneratorUnion(
            spaces, sch_rules=[], postprocs=postprocs, mutator_probs={})
        with no_tensor_intrinsics():
            context = ms.TuneContext(
                tvm.IRModule({"main": prim_func(problem, algorithm)}),
                target=target,
                space_generator=space,
                search_strategy=ms.search_strategy.EvolutionarySearch(
                    # A fifth of the first population from the best measured records: the
                    # default and the cost model's seeds (first_configs) on a first tune.
                    population_size=64, init_measured_ratio=0.2, init_min_unmeasured=32,
                    genetic_num_iters=2, max_fail_count=3,
                ),
                task_name=f"{problem.key()}:{algorithm}",
                num_threads=workers(),
            )
        contexts.append(context)
    return contexts


def _space_fn(cand: registry.Candidate, problem: Problem, target: Target) -> Callable:
    """The candidate's design space (its knobs sampled) on MetaSchedule's schedule."""

    def space(sch: tvm.s_tir.Schedule) -> tvm.s_tir.Schedule:
        cand.apply_to(sch, problem, target, tunable=True)
        return sch

    return space


@derived_object
class KnobsMatch(ms.postproc.PyPostproc):
    """Keep a sampled schedule only where it is the one its candidate builds for the
    knobs it carries (read back from the annotations).

    A design space is one traced run of the candidate's ``schedule`` with sampled knobs,
    and the search replays that trace with other decisions. Python choices a schedule
    makes on a knob's value (``knobs_value``) are not in the trace, so a replay keeps the
    sampled run's path: bn_stats_channels_last's shared-memory row sums
    (``rows_through_shared``) replayed with rows > vector is the configuration whose
    threads write the next block's channels, which the candidate itself never builds.
    On 16x35x35x288 fp16 NHWC 19 of 30 replays differed from their knobs' schedule.
    Rejected ones are resampled, as for any failed postprocessor."""

    def __init__(self, problem: Problem, target: Target):
        self.problem, self.target, self.built = problem, target, {}

    def _initialize_with_tune_context(self, context: Any) -> None:
        pass

    def apply(self, sch: Any) -> bool:
        from .kernel import schedule_for

        key = registry.annotated_choice(sch, self.problem.op)  # every space here annotates its choice
        if key not in self.built:
            try:
                self.built[key] = schedule_for(self.problem, self.target, *key)[0].mod
            except Exception:  # noqa: BLE001 -- knobs the candidate cannot build
                self.built[key] = None
        return self.built[key] is not None and tvm_ffi.structural_equal(sch.mod, self.built[key])

    def clone(self) -> KnobsMatch:
        twin = KnobsMatch(self.problem, self.target)
        twin.built = self.built
        return twin


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """A measure callback that reports trials done and the best time so far."""

    def __init__(self, total: int, report: Callable[[int, float], None]):
        super().__init__()
        self.done, self.best, self.total, self.report = 0, float("inf"), total, report

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        for result in runner_results:
            self.done += 1
            if result.run_secs:
                self.best = min(self.best, float(np.median([float(s) for s in result.run_secs])))
        self.report(self.done, self.best)

    def measured(self, seconds: Sequence[float]) -> None:
        """Count times measured before the search (the default, the seeds) in the best,
        not as trials, and report: a progress line that reads "best ..." at 0 trials
        says the search's first batch is under way, not the measurements before it."""
        self.best = min([self.best, *seconds])
        self.report(self.done, self.best)


def make_runner(timeout: float = RUN_TIMEOUT_S) -> ms.runner.LocalRunner:
    """The runner of every measurement here: valid arguments, graph-replay timing."""
    return ms.runner.LocalRunner(
        timeout_sec=timeout,
        evaluator_config=ms.runner.EvaluatorConfig(number=5, repeat=3, min_repeat_ms=20),
        f_alloc_argument=alloc_valid_arguments,
        f_run_evaluator=graph_replay_evaluator,
    )


SEEDS = 4  # the cost model's fastest predicted configurations measured before a search
POOLED_SEEDS = 12  # as many where a pool of worker processes builds them side by side


def first_configs(problem: Problem, target: Target,
                  seeds: int = SEEDS) -> list[tuple[Problem, registry.Candidate, registry.Knobs]]:
    """What a tune measures before its search: the registry's default, then the cost
    model's ``seeds`` fastest predicted other configurations (none without a model for
    the operator), so the evolutionary search starts from them: MetaSchedule draws a
    fifth of its first population from the database's best records of the task
    (``init_measured_ratio``). The model is the one dispatch would find, else the
    shipped one (seeding only adds measured records, and a tune keeps the fastest, so
    the shipped model's held-out misses cost a few trials, not a worse pick)."""
    default = registry.default_candidate(problem, target)
    default_knobs = default.default_for(problem, target)
    configs = [(problem, default, default_knobs)]
    if seeds < 1:
        return configs
    found, shipped = cost_model.find(target), cost_model.shipped_model(target)
    model = found[1] if found is not None else cost_model.load_cached(shipped) if shipped.exists() else None
    if model is None:
        return configs
    ranked = [r for r in model.rank(problem, target) if (r.candidate, r.knobs) != (default.name, default_knobs)]
    return configs + [(problem, registry.get(r.candidate), r.knobs) for r in ranked[:seeds]]


def measure_into(database: Any, target: Target, builder: Any, runner: Any,
                 configs: Sequence[tuple[Problem, registry.Candidate, registry.Knobs]]) -> list[float]:
    """Build, time and log each ``(problem, candidate, knobs)`` as a tuning record of
    ``database``; a configuration that fails to build or run (too many threads for
    the block, say) is skipped, and one whose code another's build already has is
    logged with that run's times (:func:`_start_runs`). Returns the median seconds of
    those logged. ``runner`` may be a future of one still starting: the builds go first."""
    scheduled = _scheduled(configs, target)
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, sch in scheduled])
    if isinstance(runner, concurrent.futures.Future):
        runner = runner.result()
    timed: dict[str, Any] = {}
    return _log_runs(database, target, _start_runs(runner, target, scheduled, built, timed), timed)


def _scheduled(configs: Sequence[tuple[Problem, registry.Candidate, registry.Knobs]],
               target: Target) -> list[tuple[Any, Any]]:
    """(compute, schedule) of each configuration."""
    funcs = [prim_func(problem, cand.algorithm) for problem, cand, _ in configs]
    return [(func, cand.apply(func, target, knobs=knobs)) for func, (_, cand, knobs) in zip(funcs, configs)]


def code_key(artifact_path: str) -> str:
    """What a built configuration's code is: a hash of the members of its exported
    archive (names and bytes), not of the archive, whose headers carry the export's
    time. Knob values that change nothing in the generated code give the same key:
    an ``unroll`` auto-unroll step below a loop's trip count leaves it rolled whatever
    its value. Of the 790 configurations the CUDA cross entropy candidates offer for
    eight forward and gradient problems (the bench table's shapes, 3000x50257 and the
    from-lse gradient; CUDA source compared, 2026-12-05), 471 have distinct code; the
    gradient of 16384x50257 bf16, 27 of 60."""
    digest = hashlib.sha256()
    try:
        with tarfile.open(artifact_path) as archive:
            for member in sorted(archive.getmembers(), key=lambda m: m.name):
                content = archive.extractfile(member)
                digest.update(member.name.encode() + b"\0" + (content.read() if content is not None else b""))
    except (tarfile.TarError, OSError):  # not an archive: its bytes, which are then the key
        with open(artifact_path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


class _Twin:
    """A runner future for a configuration not run: the result of the run of its code."""

    def __init__(self, result: Any):
        self._result = result

    def result(self) -> Any:
        return self._result


def _start_runs(runner: Any, target: Target, scheduled: list[tuple[Any, Any]],
                built: list[ms.builder.BuilderResult], timed: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Hand the built configurations to the runner: (compute, schedule, args, future,
    code key) each. A configuration whose code (:func:`code_key`) one earlier in
    ``built`` has, or one already timed (``timed``, code key to runner result, which
    :func:`_log_runs` fills), is not run: its future is that run's. A duplicate run
    would be GPU time for a time already known, and the twin's time is this
    configuration's own (the same code), so the grid and the cost model keep it."""
    device_type = "cuda" if target.kind.name == "cuda" else "cpu"  # as MetaSchedule names devices
    ready = [(func, sch, ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"]), result, code_key(result.artifact_path))
             for (func, sch), result in zip(scheduled, built) if not result.error_msg]
    first: dict[str, int] = {}
    for i, (*_, key) in enumerate(ready):
        if key not in timed:
            first.setdefault(key, i)
    futures = runner.run([ms.runner.RunnerInput(ready[i][3].artifact_path, device_type, ready[i][2])
                          for i in first.values()])
    by_key = dict(zip(first, futures))
    return [(func, sch, args_info, by_key[key] if key in by_key else _Twin(timed[key]), key)
            for func, sch, args_info, _, key in ready]


def _log_runs(database: Any, target: Target, runs: list[tuple[Any, ...]], timed: dict[str, Any]) -> list[float]:
    """Wait for the runs and commit each timed one as a tuning record; each result
    goes into ``timed`` under its code key."""
    logged = []
    for func, sch, args_info, future, key in runs:
        result = future.result()
        timed.setdefault(key, result)
        if result.error_msg or not result.run_secs:
            continue
        workload = database.commit_workload(tvm.IRModule({"main": func}))
        database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, result.run_secs, target, args_info))
        logged.append(float(np.median([float(s) for s in result.run_secs])))
    return logged


def _no_interactive_table() -> None:
    """Under Jupyter, MetaSchedule draws its task table with pandas, which this package
    does not need: print nothing there (the progress callback reports instead)."""
    name = "s_tir.meta_schedule.print_interactive_table"
    try:
        import pandas  # noqa: F401
    except ImportError:
        tvm_ffi.register_global_func(name, lambda *_: None, override=True)


@dataclasses.dataclass
class TuneResult:
    log_dir: str
    seconds: float
    trials: int  # asked for
    best: dict[str, tuple[str, float]]  # problem key -> (candidate, seconds)
    searched: int = 0  # trials the search ran: fewer than asked when no untried configuration was left
    seeded: float = 0.0  # seconds of ``seconds`` spent measuring the defaults and seeds before the search
    # problem key -> what was off, for each best record whose kernel gave wrong outputs
    # (rejected: dispatch skips it, and ``best`` holds the next record that checked)
    rejected: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    unchecked: dict[str, str] = dataclasses.field(default_factory=dict)  # problem key -> why its best is not checked


def tune(
    problems: Sequence[Problem],
    target: Any,
    trials: int = 32,
    log_dir: str | os.PathLike = "tuning_logs",
    progress: Callable[[int, float], None] | None = None,
    runner_timeout: float = RUN_TIMEOUT_S,
) -> TuneResult:
    """Tune ``problems`` on ``target`` with ``trials`` trials each; records go to
    ``<log_dir>/<target>/`` (appended: an earlier log is kept and extended)."""
    target = targets.with_limits(targets.resolve(target))
    per_problem = [tasks_for(problem, target) for problem in problems]
    contexts = [ctx for tasks in per_problem for ctx in tasks]
    if not contexts:
        raise ValueError(f"tune: no candidate applies to {[p.key() for p in problems]} on {target.kind.name}")
    # The runner's start (its worker imports this package: 8-9 s on the H200 host) runs on
    # a thread while this one builds the default and the seeds.
    starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tvm_fusion-runner")
    starting = starter.submit(make_runner, runner_timeout)
    starter.shutdown(wait=False)
    path = records.folder(log_dir, target)
    database = records.json_database(path)
    total = trials * len(problems)
    # A CUDA tune builds side by side (NVRTC: 1.4 s a build on the H200 host): the
    # default and POOLED_SEEDS seeds in one batch, then each search batch. The workers
    # start now, with the runner. Not on 2 cores, where the workers' start would cost
    # more than it saves, nor for LLVM builds (0.1 s): there this process builds the
    # default and SEEDS seeds while the runner starts.
    pool = PoolBuilder(workers()) if target.kind.name == "cuda" and workers() > 2 else None
    builder, seeds = (InProcessBuilder(), SEEDS) if pool is None else (PooledBuilder(pool), POOLED_SEEDS)
    # Batches small enough that the task scheduler shares a shape's trials among its
    # decompositions (a 10-trial budget in one batch once went to one task alone; its
    # first rounds visit each task once): two a task, or one where the pool builds a
    # batch in about one build's time, since each batch also costs an evolutionary
    # search (H200, 8 trials of CE 3000x20000: 4 batches of 2 took 15 s).
    most_tasks = max(len(tasks) for tasks in per_problem)
    per_iter = max(2, trials // (most_tasks if pool is not None else 2 * most_tasks))
    callbacks = [
        ms.measure_callback.AddToDatabase(),
        ms.measure_callback.RemoveBuildArtifact(),
        ms.measure_callback.UpdateCostModel(),
    ]
    counter = Progress(total, progress or (lambda done, best: None))
    callbacks.append(counter)
    _no_interactive_table()
    start = time.perf_counter()
    try:
        with tvm.transform.PassContext(opt_level=3), target:
            # The defaults and the seeds: built while the runner starts, then timed.
            first = [c for problem in problems for c in first_configs(problem, target, seeds)]
            counter.measured(measure_into(database, target, builder, starting, first))
            runner = starting.result()
            seeded = time.perf_counter() - start
            ms.tune_tasks(
                tasks=contexts,
                task_weights=[1.0] * len(contexts),
                work_dir=str(path),
                max_trials_global=total,
                max_trials_per_task=trials,
                num_trials_per_iter=per_iter,
                builder=builder,
                runner=runner,
                database=database,
                cost_model=ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(),
                                                  adaptive_training=True),
                measure_callbacks=callbacks,
                task_scheduler="gradient",
            )
    finally:
        if pool is not None:
            pool.close()
    seconds = time.perf_counter() - start
    records.invalidate()
    result = TuneResult(str(path), seconds, total, {}, counter.done, seeded)
    for problem in problems:
        checked_best(problem, target, log_dir, path, result)
    return result


# The tuner checks a problem's best record against the float64 reference (verify.check)
# up to this many elements: the reference of 16384x50257 (823M) takes tens of GB of
# float64 temporaries on the host. A larger problem is reported unchecked.
CHECK_MAX_ELEMENTS = 1 << 27
CHECK_MAX_REJECTIONS = 4  # past this many wrong bests in a row the problem gets no best in the result


def _unchecked(problem: Problem, target: Target) -> str | None:
    """Why the check cannot run here, or None: a problem past ``CHECK_MAX_ELEMENTS``, or
    no device of the target's kind in this process (a tune built for CUDA and timed
    elsewhere, as a runner on another host would)."""
    if problem.numel > CHECK_MAX_ELEMENTS:
        return f"{problem.numel} elements: too large for the host's float64 reference"
    device = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    if not device.exist:
        return f"no {target.kind.name} device here to run the kernel"
    return None


def checked_best(problem: Problem, target: Target, log_dir: str | os.PathLike, path: pathlib.Path,
                 result: TuneResult) -> None:
    """Put ``problem``'s best record into ``result.best``, after checking its kernel (as
    dispatch builds it) against the float64 reference: a wrong one is rejected in the
    log folder ``path`` (``records.reject``), noted in ``result.rejected``, and the next
    best checked."""
    from . import verify
    from .dispatch import best_record, kernel_for

    why = _unchecked(problem, target)
    for _ in range(CHECK_MAX_REJECTIONS + 1):
        found = best_record(problem, target, log_dir)
        if found is None:
            return
        result.best[problem.key()] = (found.candidate, found.seconds)
        if why:
            result.unchecked[problem.key()] = why
            return
        wrong = verify.check(kernel_for(problem, target, log_dir))
        if wrong is None:
            return
        records.reject(path, problem.key(), found.candidate, str(found.knobs), wrong)
        result.rejected.setdefault(problem.key(), []).append(wrong)
        del result.best[problem.key()]


# -- grids: every configuration timed, the cost model's training data ---------------------
GRID_BATCH = 16  # configurations built and then run together


def grid_configs(problems: Sequence[Problem], target: Target,
                 max_configs: int | None = None) -> list[tuple[Problem, registry.Candidate, registry.Knobs]]:
    """Every knob configuration of every applicable candidate of each problem, in
    dispatch order: at most ``max_configs`` a candidate (default
    ``cost_model.MAX_CONFIGS``, what the model ranks), a larger space thinned evenly,
    its default kept."""
    return [(problem, cand, knobs) for problem in problems for cand in registry.applicable(problem, target)
            for knobs in cost_model.thinned(cand, problem, target, max_configs)]


def untimed(configs: Sequence[tuple[Problem, registry.Candidate, registry.Knobs]], log_dir: str | os.PathLike,
            target: Target) -> list[tuple[Problem, registry.Candidate, registry.Knobs]]:
    """``configs`` less those that ``log_dir`` (a log folder or a database folder, the
    shipped compressed grids included) already holds a timed record of."""
    folder = cost_model.database_folder(log_dir, target)
    if not records.holds_database(folder):
        return list(configs)
    problems = {c[0] for c in configs}
    timed = {(r.problem, r.candidate, r.knobs) for r in cost_model.training_rows(folder, target, problems)}
    return [c for c in configs if (c[0], c[1].name, c[2]) not in timed]


def grid_records(
    problems: Sequence[Problem],
    target: Any,
    log_dir: str | os.PathLike = "tuning_logs",
    max_configs: int | None = None,
    progress: Callable[[int, float], None] | None = None,
    runner_timeout: float = RUN_TIMEOUT_S,
    configs: Sequence[tuple[Problem, registry.Candidate, registry.Knobs]] | None = None,
) -> int:
    """Time every configuration of :func:`grid_configs` (or ``configs``, where the
    caller has them already) with the tuner's builder and
    runner, and append each to the MetaSchedule database in ``<log_dir>/<target>/``
    as a tuning record (so dispatch, ``records.curve`` and ``cost_model.training_rows``
    read them like a tune's). A configuration that fails to build or run (too many
    threads for the block, say) is skipped, and so is one the log already holds timed
    (:func:`untimed`: a grid cut off by a time limit resumes where it stopped). Returns
    the records written."""
    target = targets.with_limits(targets.resolve(target))
    if configs is None:
        configs = untimed(grid_configs(problems, target, max_configs), log_dir, target)
    database = records.json_database(records.folder(log_dir, target))
    builder, runner = PoolBuilder(workers()) if workers() > 2 else InProcessBuilder(), make_runner(runner_timeout)
    pooled = isinstance(builder, PoolBuilder)
    written, best, runs, timed = 0, float("inf"), [], {}
    try:
        with tvm.transform.PassContext(opt_level=3), target:
            # A pipeline: this batch is scheduled and built while the runner times the one before.
            for start in range(0, len(configs) + GRID_BATCH, GRID_BATCH):
                batch = configs[start:start + GRID_BATCH]
                scheduled = _scheduled(batch, target)
                mods = [sch.mod for _, sch in scheduled]
                pending = (builder.submit(mods, target) if pooled else
                           builder.build([ms.builder.BuilderInput(mod, target) for mod in mods]))
                logged = _log_runs(database, target, runs, timed)
                written, best = written + len(logged), min([best, *logged])
                if progress is not None and start:
                    progress(min(start, len(configs)), best)
                built = [PoolBuilder.result(f) for f in pending] if pooled else pending
                runs = _start_runs(runner, target, scheduled, built, timed) if scheduled else []
    finally:
        if pooled:
            builder.close()
    records.invalidate()
    return written
