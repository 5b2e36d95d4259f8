"""BatchNorm's forward and backward on the channels-last view (M, C), CUDA.

The candidates (bn_forward_channels_last, bn_forward_eval_channels_last,
bn_backward_channels_last) run as three kernels (partials, a finalize per channel,
the map; eval's forward as two): checked here by the generated code (16-byte loads
and stores, shuffles in the finalize, no barrier under a thread guard, every
workspace written by an earlier kernel than its readers, the partials' write-back
under no row guard), nvcc's report (no spills), coverage (every channels-last
problem, tiny M and C off the vector width included, has a candidate whose default
knobs build), and on a GPU against the float64 references with poisoned outputs."""

import re

import pytest

from helpers import candidate_params, check_compiles_without_spills, needs_nvcc, on_gpu, rng, run_poisoned
from test_bn_backward import check as check_backward
from test_bn_backward import inputs as backward_inputs
from test_bn_forward import MODES as FORWARD_MODES  # (training, track_running, affine)
from test_bn_forward import check as check_forward
from test_bn_forward import inputs as forward_inputs
from test_bn_forward import kernel_args
from test_cuda_codegen import barriers_under_a_guard, kernel_params, scoped_lines, shared_stores_by_every_thread

from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_backward import bn_backward_problem
from tvm_fusion.contracts.bn_forward import bn_forward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda.common import MAX_THREADS

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
CHANNELS_LAST = ("bn_forward_channels_last", "bn_forward_eval_channels_last", "bn_backward_channels_last")
BACKWARD_MODES = [(True, True), (True, False), (False, True), (False, False)]  # (training, affine)


def forward(shape, dtype, mode, layout="NHWC"):
    training, track, affine = mode
    return bn_forward_problem(shape, dtype, layout, affine, training, track)


def backward(shape, dtype, mode, layout="NHWC"):
    training, affine = mode
    return bn_backward_problem(shape, dtype, layout, affine, training)


def channels_last_params(problems, count):
    """candidate_params of the channels-last candidates only, with the configurations
    a block can launch (the space pairs 256 channel lanes with 16 rows too: the tuner's
    verifier drops those, as bn_stats_channels_last's)."""
    for param in candidate_params(problems, CUDA, count):
        problem, name, configs = param.values
        if name in CHANNELS_LAST:
            launchable = [k for k in configs if k.channel_lanes * k.rows <= MAX_THREADS]
            yield pytest.param(problem, name, launchable, id=param.id)


# -- the generated code ------------------------------------------------------------------
def kernel_bodies(source: str) -> list[tuple[str, str, str]]:
    """``(name, parameters, body)`` of each kernel defined in ``source``, in launch
    order (TVM numbers them ``main_kernel``, ``main_kernel_1``, ... as the host calls
    them)."""
    heads = list(re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\) \{', source))
    found = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(source)
        found.append((head.group(1), head.group(2), source[head.end():end]))

    def launch_index(kernel):
        suffix = kernel[0].rsplit("_", 1)[-1]
        return int(suffix) if suffix.isdigit() else 0

    return sorted(found, key=launch_index)


def stored(body: str) -> set[str]:
    """Buffers a kernel body stores to: ``name_ptr[...] = `` and vector stores
    ``*(uint4*)(name_ptr + ...) = ``."""
    names = set()
    for line in body.splitlines():
        target = line.split(" = ", 1)[0].strip() if " = " in line else ""
        match = re.fullmatch(r"(?:\*\(\w+\*\)\()?(\w+)_ptr(?:\[.*\]| \+ .*\))", target)
        if match:
            names.add(match.group(1))
    return names


def check_channels_last_source(kernel, problem, knobs, output: str, staged: tuple[str, ...]) -> None:
    """The CUDA code of a channels-last BatchNorm candidate: shuffles exactly when it
    reduces (the finalize), no atomics, no barrier under a thread guard nor a shared
    store by every thread; every workspace (a kernel buffer the function does not
    own: the partials, the coefficients) stored by a kernel that runs before each
    kernel reading it (TVM's merge of loops checks no dependence: a finalize placed
    after the map compiles and reads stale coefficients); the partials written back
    under no row guard (bn_stats_channels_last's lesson: with one row step TVM
    hoisted the row guard over the write-back; to shared memory when rows and splits > 1); and
    16-byte loads of the ``staged`` inputs and stores of ``output`` when the vector knob
    says 16 bytes."""
    source = kernel.device_source()
    reduces = problem.op == "bn_backward" or problem.training
    assert ("__shfl_down_sync" in source) == reduces and "atomic" not in source.lower()
    assert not barriers_under_a_guard(source) and not shared_stores_by_every_thread(source), knobs
    kernels = kernel_bodies(source)
    assert len(kernels) == (3 if reduces else 2), [name for name, _, _ in kernels]
    workspace = kernel_params(source) - {name for name, _, _ in kernel.params}
    for buffer in workspace:
        writers = [i for i, (_, _, body) in enumerate(kernels) if buffer in stored(body)]
        readers = [i for i, (_, params, body) in enumerate(kernels)
                   if f"{buffer}_ptr" in params and buffer not in stored(body)]
        assert writers and all(min(writers) < i for i in readers), f"{knobs}: {buffer} by {writers}, for {readers}"
    # The lanes' write-back: to the workspace, or with rows > 1 to the block's shared
    # tile (rows_through_shared; the block's sums, one thread a channel, may then be
    # guarded by the channel bound alone).
    tile = "_shared" if "_rf_shared_ptr" in source else ""
    lanes_store = rf"(?:\*\(float[24]\*\)\()?\w+_rf{tile}_ptr[\[ ]"  # scalar or 8- and 16-byte stores
    for text, opened in scoped_lines(source):
        if re.match(lanes_store, text):
            guards = [o for o in opened if o.startswith("if") and ("threadIdx.y" in o or "blockIdx.x" in o)]
            assert not guards, f"{knobs}: partials written under {guards}"
    if knobs.vector * DTYPE_BYTES[problem.dtype] == 16:
        for name in (*staged, output):  # uint4 for 16-bit values, float4 for float32
            assert re.search(rf"\*\((?:uint4|float4)\*\)\({name}_ptr", source), (knobs, name)


# Why each shape: the ResNet stage-1 activation in NHWC (64x56x56x256 as (M, C)); a
# small NHWC image batch; BatchNorm1d on two and three rows (one partial, below
# MIN_ROWS) and on four and nine (the fewest rows with two partials; a ragged last
# step); C = 3 and 7 (no vector divides: scalar accesses) and 1000 (lanes past the
# last channel: 125 vectors on 128 lanes); fp32 (4-wide vectors).
CODEGEN_FORWARD = [((200704, 256), "float16", (True, True, True)), ((8, 7, 7, 24), "bfloat16", (True, False, False)),
                   ((2, 5), "float32", (True, True, False)), ((3, 1000), "float16", (True, True, True)),
                   ((4096, 3), "bfloat16", (True, True, True)), ((9, 40), "float32", (True, False, False)),
                   ((4, 64), "bfloat16", (True, True, True)), ((200704, 256), "bfloat16", (False, True, True)),
                   ((1, 7), "float16", (False, True, False)), ((8, 7, 7, 24), "float32", (False, True, True))]
CODEGEN_BACKWARD = [((200704, 256), "float16", (True, True)), ((8, 7, 7, 24), "bfloat16", (True, False)),
                    ((2, 5), "float32", (True, True)), ((3, 1000), "float16", (True, True)),
                    ((4096, 3), "bfloat16", (False, True)), ((9, 40), "float32", (True, False)),
                    ((1, 7), "float16", (False, False)), ((4, 64), "float32", (False, True))]


def codegen_forward():
    return [forward(shape, dtype, mode) for shape, dtype, mode in CODEGEN_FORWARD]


def codegen_backward():
    return [backward(shape, dtype, mode) for shape, dtype, mode in CODEGEN_BACKWARD]


@pytest.mark.parametrize("problem, candidate, configs", list(channels_last_params(codegen_forward(), 2)))
def test_forward_source_has_vector_accesses_and_kernels_in_order(problem, candidate, configs):
    for knobs in configs:
        check_channels_last_source(build_kernel(problem, CUDA, candidate, knobs), problem, knobs, "y", ("x",))


@pytest.mark.parametrize("problem, candidate, configs", list(channels_last_params(codegen_backward(), 2)))
def test_backward_source_has_vector_accesses_and_kernels_in_order(problem, candidate, configs):
    staged = ("x", "dy") if problem.training else ("dy",)
    for knobs in configs:
        check_channels_last_source(build_kernel(problem, CUDA, candidate, knobs), problem, knobs, "dx", staged)


@needs_nvcc
@pytest.mark.parametrize("problem, candidate", [
    (forward((200704, 256), "float16", (True, True, True)), "bn_forward_channels_last"),
    (forward((200704, 256), "bfloat16", (False, True, True)), "bn_forward_eval_channels_last"),
    (backward((200704, 256), "float16", (True, True)), "bn_backward_channels_last"),
    (backward((8, 7, 7, 24), "float32", (True, True)), "bn_backward_channels_last"),
], ids=lambda v: getattr(v, "key", lambda: v)())
def test_compiles_without_spills(problem, candidate):
    from tvm_fusion.codegen import cuda_report

    kernel = build_kernel(problem, CUDA, candidate)
    if registry.get(candidate).claims["shuffles"]:
        check_compiles_without_spills(kernel)
    else:  # eval's forward reduces nothing: no shuffles
        report = cuda_report(kernel)
        assert not any(report.spill_bytes.values()) and report.vector_loads > 0 and report.shuffles == 0, report


# -- every channels-last problem has a candidate -------------------------------------------
# Tiny M (one row in eval, two and three in training: bn_stats_channels_last leaves
# fewer than four rows to a fallback), C = 1, 3, 7 (no vector width divides) and 1000,
# rank 2 (BatchNorm1d) and NHWC.
ODD_SHAPES = [((1, 1), "NCHW"), ((2, 1), "NCHW"), ((3, 3), "NCHW"), ((2, 7), "NCHW"), ((3, 1000), "NCHW"),
              ((5, 7), "NCHW"), ((4096, 3), "NCHW"), ((1, 1, 1, 3), "NHWC"), ((2, 1, 1, 7), "NHWC"),
              ((1, 3, 1, 1000), "NHWC"), ((4, 5, 5, 1), "NHWC")]


def odd_problems():
    for (shape, layout), dtype in zip(ODD_SHAPES, ["float16", "bfloat16", "float32"] * len(ODD_SHAPES)):
        for make, modes in ((forward, FORWARD_MODES), (backward, BACKWARD_MODES)):
            for mode in modes:
                try:
                    yield make(shape, dtype, mode, layout)
                except ValueError:  # one value per channel in training: the contract's error
                    continue


@pytest.mark.parametrize("problem", list(odd_problems()), ids=lambda p: p.key())
def test_every_channels_last_problem_has_a_candidate_whose_default_builds(problem):
    assert problem.channels_last
    found = registry.applicable(problem, targets.resolve("cuda"))
    assert found and found[0].name in CHANNELS_LAST, [c.name for c in found]
    chosen = registry.default_candidate(problem, CUDA)
    kernel = build_kernel(problem, CUDA, chosen.name)
    assert kernel.knobs == chosen.default_for(problem, CUDA)


def test_the_public_build_picks_the_channels_last_candidates():
    import tvm_fusion as tf

    assert tf.build("bn_forward", (2, 16), "float16", target=CUDA).candidate == "bn_forward_channels_last"
    assert tf.build("bn_forward", (1, 16), "float16", target=CUDA, training=False).candidate == \
        "bn_forward_eval_channels_last"
    assert tf.build("bn_backward", (8, 4, 4, 32), "bfloat16", target=CUDA, layout="NHWC").candidate == \
        "bn_backward_channels_last"
    assert tf.build("bn_forward", (8, 32, 4, 4), "float16", target=CUDA).candidate != "bn_forward_channels_last"


# -- on a GPU: against the float64 references ----------------------------------------------
# Why each case: the ResNet stage-1 activation in NHWC; a small NHWC batch; BatchNorm1d
# on two rows (one partial), 3 x 1000 (lanes past the last channel) and 4096 x 3
# (scalar accesses, many rows); nine rows (a ragged last row step); one row in eval.
GPU_FORWARD = [((200704, 256), "float16", (True, True, True)), ((200704, 256), "bfloat16", (False, True, True)),
               ((8, 7, 7, 24), "float16", (True, True, True)), ((8, 7, 7, 24), "bfloat16", (True, False, False)),
               ((8, 7, 7, 24), "float32", (False, True, False)), ((2, 5), "float32", (True, True, False)),
               ((2, 5), "float16", (True, False, False)), ((3, 1000), "bfloat16", (True, True, True)),
               ((3, 1000), "float32", (False, True, True)), ((4096, 3), "float16", (True, True, False)),
               ((4096, 3), "float32", (True, True, True)), ((9, 40), "bfloat16", (True, True, True)),
               ((1, 7), "float16", (False, True, True))]
GPU_BACKWARD = [((200704, 256), "bfloat16", (True, True)), ((200704, 256), "float16", (False, True)),
                ((8, 7, 7, 24), "float16", (True, True)), ((8, 7, 7, 24), "float32", (True, False)),
                ((8, 7, 7, 24), "bfloat16", (False, False)), ((2, 5), "float32", (True, True)),
                ((2, 5), "bfloat16", (True, False)), ((3, 1000), "float16", (True, True)),
                ((4096, 3), "bfloat16", (True, True)), ((4096, 3), "float32", (False, True)),
                ((9, 40), "float16", (True, False)), ((1, 7), "float32", (False, True))]


def sampled(problems, big_count=1, count=3):
    """Fewer sampled configurations for the large shapes (the float64 reference of
    51M values is the slow part)."""
    for problem in problems:
        yield from channels_last_params([problem], big_count if problem.numel > 10**7 else count)


@on_gpu
@pytest.mark.parametrize("problem, candidate, configs",
                         list(sampled([forward(shape, dtype, mode) for shape, dtype, mode in GPU_FORWARD])))
def test_forward_candidates_on_gpu(problem, candidate, configs):
    import tvm

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):  # |mean| >> std too
            data = forward_inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
            check_forward(kernel, outs, problem, *data, what=f"{candidate} {knobs} mean {loc}")


@on_gpu
@pytest.mark.parametrize("problem, candidate, configs",
                         list(sampled([backward(shape, dtype, mode) for shape, dtype, mode in GPU_BACKWARD])))
def test_backward_candidates_on_gpu(problem, candidate, configs):
    check_backward_on_gpu(problem, candidate, configs)


def check_backward_on_gpu(problem, candidate: str, configs) -> None:
    """Each configuration's backward against the float64 reference, poisoned outputs,
    with channel means of 3 and 1000 (|mean| >> std)."""
    import tvm

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        for shift in (3.0, 1000.0):
            x, dy, mean, invstd, weight = backward_inputs(gen, problem, problem.dtype, shift=shift)
            args = [x.reshape(problem.shape), dy.reshape(problem.shape), mean, invstd]
            args += [weight] if problem.affine else []
            outs = run_poisoned(kernel, args, tvm.cuda(0))
            check_backward(outs, x, dy, mean, invstd, weight, problem, f"{candidate} {knobs} mean {shift}")


@on_gpu
def test_repeated_calls_reuse_no_stale_workspace():
    """A second call on new data gives the new statistics: a partial or coefficient
    left unwritten would carry the first call's (bn_stats_channels_last's (8, 32) fp16
    was right on the first call only)."""
    import tvm

    problem = forward((9, 40), "float16", (True, True, True))
    kernel = build_kernel(problem, targets.resolve("cuda"), "bn_forward_channels_last")
    gen = rng()
    for loc in (0.0, 5.0):
        data = forward_inputs(gen, problem, loc=loc)
        outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
        check_forward(kernel, outs, problem, *data, what=f"call with mean {loc}")
