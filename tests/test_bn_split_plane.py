"""BatchNorm's split-plane candidates (``bn_forward_split_plane``, ``bn_backward_split_plane``,
and their ``_runs`` forms, whose map takes kernel 1's grid and runs backwards): where
they apply, what their generated code guarantees, and on a GPU, every dtype and option
against the float64 reference with outputs poisoned (NaN) before the run.

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
* 4x16x23 (codegen only): 16 channels of 92 values, an odd L with few splits;
* 256x3x514 (the runs' maps): planes of 257 two-value vectors, so kernel 1's two runs a
  channel, each 257 steps of 128 lanes, start and end mid-plane.
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
FORWARD_RUNS, BACKWARD_RUNS = f"{FORWARD}_runs", f"{BACKWARD}_runs"
FORWARDS, BACKWARDS = (FORWARD, FORWARD_RUNS), (BACKWARD, BACKWARD_RUNS)
RESNET = [(64, 256, 56, 56), (32, 64, 112, 112)]
ODD = [(3, 5, 37, 41), (2, 3, 1000)]
RUNS_ODD = [(256, 3, 514)]  # the runs' maps apply to even runs only: an odd plane where they do
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
    problems = [(FORWARDS, forward(shape, "float16")), (BACKWARDS, backward(shape, "float16")),
                (BACKWARDS, backward(shape, "float16", training=False))]
    for names, problem in problems:
        for name in names:
            cand = registry.get(name)
            assert cand.applies(problem) and cand.prefers(problem, CUDA), problem.describe()
        applicable = [c.name for c in registry.applicable(problem, CUDA)]
        # the runs' map first (faster on the five shapes the H200 timed), the flat one next
        assert applicable.index(names[1]) + 1 == applicable.index(names[0]), applicable
        # ... after the grid-wide persistent ones where they fill the SMs (training), and
        # the forward's one-launch clusters before those where an SM gets three tasks.
        grid = registry.get(f"{problem.op}_grid_persistent")
        one = registry.get("bn_forward_cluster_half_one_launch")
        first = grid.name if grid.applies(problem) and grid.prefers(problem, CUDA) else names[1]
        if one.op == problem.op and one.prefers(problem, CUDA):
            first = one.name
        assert first in ((grid.name, one.name) if problem.training else (names[1],))
        assert registry.default_candidate(problem, CUDA).name == first


def test_neither_takes_channels_last_nor_the_forward_in_eval_nor_is_preferred_for_many_channels():
    for fwd, bwd in zip(FORWARDS, BACKWARDS):
        assert not registry.get(fwd).applies(bn_forward_problem((32, 56, 56, 64), "float16", "NHWC"))
        assert not registry.get(bwd).applies(bn_backward_problem((32, 56, 56, 64), "float16", "NHWC"))
        assert not registry.get(fwd).applies(bn_forward_problem((32, 64, 112, 112), "float16", training=False))
        many = [(fwd, forward((256, 2048, 7, 7), "float16")), (bwd, backward((256, 2048, 7, 7), "float16"))]
        for name, problem in many:  # 2048 channels: a block each already fills the SMs
            assert not registry.get(name).prefers(problem, CUDA)
        # 35 values a channel: no split leaves runs of 32 vectors or more
        assert not registry.get(fwd).applies(forward((5, 3, 7), "float32"))
        assert not registry.get(bwd).applies(backward((5, 3, 7), "float32"))


def test_the_runs_default_takes_256_lanes_for_the_same_step_while_the_batch_stays_two_or_more():
    """``wider_step``: 128 lanes x 4 -> 256 x 2 (the backward's map at 32 registers, not
    40); a batch of 2 stays (8x3x224x224: 256 x 1 was slower), and so do 256 lanes."""
    from tvm_fusion.schedules.cuda.common import even_partials, even_runs, wider_step
    cases = {(64, 256, 56, 56, "float16"): (7, 256, 2), (32, 64, 112, 112, "float16"): (14, 256, 2),
             (8, 3, 224, 224, "float16"): (196, 128, 2), (32, 64, 112, 112, "float32"): (14, 256, 4)}
    for (*shape, dtype), want in cases.items():
        for name, problem in ((FORWARD_RUNS, forward(tuple(shape), dtype)), (BACKWARD_RUNS, backward(tuple(shape), dtype))):
            knobs = registry.get(name).default_for(problem, CUDA)
            assert (knobs.splits, knobs.threads, knobs.unroll) == want, (name, shape, knobs)
            assert want in even_runs(problem) and knobs.splits == even_partials(problem, CUDA)[0]
    step = [(7, 128, 8), (7, 256, 4), (7, 512, 2)]
    assert wider_step((7, 128, 8), step) == (7, 256, 4)  # at most 256 lanes
    assert wider_step((7, 128, 4), [(7, 128, 4)]) == (7, 128, 4)  # only to an even triple


# -- what the generated code guarantees ------------------------------------------------------
def codegen_cases():
    problems = [(FORWARD, forward(RESNET[0], "float16")), (FORWARD, forward(RESNET[1], "bfloat16", False, False)),
                (FORWARD, forward((3, 5, 37, 41), "float32", True, False)), (FORWARD, forward((2, 3, 1000), "float32")),
                (FORWARD, forward((4, 16, 23), "float16")),
                (BACKWARD, backward(RESNET[0], "float16")), (BACKWARD, backward(RESNET[1], "bfloat16", False)),
                (BACKWARD, backward((3, 5, 37, 41), "float16", True, False)),
                (BACKWARD, backward((2, 3, 1000), "float32", False, False)),
                (BACKWARD, backward((4, 16, 23), "bfloat16")),
                (FORWARD, forward(RUNS_ODD[0], "bfloat16", True, False)),
                (BACKWARD, backward(RUNS_ODD[0], "float32", False))]
    for name, problem in problems:
        for variant in (name, f"{name}_runs"):
            if registry.get(variant).applies(problem):  # the runs' map: even runs only
                yield pytest.param(variant, problem, id=f"{variant}-{problem.key()}")


def map_is_even(problem, knobs) -> bool:
    """Whether the map's lanes split its loop with no remainder: the whole tensor by a
    block's vectors (the flat map), or each run by a step's (the runs' map)."""
    if hasattr(knobs, "map_steps"):
        return (problem.numel // knobs.vector) % (knobs.map_steps * knobs.map_threads) == 0
    return (problem.count // knobs.vector // knobs.splits) % (knobs.threads * knobs.unroll) == 0


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
    reduction, output = ("moments", "y") if name in FORWARDS else ("grad_sums", "dx")
    staged = ["x"] if name in FORWARDS else (["x", "dy"] if problem.training else ["dy"])
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
            even = map_is_even(problem, knobs)
            assert all(vector_access(source, b) for b in staged + ([output] if even else [])), what
        script = kernel.mod.script()
        last_coefficient = "bn_shift" if name in FORWARDS else ("bn_dx_xhat" if problem.training else None)
        if last_coefficient:
            assert script.index(f'T.sblock("{last_coefficient}")') < script.index(f'T.sblock("{output}")'), what


@pytest.mark.parametrize("name, problem", [(FORWARD, forward((2, 3, 1000), "float16")),
                                           (BACKWARD, backward((3, 5, 37, 41), "float32", False)),
                                           (FORWARD_RUNS, forward(RESNET[0], "float16")),
                                           (BACKWARD_RUNS, backward((8, 3, 224, 224), "float32"))],
                         ids=[FORWARD, BACKWARD, FORWARD_RUNS, BACKWARD_RUNS])
def test_tunable_space_samples_every_knob_and_replays_with_other_decisions(name, problem):
    """``tunable=True`` draws each knob of ``choices``; the trace replayed with other
    decisions (a loop structure that does not depend on the values) builds and carries
    those values: the last option of every knob, or for the runs' maps the last of
    their even triples (``builds``: an uneven run is a configuration they never build)."""
    import tvm
    from tvm import s_tir

    from tvm_fusion.compute import prim_func

    cand = registry.get(name)
    space = cand.choices(problem, CUDA)
    wanted = {knob: options[-1] for knob, options in space.items()}
    if name in (FORWARD_RUNS, BACKWARD_RUNS):
        wanted = next(k.as_dict() for k in reversed(cand.all_configs(problem, CUDA)) if cand.builds(problem, k))
        assert wanted != cand.default_for(problem, CUDA).as_dict()
    sch = cand.apply(prim_func(problem, cand.algorithm), CUDA, tunable=True)
    samples = [inst for inst in sch.trace.insts if inst.kind.name == "SampleCategorical"]
    assert len(samples) == len(space)
    trace = sch.trace
    for inst, knob in zip(samples, space):
        trace = trace.with_decision(inst, space[knob].index(wanted[knob]), remove_postproc=True)
    replay = s_tir.Schedule(prim_func(problem, cand.algorithm))
    trace.apply_to_schedule(replay, remove_postproc=True)
    script = replay.mod.script()
    for knob, value in wanted.items():
        assert f'"tvm_fusion.knob.{knob}": {value}' in script, knob
    with CUDA:
        tvm.compile(replay.mod, target=CUDA)


@needs_nvcc
@pytest.mark.parametrize("name, problem", [(FORWARD, forward(RESNET[0], "float16")),
                                           (BACKWARD, backward(RESNET[0], "float16")),
                                           (FORWARD_RUNS, forward(RESNET[0], "float16")),
                                           (BACKWARD_RUNS, backward(RESNET[1], "float16"))],
                         ids=[FORWARD, BACKWARD, FORWARD_RUNS, BACKWARD_RUNS])
def test_default_compiles_without_spills(name, problem):
    check_compiles_without_spills(build_kernel(problem, CUDA, name))


@pytest.mark.parametrize("name, problem", [(FORWARD_RUNS, forward(RESNET[0], "float16")),
                                           (BACKWARD_RUNS, backward(RESNET[1], "bfloat16")),
                                           (BACKWARD_RUNS, backward(RESNET[0], "float16", training=False))],
                         ids=[FORWARD_RUNS, BACKWARD_RUNS, f"{BACKWARD_RUNS}-eval"])
def test_the_runs_map_takes_kernel_1s_grid_and_walks_it_backwards(name, problem):
    """The map's kernel has one block per (channel, run), launched last first (kernel
    1's grid, channels fastest), each walking its run's steps from the end; its lanes
    step as kernel 1's do (``threads`` apart, ``unroll`` vectors a step), and the
    channel is the block's, so the coefficients are not indexed by the vector."""
    cand = registry.get(name)
    knobs = cand.default_for(problem, CUDA)
    source = build_kernel(problem, CUDA, name, knobs).device_source()
    bodies = [source[m.end():].split("__global__", 1)[0] for m in re.finditer(r'__global__ void [^;{]*\{', source)]
    per_run = problem.count // knobs.vector // knobs.splits
    assert any(f"(((int)blockIdx.y) * {per_run})" in body for body in bodies), "kernel 1's runs"
    reversed_grid = [body for body in bodies if "int blockIdx_x = (" in body]
    assert len(reversed_grid) == 1, "one kernel with a reversed grid"
    body = reversed_grid[0]
    blocks = problem.channels * knobs.splits
    steps = per_run // (knobs.threads * knobs.unroll)
    assert f"int blockIdx_x = ({blocks - 1} - ((int)blockIdx.x));" in body
    assert f"_walked < {steps};" in body and "blockIdx.y" not in body
    # the channel, (blocks - 1 - blockIdx.x) mod C (C a power of two here), indexes the coefficients
    channel = f"(({problem.channels - 1} - ((int)blockIdx.x)) & {problem.channels - 1})"
    coefficient = "bn_shift_ptr" if name in FORWARDS else ("bn_dx_xhat_ptr" if problem.training else "invstd_ptr")
    assert f"{coefficient}[{channel}]" in body, body[:3000]


# -- on a GPU ----------------------------------------------------------------------------------
def gpu_cases(names, cases):
    """``(name, problem, sampled)`` for each candidate of ``names`` that applies."""
    for problem, sampled in cases:
        for name in names:
            if registry.get(name).applies(problem):
                yield pytest.param(name, problem, sampled, id=f"{name}-{problem.key()}")


def forward_gpu_cases():
    """Every dtype and option on the small shapes, default and 2 sampled knobs; the
    ResNet planes with one dtype and option each, default and 1 sampled knob."""
    for shape in ODD + RUNS_ODD + [(8, 3, 224, 224)]:
        for dtype in DTYPES:
            for affine, track in FORWARD_MODES:
                yield forward(shape, dtype, affine, track), 2
    for shape, dtype, (affine, track) in zip(RESNET * 2, ["float16", "bfloat16", "float32", "float16"],
                                             FORWARD_MODES + [(True, True)]):
        yield forward(shape, dtype, affine, track), 1


def backward_gpu_cases():
    for shape in ODD + RUNS_ODD + [(8, 3, 224, 224)]:
        for dtype in DTYPES:
            for training, affine in BACKWARD_MODES:
                yield backward(shape, dtype, training, affine), 2
    for shape, dtype, (training, affine) in zip(RESNET * 2, ["float16", "bfloat16", "float32", "float16"],
                                                BACKWARD_MODES):
        yield backward(shape, dtype, training, affine), 1


@on_gpu
@pytest.mark.parametrize("name, problem, sampled", list(gpu_cases(FORWARDS, forward_gpu_cases())))
def test_forward_on_gpu(name, problem, sampled):
    import tvm

    gen = rng()
    cand = registry.get(name)
    for knobs in default_and_sampled(cand, problem, CUDA, sampled):
        kernel = build_kernel(problem, targets.resolve("cuda"), name, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):  # |mean| >> std too
            data = forward_inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, forward_args(problem, *data), tvm.cuda(0))
            check_forward(kernel, outs, problem, *data, what=f"{knobs} mean {loc}")


@on_gpu
@pytest.mark.parametrize("name, problem, sampled", list(gpu_cases(BACKWARDS, backward_gpu_cases())))
def test_backward_on_gpu(name, problem, sampled):
    import tvm

    gen = rng()
    cand = registry.get(name)
    for knobs in default_and_sampled(cand, problem, CUDA, sampled):
        kernel = build_kernel(problem, targets.resolve("cuda"), name, knobs)
        for shift in (3.0, 1000.0):  # |mean| >> std too (x's spread is 2)
            x, dy, mean, invstd, weight = backward_inputs(gen, problem, problem.dtype, shift=shift)
            args = [x.reshape(problem.shape), dy.reshape(problem.shape), mean, invstd]
            args += [weight] if problem.affine else []
            outs = run_poisoned(kernel, args, tvm.cuda(0))
            check_backward(outs, x, dy, mean, invstd, weight, problem, f"{knobs} mean {shift}")
