"""Kernel level: the schedule candidates, one module and one class each, by target.

Importing this package registers every candidate. ``DISPATCH_ORDER`` is the one
place that says, per (operator, target kind), in which order candidates are
tried when there is no tuning record: most specific first, fallback last.
"""

from .cpu import bn_stats_parallel, cross_entropy_parallel  # noqa: F401
from .cuda import bn_stats_block_per_channel, cross_entropy_block_per_row  # noqa: F401

DISPATCH_ORDER = {
    ("bn_stats", "cuda"): [
        "bn_stats_block_per_channel",
    ],
    ("cross_entropy", "cuda"): [
        "cross_entropy_block_per_row",
    ],
    ("bn_stats", "llvm"): [
        "bn_stats_parallel",
    ],
    ("cross_entropy", "llvm"): [
        "cross_entropy_parallel",
    ],
}
