"""A process group on this host: ``world_size`` spawned processes, one function each.

``run(fn, world_size)`` starts the processes (``spawn``: a fresh interpreter each, as
CUDA needs), joins them into a ``torch.distributed`` group through a file store
(no TCP port to choose), calls ``fn(rank, world_size, *args)`` in each and returns
the ranks' results in rank order. It never hangs: the first rank that fails ends
the others (they would wait in a collective forever) and its traceback is raised;
past ``timeout`` seconds every process still running is terminated and a
``TimeoutError`` names them. ``fn`` must be importable by name (a module-level
function). SyncBatchNorm's tests and the collectives' cost fit run through it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

POLL_S = 0.05
GRACE_S = 2.0  # for the other ranks to report once one has failed


def run(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: tuple = (),
        timeout: float = 120.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process of one
    group (``backend`` "gloo", or "nccl" with rank r on GPU r)."""
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run: world_size must be a positive int, got {world_size!r}")
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tvm_fusion_group_") as folder:
        store = os.path.join(folder, "store")
        outputs = [os.path.join(folder, f"rank{rank}.pt") for rank in range(world_size)]
        procs = [context.Process(target=_rank_main, args=(fn, rank, world_size, backend, store, outputs[rank], args),
                                 daemon=True) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            _wait(procs, outputs, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                proc.join(5)
        return [_load(path)[1] for path in outputs]


def _wait(procs: list, outputs: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and not any(p.exitcode not in (None, 0) for p in procs):
        if time.monotonic() > deadline:
            running = [rank for rank, p in enumerate(procs) if p.is_alive()]
            raise TimeoutError(f"ranks {running} of {len(procs)} still running after {timeout:.0f} s "
                               "(a collective that some rank never joined?): terminated")
        time.sleep(POLL_S)
    # A failure makes its peers fail in their next collective: let them report too,
    # so that the first cause is among the tracebacks.
    grace = time.monotonic() + GRACE_S
    while any(p.is_alive() for p in procs) and time.monotonic() < grace:
        time.sleep(POLL_S)
    failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if failed:
        reports = "\n".join(f"rank {rank} (exit code {procs[rank].exitcode}):\n{_failure(outputs[rank])}"
                            for rank in failed)
        raise RuntimeError(f"ranks {failed} of {len(procs)} failed:\n{reports}")


def _failure(path: str) -> str:
    if not os.path.exists(path):
        return "(no traceback: the process died before reporting)"
    status, value = _load(path)
    return value if status == "error" else "(it reported a result)"


def _load(path: str) -> tuple[str, Any]:
    import torch

    return torch.load(path, weights_only=False)


def _rank_main(fn, rank, world_size, backend, store, output, args) -> None:
    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        torch.save(("error", traceback.format_exc()), output)
        _exit(1)
    torch.save(("ok", result), output)
    _exit(0)


def _exit(code: int) -> None:
    """End the rank now that its report is on disk, without the interpreter's teardown:
    in CI a rank that had reported its result was aborted (SIGABRT, "terminate called
    without an active exception") while C++ threads (gloo's, torch's, TVM's pool) were
    torn down at exit, and its peers' results were thrown away with it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
