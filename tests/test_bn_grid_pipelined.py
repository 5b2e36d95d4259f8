"""bn_forward_grid_pipelined and bn_backward_grid_pipelined: the grid-wide persistent
BatchNorm kernels with their rounds pipelined (tvm_fusion.async_rounds).

Where they apply (parts of half the grid-wide kernels' bytes, 16-byte copies), and what
their CUDA code must show (round 0's copies before the loop; in a round, the wait for
its copies, its barrier, the next round's copies as 16-byte cp.async, then its map's
stores; a barrier between the partials' stores and their loads in the loop and in the
epilogue; every cross-thread reduction with its own shared result). Their spills,
trace replays and GPU checks (every knob sample against the float64 reference) are
tests/test_bn_grid_persistent.py's, over every grid-wide candidate."""

import re

import pytest
import tvm

from test_bn_grid_persistent import backward_problem, kernel_bodies, problem
from tvm_fusion import async_rounds, registry, targets
from tvm_fusion.compute import bn_stats
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda.bn_forward_grid_persistent import grid_choices

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
FORWARD = registry.get("bn_forward_grid_pipelined")
BACKWARD = registry.get("bn_backward_grid_pipelined")

# (shape, dtype, parts): 401 KB fp16 channels in 4 parts of 100 KB (x) and in 8 of 50 KB
# (x and dy), 802 KB bf16 channels, 256 KB fp32 ones, and 3 channels of 120 KB (one
# round of 6 blocks, or three of 2).
FORWARD_APPLIES = [((64, 256, 56, 56), "float16", 4), ((32, 64, 112, 112), "bfloat16", 8),
                   ((16, 8, 64, 64), "float32", 4), ((32, 3, 40, 48), "float16", 2)]
BACKWARD_APPLIES = [((64, 256, 56, 56), "float16", 8), ((32, 64, 112, 112), "bfloat16", 16),
                    ((16, 8, 64, 64), "float32", 8), ((32, 3, 40, 48), "float16", 4)]


@pytest.mark.parametrize("cand, make, copies, shape, dtype, parts",
                         [(FORWARD, problem, 2, *case) for case in FORWARD_APPLIES]
                         + [(BACKWARD, backward_problem, 4, *case) for case in BACKWARD_APPLIES],
                         ids=lambda v: getattr(v, "name", None))
def test_applies_in_half_parts_and_its_grid_divides_the_tasks(cand, make, copies, shape, dtype, parts):
    p = make(shape, dtype)
    assert cand.applies(p) and cand.copies == copies and bn_stats.parts(p, copies) == parts
    grids = grid_choices(p, CUDA, copies)
    assert grids and all(g % parts == 0 and parts * p.channels % g == 0 for g in grids)
    assert cand.default_for(p, CUDA).grid == max(grids)
    assert not cand.prefers(p, CUDA), "unmeasured: the tuner chooses it, not the heuristic"
    assert not cand.applies(make(shape, dtype, training=False))


@pytest.mark.parametrize("cand, make", [(FORWARD, problem), (BACKWARD, backward_problem)], ids=["forward", "backward"])
def test_does_not_apply_without_16_byte_copies(cand, make):
    """Odd 15x15 planes: scalar copies, which cp.async cannot take (the grid-wide
    kernel without the pipeline takes them)."""
    p = make((1024, 3, 15, 15), "float16")
    assert not cand.applies(p) and registry.get(cand.name.replace("pipelined", "persistent")).applies(p)


def check_pipelined(kernel, partials: str, on_chip: list[str], output: str, parts: int) -> str:
    """The persistent kernel's rounds pipelined: round 0's copies (16-byte cp.async,
    committed) before the loop; in a round, the wait for its copies, its barrier, the
    next round's copies, then its map's stores of ``output``; a barrier
    between the partials' stores and their loads in the loop and in the epilogue (the
    last round), under no condition; each cross-thread reduction with its own shared
    result. Returns the persistent kernel's source."""
    persistent, outputs = kernel_bodies(kernel.device_source())
    assert "grid_sync" not in outputs and "cp_async" not in outputs
    rounds = parts * kernel.problem.channels // kernel.knobs.grid
    loop = re.search(r"for \(int (c_p_fused_0_m) = 0; \1 < (\d+);", persistent)
    assert (int(loop.group(2)) if loop else 1) == max(rounds - 1, 1), "the loop runs all rounds but the last"
    syncs = [m.start() for m in re.finditer(r"tvm_builtin_cuda_grid_sync\(\);", persistent)]
    assert len(syncs) == min(rounds, 2)
    for i, (at, end) in enumerate(zip(syncs, [*syncs[1:], len(persistent)])):
        stored = [m.start() for m in re.finditer(rf"\b{partials}_v[01]_ptr\[[^\]]*\] =", persistent[:at])]
        loaded = [m.start() for m in re.finditer(rf"= \([^;]*\b{partials}_v[01]_ptr\[", persistent[at:end])]
        assert stored and loaded
        depth = persistent[:at].count("{") - persistent[:at].count("}")
        assert depth == (2 if rounds > 2 and i == 0 else 1), "a barrier under a condition"
    copies = list(re.finditer(r"ptx_cp_async\w*_16_\w*\([^;]*?\b(x|dy)_ptr,", persistent))
    assert {m.group(1) for m in copies} == set(on_chip)
    commits = [m.start() for m in re.finditer(r"commit_group\(\);", persistent)]
    waits = [m.start() for m in re.finditer(r"wait_group_async_wait_group_[01]\(\);", persistent)]
    assert len(commits) == min(rounds, 2) and len(waits) == len(syncs)
    if rounds > 1:  # round r + 1's copies issued after round r's barrier, before its map's stores
        next_copies = [m.start() for m in copies if commits[0] < m.start() < commits[1]]
        stores = [m.start() for m in re.finditer(rf"\b{output}_ptr\b", persistent)]
        assert next_copies and waits[0] < syncs[0] < min(next_copies)
        assert commits[1] < min(at for at in stores if at > syncs[0])
    results = set(re.findall(r"float (red_result_ptr\w*)\[1\];", persistent))
    assert len(results) == 2 * len(syncs), results  # two sums a reduction, each instance its own
    return persistent


@pytest.mark.parametrize("shape, dtype, parts", FORWARD_APPLIES)
def test_forward_cuda_source_pipelines_its_rounds(shape, dtype, parts):
    kernel = build_kernel(problem(shape, dtype), CUDA, FORWARD.name)
    persistent = check_pipelined(kernel, "part_moments", ["x"], "y", parts)
    assert "running_mean_out_ptr" not in persistent and "save_mean_ptr" not in persistent


@pytest.mark.parametrize("shape, dtype, parts", BACKWARD_APPLIES)
def test_backward_cuda_source_pipelines_its_rounds(shape, dtype, parts):
    kernel = build_kernel(backward_problem(shape, dtype), CUDA, BACKWARD.name)
    persistent = check_pipelined(kernel, "part_grad_sums", ["x", "dy"], "dx", parts)
    # dx reads x and dy from the copies only: no load of either but the copies'.
    assert not re.search(r"\b(x|dy)_ptr\[", persistent)
    assert "dweight_ptr" not in persistent and "dbias_ptr" not in persistent


def test_only_the_pipelined_decompositions_are_lowered_with_async_copies():
    """async_rounds.wanted reads the decomposition's tag: the grid-wide kernels without
    the pipeline keep TVM's lowering (storage rewrite, LowerThreadAllreduce in place)."""
    from tvm_fusion.compute import prim_func

    p = problem((64, 256, 56, 56), "float16")
    assert async_rounds.wanted(tvm.IRModule({"main": prim_func(p, "shifted_half_parts")}))
    assert not async_rounds.wanted(tvm.IRModule({"main": prim_func(p, "shifted_parts")}))
    config, disabled = async_rounds.lowering_config({}, ["a"])
    assert config["tirx.use_async_copy"] and disabled == ["a", async_rounds.LOWER_ALLREDUCE]
