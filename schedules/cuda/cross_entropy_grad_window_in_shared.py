"""Cross entropy and its gradient for rows off the 16-byte grid, each row's granules in shared memory.

Pattern ``t(R) -> denom, first_bad | x -> window(SSS) -> max(S) -> exp, sum(S) -> lse,
row_loss, coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused_window``
decomposition: for V odd in fp16/bf16 every row but one in eight starts off a 16-byte
boundary, so a row read from its own start takes 2-byte loads. The window is the row's
16-byte granules of the *flat* logits (``W = ceil((V + c - 1) / c)`` of them, the
first and last shared with the neighbouring rows), each one aligned load; the
statistics and the gradient then read the window in shared memory, so a training step
reads the logits once (plus a granule or two a row) and writes the gradient once.

Kernel 1, one block: the targets pass. Kernel 2, grid (B,):
1. Every per-row block shares one row loop (``merge_grad_rows``) bound to ``blockIdx.x``.
2. The window is copied into dynamic shared memory ``[threadIdx.x, serial, c]``: a
   16-byte global load and a 16-byte shared store per granule (the granule index is
   clamped to the tensor's last, so the last row's window stays inside it).
3. ``row_max`` then ``row_sumexp`` sweep the window 16 bytes at a time, the elements
   outside the row masked (-inf for the max, so 0 after the exp), shuffles plus one
   shared hop; both statistics stay in every thread's registers.
4. ``dlogits``: lane ``t`` of step ``s`` takes the row's element ``k = s threads + t``
   from the window (``(k + a_i) / c, (k + a_i) mod c``), the gradient in float32, and
   stores it with a 2-byte store (consecutive lanes, consecutive elements: a warp
   writes 64 contiguous bytes).
5. Thread 0 writes ``lse`` and the row loss (``row_order``).
Kernel 3, one block: the loss.

Why: the candidates that read the row from its start take 2-byte loads there, one in
flight a lane after its bound check, and are short of loads in flight, not of
bandwidth: H200, 16384x50257 bf16, fused gradient 1.5268 ms with three sweeps
(``cross_entropy_grad_block_per_row``), 1.4286 with two (``cross_entropy_grad_online``
at 1024 threads), against a 0.7813 ms floor; fewer rows in flight (persistent blocks)
was slower still (results/benchmarks.csv, 2026-12-03, the rows_per_block probe).

Measured (H200, 2026-12-03, "window knob probe" rows of results/benchmarks.csv, each
against float64 first): one read did not make it faster. 16384x50257 bf16 1.5282 ms
at its best (512 threads) against 1.4152 for ``cross_entropy_grad_online`` at 1024;
3000x50257 fp16 0.2695 (1024 threads) against 0.2771; 2048x32001 bf16 0.1076 against
0.1069. The row kernel is bound by issue, not by memory: about 35 instructions an
element over three sweeps of shared memory (a masked max, a masked sum of exp, the
gradient with its exp and a 2-byte store), some 55K warp instructions a row, 7.6 us
of an SM's issue a row against 6.2 us of its share of HBM for the row's read and
write, with two blocks an SM to overlap them. So it is not dispatched by default
(``prefers``); the tuner can still choose it. What would cut the count: the body
granules unmasked (only the first and last hold other rows' values), one online sweep
for the statistics, and ``dlogits`` written by granules with 16-byte stores (the last is
``cross_entropy_grad_granules_in_shared``).

Applies to rows over 16-byte boundaries whose window fits beside a second block on
an SM (``W * 16 <= ROW_BYTES_MAX``: V <= 57337 in fp16/bf16), ``B V`` a multiple of
a granule's c values (``window_granules``), not in place (a window's edge granules
hold the neighbouring rows' logits, which another block may be overwriting).

Not used: 16-byte stores of ``dlogits`` (its compute runs over the row's own
elements, whose flat offsets are not granule-aligned: a vector store needs the map laid
out by granules, with the edges stored apart, which is
``cross_entropy_grad_granules_in_shared``'s ``fused_granules``); the window in
registers (the forward row-in-shared candidate's lesson: a local buffer written under
one thread loop and read under others becomes a global workspace).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import async_copy
from tvm_fusion.compute.cross_entropy_grad import window_granules
from tvm_fusion.compute.primitives import granule
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import coefficients_at, lanes_split, outputs_to, row_loss_name, single_thread, thread_reduce
from .common import VECTOR_BYTES, grad_map, merge_grad_rows, schedule_grad_batch_stage, schedule_grad_prologue
from .cross_entropy_aligned_rows import unaligned_rows
from .cross_entropy_row_in_shared import ROW_BYTES_MAX

ALGORITHM = "fused_window"


@dataclass(frozen=True)
class WindowInSharedKnobs(Knobs):
    threads: int = 512
    # 16 unrolls the window copy of a 50257-class row wholly (13 granules a lane at 512
    # threads), so that a lane's 16-byte loads are all in flight before its first store.
    unroll: int = 16


@register
class CrossEntropyGradWindowInShared(Candidate):
    name = "cross_entropy_grad_window_in_shared"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = ALGORITHM
    knobs = WindowInSharedKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        if problem.op != self.op or problem.mode != "fused" or problem.in_place or not unaligned_rows(problem):
            return False
        try:
            granules = window_granules(problem)
        except ValueError:  # B V not a multiple of a granule, or V under two granules
            return False
        return granules * VECTOR_BYTES <= ROW_BYTES_MAX

    def prefers(self, problem: CrossEntropyGradProblem, target: Target) -> bool:
        # Not by default: the aligned loads did not make it faster than the online
        # candidate at 1024 threads (docstring, "Measured"); the tuner may still pick it.
        return False

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": [256, 512, 1024], "unroll": [4, 8, 16, 32]}

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> WindowInSharedKnobs:
        return WindowInSharedKnobs()

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        dlogits_row = sch.get_loops(sch.get_sblock("dlogits"))[0]
        coefficients_at(sch, problem, dlogits_row, "local")
        # 1. One row loop, one block per row.
        row = merge_grad_rows(sch, problem, ("window", "row_max", "row_sumexp"))
        sch.bind(row, "blockIdx.x")
        # 2-3. The window into shared memory, both statistics over it.
        staged = window_and_statistics(sch, problem, knobs)
        # 4. The gradient from the window, one element a lane a step.
        grad_map(sch, 1, knobs.threads, 1, knobs.unroll, staged=staged)
        # 5. lse and the row loss on thread 0.
        for name in ("lse", row_loss_name(problem)):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, knobs.threads)


def window_and_statistics(sch, problem: CrossEntropyGradProblem, knobs) -> str:
    """Steps 2-3 of the window candidates, under the row loop bound to ``blockIdx.x``:
    the window copied into dynamic shared memory (a 16-byte ``cp.async`` per granule), then ``row_max`` and ``row_sumexp`` over it, 16 bytes a lane a step,
    kept in every thread's registers. Returns the window's buffer name in shared
    memory (what the map stages from)."""
    c = granule(problem.dtype)
    window = sch.get_sblock("window")
    outputs_to(sch, window, "shared.dyn")
    staged = sch.get(window).writes[0].source.name  # the buffer's name in its new scope
    _, serial, vec = lanes_split(sch, window, 1, knobs.threads, c, knobs.unroll)
    sch.vectorize(vec)
    async_copy.mark(sch, serial)  # cp.async (tvm_fusion.async_copy)
    for name in ("row_max", "row_sumexp"):
        block = sch.get_sblock(name)
        thread_reduce(sch, block, 1, knobs.threads, c, knobs.unroll, staged)
        outputs_to(sch, block, "local")
    return staged
