"""A grid-wide barrier before a marked loop, and the cooperative launch it needs; or
a cluster-wide one, and the cluster launch it needs.

A schedule marks a loop with :func:`before` (an annotation: a traced primitive, so
MetaSchedule's records replay it). In :data:`launch_order.PIPELINE`, after TVM's
lowering and before its host/device split, :func:`with_barriers` puts
``T.cuda.grid_sync()`` (``cooperative_groups::this_grid().sync()``) before each marked
loop and gives the function the launch parameter ``tirx.use_cooperative_launch``,
which TVM's host/device split copies to every kernel of the function and its CUDA
runtime turns into ``cuLaunchCooperativeKernel``: all blocks of the grid are resident
at once (the launch fails with an error when the grid cannot be, instead of the
barrier hanging), so every block reaches the barrier.

A cluster barrier (:func:`before_cluster`) waits for the blocks of one thread-block
cluster only (Hopper: up to 8 consecutive blocks that run at once, on one GPC), not the
grid: ``barrier.cluster.arrive`` and ``wait``, release and acquire at cluster scope (the
PTX defaults), which order every thread's memory accesses before the barrier against
every cluster thread's after it, global memory included. It is emitted as
``tvm_fusion_cluster_sync()`` (:data:`CLUSTER_SYNC_SOURCE`), whose ``asm`` carries a
memory clobber so that nvcc moves no load or store across it. TVM's own
``T.cuda.cluster_sync()`` has no clobber; until 2026-12-06 it stood between two
``__threadfence()``, a gpu-scope fence in every thread where the barrier's cluster-scope
release and acquire already order the exchange. Without them (H100, 2026-12-06T17:42Z and
17:44Z, rows "probe: barrier A/B" of results/benchmarks.csv, both barriers built in one
process, each kernel checked against float64 first): cross_entropy_grad_row_in_cluster
2-7% faster (8192x128256 bf16 1.5660 ms against 1.6607, 1024x128256 fp32 0.3739 against
0.4015), bn_forward_cluster_half_one_launch 3% (64x256x56x56 fp16 0.0844 against
0.0868).

The kernel with the barrier (not the function's other kernels) gets a ``clusterCtaIdx.x``
launch dimension of the cluster's size inside its ``blockIdx.x`` one, which TVM's CUDA
runtime turns into ``cuLaunchKernelEx`` with that cluster size (the grid stays
``blockIdx.x``'s extent in blocks and must be a multiple of it; a block's rank in its
cluster is ``blockIdx.x`` modulo the size). No cooperative launch: clusters need not all
be resident at once.

The marked loop must be one every thread of every block runs: not under a thread
guard, nor under a loop whose trip count differs between blocks. Pipelines other than
``launch_order.PIPELINE`` keep the annotation as a pragma that code generation
ignores, and the kernel would race: ``launch_order.marked_loops`` is in every pipeline
that builds a scheduled module (the single-launch and aliased pipelines build on it).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import tirx
from tvm.backend.cuda import op as cuda_op

# ``pragma_`` keys survive TVM's block lowering as an attribute around the loop.
KEY = "pragma_tvm_fusion_grid_sync"
CLUSTER_KEY = "pragma_tvm_fusion_cluster_sync"  # its value: the cluster's size in blocks
CLUSTER_TAG = "clusterCtaIdx.x"
LAUNCH_PARAMS = "tirx.kernel_launch_params"
COOPERATIVE = "tirx.use_cooperative_launch"


def before(sch: Any, loop: Any) -> None:
    """Mark ``loop``: every block of the grid waits there until all blocks arrive."""
    sch.annotate(loop, KEY, 1)


def before_cluster(sch: Any, loop: Any, size: int) -> None:
    """Mark ``loop``: every block of a cluster of ``size`` consecutive blocks waits there
    until the cluster's blocks arrive (the function is launched in such clusters)."""
    sch.annotate(loop, CLUSTER_KEY, size)


CLUSTER_SYNC = "tvm_fusion_cluster_sync"
CLUSTER_SYNC_CALL = CLUSTER_SYNC + "();"  # how a kernel's CUDA source calls it
CLUSTER_SYNC_SOURCE = f"""
__forceinline__ __device__ void {CLUSTER_SYNC}() {{
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}}
"""


def _barrier(stmt: tirx.AttrStmt) -> list[tirx.Stmt]:
    if stmt.attr_key == KEY:
        return [tirx.Evaluate(cuda_op.cuda_grid_sync())]
    return [tirx.Evaluate(cuda_op.cuda_func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE))]


def _walk(stmt: tirx.Stmt, found: list) -> tirx.Stmt:
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_walk(s, found) for s in stmt.seq])
    if isinstance(stmt, tirx.AttrStmt):
        if stmt.attr_key in (KEY, CLUSTER_KEY):
            found.append(stmt)
            return tirx.SeqStmt([*_barrier(stmt), _walk(stmt.body, found)])
        before = len(found)
        body = _walk(stmt.body, found)
        if stmt.attr_key == "thread_extent" and stmt.node.thread_tag == "blockIdx.x":
            body = _in_clusters(stmt, body, found[before:])
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _walk(stmt.body, found),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        before = len(found)
        then_case = _walk(stmt.then_case, found)
        else_case = None if stmt.else_case is None else _walk(stmt.else_case, found)
        if len(found) != before:
            raise ValueError(f"{KEY}: a grid barrier under a condition ({stmt.condition}) would leave blocks waiting")
        return tirx.IfThenElse(stmt.condition, then_case, else_case)
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, _walk(stmt.body, found))
    return stmt


def _in_clusters(launch: tirx.AttrStmt, body: tirx.Stmt, marks: list) -> tirx.Stmt:
    """A kernel's ``body`` (inside its ``blockIdx.x`` launch) with a ``clusterCtaIdx.x``
    launch dimension of its cluster barriers' size, where ``marks`` has one."""
    sizes = {int(m.value) for m in marks if m.attr_key == CLUSTER_KEY}
    if not sizes:
        return body
    if len(sizes) > 1 or any(m.attr_key == KEY for m in marks):
        raise ValueError(f"{CLUSTER_KEY}: one cluster size a kernel and no grid barrier beside it")
    size = sizes.pop()
    if int(launch.value) % size:
        raise ValueError(f"{CLUSTER_KEY}: a grid of {launch.value} blocks is no whole number of clusters of {size}")
    rank = tirx.IterVar(tvm.ir.Range(0, size), tirx.Var("cluster_rank", "int32"), 1, CLUSTER_TAG)
    return tirx.AttrStmt(rank, "thread_extent", size, body)


def marks_in(text: str) -> int:
    """How many barrier marks (grid and cluster) a function's printed form has."""
    return text.count(KEY) + text.count(CLUSTER_KEY)


def with_barriers(func: tirx.PrimFunc, marks: int | None = None) -> tirx.PrimFunc:
    """``func`` (lowered: launches as ``thread_extent`` attributes) with a barrier before
    each marked loop: grid barriers launched cooperatively, cluster barriers in clusters
    of the marked size. ``marks``: how many the function has (counted in its printed
    form when not given)."""
    marks = marks_in(func.script()) if marks is None else marks
    if not marks:
        return func
    found: list = []
    new = func.with_body(_walk(func.body, found))
    if len(found) != marks:
        raise ValueError(f"{KEY}: a marked loop was left without its barrier in "
                         f"{func.attrs.get('global_symbol', 'a function')}")
    if all(m.attr_key == CLUSTER_KEY for m in found):
        return new
    params = list(func.attrs.get(LAUNCH_PARAMS, [])) if func.attrs is not None else []
    return new.with_attr(LAUNCH_PARAMS, [*params, COOPERATIVE] if COOPERATIVE not in params else params)
