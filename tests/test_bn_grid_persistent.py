"""bn_forward_grid_persistent and bn_backward_grid_persistent: BatchNorm's training
forward and backward, each as one cooperative kernel.

Where it applies (channels past one block's shared memory, cut in parts of at most
200 KB), that its grid is a multiple of the parts that divides the tasks, what its
CUDA code must show (the grid barrier between the partial sums' stores and the
combine's loads, every block meeting it; x copied with 16-byte loads; the cooperative
launch tag on the kernel), that its tuning space replays, and on a GPU that every
knob sample computes the float64 reference (|mean| >> std included) with outputs
poisoned before the run."""

import re

import pytest
import tvm

from helpers import check_threads_decisions_replay, needs_nvcc, on_gpu, rng, run_poisoned
from test_bn_forward import check_knobs_on_gpu
from tvm_fusion import grid_barrier, launch_order, registry, targets
from tvm_fusion.compute import bn_stats
from tvm_fusion.contracts.bn_backward import bn_backward_problem
from tvm_fusion.contracts.bn_forward import bn_forward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel, compiled_form
from tvm_fusion.schedules.cuda.bn_forward_grid_persistent import grid_choices

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "bn_forward_grid_persistent"
CANDIDATE = registry.get(NAME)


def problem(shape, dtype, affine=True, track_running=True, training=True, layout="NCHW"):
    return bn_forward_problem(shape, dtype, layout, affine, training, track_running)


# (shape, dtype, parts): the ResNet layer of the table (401 KB a channel),
# 802 KB channels at two dtypes, an fp32 channel of 230 KB, and odd 15x15 planes
# (scalar loads, a guarded last step).
APPLIES = [((64, 256, 56, 56), "float16", 2), ((32, 64, 112, 112), "bfloat16", 4),
           ((64, 256, 56, 56), "float32", 4), ((16, 8, 60, 60), "float32", 2), ((1024, 3, 15, 15), "float16", 4)]


@pytest.mark.parametrize("shape, dtype, parts", APPLIES)
def test_applies_in_parts_and_its_grid_divides_the_tasks(shape, dtype, parts):
    p = problem(shape, dtype)
    assert CANDIDATE.applies(p) and bn_stats.parts(p) == parts
    grids = grid_choices(p, CUDA)
    assert grids and all(g % parts == 0 and parts * p.channels % g == 0 and g <= targets.sm_count(CUDA)
                         for g in grids)
    assert CANDIDATE.default_for(p, CUDA).grid == max(grids)
    # The default where its grid fills the SMs (128 of 132), not on 16 or 12 blocks.
    assert CANDIDATE.prefers(p, CUDA) == (max(grids) >= 0.9 * targets.sm_count(CUDA)) == (max(grids) == 128)


@pytest.mark.parametrize("p, why", [
    (problem((256, 2048, 7, 7), "float16"), "25 KB a channel: one part (bn_forward_persistent)"),
    (problem((64, 256, 56, 56), "float16", training=False), "eval keeps no statistics"),
    (problem((64, 56, 56, 256), "float16", layout="NHWC"), "channels last"),
    (problem((1, 4, 512, 512), "float32"), "one image of 1 MB a channel: no part under 200 KB"),
    (problem((16, 8, 60, 60), "float16"), "112 KB a channel: one part"),
], ids=lambda v: v if isinstance(v, str) else v.key())
def test_does_not_apply(p, why):
    assert not CANDIDATE.applies(p), why


def kernel_bodies(source: str) -> list[str]:
    return re.split(r'extern "C" __global__', source)[-2:]  # the definitions


def check_barrier(kernel, partials: str, parts: int) -> tuple[str, int]:
    """One barrier in the persistent kernel, none in the outputs' one; in the round loop
    alone (no condition around it), after the ``partials`` stores and before their
    loads; rounds times the grid is the tasks. Returns the persistent kernel's source
    and the barrier's place in it."""
    persistent, outputs = kernel_bodies(kernel.device_source())
    assert persistent.count("tvm_builtin_cuda_grid_sync();") == 1 and "grid_sync" not in outputs
    at = persistent.index("tvm_builtin_cuda_grid_sync();")
    stored = [m.start() for m in re.finditer(rf"\b{partials}_v[01]_ptr\[[^\]]*\] =", persistent)]
    loaded = [m.start() for m in re.finditer(rf"= \([^;]*\b{partials}_v[01]_ptr\[", persistent)]
    assert stored and loaded and max(stored) < at < min(loaded)
    round_loop = re.search(r"for \(int (c_p_fused_0_m) = 0; \1 < (\d+);", persistent)
    rounds = int(round_loop.group(2)) if round_loop else 1  # one round: no loop
    assert rounds * kernel.knobs.grid == parts * kernel.problem.channels
    depth = persistent[:at].count("{") - persistent[:at].count("}")
    assert depth == (2 if round_loop else 1), "the barrier sits in the round loop alone, under no condition"
    # The lanes split a part evenly: no step some lanes skip, so no bound that TVM could
    # take from the tensor instead of the part (the H100's wrong y at 1024 lanes).
    assert not re.search(r"if \([^{]*blockIdx", persistent), "a guard on a block's part"
    return persistent, at


@pytest.mark.parametrize("shape, dtype, parts", APPLIES)
def test_cuda_source_has_the_barrier_between_the_partials_and_their_combine(shape, dtype, parts):
    kernel = build_kernel(problem(shape, dtype), CUDA, NAME)
    persistent, _ = check_barrier(kernel, "part_moments", parts)
    # x comes in once, through the shared copy, a vector a lane as cp.async (tvm_fusion.async_copy)
    # where the vector is 4, 8 or 16 bytes, waited for before the barrier.
    assert persistent.count("x_shared_dyn_ptr") >= 3
    if kernel.knobs.vector * DTYPE_BYTES[dtype] in (4, 8, 16):
        assert re.search(r"ptx_cp_async_legacy_cg_\d+_\d+_\d+\(x_shared_dyn_ptr, [^;]*x_ptr[, []", persistent)
        assert "wait_all();" in persistent
    # The per-channel outputs come from the second kernel, once a channel.
    assert "running_mean_out_ptr" not in persistent and "save_mean_ptr" not in persistent


def lowered(kernel, p) -> tvm.IRModule:
    """The kernel's functions through launch_order's pipeline (barriers inserted,
    launches tagged)."""
    mod = compiled_form(kernel.mod, p)
    pipeline, _, _ = tvm.tirx.get_tir_pipeline(launch_order.PIPELINE)
    with CUDA:
        return pipeline(tvm.IRModule({g: f.with_attr("target", CUDA) for g, f in mod.functions.items()}))


def test_the_function_is_tagged_for_a_cooperative_launch_only_where_a_loop_is_marked():
    """``launch_order``'s pipeline inserts the barrier and tags the function with
    ``tirx.use_cooperative_launch`` (TVM's host/device split copies a function's
    ``tirx.kernel_launch_params`` onto its kernels); a function with no mark keeps
    plain launches (bn_forward_block_per_channel's)."""
    p = problem((64, 256, 56, 56), "float16")
    for name, marked in ((NAME, True), ("bn_forward_block_per_channel", False)):
        mod = lowered(build_kernel(p, CUDA, name), p)
        tags = [str(t) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
                for t in (f.attrs.get(grid_barrier.LAUNCH_PARAMS, []) if f.attrs is not None else [])]
        assert (grid_barrier.COOPERATIVE in tags) == marked, (name, tags)
        assert ("cuda.grid_sync" in "".join(f.script() for f in mod.functions.values())) == marked


def test_a_barrier_under_a_condition_is_refused():
    bx, tx = tvm.tirx.Var("bx", "int32"), tvm.tirx.Var("tx", "int32")
    marked = tvm.tirx.AttrStmt(0, grid_barrier.KEY, 1, tvm.tirx.Evaluate(0))
    func = tvm.tirx.PrimFunc([], tvm.tirx.IfThenElse(tx < 1, marked, None))
    with pytest.raises(ValueError, match="under a condition"):
        grid_barrier.with_barriers(func)
    assert grid_barrier.COOPERATIVE in grid_barrier.with_barriers(tvm.tirx.PrimFunc([], marked)).attrs[
        grid_barrier.LAUNCH_PARAMS]


def configs(cand, p):
    """The default, the fewest lanes on the smallest grid, and one from the middle."""
    space = cand.all_configs(p, CUDA)
    smallest = min(space, key=lambda k: (k.threads, getattr(k, "grid", 0)))
    return list(dict.fromkeys([cand.default_for(p, CUDA), smallest, space[len(space) // 2]]))


# -- the backward: x and dy in shared memory, dx from them ------------------------------
BACKWARD = registry.get("bn_backward_grid_persistent")
# (shape, dtype, parts): the same channels, x and dy together in at most 200 KB a part.
BACKWARD_APPLIES = [((64, 256, 56, 56), "float16", 4), ((32, 64, 112, 112), "bfloat16", 8),
                    ((16, 8, 64, 64), "float32", 4), ((1024, 3, 15, 15), "float16", 8)]


def backward_problem(shape, dtype, affine=True, training=True, layout="NCHW"):
    return bn_backward_problem(shape, dtype, layout, affine, training)


@pytest.mark.parametrize("shape, dtype, parts", BACKWARD_APPLIES)
def test_backward_applies_in_parts_and_its_grid_divides_the_tasks(shape, dtype, parts):
    p = backward_problem(shape, dtype)
    assert BACKWARD.applies(p) and bn_stats.parts(p, copies=2) == parts
    grids = grid_choices(p, CUDA, BACKWARD.copies)
    assert grids and all(g % parts == 0 and parts * p.channels % g == 0 for g in grids)
    assert BACKWARD.default_for(p, CUDA).grid == max(grids)
    assert BACKWARD.prefers(p, CUDA) == (max(grids) == 128)
    assert not BACKWARD.applies(backward_problem(shape, dtype, training=False))


@pytest.mark.parametrize("shape, dtype, parts", BACKWARD_APPLIES)
def test_backward_cuda_source_has_the_barrier_between_the_partials_and_their_combine(shape, dtype, parts):
    kernel = build_kernel(backward_problem(shape, dtype), CUDA, BACKWARD.name)
    persistent, at = check_barrier(kernel, "part_grad_sums", parts)
    # dx reads x and dy from the copies only: neither is loaded from global memory after the barrier.
    assert not re.search(r"\b(x|dy)_ptr\b", persistent[at:])
    assert "dweight_ptr" not in persistent and "dbias_ptr" not in persistent


def check_backward_knobs_on_gpu(p, cand) -> None:
    """Each knob sample of the backward ``cand`` (:func:`configs`) on the GPU against
    the float64 reference, |mean| >> std, outputs poisoned before the run."""
    import test_bn_backward as ref

    gen = rng()
    for knobs in configs(cand, p):
        kernel = build_kernel(p, targets.resolve("cuda"), cand.name, knobs)
        x, dy, mean, invstd, weight = ref.inputs(gen, p, p.dtype, shift=3.0)
        outs = run_poisoned(kernel, ref.kernel_args(p, x, dy, mean, invstd, weight), tvm.cuda(0))
        ref.check(outs, x, dy, mean, invstd, weight, p, f"{cand.name} {knobs}")


# -- every grid-wide candidate: these two, the pipelined ones (test_bn_grid_pipelined.py)
# and the cluster ones (test_bn_cluster.py) ----------------------------------------------
FORWARDS = ("bn_forward_grid_persistent", "bn_forward_grid_pipelined", "bn_forward_cluster", "bn_forward_cluster_half",
            "bn_forward_cluster_quarter", "bn_forward_cluster_rounds", "bn_forward_cluster_half_one_launch")
BACKWARDS = ("bn_backward_grid_persistent", "bn_backward_grid_pipelined", "bn_backward_cluster", "bn_backward_cluster_rounds")
# 120 KB fp16 channels: the pipelined kernels' one round of 6 blocks or three of 2 (the
# others take them in one part, so not at all).
SMALL_PARTS = (32, 3, 40, 48)


def cases(names, make, shapes):
    """(name, problem) pairs where the candidate applies."""
    return [pytest.param(name, p, id=f"{name}-{p.key()}") for name in names for *args, in shapes
            for p in [make(*args)] if registry.get(name).applies(p)]


@needs_nvcc
@pytest.mark.parametrize("name, p", cases(FORWARDS, problem, [((64, 256, 56, 56), "float16")])
                         + cases(BACKWARDS, backward_problem, [((64, 256, 56, 56), "float16")]))
def test_cuda_kernels_compile_without_spills(name, p):
    from tvm_fusion.codegen import cuda_report

    report = cuda_report(build_kernel(p, CUDA, name))
    launches = 1 if registry.get(name).one_launch else 2
    assert len(report.kernels) == launches and not any(report.spill_bytes.values()), report
    assert report.shuffles > 0 and (report.vector_loads > 0 or "pipelined" in name), report  # cp.async


@pytest.mark.parametrize("name, p", cases(FORWARDS, problem, [((16, 8, 60, 60), "float32"), ((16, 8, 64, 64), "float32")])
                         + cases(BACKWARDS, backward_problem, [((16, 8, 64, 64), "float32")]))
def test_tuning_space_replays_with_every_decision(name, p):
    check_threads_decisions_replay(registry.get(name), p, CUDA)


FORWARD_GPU = [((64, 256, 56, 56), "float16", True, True), ((32, 64, 112, 112), "bfloat16", False, True),
               ((16, 8, 60, 60), "float32", True, False), ((16, 8, 64, 64), "float32", True, False),
               ((1024, 3, 15, 15), "float16", False, False), (SMALL_PARTS, "float16", False, False)]
BACKWARD_GPU = [((64, 256, 56, 56), "float16", True), ((32, 64, 112, 112), "bfloat16", False),
                ((16, 8, 64, 64), "float32", True), ((1024, 3, 15, 15), "float16", False),
                (SMALL_PARTS, "float16", False)]


@on_gpu
@pytest.mark.parametrize("name, p", cases(FORWARDS, problem, FORWARD_GPU))
def test_on_gpu_every_knob_sample_computes_the_reference(name, p):
    check_knobs_on_gpu(p, name, configs(registry.get(name), p))


@on_gpu
@pytest.mark.parametrize("name, p", cases(BACKWARDS, backward_problem, BACKWARD_GPU))
def test_backward_on_gpu_every_knob_sample_computes_the_reference(name, p):
    check_backward_knobs_on_gpu(p, registry.get(name))
