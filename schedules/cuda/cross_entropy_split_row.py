"""Few rows: each row's online pass split across ``splits`` blocks, one launch.

Pattern ``x(SSR) -> chunk (max, sumexp)(SS) -> part (max, sumexp)(SS) | (max, sumexp)(S)
-> row_loss(S) -> loss``: the ``split_online`` decomposition (``online`` over chunks
padded to a multiple of 64, the padding masked) with its chunk reduction cut by an
rfactor into exact parts. Kernel 1, grid (B x splits): block ``(i, s)`` walks part ``s`` of row
``i``'s 16-byte chunks as ``cross_entropy_online`` walks a whole row (a 16-byte load a
chunk into registers, the chunk's max and exps there, lanes combined by the online rule
through shuffles) and writes the part's pair. Kernel 2, one block: a lane a row folds
the row's ``splits`` pairs by the same rule and writes the row loss; kernel 3, one
block: the batch. ``single_launch`` joins kernels 2 and 3 (one block each: a barrier
between them) and hands them to kernel 1's last block: one launch.

Why: with fewer rows than SMs a block a row leaves SMs idle, and one SM pulls a row at
a fraction of the device's bandwidth. H200, CE 128x32000 fp16 (8.2 MB): 0.0078 ms
under graph replay for ``cross_entropy_online`` at 1024 lanes, a block a row on 128 of
132 SMs, against 0.0019 ms of copy at 4.2 TB/s (README results, rows of
results/benchmarks.csv); 4x50257 fp16 (0.4 MB) took 7.1 us, 1x32000 fp32 6.0 us (rows
"heuristic default" of the held-out grids, 2026-12-04), where issue 14 asks 1.5x an
empty launch (about 1.3 us) under 1 MB. Cut into ``splits`` parts the same rows keep
``B x splits`` blocks busy, each part read by one block at an SM's rate.

Predicted: 128x32000 fp16 at 4 parts (512 blocks, 16 KB each) about 0.004 ms (the
read at 60% of copy plus a launch); 4x50257 fp16 at 32 parts (128 blocks) about 2-3 us.

Measured before ``split_online`` (H100, copy 3018 GB/s, rows "probe: split_row A/B" of
results/benchmarks.csv, 2026-12-06T02:08Z): wrong losses wherever the parts did not divide
the chunks; the prediction above missed on 128x32000 (16 parts 13.6 us, 32 parts 19.2).

Measured with ``split_online`` (H100, copy 3041 GB/s, empty launch 0.92 us, graph replay,
the same rows at 2026-12-06T04:12-04:13Z, 52a6bda; every configuration of 2 to 64 parts checked
against float64 on NaN-poisoned outputs first: none wrong), us:

=====================  ==================  ==========================  ================
shape (row bytes)      dispatch then       split_row, parts: us        parts ~32 KiB
=====================  ==================  ==========================  ================
CE 16x128256 bf16      10.62 (online)      4: 9.75, 8: 7.73, 16: 8.24  8: **7.73**
(250 KiB)
CE 64x151936 bf16      17.73 (online)      4: 17.09, 8: 14.51,         8: **14.51**
(297 KiB)                                  16: 16.38
CE 32x256000 bf16      24.82 (online)      8: 15.96, 16: 14.95,        16: **14.95**
(500 KiB)                                  32: 16.47
CE 8x256000 bf16       24.74 (block a row) 8: 10.20, 16: 9.11,         16: **9.11**
(500 KiB)                                  32: 9.51
CE 128x151936 bf16     20.19 (online)      4: 21.34, 8: 21.38          loses (128 rows)
CE 128x32000 fp16      8.01 (online)       2: 9.52, 4: 8.87            loses
CE 4x50257 fp16        7.07 (aligned)      4: 7.89, 8: 6.55, 16: 6.93  (98 KiB row)
CE 1x32000 fp32        4.53 (block a row)  8: 5.82, 16: 5.51           loses (125 KiB)
=====================  ==================  ==========================  ================

So a part wants about 32 KiB (``PART_BYTES``): the best split on every row of 250 KiB and
more, 8 to 16 parts. Dispatch prefers it from rows of 240 KiB for at most ``sm_count / 2`` rows
(``prefers``): 18-63% faster on the four such shapes; with 128 rows a block a row
already fills the SMs (128x151936 loses 6%), and on shorter rows the fold in the
last block costs about what the split saves (4x50257: 7% faster at 8 parts, 12% slower
at 4; 1x32000 fp32 slower at every split). The shipped cost model was trained before
this candidate and cannot rank it, so dispatch takes this pick over the model's
(``dispatch._choose``).

Measured as dispatched (H100, copy 3006 GB/s, rows "probe: split_row dispatch" of
results/benchmarks.csv, 2026-12-06T04:45Z, 943b522; each kernel checked against float64
first), us under graph replay, dispatch against the cost model's pick (what dispatch
took without this rule), then the user's call ``tvm_fusion.cross_entropy`` back to back:

=====================  ==========  ===============  ======================================
shape                  split_row   cost model pick  call (check_targets False / True)
=====================  ==========  ===============  ======================================
CE 16x128256 bf16      7.61        13.02            10.67 / 12.23
CE 64x151936 bf16      14.95       17.77            16.39 / 16.43
CE 32x256000 bf16      14.48       24.79            16.62 / 16.54
CE 8x256000 bf16       9.05        24.26            14.24 / 12.33
CE 1x128256 fp32       6.77        13.28            10.79 / 12.24
CE 66x128256 bf16      13.41       15.78            14.98 / 14.91
CE 32x151936 fp16      12.26       16.29            13.78 / 13.85
CE 2x256000 bf16       7.54        23.46            10.74 / 12.36
=====================  ==========  ===============  ======================================

Faster on all eight, 1.2x to 3.1x. Where the kernel takes under 10 us the call takes
about 3 us more (the host's share). The model's pick is the one at 943b522; since
1107603 it picks the same on seven of them, and on 16x128256
``cross_entropy_block_per_row`` at 1024 threads, vector 8, unroll 64 (not timed here).
Not measured on an H200.

Medium rows. A grid over every candidate's knobs on five inputs under 1 MB (H100, rows
"probe: small-input knob grid", 2026-12-06T08:45-08:53Z) found split_row's best on few rows
of 62-250 KiB faster than dispatch's pick, with parts of 8-16 KiB, not 32. Timed then on
twelve shapes (H100, copy 3040 GB/s, rows "probe: split_row on few rows of 64-240 KiB",
2026-12-06T09:05Z, 9a2a64e; each kernel checked against float64 first), us under graph
replay, mean; in bold what dispatch picks now:

=====================  ===================  ===========  ===========  =============
shape (row)            dispatch then        parts ~16    parts ~32    parts ~8 KiB
                                            KiB          KiB
=====================  ===================  ===========  ===========  =============
4x50257 bf16 (98)      7.16 (aligned rows)  **6.18**     6.44         6.08
8x32000 fp16 (62.5)    5.98 (block a row)   **5.31**     6.20         5.37
16x50257 bf16 (98)     7.55 (aligned rows)  **6.50**     6.81         7.37
32x32000 fp16 (62.5)   6.13 (block a row)   **5.55**     6.34         6.08
8x65536 fp16 (128)     7.84 (block a row)   **5.47**     5.54         6.91
16x100000 fp16 (195)   10.40 (block a row)  **7.89**     7.22         11.27
2x32000 fp32 (125)     6.11 (block a row)   **5.09**     5.82         5.25
2x65536 bf16 (128)     7.82 (block a row)   **4.73**     5.23         5.15
48x32000 bf16 (62.5)   6.40 (block a row)   **5.71**     6.50         6.47
64x50257 bf16 (98)     **8.43** (aligned)   9.69         9.22         11.64
1x50257 fp32 (196)     6.47 (aligned rows)  5.61         5.91         5.95
1x32000 fp16 (62.5)    **4.29** (block)     4.90         5.98         4.51
=====================  ===================  ===========  ===========  =============

So dispatch also prefers it for 2 to 49 rows (``MEDIUM_ROWS_AN_SM`` of 132 SMs) of 60 KiB
to 240 KiB, in parts of about 16 KiB (``MEDIUM_PART_BYTES``): 9-40% less time on the nine
such shapes above; 64 rows lose (a block a row nearly fills the SMs), and so does one
row of 62.5 KiB, where the fold costs more than the split saves (one row of 196 KiB
fp32 won, but one row of 125 KiB lost in the table before: one row stays out). It comes
first in dispatch order so that it also displaces ``cross_entropy_aligned_rows`` (odd
rows). Inputs under 1 MB stay 4-7x an empty launch (0.92 us) at best: a kernel that
reads, reduces a row across blocks and folds the batch in its last block has a chain of
dependent steps that an empty kernel does not.

Applies to cross entropy (any reduction, weight and smoothing: the parts carry the
online decomposition's extra sums) of at most ``MAX_ROWS`` rows, about two an SM, where
a block a row stops filling the GPU; the fold runs a row a lane of one block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.compute.cross_entropy import SPLIT_GRAIN
from tvm_fusion.compute.primitives import granule
from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import sm_count

from ..common import lane_steps, outputs_to, unroll
from .common import chunks_at, schedule_ce_batch_stage

ALGORITHM = "split_online"  # online over chunks padded to a multiple of 64: exact parts
# Past about two rows an SM the row candidates fill the GPU (cross_entropy_online is
# preferred from 2 x 132 rows on an H200); the fold runs a row a lane of one block.
MAX_ROWS = 512
SPLITS = [2 ** k for k in range(1, SPLIT_GRAIN.bit_length())]  # 2 to 64: each divides the padded chunks
PART_BYTES = 32 * 1024  # the default's part: the best split of every row of 250 KiB and more (docstring)
PREFERRED_ROW_BYTES = 240 * 1024  # dispatch prefers it from rows of 240 KiB (128256 bf16: 250.5) ...
ROWS_AN_SM = 0.5  # ... for at most half a row an SM (66 rows on 132 SMs)
# Medium rows (docstring, "Medium rows"): from 60 KiB (32000 fp16: 62.5) to PREFERRED_ROW_BYTES,
# at least two rows and at most 0.375 a SM (49 of 132: 48x32000 won, 64x50257 lost), in parts
# of about 16 KiB.
MEDIUM_ROW_BYTES = 60 * 1024
MEDIUM_ROWS_AN_SM = 0.375
MEDIUM_PART_BYTES = 16 * 1024


@dataclass(frozen=True)
class SplitRowKnobs(Knobs):
    splits: int = 8
    threads: int = 256
    unroll: int = 16


@register
class CrossEntropySplitRow(Candidate):
    name = "cross_entropy_split_row"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = ALGORITHM
    knobs = SplitRowKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        return problem.op == self.op and problem.batch <= MAX_ROWS and self.chunks(problem) >= 2 * SPLITS[0]

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        # H100, 2026-12-06 (docstring): 18-63% faster on 8 to 64 rows of 250-500 KiB, and
        # 9-40% less time on 2 to 48 rows of 60-240 KiB.
        rows, row = problem.batch, self.row_bytes(problem)
        if row >= PREFERRED_ROW_BYTES:
            return rows <= ROWS_AN_SM * sm_count(target)
        return row >= MEDIUM_ROW_BYTES and 2 <= rows <= MEDIUM_ROWS_AN_SM * sm_count(target)

    @staticmethod
    def row_bytes(problem: CrossEntropyProblem) -> int:
        return problem.classes * DTYPE_BYTES[problem.dtype]

    @staticmethod
    def chunks(problem: CrossEntropyProblem) -> int:
        """16-byte chunks a row."""
        return -(-problem.classes // granule(problem.dtype))

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        splits = [s for s in SPLITS if 2 * s <= self.chunks(problem)]
        return {"splits": splits, "threads": [128, 256, 512], "unroll": [4, 16]}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> SplitRowKnobs:
        # The split whose parts are nearest PART_BYTES (MEDIUM_PART_BYTES on rows under
        # PREFERRED_ROW_BYTES), nearest by ratio (log2).
        splits = self.choices(problem, target)["splits"]
        row = self.row_bytes(problem)
        wanted = math.log2(max(1.0, row / (PART_BYTES if row >= PREFERRED_ROW_BYTES else MEDIUM_PART_BYTES)))
        split = min(splits, key=lambda s: (abs(math.log2(s) - wanted), s))
        per_part = -(-self.chunks(problem) // split)
        threads = 128 if per_part <= 256 else 256
        return SplitRowKnobs(splits=split, threads=threads, unroll=16)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        threads = knobs.threads
        # Kernel 1: a block a (row, part), its chunks across the lanes.
        online = sch.get_sblock("row_online")
        _, chunk = sch.get_loops(online)
        part, within = sch.split(chunk, [knobs.splits, None])
        partial = sch.rfactor(part, 0)
        row, part, within = sch.get_loops(partial)[:3]
        sch.bind(sch.fuse(row, part), "blockIdx.x")
        serial, at, _ = lane_steps(sch, within, threads)
        unroll(sch, serial, knobs.unroll)
        chunks_at(sch, at)
        # Kernel 2, one block: a lane a row folds the row's parts and writes its loss.
        online = sch.get_sblock("row_online")
        row, _ = sch.get_loops(online)
        sch.bind(sch.add_unit_loop(row), "blockIdx.x")
        serial_rows, _, _ = lane_steps(sch, row, threads)
        outputs_to(sch, online, "local")
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        sch.reverse_compute_at(epilogue, serial_rows)
        # Kernel 3, one block of the same lanes: the batch (the targets' check for "none").
        schedule_ce_batch_stage(sch, problem, threads)
