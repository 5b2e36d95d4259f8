"""Loops walked backwards: a kernel's grid, or a block's serial loop, from its last
step to its first.

Why: a second pass over a tensor (BatchNorm's map after its statistics) reads again
what the first pass read, and the last part the first pass read is still in the L2
cache (60 MiB on the H200) when the second one starts. A second pass that starts there
finds that part on chip; one that starts where the first started finds it evicted
by the time it gets there, and reads everything from HBM again.

A schedule marks a loop bound to ``blockIdx.x`` or a serial loop with
:func:`reverse`, an annotation: a traced primitive, so MetaSchedule's records
replay it. :data:`PIPELINE` is TVM's ``s_tir`` pipeline (what ``"default"`` builds
for CUDA) with :func:`reverse_marked` between its lowering and its host/device
split; every build of a scheduled module goes through it (``kernel.build_kernel``,
the tuner's builders, the single-launch and aliased pipelines). There a marked loop
``for i in range(n)`` becomes ``for j in range(n): i = n - 1 - j; ...``, a
:class:`tvm.tirx.Bind` of the old variable, so its body is unchanged. TensorIR has no
primitive for it: ``transform_block_layout`` takes no negative stride (its
``MapShape`` wants every mapped range to start at 0).

A module compiled by another pipeline keeps the annotation as a pragma that code
generation ignores: the loop runs forwards, with the same results. A marked serial
loop that TVM's auto-unroll has unrolled is left as it is (its loads issue together).

Measured (H200, 2026-12-05, rows "probe: launch_order A/B" of results/benchmarks.csv,
kernels under CUDA-graph replay on rotated input sets, off then on, ms): BatchNorm
64x256x56x56 bf16 channels-last forward 0.0890 -> 0.0823, forward + backward 0.2291 ->
0.2179; 256x2048x7x7 fp16 (small planes) 0.0481 -> 0.0462 and 0.1234 -> 0.1169;
64x256x56x56 fp16 0.0822 -> 0.0815 and 0.2096 -> 0.2032; 32x64x112x112 fp16 0.0448 ->
0.0444 and 0.1133 -> 0.1125. Cross entropy's fused gradient 8192x128256 bf16 1.5450 ->
1.5025, 2048x151936 bf16 0.4700 -> 0.4445; 16384x50257 bf16 (scalar rows, its
gradient loop unrolled, so unmarked) 1.1617 -> 1.1601. The NCHW split-plane map gained
little (0.7 us of 82) because its first pass does not end at the tensor's end: kernel 1
is one wave there, so the L2 holds the end of every run (``schedules.cuda.common.run_map``
walks those first).
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import tirx

from . import async_copy, async_rounds, dependent_launch, granule_stores, grid_barrier, store_hints
from .compute import PARTITION_LIKELY_ATTR
from .stmts import map_children

# TVM 0.27's UnrollLoop multiplies a loop's extent by its body's steps in a C int and
# unrolls the loop when the product is at most ``auto_max_step`` (0 by default: no
# automatic unroll outside an unroll pragma). Past 2^31 the product wraps negative, and
# the loop was unrolled in full: a 2^29-long plane of a CPU BatchNorm (2x2x536870919)
# ran out of memory compiling. The smallest int as the threshold keeps the default
# without that (a pragma's own threshold still applies inside it).
UNROLL_CONFIG = "tirx.UnrollLoop"
NO_AUTO_UNROLL = -(2**31)

# The annotation key. ``pragma_`` keys survive TVM's block lowering as an attribute
# around the loop, where :func:`reverse_marked` finds it.
KEY = "pragma_tvm_fusion_reversed"
# TVM_FUSION_LAUNCH_ORDER=0 builds marked loops forwards (an A/B switch, in the kernel
# cache's key).
ENABLED = os.environ.get("TVM_FUSION_LAUNCH_ORDER", "1") != "0"
PIPELINE = "tvm_fusion"


def _tail_passes() -> list[tvm.transform.Pass]:
    """The s_tir pipeline's last passes, in order, which run after the reversal
    (single_launch's merge also comes before them)."""
    return [
        tvm.s_tir.transform.MergeSharedMemoryAllocations(),
        tirx.transform.SplitHostDevice(),
        tirx.transform.MakePackedAPI(),
        tirx.transform.FP8StorageLegalize(),
        tirx.transform.BF16StorageLegalize(),
    ]


# Their names, which :func:`lowered` disables in the s_tir pipeline.
TAIL = tuple(p.info.name for p in _tail_passes())


def reverse(sch: Any, loop: Any) -> None:
    """Mark ``loop`` (already bound to ``blockIdx.x``, or serial) to run from its last
    step to its first."""
    node = sch.get(loop)
    bound = node.thread_binding.thread_tag if node.thread_binding is not None else None
    if bound not in (None, "blockIdx.x") or node.kind not in (tirx.ForKind.SERIAL, tirx.ForKind.THREAD_BINDING):
        raise ValueError(f"launch_order.reverse: only a loop bound to blockIdx.x or a serial loop runs backwards, "
                         f"not {node.loop_var.name} ({bound or tirx.ForKind(node.kind).name.lower()})")
    sch.annotate(loop, KEY, 1)


def _backwards(var: tirx.Var, start: Any, extent: Any, body: tirx.Stmt) -> tuple[tirx.Var, tirx.Stmt]:
    walked = tirx.Var(var.name + "_walked", var.ty)  # int64 past 2^31 elements
    return walked, tirx.SeqStmt([tirx.Bind(var, start + extent - 1 - (walked - start)), body])


def _reversed(marked: tirx.AttrStmt, found: list) -> tirx.Stmt:
    loop = marked.body
    if isinstance(loop, tirx.AttrStmt) and loop.attr_key == "thread_extent":
        iv = loop.node
        if iv.thread_tag != "blockIdx.x":
            raise ValueError(f"{KEY}: only a loop bound to blockIdx.x or a serial loop runs backwards, "
                             f"not one bound to {iv.thread_tag}")
        walked, body = _backwards(iv.var, 0, loop.value, _walk(loop.body, found))
        return tirx.AttrStmt(tirx.IterVar(iv.dom, walked, iv.iter_type, iv.thread_tag), "thread_extent",
                             loop.value, body)
    if isinstance(loop, tirx.For) and loop.kind in (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED):
        walked, body = _backwards(loop.loop_var, loop.min, loop.extent, _walk(loop.body, found))
        return tirx.For(walked, loop.min, loop.extent, loop.kind, body, None, loop.annotations)
    if not isinstance(loop, tirx.For):  # TVM's auto-unroll has unrolled it: its loads issue together
        return _walk(loop, found)
    raise ValueError(f"{KEY}: marks a {loop.kind} loop, not a blockIdx.x or serial one")


def _walk(stmt: tirx.Stmt, found: list) -> tirx.Stmt:
    """``stmt`` with every marked loop under it reversed (and unmarked, or only
    unmarked when :data:`ENABLED` is off); each mark met is appended to ``found``."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == KEY:
        found.append(stmt)
        return _reversed(stmt, found) if ENABLED else _walk(stmt.body, found)
    return map_children(stmt, lambda child: _walk(child, found))


def reverse_marked(func: tirx.PrimFunc, marks: int | None = None) -> tirx.PrimFunc:
    """``func`` (lowered: launches as ``thread_extent`` attributes) with its marked
    loops walked backwards. ``marks``: how many the function has, counted in its printed
    form (7-8 ms for the fused gradient's) when not given, against those the walk met."""
    marks = func.script().count(KEY) if marks is None else marks
    if not marks:
        return func
    found: list = []
    new = func.with_body(_walk(func.body, found))
    if len(found) != marks:  # a mark under a statement _walk does not enter
        raise ValueError(f"{KEY}: a marked loop was left unreversed in {func.attrs.get('global_symbol', 'a function')}")
    return new


def _global_allocations(launch: tirx.Stmt) -> tuple[list[tirx.Stmt], tirx.Stmt]:
    """The global-scope allocations at the top of a kernel's body (under its launch
    attributes), and the kernel without them."""
    if isinstance(launch, tirx.AttrStmt) and launch.attr_key == "thread_extent":
        found, body = _global_allocations(launch.body)
        return found, tirx.AttrStmt(launch.node, launch.attr_key, launch.value, body) if found else launch
    if isinstance(launch, tirx.SeqStmt):
        found = [s for s in launch.seq if isinstance(s, tirx.AllocBuffer) and s.buffer.scope() == "global"]
        rest = [s for s in launch.seq if not any(s.same_as(f) for f in found)]
        return found, launch if not found else rest[0] if len(rest) == 1 else tirx.SeqStmt(rest)
    return [], launch


def host_scratch(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (lowered) with each global buffer allocated inside a kernel allocated
    before the kernel's launch instead, on the host (TVM's workspace pool), as a
    buffer used by two kernels is. TVM places an allocation where all its uses meet:
    a global scratch buffer that one kernel alone uses (cross-block partials that the
    kernel's own later blocks read, ``bn_forward_cluster_half_one_launch``) lands
    inside that kernel, and CUDA code generation refuses a global allocation there.
    Builds that take such buffers as parameters (``kernel.compiled_form``'s
    ``workspace``) never see one; the tuner's builds and trace replays do."""
    seq = list(func.body.seq) if isinstance(func.body, tirx.SeqStmt) else [func.body]
    out: list[tirx.Stmt] = []
    for stmt in seq:
        if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent" and \
                stmt.node.thread_tag.startswith("blockIdx"):
            found, stmt = _global_allocations(stmt)
            out += found
        out.append(stmt)
    return func if len(out) == len(seq) else func.with_body(tirx.SeqStmt(out))


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.MarkedLoops")
def marked_loops(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
    """Every function's marked loops reversed and its grid barriers inserted
    (:func:`tvm_fusion.grid_barrier.with_barriers`), both counted in one printing, and
    its kernels' global scratch allocated on the host (:func:`host_scratch`)."""
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            text = func.script()
            func = reverse_marked(func, text.count(KEY))
            mod[gvar] = host_scratch(grid_barrier.with_barriers(func, grid_barrier.marks_in(text)))
    return mod


def tail() -> tvm.transform.Pass:
    """The launches overlapped where ``dependent_launch`` is switched on, then the
    ``s_tir`` pipeline's passes after its lowering (:data:`TAIL`), in order."""
    return tvm.transform.Sequential([dependent_launch.overlap, *_tail_passes()])


def lowered(pipeline: tvm.transform.Pass, mod: tvm.IRModule, ctx: Any) -> tvm.IRModule:
    """``mod`` (its granule maps stored into their outputs: :mod:`tvm_fusion.granule_stores`)
    through ``pipeline`` (``s_tir``'s) without its :data:`TAIL`, marked loops
    reversed and grid barriers inserted (:func:`marked_loops`); with loop partition on
    const loops where a function asks for it (the
    :data:`~tvm_fusion.compute.PARTITION_LIKELY_ATTR` attribute of the decompositions in
    :data:`~tvm_fusion.compute.PARTITION_LIKELY`), and pipelined rounds lowered as
    :mod:`tvm_fusion.async_rounds` says where one asks for that, their ``cp.async``
    copies' 64-bit offsets folded into the source (``async_copy.wide_sources``); then the large gradient
    stores made evict-first (:mod:`tvm_fusion.store_hints`)."""
    config, disabled = dict(ctx.config), [*ctx.disabled_pass, *TAIL]
    config.setdefault(UNROLL_CONFIG, {"auto_max_step": NO_AUTO_UNROLL})
    if any(isinstance(f, tirx.PrimFunc) and f.attrs is not None and f.attrs.get(PARTITION_LIKELY_ATTR)
           for f in mod.functions.values()):
        config["s_tir.LoopPartition"] = {"partition_const_loop": True}
    pipelined = async_rounds.wanted(mod)
    if pipelined:
        config, disabled = async_rounds.lowering_config(config, disabled)
    mod = granule_stores.module_stores_in_place(mod)  # a tuner's build: no compiled_form before

    def through(config: dict) -> tvm.IRModule:
        with tvm.transform.PassContext(opt_level=ctx.opt_level, required_pass=list(ctx.required_pass),
                                       disabled_pass=disabled, config=config, instruments=list(ctx.instruments)):
            out = pipeline(mod)
            return async_rounds.lower_allreduce(out) if pipelined else out

    out = through(config)
    if async_copy.wanted(mod):
        if async_copy.copyable(out):
            # Marked copies of cp.async's widths: lowered again as InjectPTXAsyncCopy takes them.
            out = through(async_copy.lowering_config(config))
        out = async_copy.inject(out)
    mod = async_copy.wide_sources(out)
    return store_hints.evict_first_stores(marked_loops(mod))


def _pipeline(**kwargs):
    """TVM's s_tir pipeline with :func:`marked_loops` before its host/device split."""
    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir", **kwargs)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Pipeline")
    def run(mod, ctx):
        return tail()(lowered(pipeline, mod, ctx))

    return run, finalize_host, finalize_device


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
