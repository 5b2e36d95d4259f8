"""TVM's CPU thread pool gets a thread a physical core at import (tvm_fusion.cpu_threads)."""

import os
import subprocess
import sys

import pytest

from tvm_fusion import cpu_threads


@pytest.mark.parametrize("given", [{}, {"TVM_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "5"}, {"TVM_BIND_THREADS": "1"},
                                   {"TVM_THREAD_POOL_SPIN_COUNT": "300000"}])
def test_each_variable_is_set_only_where_the_user_set_none(given):
    environ = dict(given)
    cpu_threads.configure(environ)
    counted = "TVM_NUM_THREADS" in given or "OMP_NUM_THREADS" in given
    assert environ == {**({} if counted else {"TVM_NUM_THREADS": str(cpu_threads.physical_cores())}),
                       "TVM_BIND_THREADS": "0", "TVM_THREAD_POOL_SPIN_COUNT": "0", **given}


def test_physical_cores_count_the_allowed_cpus_once_a_core():
    cores = cpu_threads.physical_cores()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= cores <= allowed


@pytest.mark.parametrize("threads", [None, "1"])
def test_a_cpu_kernel_runs_on_a_thread_a_core_pins_nothing_and_stays_right(threads):
    """In a fresh process with no variable set, TVM's pool (sized at the first parallel
    kernel) has a thread a physical core, where TVM alone gives half the hardware
    threads on x86; the calling thread keeps its CPUs (TVM pinned it to CPU 0 with a
    pool of one thread, and torch's threads started later with it), also where the user
    asks for one thread; a parallel cross entropy still matches float64."""
    code = (
        "import os, numpy as np, tvm, tvm_fusion as tf\n"
        "from tvm_fusion import cpu_threads\n"
        "cpus = os.sched_getaffinity(0)\n"
        "rng = np.random.default_rng(0)\n"
        "x = (rng.standard_normal((512, 1000)) * 2).astype(np.float32)\n"
        "t = rng.integers(0, 1000, 512)\n"
        "got = float(np.asarray(tf.cross_entropy(x, t)))\n"
        "x64 = x.astype(np.float64); m = x64.max(1)\n"
        "lse = m + np.log(np.exp(x64 - m[:, None]).sum(1))\n"
        "want = float((lse - x64[np.arange(512), t]).mean())\n"
        "assert abs(got - want) <= 1e-5 * abs(want), (got, want)\n"
        "used = tvm.get_global_func('runtime.NumThreads')()  # creates the pool where no kernel did\n"
        "assert os.sched_getaffinity(0) == cpus, (os.sched_getaffinity(0), cpus)\n"
        "print(used, cpu_threads.physical_cores())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "TVM_BIND_THREADS",
                                                         "TVM_THREAD_POOL_SPIN_COUNT")}
    if threads:
        env["TVM_NUM_THREADS"] = threads
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    used, cores = map(int, done.stdout.split()[-2:])
    assert used == (int(threads) if threads else cores)
