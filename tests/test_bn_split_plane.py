"""BatchNorm's split-plane candidates (``bn_forward_split_plane``, ``bn_backward_split_plane``):
where they apply, what their generated code guarantees, and on a GPU, every dtype and
option against the float64 reference with outputs poisoned (NaN) before the run.

The references and tolerances are test_bn_forward's and test_bn_backward's (``check``:
float32 arithmetic relative to the largest element, the sums times sqrt(n), plus the
map's final rounding to its dtype).

Why each shape is there:
* 64x256x56x56 and 32x64x112x112 (NCHW): the planes the candidates are for, few
  channels (256, 64) for 132 SMs with 200704 and 401408 values each;
* 8x3x224x224: 3 channels, where a block per channel uses 3 SMs;
* 3x5x37x41: odd planes, no vector wider than one value divides L (scalar loads and
  stores), the splits are divisors of the run 3 x 37 x 41;
* 2x3x1000: short channels (2000 values, split in 2 or 5 runs shorter than a block
  of lanes: kernel 1's serial loop has one step), L a multiple of 8 but not of 16;
* 4x16x23 (codegen only): 16 channels of 92 values, an odd L with few splits.
"""

import re

import pytest

from helpers import check_compiles_without_spills, default_and_sampled, needs_nvcc, on_gpu, rng, run_poisoned
from test_bn_backward import check as check_backward
from test_bn_backward import inputs as backward_inputs
from test_bn_forward import check as check_forward
from test_bn_forward import inputs as forward_inputs
from test_bn_forward import kernel_args as forward_args
from test_cuda_codegen import barriers_under_a_guard, scoped_lines, shared_stores_by_every_thread
from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_backward import bn_backward_problem
from tvm_fusion.contracts.bn_forward import bn_forward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
FORWARD, BACKWARD = "bn_forward_split_plane", "bn_backward_split_plane"
RESNET = [(64, 256, 56, 56), (32, 64, 112, 112)]
ODD = [(3, 5, 37, 41), (2, 3, 1000)]
DTYPES = ["float16", "bfloat16", "float32"]
# (affine, track_running) of the forward (training); (training, affine) of the backward
FORWARD_MODES = [(True, True), (False, False), (True, False)]
BACKWARD_MODES = [(True, True), (True, False), (False, True), (False, False)]


def forward(shape, dtype, affine=True, track=True):
    return bn_forward_problem(shape, dtype, "NCHW", affine, True, track)


def backward(shape, dtype, training=True, affine=True):
    return bn_backward_problem(shape, dtype, "NCHW", affine, training)


# -- where they apply ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", RESNET)
def test_both_apply_and_are_preferred_on_the_resnet_planes(shape):
    problems = [(FORWARD, forward(shape, "float16")), (BACKWARD, backward(shape, "float16")),
                (BACKWARD, backward(shape, "float16", training=False))]
    for name, problem in problems:
        cand = registry.get(name)
        assert cand.applies(problem) and cand.prefers(problem, CUDA), problem.describe()
        assert name in [c.name for c in registry.applicable(problem, CUDA)]


def test_neither_takes_channels_last_nor_the_forward_in_eval_nor_is_preferred_for_many_channels():
    assert not registry.get(FORWARD).applies(bn_forward_problem((32, 56, 56, 64), "float16", "NHWC"))
    assert not registry.get(BACKWARD).applies(bn_backward_problem((32, 56, 56, 64), "float16", "NHWC"))
    assert not registry.get(FORWARD).applies(bn_forward_problem((32, 64, 112, 112), "float16", training=False))
    many = [(FORWARD, forward((256, 2048, 7, 7), "float16")), (BACKWARD, backward((256, 2048, 7, 7), "float16"))]
    for name, problem in many:  # 2048 channels: a block each already fills the SMs
        assert not registry.get(name).prefers(problem, CUDA)
    # 35 values a channel: no split leaves runs of 32 vectors or more
    assert not registry.get(FORWARD).applies(forward((5, 3, 7), "float32"))
    assert not registry.get(BACKWARD).applies(backward((5, 3, 7), "float32"))


# -- what the generated code guarantees ------------------------------------------------------
def codegen_cases():
    problems = [(FORWARD, forward(RESNET[0], "float16")), (FORWARD, forward(RESNET[1], "bfloat16", False, False)),
                (FORWARD, forward((3, 5, 37, 41), "float32", True, False)), (FORWARD, forward((2, 3, 1000), "float32")),
                (FORWARD, forward((4, 16, 23), "float16")),
                (BACKWARD, backward(RESNET[0], "float16")), (BACKWARD, backward(RESNET[1], "bfloat16", False)),
                (BACKWARD, backward((3, 5, 37, 41), "float16", True, False)),
                (BACKWARD, backward((2, 3, 1000), "float32", False, False)),
                (BACKWARD, backward((4, 16, 23), "bfloat16"))]
    for name, problem in problems:
        yield pytest.param(name, problem, id=f"{name}-{problem.key()}")


def partial_stores(source: str, name: str) -> list[list[str]]:
    """The ``if`` lines around each store of kernel 1's partials (``<name>_v0_rf``)."""
    return [[o for o in opened if o.startswith("if")] for text, opened in scoped_lines(source)
            if text.startswith(f"{name}_v0_rf_ptr[")]


def vector_access(source: str, buffer: str) -> bool:
    """A 16-byte load or store of ``buffer`` (uint4 for 16-bit types, float4 for float32)."""
    return re.search(rf"\*\((?:uint4|float4)\*\)\({buffer}_ptr", source) is not None


@pytest.mark.parametrize("name, problem", list(codegen_cases()))
def test_cuda_source_of_default_and_sampled_knobs(name, problem):
    """Three kernels; the partials' cross-thread step lowered (shuffles, the partial
    stored by thread 0 alone: a skipped lowering lets every lane store it); no barrier
    under a thread guard, no shared store by every thread, no atomics; 16-byte loads
    of the inputs and stores of the map's output when a 16-byte vector divides L; and
    the map after the kernel that writes its coefficients (TVM's merge places the
    finalize loop at its last block's place and checks no dependence)."""
    cand = registry.get(name)
    reduction, output = ("moments", "y") if name == FORWARD else ("grad_sums", "dx")
    staged = ["x"] if name == FORWARD else (["x", "dy"] if problem.training else ["dy"])
    for knobs in default_and_sampled(cand, problem, CUDA, 3):
        kernel = build_kernel(problem, CUDA, name, knobs)
        source = kernel.device_source()
        what = f"{problem.key()} {knobs}"
        assert len(re.findall(r'extern "C" __global__ void [^;]*\{', source)) == 3, what
        assert "__shfl_down_sync" in source and "atomic" not in source.lower(), what
        stores = partial_stores(source, reduction)
        assert stores and all(any("threadIdx.x) == 0" in g for g in guards) for guards in stores), what
        assert not barriers_under_a_guard(source), f"{what}: {barriers_under_a_guard(source)[:2]}"
        assert not shared_stores_by_every_thread(source), f"{what}: {shared_stores_by_every_thread(source)[:2]}"
        if knobs.vector * DTYPE_BYTES[problem.dtype] == 16:
            # 16-byte stores where the map's lanes split the tensor evenly; elsewhere
            # stores one by one under the bound (schedules.cuda.common.store_vectors)
            even = (problem.numel // knobs.vector) % (knobs.map_steps * knobs.map_threads) == 0
            assert all(vector_access(source, b) for b in staged + ([output] if even else [])), what
        script = kernel.mod.script()
        last_coefficient = "bn_shift" if name == FORWARD else ("bn_dx_xhat" if problem.training else None)
        if last_coefficient:
            assert script.index(f'T.sblock("{last_coefficient}")') < script.index(f'T.sblock("{output}")'), what


@pytest.mark.parametrize("name, problem", [(FORWARD, forward((2, 3, 1000), "float16")),
                                           (BACKWARD, backward((3, 5, 37, 41), "float32", False))],
                         ids=[FORWARD, BACKWARD])
def test_tunable_space_samples_every_knob_and_replays_with_other_decisions(name, problem):
    """``tunable=True`` draws each knob of ``choices``; the trace replayed with the last
    option of every knob (a loop structure that does not depend on the values) builds
    and carries those values."""
    import tvm
    from tvm import s_tir

    from tvm_fusion.compute import prim_func

    cand = registry.get(name)
    space = cand.choices(problem, CUDA)
    sch = cand.apply(prim_func(problem, cand.algorithm), CUDA, tunable=True)
    samples = [inst for inst in sch.trace.insts if inst.kind.name == "SampleCategorical"]
    assert len(samples) == len(space)
    trace = sch.trace
    for inst in samples:
        trace = trace.with_decision(inst, len(inst.attrs[0]) - 1, remove_postproc=True)
    replay = s_tir.Schedule(prim_func(problem, cand.algorithm))
    trace.apply_to_schedule(replay, remove_postproc=True)
    script = replay.mod.script()
    for knob, options in space.items():
        assert f'"tvm_fusion.knob.{knob}": {options[-1]}' in script, knob
    with CUDA:
        tvm.compile(replay.mod, target=CUDA)


@needs_nvcc
@pytest.mark.parametrize("name, problem", [(FORWARD, forward(RESNET[0], "float16")),
                                           (BACKWARD, backward(RESNET[0], "float16"))], ids=[FORWARD, BACKWARD])
def test_default_compiles_without_spills(name, problem):
    check_compiles_without_spills(build_kernel(problem, CUDA, name))


# -- on a GPU ----------------------------------------------------------------------------------
def forward_gpu_cases():
    """Every dtype and option on the small shapes, default and 2 sampled knobs; the
    ResNet planes with one dtype and option each, default and 1 sampled knob."""
    for shape in ODD + [(8, 3, 224, 224)]:
        for dtype in DTYPES:
            for affine, track in FORWARD_MODES:
                problem = forward(shape, dtype, affine, track)
                yield pytest.param(problem, 2, id=problem.key())
    for shape, dtype, (affine, track) in zip(RESNET * 2, ["float16", "bfloat16", "float32", "float16"],
                                             FORWARD_MODES + [(True, True)]):
        problem = forward(shape, dtype, affine, track)
        yield pytest.param(problem, 1, id=problem.key())


def backward_gpu_cases():
    for shape in ODD + [(8, 3, 224, 224)]:
        for dtype in DTYPES:
            for training, affine in BACKWARD_MODES:
                problem = backward(shape, dtype, training, affine)
                yield pytest.param(problem, 2, id=problem.key())
    for shape, dtype, (training, affine) in zip(RESNET * 2, ["float16", "bfloat16", "float32", "float16"],
                                                BACKWARD_MODES):
        problem = backward(shape, dtype, training, affine)
        yield pytest.param(problem, 1, id=problem.key())


@on_gpu
@pytest.mark.parametrize("problem, sampled", list(forward_gpu_cases()))
def test_forward_on_gpu(problem, sampled):
    import tvm

    gen = rng()
    cand = registry.get(FORWARD)
    for knobs in default_and_sampled(cand, problem, CUDA, sampled):
        kernel = build_kernel(problem, targets.resolve("cuda"), FORWARD, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):  # |mean| >> std too
            data = forward_inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, forward_args(problem, *data), tvm.cuda(0))
            check_forward(kernel, outs, problem, *data, what=f"{knobs} mean {loc}")


@on_gpu
@pytest.mark.parametrize("problem, sampled", list(backward_gpu_cases()))
def test_backward_on_gpu(problem, sampled):
    import tvm

    gen = rng()
    cand = registry.get(BACKWARD)
    for knobs in default_and_sampled(cand, problem, CUDA, sampled):
        kernel = build_kernel(problem, targets.resolve("cuda"), BACKWARD, knobs)
        for shift in (3.0, 1000.0):  # |mean| >> std too (x's spread is 2)
            x, dy, mean, invstd, weight = backward_inputs(gen, problem, problem.dtype, shift=shift)
            args = [x.reshape(problem.shape), dy.reshape(problem.shape), mean, invstd]
            args += [weight] if problem.affine else []
            outs = run_poisoned(kernel, args, tvm.cuda(0))
            check_backward(outs, x, dy, mean, invstd, weight, problem, f"{knobs} mean {shift}")
