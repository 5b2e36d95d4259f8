"""A function's launches overlapped: programmatic dependent launch (sm_90 and later).

Why: a kernel of several launches (the cross entropy gradient's targets pass, its rows,
its loss stage; BatchNorm's statistics, finalize and map) waits at each boundary for
the whole previous grid to finish, then for the next grid to be launched. On the H200
the gradient of 65536x1000 fp16 took 0.0732 ms where its row kernel alone took 65.6 us
(CUPTI, rows of 2026-12-06 in results/benchmarks.csv): the small launches around it and
their gaps are the rest. With a programmatic launch the next grid may start as soon as
every block of the one before has said so (``griddepcontrol.launch_dependents``), and
runs until it needs what that grid wrote (``griddepcontrol.wait``: every grid it
depends on finished, its stores visible). The row kernel then reads its rows and takes
their maximum and sum while the targets pass still runs, and waits only before it
reads the mean's denominator.

:func:`overlap` (a lowering pass, after ``single_launch``'s merge and before TVM splits
host from device code) gives a function of two launches or more TVM's launch
parameter ``tirx.use_programtic_dependent_launch`` (TVM's spelling: every launch of
the function is made with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``)
and, in each launch:

1. ``griddepcontrol.wait`` before the first statement (of the innermost thread body,
   or before it where a statement outside it does) that touches a global buffer an
   earlier launch of the function writes, or writes one an earlier launch reads (a
   ticket counter, taken with ``atomicAdd``, counts as written); at its end where no
   statement does (a grid's wait covers only the grid just before it, so each grid
   ends after the ones before it). The first launch waits first of all: the stream's
   work before the call (a tensor that the call's outputs reuse, still read) is then
   finished before any launch of the call starts.
2. ``griddepcontrol.launch_dependents`` first (after the first launch's wait), in every
   launch but the last: the next launch may start while this one runs; it waits
   where (1) says. The last launch never lets the stream's next kernel in early.

Why it is safe: a launch starts only after every block of the one before has passed
its trigger, so after the first launch's wait, so after the work before the call; and
each launch touches what the earlier ones wrote (or writes what they read) only after
its wait, which returns when every earlier grid of the stream has finished (a grid
finishes after its own wait). Left as they are: functions launched cooperatively
(``grid_barrier``), functions with a launch the walk does not see (bound to threads
only, or nested in another statement), and functions the build did not ask for it
(:func:`asked`, which names the parameters that may be one buffer: the pass tells
buffers apart by name, and takes each such pair as one). One
assumption is outside the call: the kernel just before it on the stream, if it lets
the call start early, has itself waited for the kernels before it (a kernel that
triggers ``launch_dependents`` without ever waiting would break the chain).

Where it is on (:func:`wanted`): by default for the fused cross entropy gradient only
(``cross_entropy_grad``, mode ``fused``, in place or not), the one kind of call it made
faster on every shape timed. H100, 2026-12-07T11:50Z, rows "probe: dependent launch A/B"
of results/benchmarks.csv, dispatch's candidate and knobs under graph replay, each
checked against float64 first, as built / overlapped, us: 65536x1000 fp16 98.32 / 96.89,
4096x32000 fp16 185.86 / 182.34, 16384x50257 bf16 1182.70 / 1178.85, 8192x128256 bf16
1558.78 / 1554.34, 3000x50257 fp16 217.74 / 215.67, 128x32000 fp16 (one launch) 14.33 /
14.27. The probe built the tuning record's own module where one is shipped (all but
3000x50257 and 128x32000), not today's schedule, which the API builds; for 65536x1000
that module has 5 launches where the API's kernel has 3. On the API's own kernels
(``dispatch.kernel_for``; 15:16Z, rows "probe: dependent launch on the API's kernels",
one run a setting, plain / overlapped): 65536x1000 fp16 98.56 / 97.52, 4096x32000 fp16
182.64 / 180.42, 3000x50257 fp16 216.42 / 213.19, 16384x50257 bf16 1122.62 / 1126.64,
8192x128256 bf16 1604.54 / 1691.68 (its plain launches took 1558.78 and 1668.90 in the
probe before: one run does not settle it). Less than predicted (65536x1000 on the H200
from 0.0732 toward 0.066-0.069 ms, 5-10%; here 1.1%). Per kernel (CUPTI, 15:17Z) the
row kernel took 89.82 us of the call's 100.19 plain and 97.02 overlapped. A reason
that bounds it: only the row kernel's first wave (at most 16 blocks of 128 lanes an SM,
an eighth of its 16384 blocks) can run ahead of the targets pass, and the loss stage
needs every row's loss, so it waits at its top.

BatchNorm's calls it made slower as often as faster (the same lease, 11:51Z, rows
"probe: dependent launch A/B" of batch_norm_fwd / batch_norm_fwd_bwd, record modules
where shipped): the channels-last forward of 64x256x56x56 bf16 118.44 -> 119.53-120.41
us, the small-plane forward of 256x2048x7x7 fp16 63.55 -> 64.99-65.58; 32x64x112x112
fp16 forward + backward 135.46 -> 133.15; the one-launch forwards unchanged. There the
later launches wait almost at their top (the map needs the statistics first), so they
gain no work before the wait; they are left as built. ``TVM_FUSION_DEPENDENT_LAUNCH=1``
overlaps every op's launches, ``=0`` none (both in the kernel cache's key).
"""

from __future__ import annotations

import os

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad

from . import grid_barrier, targets
from .stmts import seq, statements, thread_attr

_SETTING = os.environ.get("TVM_FUSION_DEPENDENT_LAUNCH", "")
ENABLED = _SETTING != "0"  # the pass runs at all
EVERY_OP = _SETTING == "1"  # every op's calls, not only DEFAULT_OPS'
# (op, mode) of the calls overlapped by default: where it was timed faster.
DEFAULT_OPS = frozenset({("cross_entropy_grad", "fused")})
# The function attribute that asks for it, set by the build.
ATTR = "tvm_fusion_dependent_launch"  # its value: the aliased parameters (``asked``)
TAG = "tirx.use_programtic_dependent_launch"  # TVM 0.27's name for the launch parameter
MIN_ARCH = 90


def aliases(problem) -> dict[str, str]:
    """The outputs of a call of ``problem`` that may be one of its inputs, each to that
    input, by parameter name: the gradient written over the logits, and BatchNorm's
    running statistics (read and written through two parameters, often one tensor).
    The pass tells buffers apart by name; these pairs it takes as one buffer."""
    if getattr(problem, "in_place", False):
        return {"dlogits": "logits"}
    if problem.op == "bn_forward":
        return {"running_mean_out": "running_mean", "running_var_out": "running_var"}
    return {}


def wanted(problem) -> bool:
    """Whether a build of ``problem`` asks for the pass: switched on, and ``problem`` one of
    :data:`DEFAULT_OPS` (or every op, :data:`EVERY_OP`)."""
    return ENABLED and (EVERY_OP or (problem.op, getattr(problem, "mode", None)) in DEFAULT_OPS)


def asked(mod: tvm.IRModule, problem) -> tvm.IRModule:
    """``mod`` (the build's) with each function asking for the pass, and naming
    ``problem``'s aliased parameters (:func:`aliases`) as ``"output=input"`` pairs."""
    pairs = [f"{out}={inp}" for out, inp in aliases(problem).items()]
    return tvm.IRModule({gvar: func.with_attr(ATTR, pairs) if isinstance(func, tirx.PrimFunc) else func
                         for gvar, func in mod.functions.items()})


def _ptx(action: str) -> tirx.Stmt:
    from tvm.backend.cuda.ptx import PTXNamespace
    return tirx.Evaluate(getattr(PTXNamespace().griddepcontrol, action)())


def wait() -> tirx.Stmt:
    """``griddepcontrol.wait``: every grid this one depends on finished, its stores visible."""
    return _ptx("wait")


def launch_dependents() -> tirx.Stmt:
    """``griddepcontrol.launch_dependents``: this block lets the next grid start."""
    return _ptx("launch_dependents")


def _key(buffer) -> str:
    return str(buffer.data)  # "dlogits.data", an alias's too; a pointer argument prints the same


def accesses(stmt: tirx.Stmt, same: dict[str, str] | None = None) -> tuple[set[str], set[str]]:
    """(read, written) global buffers of ``stmt``, by their data's name (an aliased
    output's as its input's, ``same``); a buffer whose address is taken (an atomic's) or
    a pointer handed to a call counts as both."""
    reads: set[str] = set()
    writes: set[str] = set()

    def store(node):
        if node.buffer.scope() == "global":
            writes.add(_key(node.buffer))

    def load(node):
        if node.source.scope() == "global":
            reads.add(_key(node.source))

    def call(node):
        if isinstance(node.op, tvm.ir.Op) and node.op.name == "tirx.address_of":
            for arg in node.args:
                if isinstance(arg, TensorLoad) and arg.source.scope() == "global":
                    writes.add(_key(arg.source))
        for arg in node.args:  # a copy's source (cp.async), or any pointer a call is handed
            ty = getattr(arg, "ty", None)
            if isinstance(ty, tvm.ir.PointerType) and ty.storage_scope in ("", "global"):
                reads.add(str(arg))
                writes.add(str(arg))

    tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, store), (TensorLoad, load), (tvm.ir.Call, call)])
    same = same or {}
    return {same.get(k, k) for k in reads}, {same.get(k, k) for k in writes}


def _conflicts(stmt, earlier_reads: set[str], earlier_writes: set[str], same: dict[str, str]) -> bool:
    reads, writes = accesses(stmt, same)
    return bool((reads | writes) & earlier_writes or writes & earlier_reads)


def _rewrite(launch, earlier_reads, earlier_writes, same, first: bool, last: bool):
    """``launch`` (a thread-attribute nest) with its wait and its trigger (module
    docstring)."""
    head = [launch_dependents()] if not last else []

    def inner(nest):
        """(nest with the wait placed under it, placed?) for the nest's statements."""
        body = statements(nest.body)
        for i, stmt in enumerate(body):
            if thread_attr(stmt) and i == len(body) - 1:
                new, placed = inner(stmt)
                if placed:
                    body[i] = new
                    return tirx.AttrStmt(nest.node, nest.attr_key, nest.value, seq(body)), True
                break
            if _conflicts(stmt, earlier_reads, earlier_writes, same):
                body[i:i] = [wait()]
                return tirx.AttrStmt(nest.node, nest.attr_key, nest.value, tirx.SeqStmt(body)), True
        return nest, False

    if first:
        body = tirx.SeqStmt([wait(), *head, launch.body])
        return tirx.AttrStmt(launch.node, launch.attr_key, launch.value, body)
    new, placed = inner(launch)
    tail = [] if placed else [wait()]  # its end waits, so that its end implies the earlier ends
    return tirx.AttrStmt(new.node, new.attr_key, new.value, seq([*head, new.body, *tail]))


def _arch(func: tirx.PrimFunc) -> int:
    """The function's sm_ number; 0 when it has no target."""
    target = func.attrs.get("target") if func.attrs is not None else None
    return targets.arch_number(target) if target is not None else 0


def _has_launch(stmt: tirx.Stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, [(tirx.AttrStmt, lambda node: found.append(thread_attr(node)))])
    return any(found)


def overlapped(func: tirx.PrimFunc, arch: int | None = None) -> tirx.PrimFunc:
    """``func`` (lowered, launches merged) with its launches overlapped (module
    docstring); as it is when the build did not ask (:func:`asked`), with fewer than
    two launches, with a launch the walk would not see, when launched cooperatively,
    or below sm_90."""
    params = list(func.attrs.get(grid_barrier.LAUNCH_PARAMS, [])) if func.attrs is not None else []
    if grid_barrier.COOPERATIVE in params or TAG in params or func.attrs is None or ATTR not in func.attrs:
        return func
    same = {f"{out}.data": f"{inp}.data" for out, inp in (str(pair).split("=") for pair in func.attrs[ATTR])}
    if (arch if arch is not None else _arch(func)) < MIN_ARCH:
        return func
    top = statements(func.body)
    launches = [i for i, stmt in enumerate(top) if thread_attr(stmt, "blockIdx")]
    if len(launches) < 2 or any(_has_launch(stmt) for i, stmt in enumerate(top) if i not in launches):
        return func  # a launch the walk would not see (one of threads only, or nested): left alone
    reads: set[str] = set()
    writes: set[str] = set()
    for n, i in enumerate(launches):
        launch_reads, launch_writes = accesses(top[i], same)
        top[i] = _rewrite(top[i], reads, writes, same, first=n == 0, last=n == len(launches) - 1)
        reads |= launch_reads
        writes |= launch_writes
    return func.with_body(tirx.SeqStmt(top)).with_attr(grid_barrier.LAUNCH_PARAMS, [*params, TAG])


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.DependentLaunch")
def overlap(mod, _ctx):
    """:func:`overlapped` on every function of ``mod`` when :data:`ENABLED`."""
    if not ENABLED:
        return mod
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = overlapped(func)
    return mod
