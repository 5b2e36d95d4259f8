"""The cross entropy gradient's targets pass run by its row kernel's blocks: one launch
before the rows fewer.

Why: the fused gradient of 65536x1000 fp16 is three launches, the pass over the targets
(64 blocks of partial counts, then one block for the mean's denominator and the first bad
row), the row kernel (16384 blocks) and the loss stage. On the H100 (CUPTI, rows "probe:
launch parts" of results/benchmarks.csv, 2026-12-07T15:17Z) the targets pass took 3.23
us and the row kernel 89.82 of a 100.19 us call; overlapped (``dependent_launch``) the row
kernel's first wave still waits for the whole targets grid before it reads the
denominator. Here the row kernel's own blocks do that pass, and only its first wave can
wait for it, for less: no grid to launch and drain in between.

How (a lowering pass, after TVM's cross-thread lowering and before ``single_launch``
merges launch pairs). Where a function's first launches are a targets pass of ``K``
blocks (``K`` > 1) then one block, then a row kernel of at least ``K`` blocks on the same
number of lanes, the three become one launch of the row kernel's grid:

1. The targets pass as chunks: chunk ``j`` is the pass's block ``j``, its thread index
   the row block's linear one (``threadIdx.x + blockDim.x * threadIdx.y``: the lanes of
   a warp stay a warp, so the pass's shuffles are the hardware's). After a chunk its
   block fences its stores and takes a ticket (``A_DONE``); the block of the last ticket
   runs the pass's final block and resets that counter.
2. Where the rows read nothing the pass writes (the sum and ``"none"`` reductions: the
   pass only finds the first bad row), row block ``j < K`` runs chunk ``j`` first, and no
   row waits.
3. Where they do (the mean: its denominator), a block runs chunks before the first
   statement that reads what the pass writes, claiming them one at a time from a counter
   (``A_NEXT``), until none is left; then its lane 0 waits until the final block has set
   ``FLAG`` (a ``__ldcv`` load in a loop with ``__nanosleep``), and a fence and a barrier
   later its lanes read the denominator. A block that had seen the flag set at its start
   skips the claims and the wait (not lane 0's fence). Whether it had travels through a shared
   word of its own: the claims' word may still be read by a warp leaving the first claims
   (the rows' statistics have no block barrier). Blocks ``j < K`` claim chunks at their start too, so the pass starts with
   the kernel. No block can wait for a chunk nobody runs: a block waits only after the
   claims are exhausted, and every claimed chunk belongs to a block that is running and
   waits for nothing before finishing it. The loss stage's last block (the next launch,
   which starts after every row block has finished) resets ``A_NEXT`` and ``FLAG``; the
   mean always has one.

Not used: the chunks run only by row blocks ``j < K`` while others wait (CUDA promises
no order of blocks: waiting blocks could fill the GPU before block ``j`` starts); a
dynamic block index drawn from a counter by every block (16384 atomic round trips, each
in front of a block's first load); the loss stage folded in the same way (every row block
would end with a fence, which waits for its own gradient stores, and a ticket, for a
tail of about 1.5 us; not tried).

The counters live in ``single_launch``'s launch counter, each in its own 128-byte line
(slot 0 stays the merged pairs' ticket). Two calls must not share a counter while both
run: the torch launchers keep one a stream (and one a call under graph capture), calls
on TVM tensors one per device and TVM stream (``tvm_ffi.get_raw_stream``); two calls
sharing one at once could wait forever (a loss stage resetting the flag another call's
blocks wait on). ``TVM_FUSION_FOLD_PROLOGUE=1`` switches the pass
on (off by default until a GPU A/B shows it faster; in the kernel cache's key), and the
warp-per-row gradient schedules then give the targets pass the row kernel's lane count.
"""

from __future__ import annotations

import math
import os

import tvm
from tvm import tirx

from . import single_launch
from .dependent_launch import accesses
from .single_launch import _fence, _launch_nest, _replace_innermost, _sync, flattened, lane_zero
from .stmts import seq, statements, thread_attr

ENABLED = os.environ.get("TVM_FUSION_FOLD_PROLOGUE", "0") == "1"
# The candidates whose builds ask for it: their schedules give the targets pass the row
# kernel's lanes, and their row kernels are the ones checked on the GPU.
CANDIDATES = frozenset({"cross_entropy_grad_warp_per_row", "cross_entropy_grad_warp_per_row_padded"})
ATTR = "tvm_fusion_fold_prologue"  # the function attribute that asks for the fold
# The counters' slots in single_launch's launch counter (slot 0 is its merged pairs').
A_NEXT, A_DONE, FLAG = single_launch.SLOT, 2 * single_launch.SLOT, 3 * single_launch.SLOT
COUNTER_INTS = single_launch.COUNTER_INTS
# A waiting lane's pause between two loads of the flag: every block of the first wave
# may wait, each load is one L2 request to one line, and more than about one request a
# clock to a line queues at its L2 slice. TVM_FUSION_FOLD_SLEEP_NS sets another (an A/B).
SLEEP_NS = int(os.environ.get("TVM_FUSION_FOLD_SLEEP_NS", "256"))


def _extern(dtype: str, name: str, *args) -> tirx.PrimExpr:
    return tirx.call_extern(dtype, name, *args)


def _slot(counter: tirx.Buffer, slot: int) -> tirx.PrimExpr:
    return tirx.address_of(tirx.BufferLoad(counter, [slot]))


def _launch_free(stmt: tirx.Stmt, counter: tirx.Buffer) -> bool:
    """No thread attribute below ``stmt`` and no use of the launch counter."""
    script = stmt.script()
    return "launch_thread" not in script and counter.name not in script


def asked(mod: tvm.IRModule, candidate: str) -> tvm.IRModule:
    """``mod`` (a build's) with each function asking for the fold where it is switched on
    and ``candidate`` is one of :data:`CANDIDATES`."""
    if not ENABLED or candidate not in CANDIDATES:
        return mod
    return tvm.IRModule({gvar: func.with_attr(ATTR, True) if isinstance(func, tirx.PrimFunc) else func
                         for gvar, func in mod.functions.items()})


def fold(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its targets pass folded into its row kernel (module docstring), or
    unchanged where the build did not ask (:func:`asked`) or its launches are not that
    shape."""
    counter = single_launch._counter(func)
    if (counter is None or int(counter.shape[0]) < COUNTER_INTS or func.attrs is None
            or not func.attrs.get(ATTR, False)):
        return func
    top = statements(func.body)
    launches = [i for i, s in enumerate(top) if thread_attr(s, "blockIdx")]
    if len(launches) < 3 or launches[1] != launches[0] + 1 or launches[2] != launches[0] + 2:
        return func
    i = launches[0]
    first, final, rows = (_launch_nest(top[i + k]) for k in range(3))
    if first is None or final is None or rows is None:
        return func
    (b1, t1, inner1, _), (b2, t2, inner2, _), (br, tr, inner_rows, row_prefix) = first, final, rows
    body1, body2, bodyr = inner1.body, inner2.body, inner_rows.body
    lanes = math.prod(e for _, _, e in tr)
    chunks = math.prod(e for _, _, e in b1)
    grid = math.prod(e for _, _, e in br)
    if (len(b1) != 1 or len(br) != 1 or chunks < 2 or math.prod(e for _, _, e in b2) != 1 or grid < chunks
            or [(t, e) for t, _, e in t1] != [("threadIdx.x", lanes)] or [(t, e) for t, _, e in t2] != [("threadIdx.x", lanes)]
            or not all(_launch_free(b, counter) for b in (body1, body2, bodyr))):
        return func
    pass_reads, pass_writes = accesses(tirx.SeqStmt([top[i], top[i + 1]]))
    _, row_writes = accesses(top[i + 2])
    if row_writes & pass_reads or any(accesses(s)[0] & pass_writes for s in row_prefix):
        return func  # the wait goes in the innermost body: nothing before it may read the pass
    by_tag = {tag: var for tag, var, _ in tr}
    linear, stride = None, 1
    for tag in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
        extent = next((e for t, _, e in tr if t == tag), 1)
        if tag in by_tag:
            term = by_tag[tag] if stride == 1 else by_tag[tag] * stride
            linear = term if linear is None else linear + term
        stride *= extent
    first_lane = lane_zero(tr)
    row_block = br[0][1]
    waits = [n for n, s in enumerate(statements(bodyr)) if accesses(s)[0] & pass_writes]

    last = tirx.decl_buffer((1,), "int32", "fold_last", scope="shared")
    done = tirx.Var("fold_done", "int32")

    def chunk(j: tirx.PrimExpr, release: bool) -> list[tirx.Stmt]:
        """Chunk ``j``, then the ticket; the last ticket's block runs the final block
        (and, ``release``, sets the flag)."""
        after_final = [_fence(), _sync(), tirx.IfThenElse(first_lane, tirx.Evaluate(
            _extern("int32", "atomicExch", _slot(counter, FLAG), 1)), None)] if release else []
        return [
            *flattened(top[i], {"threadIdx.x": linear}, j), _fence(), _sync(),
            tirx.IfThenElse(first_lane, tirx.SeqStmt([
                tirx.Bind(done, _extern("int32", "atomicAdd", _slot(counter, A_DONE), 1)),
                tirx.BufferStore(last, tirx.Select(done == chunks - 1, 1, 0), [0]),
                tirx.IfThenElse(done == chunks - 1, tirx.BufferStore(counter, tirx.const(0, "int32"), [A_DONE]), None),
            ]), None),
            _sync(),
            tirx.IfThenElse(tirx.BufferLoad(last, [0]) != 0,
                            tirx.SeqStmt([_fence(), *flattened(top[i + 1], {"threadIdx.x": linear}), *after_final]), None),
            _sync(),
        ]

    body = statements(bodyr)
    if not waits:
        start = tirx.IfThenElse(row_block < chunks, tirx.SeqStmt(chunk(row_block, False)), None)
        new_rows = [tirx.AllocBuffer(last), start, *body]
    else:
        at = waits[0]
        claim = tirx.decl_buffer((1,), "int32", "fold_claim", scope="shared")
        seen = tirx.decl_buffer((1,), "int32", "fold_seen", scope="local")
        j = tirx.Var("fold_chunk", "int32")

        def claims() -> tirx.Stmt:
            take = tirx.IfThenElse(first_lane, tirx.BufferStore(
                claim, _extern("int32", "atomicAdd", _slot(counter, A_NEXT), 1), [0]), None)
            loop = tirx.While(tirx.BufferLoad(claim, [0]) < chunks, tirx.SeqStmt([
                tirx.Bind(j, tirx.BufferLoad(claim, [0])), _sync(), *chunk(j, True), take, _sync()]))
            return tirx.SeqStmt([take, _sync(), loop])

        spin = tirx.While(_extern("int32", "__ldcv", _slot(counter, FLAG)) == 0,
                          tirx.Evaluate(_extern("int32", "__nanosleep", SLEEP_NS)))
        skip = tirx.decl_buffer((1,), "int32", "fold_skip", scope="shared")
        # Once lane 0 has read the flag set, its fence and then a barrier order the
        # block's reads of the denominator after the final block's stores. Lane 0 alone:
        # a fence waits for the thread's own pending accesses, and every lane's would
        # hold every row block up here. A block that saw the flag at its start passes
        # one barrier.
        wait = [
            tirx.IfThenElse(first_lane, tirx.SeqStmt([tirx.BufferStore(skip, tirx.BufferLoad(seen, [0]), [0]),
                                                     _fence()]), None),
            _sync(),
            tirx.IfThenElse(tirx.BufferLoad(skip, [0]) == 0, tirx.SeqStmt([
                claims(), tirx.IfThenElse(first_lane, tirx.SeqStmt([spin, _fence()]), None), _sync()]), None),
        ]
        new_rows = [
            tirx.AllocBuffer(last), tirx.AllocBuffer(claim), tirx.AllocBuffer(seen), tirx.AllocBuffer(skip),
            tirx.BufferStore(seen, tirx.const(1, "int32"), [0]),
            tirx.IfThenElse(first_lane, tirx.BufferStore(seen, _extern("int32", "__ldcv", _slot(counter, FLAG)), [0]), None),
            tirx.IfThenElse(row_block < chunks, tirx.SeqStmt([_sync(), claims()]), None),
            *body[:at], *wait, *body[at:],
        ]
        # The loss stage (the next launch) resets the claims and the flag; without one, no fold.
        rest = [n for n in launches if n > i + 2]
        reset = _with_reset(top[rest[-1]], counter) if rest else None
        if reset is None:
            return func
        top[rest[-1]] = reset
    top[i:i + 3] = [_replace_innermost(top[i + 2], seq(new_rows))]
    return func.with_body(seq(top))


def _with_reset(launch, counter: tirx.Buffer):
    """``launch`` (the loss stage's final block) with its lane 0 resetting the claims
    counter and the flag at its end; None where it is no plain launch nest."""
    nest = _launch_nest(launch)
    if nest is None:
        return None
    _, threads, inner, _ = nest
    reset = tirx.IfThenElse(lane_zero(threads), tirx.SeqStmt([
        tirx.BufferStore(counter, tirx.const(0, "int32"), [A_NEXT]),
        tirx.BufferStore(counter, tirx.const(0, "int32"), [FLAG])]), None)
    return _replace_innermost(launch, tirx.SeqStmt([*statements(inner.body), reset]))


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FoldPrologue")
def fold_prologue(mod, _ctx):
    """:func:`fold` on every function of ``mod`` when :data:`ENABLED`."""
    if not ENABLED:
        return mod
    changed = False
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            folded = fold(func)
            changed = changed or not folded.same_as(func)
            mod[gvar] = folded
    # The claims run at two places (a block's start and its wait), each a copy of the
    # targets pass's statements: ConvertSSA gives the second copy's variables new names.
    return tirx.transform.ConvertSSA()(mod) if changed else mod
