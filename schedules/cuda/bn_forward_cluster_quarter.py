"""BatchNorm's training forward in thread-block clusters of parts of a quarter of the
bytes: up to four blocks an SM, x read once.

Pattern: ``bn_forward_cluster``'s on the ``shifted_quarter_parts`` decomposition: parts
of at most 50 KB, P about four times ``bn_forward_cluster``'s and at most 8 (64x256x56x56
16-bit: 401 KB a channel, P = 8; fp32 would take 16). Default lanes a quarter of its
(224: ``ClusterParts.lane_share``), the same bytes a lane.

Why: ``bn_forward_cluster_half``'s reason, one step further: four blocks an SM.

Measured (H100, 2026-12-05T18:48Z, rows "probe: cluster BatchNorm, smaller parts";
registered there as ``probe_bn_forward_cluster_quarter``), ms, 224 and 448 lanes
against ``bn_forward_cluster_half``'s 448 and 896 in the same run: 64x256x56x56 fp16
0.0891 and 0.0924 against 0.0892 and 0.0878; bf16 0.0900 and 0.0884 against 0.0921 and
0.0911 (grid-wide 0.0982). The fastest forward measured on bf16, not on fp16: the tuner
chooses it per shape, dispatch does not prefer it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_cluster import BNForwardCluster


@register
class BNForwardClusterQuarter(BNForwardCluster):
    name = "bn_forward_cluster_quarter"
    algorithm = "shifted_quarter_parts"
    lane_share = 4
