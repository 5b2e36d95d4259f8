"""How the bench and the tuner time things: CUDA graph replay of kernel launches,
user calls issued back to back, ``time.perf_counter`` on the CPU, and the ceilings
(device copy, an empty launch) the results are read against.

Only timing lives here, so the tuner's runner and ``tvm-fusion bench`` share one
method without the tuner importing the bench. :class:`DeviceTiming` picks one device's
methods for the training benches, which run on either.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import targets

# Rotate inputs so a timed set never fits in L2: argument copies filling this many L2s.
ROTATION_L2S = 4
MAX_COPIES = 32
# A timed loop of calls lasts about this long, so the events' own cost stays small.
LOOP_MS = 3.0
MAX_PER_LOOP = 500


def copies_for(nbytes: int, target: Any = None) -> int:
    """Argument sets to cycle through on the GPU so that ``nbytes`` a launch are read
    from HBM, not from a warm L2 (of ``target``, default the ``"cuda"`` target)."""
    rotation = ROTATION_L2S * targets.l2_bytes("cuda" if target is None else target)
    return max(1, min(MAX_COPIES, math.ceil(rotation / max(nbytes, 1))))


def _per_loop(rough_ms: float, sets: int) -> int:
    """Calls per timed loop: about LOOP_MS of them, a whole number of input rotations."""
    count = int(min(max(LOOP_MS / rough_ms, sets), MAX_PER_LOOP))
    return max(sets, count - count % sets)


def _rough_ms_gpu(run: Callable[[], Any]) -> float:
    """One warm-up call (module load, autotuners, torch.compile, allocator caches),
    then one call timed with events: the size of the loops to come."""
    import torch

    run()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return max(start.elapsed_time(stop), 1e-3)


def time_gpu(launches: list[Callable[[], None]], repeats: int = 15, per_graph: int = 0,
             graphable: bool = True) -> tuple[float, str]:
    """Median ms of one launch: CUDA graph replay of many launches timed with events;
    falls back to timing a loop of launches when capture is not possible.

    A graph holds enough launches (cycling over the rotated inputs) for a replay to
    last about 3 ms, so the replay's own overhead stays under a few percent."""
    import torch
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        rough = _rough_ms_gpu(launches[0])
        if rough > 2.0:  # slow (a peer's fallback schedule): a few launches are enough
            launches, repeats = launches[:3], 3
        for launch in launches:
            launch()
        torch.cuda.synchronize()
    if not per_graph:
        per_graph = _per_loop(rough, len(launches))
    if rough * per_graph > 50:
        repeats = min(repeats, 5)
    try:
        if not graphable:
            raise RuntimeError("not capturable")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with tvm_ffi.use_torch_stream(torch.cuda.graph(graph, stream=stream)):
                for i in range(per_graph):
                    launches[i % len(launches)]()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        run, count, method = graph.replay, per_graph, "graph"
    except Exception:  # noqa: BLE001 - e.g. a peer that allocates while capturing
        torch.cuda.synchronize()
        count, method = per_graph, "loop"

        def run():
            with tvm_ffi.use_torch_stream():
                for i in range(count):
                    launches[i % len(launches)]()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / count)
    return statistics.median(times), method


def time_calls_gpu(calls: list[Callable[[], Any]], repeats: int = 7) -> tuple[float, str]:
    """Median ms of one user call on the GPU, issued back to back as a training loop
    issues them: CUDA events around a loop of calls cycling over the rotated inputs,
    no graph, so the host's work per call (argument checks, dispatch, allocation, any
    sync) counts as it does for the caller whenever it outlasts the kernel. Calls run
    on torch's current stream, as the caller's code does."""
    import torch

    rough = _rough_ms_gpu(calls[0])
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if rough > 2.0:
        calls, repeats = calls[:3], min(repeats, 3)
    count = _per_loop(rough, len(calls))
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start.record()
        for i in range(count):
            calls[i % len(calls)]()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / count)
    return statistics.median(times), "api loop"


def time_cpu(run: Callable[[], None], repeats: int = 5) -> tuple[float, str]:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), "perf_counter"


def time_calls_cpu(calls: list[Callable[[], Any]], repeats: int = 5) -> tuple[float, str]:
    """Median ms of one user call on the CPU: ``time.perf_counter`` around a loop of
    calls back to back (about LOOP_MS of them; one call when a call is longer)."""
    calls[0]()
    start = time.perf_counter()
    calls[0]()
    rough = max((time.perf_counter() - start) * 1e3, 1e-3)
    count = _per_loop(rough, len(calls))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            calls[i % len(calls)]()
        times.append((time.perf_counter() - start) * 1e3 / count)
    return statistics.median(times), "api perf_counter"


def copy_bandwidth_gpu(nbytes: int = 4 * 2**30) -> float:
    """Device-to-device copy by the SMs, bytes read plus written per second (GB/s).

    A copy kernel (``torch.mul(src, 1, out=dst)``), timed in a loop: ``copy_`` inside
    a CUDA graph becomes a memcpy node served by the copy engines, which reached only
    2710 GB/s on the H200 (2026-11-29 run) against about 4.2 TB/s by the SMs. The GPU
    idles at low clocks; half a second of copies first lets them ramp."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:
        torch.mul(src, 1.0, out=dst)
        torch.cuda.synchronize()
    ms, _ = time_gpu([lambda: torch.mul(src, 1.0, out=dst)], repeats=10, per_graph=10, graphable=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth_cpu(nbytes: int = 512 * 2**20) -> float:
    src = np.random.default_rng().random(nbytes // 8)
    dst = np.empty_like(src)
    ms, _ = time_cpu(lambda: np.copyto(dst, src), repeats=5)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def empty_launch_gpu() -> float:
    """One empty kernel launch, timed like the others (the floor for small inputs)."""
    import tvm
    from tvm import s_tir, te

    a = te.placeholder((1,), "float32", name="a")
    b = te.compute((1,), lambda i: a[i], name="b")
    sch = s_tir.Schedule(te.create_prim_func([a, b]))
    (loop,) = sch.get_loops(sch.get_sblock("b"))
    sch.bind(loop, "threadIdx.x")
    ex = tvm.compile(sch.mod, target=targets.resolve("cuda"))
    dev = tvm.cuda(0)
    x, y = tvm.runtime.empty((1,), "float32", dev), tvm.runtime.empty((1,), "float32", dev)
    func = ex["main"]
    ms, _ = time_gpu([lambda: func(x, y)], repeats=20, per_graph=100)
    return ms


@dataclasses.dataclass(frozen=True)
class DeviceTiming:
    """One device's methods, for the benches that run on either (``bench_train``,
    ``bench_bn``): kernels alone, the user's calls back to back, the copy ceiling,
    how many rotated input sets, and waiting for and freeing device memory.

    On the GPU: graph replay (``time_gpu``), CUDA events around a loop of calls
    (``time_calls_gpu``), inputs rotated past the L2. On the CPU: ``time_cpu`` and
    ``time_calls_cpu`` (``time.perf_counter``), one input set as ``tvm-fusion bench``
    has there (the CPU cases move more bytes than a last-level cache holds), nothing
    to wait for."""

    device: str  # torch's device type: "cuda" or "cpu"

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"DeviceTiming: device must be 'cuda' or 'cpu', got {self.device!r}")

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def kernels(self, launches: list[Callable[[], None]]) -> tuple[float, str]:
        return time_gpu(launches) if self.on_gpu else time_cpu(launches[0])

    def calls(self, calls: list[Callable[[], Any]]) -> tuple[float, str]:
        return time_calls_gpu(calls) if self.on_gpu else time_calls_cpu(calls)

    def copy_bandwidth(self) -> float:
        return copy_bandwidth_gpu() if self.on_gpu else copy_bandwidth_cpu()

    def input_sets(self, nbytes: int) -> int:
        """Argument sets to cycle through when a call reads ``nbytes``."""
        return max(1, copies_for(nbytes)) if self.on_gpu else 1

    def synchronize(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def release(self) -> None:
        """Hand freed memory back (torch's CUDA cache); nothing to do on the CPU."""
        if self.on_gpu:
            import torch

            torch.cuda.empty_cache()
