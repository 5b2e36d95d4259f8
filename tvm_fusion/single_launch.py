"""One launch where a schedule gives two: the last block to finish runs the second kernel.

A cross entropy (row kernel, then one block over the row losses) or a split-plane
``bn_stats`` (partials, then a finalize block a channel) is two kernels, and on the
H200's host the two TVM launches cost 9.6 us of host time (the README's results): on a
small input the launches, not the GPU, set the call's time. A schedule cannot fold the second kernel
into the first (blocks run in no order, and only thread loops carry a cross-lane
reduction), so this is a lowering pass, run after TVM has lowered the cross-thread
reductions and before it splits host from device code:

1. every thread of the first kernel ends with ``__threadfence()`` (its stores are
   visible to every block), then ``__syncthreads()``;
2. thread 0 takes a ticket, ``atomicAdd(launch_counter, 1)``; the block that draws
   the last ticket resets the counter to 0 (the next launch on the stream starts from
   0) and tells its threads through shared memory;
3. that block runs the second kernel's body, its block index a serial loop (a block
   over each of at most ``MAX_SERIAL_BLOCKS`` blocks), its thread indices bound to the
   first kernel's, which must be the same (tags and extents).

Every such pair of a function is merged, from the last launch backwards, the pairs
apart: the cross entropy gradient's targets pass over many rows (partials, then one
block) and its loss stage (the same) become two launches instead of four. Before that,
consecutive launches of one block each with the same thread extents are joined into one
(the second body after the first and a barrier, no ticket), which may then be the
second kernel of a pair (``cross_entropy_split_row``: a block a row part, then a fold
block and a batch block, one launch).

``launch_counter`` is a zeroed int32 (COUNTER_INTS,) parameter that :func:`with_launch_counter`
appends to ``main``; each API launcher passes one of its own per CUDA stream
(``arrays.Kind.scratch``), a direct kernel call (``Kernel.func``) one per stream here.
Where the pass cannot merge (one kernel, different thread extents, a second kernel of
more blocks) it leaves those launches as they were, and a function with none merged
leaves the counter unused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from . import launch_order
from .stmts import seq, statements, thread_attr

COUNTER = "launch_counter"
# TVM_FUSION_SINGLE_LAUNCH=0 builds every kernel as scheduled (an A/B switch).
ENABLED = os.environ.get("TVM_FUSION_SINGLE_LAUNCH", "1") != "0"
# A second kernel of this many blocks at most runs in the last block as a loop; one
# of more (a finalize block per channel of a wide layer) keeps its own launch, where
# its blocks spread over the SMs.
MAX_SERIAL_BLOCKS = 4
PIPELINE = "tvm_fusion_single_launch"
# The counter's ints: slot 0 the merged pairs' ticket, slots SLOT, 2 SLOT and 3 SLOT
# folded_prologue's (each counter in its own 128-byte line, so that spinning on one never
# slows the others).
SLOT = 32
COUNTER_INTS = 4 * SLOT


def with_launch_counter(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with a zeroed int32 (COUNTER_INTS,) ``launch_counter`` parameter appended
    to ``main``."""
    func = mod["main"]
    counter = tirx.decl_buffer((COUNTER_INTS,), "int32", COUNTER, data_alignment=16)
    new = tirx.PrimFunc([*func.params, counter], func.body, func.ret_type, func.attrs)
    out = tvm.IRModule(dict(mod.functions))
    out["main"] = new
    return out


def _counter(func: tirx.PrimFunc) -> tirx.Buffer | None:
    last = func.params[-1] if func.params else None
    return last if last is not None and last.name == COUNTER else None


def _launch_nest(launch):
    """(block dims, thread dims, innermost thread attribute, declarations above it) of
    a launch, each dim (tag, var, extent), where the nest is attributes each holding
    declarations then the next attribute; None when it is not that shape."""
    blocks, threads, prefix, stmt = [], [], [], launch
    while True:
        if thread_attr(stmt, "blockIdx") and not threads:
            blocks.append((stmt.node.thread_tag, stmt.node.var, int(stmt.value)))
        elif thread_attr(stmt, "threadIdx"):
            threads.append((stmt.node.thread_tag, stmt.node.var, int(stmt.value)))
        else:
            return None
        body = statements(stmt.body)
        last = body[-1]
        if thread_attr(last, "blockIdx") or thread_attr(last, "threadIdx"):
            if any(isinstance(s, tirx.AttrStmt) and s.attr_key == "thread_extent" for s in body[:-1]):
                return None
            prefix.extend(body[:-1])
            stmt = last
            continue
        return blocks, threads, stmt, prefix


def lane_zero(threads) -> tirx.PrimExpr:
    """Whether this is a launch's first lane: every thread index of ``threads`` (dims
    as :func:`_launch_nest` gives them) 0."""
    cond = None
    for _, var, _ in threads:
        cond = var == 0 if cond is None else tirx.And(cond, var == 0)
    return cond


def _sync():
    return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def _fence():
    return tirx.Evaluate(tirx.call_extern("int32", "__threadfence"))


def _replace_innermost(stmt, new_body):
    """``stmt`` (a launch nest) with the body of its innermost thread attribute replaced."""
    body = statements(stmt.body)
    last = body[-1]
    if thread_attr(last, "blockIdx") or thread_attr(last, "threadIdx"):
        body[-1] = _replace_innermost(last, new_body)
        inner = seq(body)
    else:
        inner = new_body
    return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, inner)


def _flatten_second(launch, threads):
    """The second kernel's statements for the last block: its thread indices bound to
    the first kernel's, its block indices to a serial loop."""
    return flattened(launch, {tag: var for tag, var, _ in threads})


def flattened(launch, by_tag: dict, block: tirx.PrimExpr | None = None) -> list:
    """A launch's statements run by a block of another: each thread index bound to
    ``by_tag``'s value for its tag, its block index to ``block``, or without one its
    block indices to a serial loop over its blocks."""
    binds, blocks, stmt = [], [], launch
    prefix = []
    while thread_attr(stmt, "blockIdx") or thread_attr(stmt, "threadIdx"):
        tag, var = stmt.node.thread_tag, stmt.node.var
        value = by_tag[tag] if tag.startswith("threadIdx") else block
        if value is not None:
            binds.append(tirx.Bind(var, value if value.ty.dtype == var.ty.dtype else tirx.Cast(var.ty.dtype, value)))
        else:
            blocks.append((var, int(stmt.value)))
        children = statements(stmt.body)
        last = children[-1]
        prefix.extend(children[:-1])
        if thread_attr(last, "blockIdx") or thread_attr(last, "threadIdx"):
            stmt = last
        else:
            prefix.append(last)
            break
    serial = [(var, extent) for var, extent in blocks if extent > 1]
    body = [*binds, *[tirx.Bind(var, tirx.const(0, var.ty.dtype)) for var, extent in blocks if extent == 1], *prefix]
    if not serial:
        return body
    (var, extent), = serial
    loop_var = tirx.Var(var.name + "_serial", var.ty.dtype)  # int64 past 2^31 elements
    # A sync ends each block: the next one's shared-memory writes come after every
    # lane's reads of this one's.
    return [tirx.For(loop_var, tirx.const(0, var.ty.dtype), tirx.const(extent, var.ty.dtype), tirx.ForKind.SERIAL,
                     tirx.SeqStmt([tirx.Bind(var, loop_var), *body, _sync()]))]


def _pair(first_launch, second_launch):
    """``(blocks of the first, its threads, blocks of the second, the first's innermost
    body)`` where the two launches may become one, else None: both plain launch nests
    with the same thread tags and extents, no thread attribute below either nest (a lane
    the ticket's lane-0 test, or the barrier, would not see), and no ticket already in
    either (a merged launch would share the counter's slot 0)."""
    first, second = _launch_nest(first_launch), _launch_nest(second_launch)
    if first is None or second is None:
        return None
    (blocks1, threads1, _, _), (blocks2, threads2, inner2, _) = first, second
    if [(t, e) for t, _, e in threads1] != [(t, e) for t, _, e in threads2]:
        return None
    first_body = _innermost_body(first_launch)
    for script in (first_body.script(), inner2.body.script()):
        if "launch_thread" in script or f"{COUNTER}[0]" in script:  # other slots: folded_prologue's
            return None
    return blocks1, threads1, blocks2, first_body


def _merged(first_launch, second_launch, pair, counter):
    """The two launches (:func:`_pair`'s ``pair``) as one, the second run by the last
    block of the first (the module docstring says how), or None where the second has
    too many blocks."""
    blocks1, threads1, blocks2, first_body = pair
    serial = [e for _, _, e in blocks2 if e > 1]
    if len(serial) > 1 or (serial and serial[0] > MAX_SERIAL_BLOCKS):
        return None
    grid = math.prod(extent for _, _, extent in blocks1)
    is_last = tirx.decl_buffer((1,), "int32", "launch_is_last", scope="shared")
    ticket = tirx.Var("launch_ticket", "int32")
    take_ticket = tirx.SeqStmt([
        tirx.Bind(ticket, tirx.call_extern("int32", "atomicAdd", tirx.address_of(tirx.BufferLoad(counter, [0])), 1)),
        tirx.BufferStore(is_last, tirx.Select(ticket == grid - 1, 1, 0), [0]),
        tirx.IfThenElse(ticket == grid - 1, tirx.BufferStore(counter, tirx.const(0, "int32"), [0]), None),
    ])
    last_block = tirx.SeqStmt([_fence(), *_flatten_second(second_launch, threads1)])
    merged_body = tirx.SeqStmt([
        first_body,
        _fence(),
        _sync(),
        tirx.AllocBuffer(is_last),
        tirx.IfThenElse(lane_zero(threads1), take_ticket, None),
        _sync(),
        tirx.IfThenElse(tirx.BufferLoad(is_last, [0]) != 0, last_block, None),
    ])
    return _replace_innermost(first_launch, merged_body)


def _concatenated(first_launch, second_launch, pair):
    """Two launches (:func:`_pair`'s ``pair``) of one block each as one: the second's
    body after the first's and a barrier (which also makes the first's global stores
    visible to the block), or None where either has more blocks. No ticket: the one
    block is the last."""
    blocks1, threads1, blocks2, first_body = pair
    if any(extent != 1 for _, _, extent in (*blocks1, *blocks2)):
        return None
    return _replace_innermost(first_launch, tirx.SeqStmt(
        [first_body, _sync(), *_flatten_second(second_launch, threads1)]))


def _innermost_body(launch):
    """The statements under a launch nest's innermost thread attribute."""
    innermost = launch
    while True:
        body = innermost.body
        tail = statements(body)[-1]
        if not (thread_attr(tail, "blockIdx") or thread_attr(tail, "threadIdx")):
            return innermost.body
        innermost = tail


def merge_launch_pairs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with each kernel that can be run by the last block of the kernel before
    it merged into that one, or unchanged where none can. Pairs are taken from the last
    launch backwards and never overlap: a merged kernel is neither merged again nor run
    by another's last block, so one counter serves them all (launches on a stream run in
    order, and each merged kernel leaves the counter at 0)."""
    counter = _counter(func)
    if counter is None:
        return func
    top = statements(func.body)
    launches, i = len(top), len(top) - 2
    while i >= 0:
        pair = None
        if thread_attr(top[i], "blockIdx") and thread_attr(top[i + 1], "blockIdx"):
            pair = _pair(top[i], top[i + 1])
        joined = None if pair is None else _concatenated(top[i], top[i + 1], pair)
        if joined is not None:  # one block, no ticket: it may join or be merged again
            top[i:i + 2] = [joined]
            i = min(i, len(top) - 2)
            continue
        merged = None if pair is None else _merged(top[i], top[i + 1], pair, counter)
        if merged is None:
            i -= 1
            continue
        top[i:i + 2] = [merged]
        i -= 2
    if len(top) == launches:
        return func
    return func.with_body(seq(top))


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.MergeLaunchPairs")
def merge_launches(mod, _ctx):
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = merge_launch_pairs(func)
    return mod


def _single_launch_pipeline(**kwargs):
    """TVM's s_tir pipeline with :func:`merge_launches` (after ``folded_prologue``'s
    fold, where switched on) between its cross-thread lowering (and ``launch_order``'s
    reversal of marked loops) and its host/device split."""
    from . import folded_prologue  # which builds on this module's counter and merges

    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir", **kwargs)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.SingleLaunchPipeline")
    def run(mod, ctx):
        folded = folded_prologue.fold_prologue(launch_order.lowered(pipeline, mod, ctx))
        return launch_order.tail()(merge_launches(folded))

    return run, finalize_host, finalize_device


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _single_launch_pipeline)


# -- the counters a launch passes -------------------------------------------------
# For direct kernel calls (Kernel.func; the API's launchers keep their own):
# one zeroed counter per (CUDA device, torch stream): calls on one stream run in
# order, and each merged kernel leaves its counter at 0 (and one that did not merge
# never touches it). Under CUDA graph capture a call gets a counter of its own,
# zeroed by a memset the graph records, so a replay never sees another's ticket.
_PER_STREAM: dict[tuple[int, int], Any] = {}
_PER_TVM_STREAM: dict[tuple[int, int, int], Any] = {}  # TVM tensors: per tvm_key (device, TVM stream)


def zeroed_counter(device: Any) -> Any:
    """A fresh zeroed launch counter, a torch tensor on ``device``."""
    import torch

    return torch.zeros(COUNTER_INTS, dtype=torch.int32, device=device)


def torch_counter(index: int) -> Callable[[], Any]:
    """A function that gives the launch counter for the current stream of CUDA device ``index``."""
    import torch

    device = torch.device("cuda", index)
    current_stream, capturing = torch._C._cuda_getCurrentRawStream, torch._C._cuda_isCurrentStreamCapturing

    def get() -> Any:
        if capturing():
            return zeroed_counter(device)
        key = (index, current_stream(index))
        found = _PER_STREAM.get(key)
        if found is None:
            found = _PER_STREAM.setdefault(key, zeroed_counter(device))
        return found

    return get


def tvm_key(device: Any) -> tuple[int, int, int]:
    """A TVM device with its current stream (``tvm_ffi.get_raw_stream``, where a call on
    TVM tensors launches): calls under one key run in order, calls under two may overlap."""
    return device.dlpack_device_type(), device.index, tvm_ffi.get_raw_stream(device)


def tvm_counter(device: Any) -> Any:
    """The launch counter for TVM tensors on ``device`` and its current stream (a zeroed TVM tensor)."""
    key = tvm_key(device)
    found = _PER_TVM_STREAM.get(key)
    if found is None:
        found = _PER_TVM_STREAM.setdefault(key, tvm.runtime.tensor(np.zeros(COUNTER_INTS, np.int32), device))
    return found


_GETTERS: dict[int, Callable[[], Any]] = {}  # torch_counter's function per CUDA device index


def counter_like(x: Any) -> Any:
    """The launch counter for a kernel whose first argument is ``x`` (a torch or TVM tensor)."""
    if isinstance(x, tvm_ffi.Tensor):
        return tvm_counter(x.device)
    index = max(x.get_device(), 0)
    get = _GETTERS.get(index)
    if get is None:
        get = _GETTERS.setdefault(index, torch_counter(index))
    return get()

