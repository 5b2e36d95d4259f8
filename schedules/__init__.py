"""Kernel level: the schedule candidates, one module and one class each, by target.

Importing this package registers every candidate. ``DISPATCH_ORDER`` is the one
place that says, per (operator, target kind), in which order candidates are
tried when there is no tuning record: most specific first, fallback last.
"""

from .cpu import (  # noqa: F401
    bn_backward_dx_parallel,
    bn_backward_parallel,
    bn_forward_parallel,
    bn_stats_parallel,
    cross_entropy_grad_from_lse_parallel,
    cross_entropy_grad_parallel,
    cross_entropy_parallel,
)
from .cuda import (  # noqa: F401
    bn_backward_block_per_channel,
    bn_backward_channels_last,
    bn_backward_cluster,
    bn_backward_cluster_rounds,
    bn_backward_dx_block_per_channel,
    bn_backward_dx_channels_last,
    bn_backward_grid_persistent,
    bn_backward_grid_pipelined,
    bn_backward_persistent,
    bn_backward_small_plane,
    bn_backward_split_plane,
    bn_backward_split_plane_runs,
    bn_forward_block_per_channel,
    bn_forward_channels_last,
    bn_forward_cluster,
    bn_forward_cluster_half,
    bn_forward_cluster_half_one_launch,
    bn_forward_cluster_quarter,
    bn_forward_cluster_rounds,
    bn_forward_grid_persistent,
    bn_forward_grid_pipelined,
    bn_forward_persistent,
    bn_forward_small_plane,
    bn_forward_split_plane,
    bn_forward_split_plane_runs,
    bn_stats_block_per_channel,
    bn_stats_block_per_channel_padded,
    bn_stats_channels_last,
    bn_stats_split_plane,
    bn_stats_warp_per_channel,
    cross_entropy_aligned_rows,
    cross_entropy_block_per_row,
    cross_entropy_grad_block_per_row,
    cross_entropy_grad_from_lse_block_per_row,
    cross_entropy_grad_from_lse_warp_per_row,
    cross_entropy_grad_granules_in_shared,
    cross_entropy_grad_head_in_shared,
    cross_entropy_grad_online,
    cross_entropy_grad_row_in_cluster,
    cross_entropy_grad_row_in_shared,
    cross_entropy_grad_row_targets,
    cross_entropy_grad_warp_per_row,
    cross_entropy_grad_warp_per_row_padded,
    cross_entropy_grad_window_in_shared,
    cross_entropy_online,
    cross_entropy_row_in_shared,
    cross_entropy_split_row,
    cross_entropy_warp_per_row,
    cross_entropy_warp_per_row_padded,
)

DISPATCH_ORDER = {
    ("bn_stats", "cuda"): [
        "bn_stats_channels_last",
        "bn_stats_block_per_channel_padded",
        "bn_stats_split_plane",
        "bn_stats_warp_per_channel",
        "bn_stats_block_per_channel",
    ],
    # split_row first: it prefers only few rows of 60 KiB and more, where it beat the
    # others' picks (its docstring), odd rows (aligned_rows) included.
    ("cross_entropy", "cuda"): [
        "cross_entropy_split_row",
        "cross_entropy_aligned_rows",
        "cross_entropy_warp_per_row_padded",
        "cross_entropy_warp_per_row",
        "cross_entropy_row_in_shared",
        "cross_entropy_online",
        "cross_entropy_block_per_row",
    ],
    # Each candidate computes one mode (problem.mode): fused or from_lse.
    ("cross_entropy_grad", "cuda"): [
        "cross_entropy_grad_granules_in_shared",
        "cross_entropy_grad_window_in_shared",
        "cross_entropy_grad_warp_per_row_padded",
        # each one-launch twin before its base: the same row kernel, prefers the same
        # shapes, a launch fewer (applies to batches of at most 1024 rows, mean and sum)
        "cross_entropy_grad_row_in_shared_targets",
        "cross_entropy_grad_row_in_shared",
        "cross_entropy_grad_warp_per_row",
        "cross_entropy_grad_row_in_cluster",
        "cross_entropy_grad_head_in_shared",
        "cross_entropy_grad_online",
        "cross_entropy_grad_row_targets",
        "cross_entropy_grad_block_per_row",
        "cross_entropy_grad_from_lse_warp_per_row",
        "cross_entropy_grad_from_lse_block_per_row",
    ],
    ("bn_stats", "llvm"): [
        "bn_stats_parallel",
    ],
    ("bn_backward", "llvm"): [
        "bn_backward_parallel",
    ],
    ("bn_backward_dx", "llvm"): [
        "bn_backward_dx_parallel",
    ],
    ("bn_forward", "llvm"): [
        "bn_forward_parallel",
        "bn_forward_eval_parallel",
    ],
    # The channels-last candidates take the (M, C) view, the others the (N, C, L) one.
    # A split-plane candidate's runs form first: it applies to even runs only, and was
    # the faster on each of the five shapes the H200 timed (its docstring).
    ("bn_backward", "cuda"): [
        "bn_backward_small_plane",
        "bn_backward_persistent",
        "bn_backward_grid_persistent",
        "bn_backward_grid_pipelined",
        "bn_backward_cluster",
        "bn_backward_cluster_rounds",
        "bn_backward_channels_last",
        "bn_backward_split_plane_runs",
        "bn_backward_split_plane",
        "bn_backward_block_per_channel",
    ],
    # SyncBatchNorm's dx: one candidate per view.
    ("bn_backward_dx", "cuda"): [
        "bn_backward_dx_channels_last",
        "bn_backward_dx_block_per_channel",
    ],
    ("bn_forward", "cuda"): [
        "bn_forward_small_plane",
        "bn_forward_persistent",
        "bn_forward_cluster_half_one_launch",
        "bn_forward_cluster_half",
        "bn_forward_grid_persistent",
        "bn_forward_grid_pipelined",
        "bn_forward_cluster",
        "bn_forward_cluster_quarter",
        "bn_forward_cluster_rounds",
        "bn_forward_channels_last",
        "bn_forward_eval_channels_last",
        "bn_forward_split_plane_runs",
        "bn_forward_split_plane",
        "bn_forward_block_per_channel",
        "bn_forward_eval_block_per_channel",
    ],
    ("cross_entropy", "llvm"): [
        "cross_entropy_parallel",
    ],
    # Each candidate computes one mode (problem.mode): fused or from_lse.
    ("cross_entropy_grad", "llvm"): [
        "cross_entropy_grad_parallel",
        "cross_entropy_grad_from_lse_parallel",
    ],
}
