"""How many threads run a CPU (LLVM) kernel: TVM's thread pool, set up at import.

TVM sizes its pool once, at a thread's first parallel kernel, from ``TVM_NUM_THREADS``,
else ``OMP_NUM_THREADS``, else half of ``std::thread::hardware_concurrency()`` on x86
(it assumes two hardware threads a core). On a machine without simultaneous
multithreading that is half its cores: on the 2-core CI machine every ``parallel``
candidate ran on one core (``runtime.NumThreads()`` was 1). There, with one thread a
core, cross entropy over 1024x32000 float32 took 7.84-8.74 ms instead of 14.08-14.31 on
one thread, and BatchNorm's backward over 32x64x56x56 float32 3.55-3.65 ms instead of
6.03-6.37 (torch's own in the same runs: 41.6-53.3 and 3.7-10.2 ms; rows "probe: CPU
threads A/B" at 9747c8c, 2026-12-07).

So, when neither variable is set, importing tvm_fusion sets ``TVM_NUM_THREADS`` to the
physical cores this process may run on (its CPU affinity, one thread a core of the
kernel's CPU topology; every allowed CPU where the topology cannot be read). Set either
variable to choose another count.

It also sets ``TVM_BIND_THREADS=0`` (unless set): by default TVM pins its workers to
cores and the thread that creates the pool (the first parallel kernel of more than one
thread, or ``runtime.NumThreads()``) to the pool's first cores, and every thread the
process starts afterwards inherits that. A pool of one thread created by
``runtime.NumThreads()`` pinned the main thread to CPU 0, and torch's intra-op threads,
started after it, then shared that one core. Unpinned, the operating system places both
pools' threads.

And it sets ``TVM_THREAD_POOL_SPIN_COUNT=0`` (unless set): after each parallel kernel
TVM's workers otherwise spin, yielding, for up to 300000 rounds before they sleep, and
inside a torch program they take those rounds from torch's own threads. The small
ResNet's SGD step with ``patch`` (``bench_bn.bench_step`` on the CPU, three runs a
setting) took 84.8-88.6 ms with workers that sleep at once and 89.4-151.2 ms with TVM's
spinning (torch's unpatched step 69.8-84.9 ms in the same processes; rows "probe: CPU
pool spin A/B", 2026-12-07). The price is a wake-up on each parallel kernel: tens of
microseconds on a call of a few hundred.

A pool that already exists (a parallel TVM kernel ran before the import) keeps its size
and its pinning.
"""

from __future__ import annotations

import os

TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (at least 1)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(TOPOLOGY.format(cpu, "physical_package_id")) as package, \
                    open(TOPOLOGY.format(cpu, "core_id")) as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:  # no topology (some containers): count every allowed CPU
            return max(1, len(cpus))
    return max(1, len(cores))


def configure(environ: dict[str, str] | None = None) -> None:
    """In ``environ`` (the process's environment): ``TVM_NUM_THREADS`` set to
    :func:`physical_cores` unless it or ``OMP_NUM_THREADS`` is set, and
    ``TVM_BIND_THREADS=0`` and ``TVM_THREAD_POOL_SPIN_COUNT=0`` unless set."""
    environ = os.environ if environ is None else environ
    if "TVM_NUM_THREADS" not in environ and "OMP_NUM_THREADS" not in environ:
        environ["TVM_NUM_THREADS"] = str(physical_cores())
    environ.setdefault("TVM_BIND_THREADS", "0")
    environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
