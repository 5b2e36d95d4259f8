import os
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import has_gpu  # noqa: E402

# Under pytest-xdist every worker is a process with TVM's thread pool of its own; one
# thread a worker keeps the suite at one thread a core (tvm_fusion's import would give
# each worker a thread a core). tests/test_cpu_threads.py checks the import's own count.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("TVM_NUM_THREADS", "1")


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the launchers allocate from now on (torch tensors and numpy arrays)
    starts as NaN (or -7777)."""
    from tvm_fusion import arrays, records

    plain = arrays.Kind.allocator

    def allocator(self, shape, dtype, *args, **kwargs):
        allocate = plain(self, shape, dtype, *args, **kwargs)
        if self.name == "numpy":  # np.empty: its garbage may hold the zeros a test expects

            def poisoned_numpy():
                out = allocate()
                out.fill(-7777 if np.issubdtype(out.dtype, np.integer) else np.nan)
                return out

            return poisoned_numpy
        if self.name != "torch":
            return allocate

        def poisoned_allocate():
            out = allocate()
            return out.fill_(float("nan") if out.is_floating_point() else -7777)

        return poisoned_allocate

    monkeypatch.setattr(arrays.Kind, "allocator", allocator)
    records.invalidate()  # the launchers are rebuilt with the poisoned allocators
    yield
    records.invalidate()


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a gpu-marked test, the device memory its process no longer uses goes back:
    unreachable cycles collected (a failed test's traceback holds its arrays), then
    torch's cached blocks freed. ``.ci/gpu-suite`` runs 10-15 pytest workers on one GPU,
    and each worker's caching allocator keeps what its largest test took. On an 80 GB
    H100 (2026-12-05), two runs of part C each lost one test to ``cudaErrorMemoryAllocation``
    while allocating its inputs (``test_ce_aligned_rows``: 3000x50257 fp16, and one run
    whose message was not kept, 16384x50257 bf16); each passed alone, twice."""
    yield
    torch = sys.modules.get("torch")
    if "gpu" in request.keywords and torch is not None and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running")


# The longest single tests (the notebooks: 45-390 s each on the 2-core CI machine, the
# rest a few seconds at most) go first, so that the other worker runs the short ones
# beside them instead of waiting for the last notebook at the end of the run.
FIRST = ("tests/test_notebooks.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
