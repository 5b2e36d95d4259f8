"""Shared test helpers: fresh random data, the tolerance table, a NaN-aware comparison,
and running a compiled kernel with poisoned outputs."""

from __future__ import annotations

import functools
import os
import re

import numpy as np

import tvm

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes comes with apache-tvm
    BF16 = None

# Results are float32 and the reference is float64 on the same (quantized) input,
# so the error is float32 accumulation and exp/log rounding, not the input dtype;
# against torch, which returns fp16/bf16 losses, the output rounding dominates.
TOLERANCES = {
    "float32": {"rtol": 2e-5, "atol": 2e-5, "torch_rtol": 2e-5},
    "float16": {"rtol": 2e-5, "atol": 2e-5, "torch_rtol": 2e-3},
    "bfloat16": {"rtol": 2e-5, "atol": 2e-5, "torch_rtol": 1.6e-2},
}


def bn_atol(dtype: str, count: int) -> float:
    """Absolute tolerance of BN statistics in units of the data's spread: float32
    accumulation of ``count`` values per channel (in lanes and threads) drifts
    like sqrt(count) roundings of the running sums."""
    return TOLERANCES[dtype]["atol"] + 1e-7 * np.sqrt(count)


POISON_FLOAT = np.nan
POISON_INT = -7777


def rng() -> np.random.Generator:
    """A fresh generator per call; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("TVM_FUSION_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def random_floats(gen: np.random.Generator, shape, dtype: str, loc=0.0, scale=1.0) -> np.ndarray:
    return (gen.standard_normal(shape) * scale + loc).astype(np_dtype(dtype))


def assert_close(actual, expected, rtol: float, atol: float, what: str = "") -> None:
    """Compare NaN-aware (NaN must match NaN); on failure print the worst mismatches."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    if not np.array_equal(nan_a, nan_e):
        rows = np.flatnonzero((nan_a != nan_e).ravel())[:5]
        raise AssertionError(
            f"{what}: NaN pattern differs at flat index {rows.tolist()}: "
            f"actual {actual.ravel()[rows]}, expected {expected.ravel()[rows]}"
        )
    mask = ~nan_e
    both_inf = np.isinf(expected) & (actual == expected)
    err = np.where(mask & ~both_inf, np.abs(actual - expected), 0.0)
    bound = atol + rtol * np.abs(np.where(mask & ~both_inf, expected, 0.0))
    bad = err > bound
    if bad.any():
        worst = np.argsort(-(err - bound).ravel())[:5]
        lines = [
            f"  [{np.unravel_index(i, actual.shape)}] actual={actual.ravel()[i]!r} "
            f"expected={expected.ravel()[i]!r} err={err.ravel()[i]:.3g} bound={bound.ravel()[i]:.3g}"
            for i in worst
        ]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values off\n" + "\n".join(lines))


def run_poisoned(kernel, inputs: list[np.ndarray], device=None) -> list[np.ndarray]:
    """Run ``kernel`` on ``inputs`` with every output pre-filled with poison; return outputs.

    An output element the kernel never writes stays NaN (or POISON_INT) and fails the
    comparison with the reference. Each output is the front of a longer poisoned
    buffer, and a store past its end fails here: such stores land in a neighbouring
    allocation, which nothing else checks (the dx of a BatchNorm backward overwrote
    torch's tensors on the H200, 2026-12-01, while its own values were right)."""
    device = device or (tvm.cuda(0) if kernel.target.kind.name == "cuda" else tvm.cpu(0))
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), device) for a in inputs]
    # The parameters after the inputs are the outputs (Kernel.num_inputs counts
    # logits, target[, weight] only: cross_entropy_grad's from_lse has two more).
    shapes = kernel.params[: len(inputs)]
    args = [a._create_view(shape) for a, (_, shape, _) in zip(args, shapes)]
    buffers, outs = [], []
    for _, shape, dtype in kernel.params[len(inputs) :]:
        poison = POISON_INT if dtype.startswith("int") else POISON_FLOAT
        buffer = tvm.runtime.tensor(np.full(int(np.prod(shape)) + GUARD_ELEMENTS, poison, dtype=dtype), device)
        buffers.append((buffer, int(np.prod(shape)), poison))
        outs.append(buffer._create_view(tuple(shape)))
    kernel(*args, *outs)
    for (name, _, _), (buffer, size, poison) in zip(kernel.params[len(inputs) :], buffers):
        tail = buffer.numpy()[size:]
        written = ~np.isnan(tail.astype(np.float64)) if poison is POISON_FLOAT else tail != poison
        assert not written.any(), (f"{kernel.candidate} {kernel.knobs}: {int(written.sum())} values stored past "
                                   f"the end of {name} (first at +{int(np.argmax(written))})")
    return [o.numpy() for o in outs]


GUARD_ELEMENTS = 1 << 14  # poisoned elements after each output


def has_gpu() -> bool:
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001
        return False


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def default_and_sampled(cand, problem, target, count: int) -> list:
    """The candidate's default knobs and ``count`` configurations of its space, drawn
    with a seed of the candidate's name (the same draw on every run), less those the
    candidate says do not build (``Candidate.builds``: the tuner never times them)."""
    import random

    configs = cand.all_configs(problem, target)
    drawn = random.Random(cand.name).sample(configs, min(count, len(configs)))
    return [cand.default_for(problem, target)] + [knobs for knobs in drawn if cand.builds(problem, knobs)]


def candidate_params(problems, target, count: int):
    """``pytest.param(problem, candidate name, configs)`` for every applicable candidate
    of every problem, with its default and ``count`` sampled configurations."""
    import pytest

    from tvm_fusion import registry

    for problem in problems:
        for cand in registry.applicable(problem, target):
            yield pytest.param(problem, cand.name, default_and_sampled(cand, problem, target, count),
                               id=f"{cand.name}-{problem.key()}")


def needs_nvcc(test):
    """Skip ``test`` where nvcc is not installed."""
    import pytest

    from tvm_fusion.codegen import nvcc_path

    return pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")(test)


def on_gpu(test):
    """Mark ``test`` gpu and skip it without a CUDA GPU."""
    import pytest

    return pytest.mark.gpu(pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")(test))


def check_channel_block_source(kernel, problem, knobs, output: str, shuffles: bool) -> None:
    """The CUDA code of a block-per-channel BatchNorm kernel: shuffles when it
    reduces, no atomics, no buffer beyond its parameters (a grid-split candidate's
    workspace aside), no barrier under a thread guard nor a shared store by every
    thread, and 16-byte loads of x (or 16-byte ``cp.async`` copies of it, the
    pipelined rounds') and stores of ``output`` when the vector knob says 16 bytes."""
    from test_cuda_codegen import barriers_under_a_guard, kernel_params, shared_stores_by_every_thread

    from tvm_fusion.contracts.common import DTYPE_BYTES

    source = kernel.device_source()
    assert ("__shfl_down_sync" in source) == shuffles and "atomic" not in source.lower()
    # Partials (split_plane, channels_last, small_plane) only in the function's workspace.
    assert kernel_params(source) <= {name for name, _, _ in kernel.params + kernel.workspace}
    assert "TVMBackendAllocWorkspace" not in kernel.executable.mod.inspect_source()
    assert not barriers_under_a_guard(source) and not shared_stores_by_every_thread(source)
    if knobs.vector * DTYPE_BYTES[problem.dtype] == 16:
        copied = re.search(r"ptx_cp_async\w*_16_\w*\([^;]*\bx_ptr,", source)
        assert ("*(uint4*)(x_ptr" in source or copied) and f"*(uint4*)({output}_ptr" in source, knobs


def check_cluster_barrier(source: str, body: str) -> None:
    """``body`` (one kernel of ``source``) waits at its cluster barrier through
    ``grid_barrier``'s helper, defined in ``source`` with the arrive and the wait as
    ``asm`` that clobbers memory (so nvcc moves no access across them), and no fence:
    the barrier's cluster-scope release and acquire order the exchange."""
    from tvm_fusion import grid_barrier

    assert grid_barrier.CLUSTER_SYNC_SOURCE.strip() in source
    assert source.count('"memory"') >= 2 and "barrier.cluster.arrive" in grid_barrier.CLUSTER_SYNC_SOURCE
    assert grid_barrier.CLUSTER_SYNC_CALL in body and "tvm_builtin_cuda_cluster_sync" not in body
    assert "thread_fence" not in body and "__threadfence" not in body


def check_compiles_without_spills(kernel) -> None:
    """nvcc's report of the kernel: no spills, 16-byte loads and shuffles in the PTX."""
    from tvm_fusion.codegen import cuda_report

    report = cuda_report(kernel)
    assert not any(report.spill_bytes.values()) and report.vector_loads > 0 and report.shuffles > 0, report


def check_threads_decisions_replay(candidate, problem, target) -> None:
    """The tuner replays a candidate's trace with other sampled decisions: each
    ``threads`` decision (the first sampled knob) must build and launch the threads
    it says."""
    import tvm
    from tvm import s_tir

    from tvm_fusion import launch_order
    from tvm_fusion.compute import prim_func
    from tvm_fusion.kernel import compiled_form

    func = prim_func(problem, candidate.algorithm)
    trace = candidate.apply(func, target, tunable=True).trace
    threads = next(inst for inst in trace.insts if inst.kind.name == "SampleCategorical")
    assert [int(v) for v in threads.attrs[0]] == candidate.choices(problem, target)["threads"]
    for decision, count in enumerate(candidate.choices(problem, target)["threads"]):
        sch = s_tir.Schedule(func)
        trace.with_decision(threads, decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
        with target:  # the pipeline every build of a scheduled module goes through
            executable = tvm.compile(compiled_form(sch.mod, problem), target=target, tir_pipeline=launch_order.PIPELINE)
        source = "\n".join(m.inspect_source() for m in executable.mod.imports)
        assert f"__launch_bounds__({count})" in source


def _channels_last(t):
    import torch

    return t.to(memory_format=torch.channels_last)


# The input forms a BatchNorm test runs, from a (N, C, H, W) tensor: NCHW and
# channels-last (the two 4-D memory formats torch trains with, (N, C, L) and (M, C)
# kernels), (N, C) and (N, C, L) (BatchNorm1d), 5-D (reduced to (N, C, D*H*W)), and a
# transposed view (odd strides: copied first).
BN_LAYOUTS = {
    "nchw": lambda t: t,
    "channels-last": _channels_last,
    "nc": lambda t: t.reshape(t.shape[0] * t.shape[2], t.shape[1] * t.shape[3]),
    "ncl": lambda t: t.reshape(t.shape[0], t.shape[1], -1),
    "ncdhw": lambda t: t.reshape(t.shape[0], t.shape[1], 1, t.shape[2], t.shape[3]),
    "transposed": lambda t: t.transpose(2, 3),
}


def shipped_problems(op: str) -> list:
    """The ``op`` problems whose workloads the shipped H200 log holds, as pytest params:
    dispatch runs their tuned records' kernels on the GPU (the log read as dispatch
    reads it, without parsing the records' traces)."""
    import pytest

    return [pytest.param(p, id=p.key()) for p in _shipped_problems() if p.op == op]


@functools.cache
def _shipped_problems() -> list:
    """Every problem of the shipped H200 log, sorted by key: read once a process (three
    test modules ask at collection)."""
    from tvm_fusion import records, targets
    from tvm_fusion.compute import problem_of

    path = records.folder(records.SHIPPED, targets.resolve({"kind": "cuda", "arch": "sm_90"}))
    found = {}
    for workload in records.IndexedLog(path).workloads:  # none where no log ships
        func = workload.mod["main"]
        if "tvm_fusion.problem" in func.attrs:
            problem = problem_of(func)
            found[problem.key()] = problem
    return [found[key] for key in sorted(found)]


def launch(blocks, threads, body):
    """A launch nest of ``blocks`` x ``threads`` (1-D each) around ``body(bx, tx)``: a
    statement, or a list of them."""
    from tvm import tirx

    from tvm_fusion.stmts import seq

    bx, tx = tirx.Var("bx", "int32"), tirx.Var("tx", "int32")
    block = tirx.IterVar(tvm.ir.Range(0, blocks), bx, tirx.IterVar.ThreadIndex, "blockIdx.x")
    thread = tirx.IterVar(tvm.ir.Range(0, threads), tx, tirx.IterVar.ThreadIndex, "threadIdx.x")
    stmts = body(bx, tx)
    stmts = seq(stmts) if isinstance(stmts, list) else stmts
    return tirx.AttrStmt(block, "thread_extent", blocks, tirx.AttrStmt(thread, "thread_extent", threads, stmts))
