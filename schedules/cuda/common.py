"""CUDA steps shared by the candidates of one operator."""

from __future__ import annotations

from tvm import s_tir

from ..common import outputs_to, single_thread

MAX_THREADS = 1024
VECTOR_BYTES = 16  # one 128-bit load (LDG.E.128) per lane


def vector_choices(elem_bytes: int, contiguous: int) -> list[int]:
    """Vector widths up to 16 bytes that divide the contiguous run (so every vector
    is aligned and in bounds); 1 only when no wider one does (a unit loop changes
    the loop structure, which a tuning trace replayed with another decision cannot
    follow)."""
    widths = []
    width = 2
    while width * elem_bytes <= VECTOR_BYTES:
        if contiguous % width == 0:
            widths.append(width)
        width *= 2
    return widths or [1]


def schedule_ce_batch_stage(sch: s_tir.Schedule, reduction: str, threads: int = MAX_THREADS) -> None:
    """Second kernel of cross entropy: one block sums the row losses and weights and
    finds the first bad target, each thread striding over rows, then a warp-shuffle
    reduction; thread 0 writes ``loss`` and ``first_bad_row``."""
    stage = "first_bad_row" if reduction == "none" else "batch"
    block = sch.get_sblock(stage)
    unit, rows = sch.get_loops(block)
    sch.bind(unit, "blockIdx.x")
    serial, lane = sch.split(rows, [None, threads])
    sch.reorder(lane, serial)
    sch.bind(lane, "threadIdx.x")
    if reduction == "none":
        return
    outputs_to(sch, block, "shared")
    for name in ("first_bad_row", "loss"):
        epilogue = sch.get_sblock(name)
        sch.reverse_compute_at(epilogue, unit)
        single_thread(sch, epilogue, threads)
