"""What SyncBatchNorm's collectives cost: bytes per layer, a fitted latency-bandwidth model.

Per BatchNorm layer of C channels and training step, on a group of ``world`` ranks
(``tvm_fusion.torch.SyncBatchNorm``):

- forward, one ``all_gather`` of (count, mean[C], M2[C]): the gathered table,
  ``world * (2C + 1) * 4`` bytes, lands on every rank;
- backward, one ``all_reduce`` (sum) of (sum dy[C], sum dy * xhat[C]): ``2C * 4``
  bytes a rank.

Each collective kind costs ``time = latency + bytes / bandwidth`` (``Cost``), the two
numbers fitted by least squares to collectives timed in an initialized group
(``measure``, ``fit``; ``measure_on_host`` spawns the group on this host). The
buffers of real layers are a few kilobytes, so the latency term is nearly all of
it: the overhead of SyncBN is the count of its collectives, two per layer and step,
each a synchronization of every rank. The latency is the fitted group's (a ring
all_gather takes world - 1 steps): fit with the world size predicted for where the
host has the processes for it.

``DEFAULT_COSTS`` holds a fit made with Gloo on the 2-core CI machine (the numbers an
estimate falls back on without ``--fit``; a GPU host's NCCL numbers differ and must
be fitted there): 0.6 to 1.3 ms a collective, whatever its size up to tens of
kilobytes. On that machine single measurements scatter by a factor of two or more
either side of the fit (below), so read the defaults as an order of magnitude.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

KINDS = ("all_gather", "all_reduce")
FLOAT32 = 4
SIZES = tuple(2**k for k in range(4, 19, 2))  # float32 elements a rank: 64 B .. 1 MiB


@dataclasses.dataclass(frozen=True)
class Cost:
    """``time = latency_s + bytes / bandwidth`` (bytes per second) for one collective kind."""

    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


# Gloo, two processes on the 2-core CI machine, 2026-12-01T21:33Z (results/benchmarks.csv,
# ops syncbn_all_gather / syncbn_all_reduce): measure_on_host(2, "gloo"), 64 B to 2 MiB
# received a rank, each size the median of 11 batches of 20 calls, one least-squares
# fit a kind. On those 2 cores the time of a small collective is scheduling noise: the
# fitted points sat -33% to +88% from the line, and the held-out sizes of real layers
# (C = 64 to 512: 0.5 to 8 KB) measured 0.24 to 1.6 ms against the line's 0.60 (gather)
# and 1.28 ms (reduce), -32% to +145%. Read these as an order of magnitude only.
DEFAULT_COSTS = {
    "all_gather": Cost(latency_s=597e-6, bandwidth=1.24e9),
    "all_reduce": Cost(latency_s=1281e-6, bandwidth=0.72e9),
}
DEFAULT_SOURCE = "the stored fit (Gloo, 2 processes on the 2-core CI machine)"


def collective_bytes(channels: int, world_size: int) -> dict[str, int]:
    """Bytes each rank receives per layer and step: the forward's gathered table and
    the backward's reduced pair."""
    return {"all_gather": world_size * (2 * channels + 1) * FLOAT32, "all_reduce": 2 * channels * FLOAT32}


NEGLIGIBLE_SLOPE = 1e-9  # a bytes term below this share of the measured times is no bandwidth term


def fit(nbytes: Any, seconds: Any) -> Cost:
    """Least-squares ``latency + bytes / bandwidth`` through measured (bytes, seconds)
    pairs; a slope of 0 or less (times that do not grow with the bytes) is an
    infinite bandwidth, and so is a slope whose bytes term is rounding
    (``NEGLIGIBLE_SLOPE`` of the times at the largest size): flat times fit a slope of
    9.4e-24 s a byte with one LAPACK build (AMD EPYC, numpy 2.4.6) and exactly 0 with
    another."""
    x, t = np.asarray(nbytes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1 or len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError(f"fit: needs matching 1-D sizes and times with two sizes at least, got {x.shape} "
                         f"sizes and {t.shape} times")
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), t, rcond=None)
    if per_byte * x.max() <= NEGLIGIBLE_SLOPE * np.abs(t).max():
        return Cost(float(latency), float("inf"))
    return Cost(float(latency), float(1.0 / per_byte))


# -- measuring ----------------------------------------------------------------------------
def measure(group: Any = None, sizes: tuple[int, ...] = SIZES, calls: int = 20, batches: int = 11
            ) -> dict[str, list[tuple[int, float]]]:
    """Per kind, ``(bytes received a rank, seconds a call)`` at each size (float32
    elements a rank) in the initialized ``group``: the median of ``batches`` batches
    of ``calls`` back-to-back calls, every batch started at a barrier (the slowest
    rank's arrival is in the time, as in training). Call it on every rank."""
    import torch
    import torch.distributed as dist

    from .sync_batch_norm import _ALL_GATHER

    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    found: dict[str, list[tuple[int, float]]] = {kind: [] for kind in KINDS}
    for size in sizes:
        buffer = torch.ones(size, device=device)
        table = buffer.new_empty(world * size)
        calls_of = {"all_gather": lambda: _ALL_GATHER(table, buffer, group=group),
                    "all_reduce": lambda: dist.all_reduce(buffer, group=group)}
        for kind, call in calls_of.items():
            call()  # warm up: connections, buffers
            per_call = []
            for _ in range(batches):
                dist.barrier(group)
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                sync()
                per_call.append((time.perf_counter() - start) / calls)
            nbytes = world * size * FLOAT32 if kind == "all_gather" else size * FLOAT32
            found[kind].append((nbytes, statistics.median(per_call)))
    return found


def fit_measured(found: dict[str, list[tuple[int, float]]]) -> dict[str, Cost]:
    return {kind: fit([b for b, _ in pairs], [s for _, s in pairs]) for kind, pairs in found.items()}


def _measure_rank(rank: int, world_size: int, sizes: tuple[int, ...]) -> dict[str, list[tuple[int, float]]]:
    return measure(sizes=sizes)


def default_backend() -> str:
    """NCCL where torch sees CUDA GPUs, else Gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def local_ranks(backend: str) -> int:
    """Processes a fit may start on this host: one a GPU for NCCL, one a core (two at
    least) for Gloo."""
    import os

    if backend == "nccl":
        import torch

        return max(1, torch.cuda.device_count())
    return max(2, os.cpu_count() or 2)


def measure_on_host(world_size: int, backend: str = "gloo", sizes: tuple[int, ...] = SIZES,
                    timeout: float = 300.0) -> tuple[dict[str, Cost], dict[str, list[tuple[int, float]]]]:
    """Spawn ``world_size`` processes on this host (``backend`` "gloo" or "nccl"),
    time the collectives and fit them: ``(costs, rank 0's measurements)``."""
    from . import processes

    found = processes.run(_measure_rank, world_size, backend, (tuple(sizes),), timeout)[0]
    return fit_measured(found), found


# -- a model's overhead -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerCost:
    name: str
    channels: int
    forward_bytes: int
    forward_s: float
    backward_bytes: int
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def bn_layers(model: Any) -> list[tuple[str, int]]:
    """``(name, channels)`` of every BatchNorm layer of a torch module, in order."""
    from torch import nn

    return [(name, module.num_features) for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def predict(layers: list[tuple[str, int]], world_size: int, costs: dict[str, Cost] | None = None) -> list[LayerCost]:
    """Each layer's SyncBN collectives per training step on ``world_size`` ranks:
    bytes and modelled seconds, forward and backward."""
    costs = costs or DEFAULT_COSTS
    rows = []
    for name, channels in layers:
        nbytes = collective_bytes(channels, world_size)
        rows.append(LayerCost(name, channels, nbytes["all_gather"], costs["all_gather"].seconds(nbytes["all_gather"]),
                              nbytes["all_reduce"], costs["all_reduce"].seconds(nbytes["all_reduce"])))
    return rows


def model_layers(name: str, width: int = 64) -> list[tuple[str, int]]:
    """The BatchNorm layers of a built-in model: "resnet-small", the small ResNet of
    ``tvm_fusion.relax.model`` at ``width`` channels."""
    if name != "resnet-small":
        raise ValueError(f"syncbn-cost: model must be 'resnet-small', got {name!r}")
    from ..relax.model import small_resnet

    return bn_layers(small_resnet(width=width))


def table(rows: list[LayerCost], world_size: int, costs: dict[str, Cost], source: str = DEFAULT_SOURCE) -> str:
    """The per-layer table and the total, as the CLI prints it; ``source`` says where
    the costs come from."""
    lines = [f"SyncBatchNorm collectives per training step, world size {world_size}; costs: {source}",
             *(f"  {kind}: latency {c.latency_s * 1e6:.1f} us, bandwidth {c.bandwidth / 1e9:.3f} GB/s"
               for kind, c in costs.items()),
             f"{'layer':<24} {'C':>6} {'fwd bytes':>10} {'fwd us':>9} {'bwd bytes':>10} {'bwd us':>9} {'total us':>9}"]
    for r in rows:
        lines.append(f"{r.name:<24} {r.channels:>6} {r.forward_bytes:>10} {r.forward_s * 1e6:>9.1f} "
                     f"{r.backward_bytes:>10} {r.backward_s * 1e6:>9.1f} {r.total_s * 1e6:>9.1f}")
    total_bytes = sum(r.forward_bytes + r.backward_bytes for r in rows)
    lines.append(f"{'total':<24} {'':>6} {sum(r.forward_bytes for r in rows):>10} "
                 f"{sum(r.forward_s for r in rows) * 1e6:>9.1f} {sum(r.backward_bytes for r in rows):>10} "
                 f"{sum(r.backward_s for r in rows) * 1e6:>9.1f} {sum(r.total_s for r in rows) * 1e6:>9.1f}")
    lines.append(f"{2 * len(rows)} collectives, {total_bytes} bytes a rank per step")
    return "\n".join(lines)
