"""CUDA candidates compile here (no GPU needed) and their code shows what they claim.

Checked by structure, not golden IR: warp shuffles in the source and the PTX,
16-byte loads where the candidate's vector knob says so, atomics only in a
candidate that says it uses them, no global scratch buffer beyond the function's
own parameters (a split reduction's partials among them, as its workspace), and
64-bit offsets once a tensor passes 2^31 elements."""

import dataclasses
import re

import pytest

import tvm_fusion as tf
from tvm_fusion import cost_model, registry, single_launch, targets
from helpers import candidate_params
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})

# Shapes of the README's results table plus awkward ones: C=3, odd planes, odd vocabularies.
BN_CASES = [((64, 256, 56, 56), "NCHW"), ((8, 3, 224, 224), "NCHW"), ((256, 2048, 7, 7), "NCHW"),
            ((32, 56, 56, 64), "NHWC"), ((5, 3, 7), "NCHW")]
CE_CASES = [((4096, 32000), {}), ((128, 32000), {"reduction": "none"}), ((64, 50257), {"weight": True, "label_smoothing": 0.1}),
            ((65536, 1000), {"reduction": "sum", "target_dtype": "int32"})]


def kernel_params(source: str) -> set[str]:
    names = set()
    for sig in re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?\w+\(([^)]*)\)', source):
        names.update(re.findall(r"(\w+)_ptr\b", sig))
    return names


TICKET = r"atomicAdd\(\(&\(launch_counter_ptr\[0\]\)\), 1\)"


def without_ticket(source: str) -> str:
    return re.sub(TICKET, "", source)


def cases():
    for shape, layout in BN_CASES:
        problem = tf.make_problem("bn_stats", shape, "float16", layout=layout)
        for cand in registry.applicable(problem, CUDA):
            yield pytest.param(problem, cand.name, id=f"{cand.name}-{problem.key()}")
    for shape, options in CE_CASES:
        for dtype in ("bfloat16", "float32"):
            problem = tf.make_problem("cross_entropy", shape, dtype, **options)
            for cand in registry.applicable(problem, CUDA):
                yield pytest.param(problem, cand.name, id=f"{cand.name}-{problem.key()}")


@pytest.mark.parametrize("problem, candidate", list(cases()))
def test_cuda_source_shows_the_strategy(problem, candidate):
    kernel = build_kernel(problem, CUDA, candidate)
    source = kernel.device_source()
    cand = registry.get(candidate)
    shuffles = "__shfl_down_sync" in source or "__shfl_xor_sync" in source
    assert shuffles == cand.claims.get("shuffles", False)
    # The launch ticket of a merged kernel (single_launch) is no atomic of the strategy's.
    assert ("atomic" in without_ticket(source).lower()) == cand.claims.get("atomics", False)
    # A split candidate's partials are the function's workspace parameters, passed by
    # the caller per stream (kernel.compiled_form), never TVM's per-thread pool.
    func_params = {name for name, _, _ in kernel.params + kernel.workspace} | {single_launch.COUNTER}
    assert kernel_params(source) <= func_params, "a kernel takes a global buffer the function does not own"
    assert "TVMBackendAllocWorkspace" not in kernel.executable.mod.inspect_source()


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("problem, candidate", list(cases())[::2])
def test_nvcc_compiles_and_ptx_has_shuffles_and_vector_loads(problem, candidate):
    kernel = build_kernel(problem, CUDA, candidate)
    report = cuda_report(kernel)
    cand = registry.get(candidate)
    assert (report.shuffles > 0) == cand.claims.get("shuffles", False)
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
    vector = kernel.knobs.as_dict().get("vector", 16 // DTYPE_BYTES[problem.dtype])
    if cand.claims.get("vector_loads") and vector * DTYPE_BYTES[problem.dtype] == 16 and not ragged(problem):
        assert report.vector_loads > 0, "the candidate says 16-byte loads but the PTX has none"
    tickets = len(re.findall(TICKET, kernel.device_source()))
    assert (report.atomics - tickets > 0) == cand.claims.get("atomics", False)


def ragged(problem) -> bool:
    """No 16-byte vector fits the rows (an odd V or plane): loads stay scalar."""
    contiguous = getattr(problem, "classes", None) or (problem.channels if problem.channels_last else problem.shape[2])
    return contiguous % (16 // DTYPE_BYTES[problem.dtype]) != 0


def test_int64_offsets_past_two_to_the_31():
    problem = tf.make_problem("cross_entropy", (16384, 151936), "bfloat16")
    assert problem.numel > 2**31
    source = tf.build("cross_entropy", shape=problem.shape, dtype="bfloat16", target=CUDA).device_source()
    assert "(int64_t)" in source or "long long" in source or "int64_t" in source
    small = tf.build("cross_entropy", shape=(4096, 32000), dtype="bfloat16", target=CUDA).device_source()
    assert "int64_t)blockIdx" not in small


# The shapes where the H200 gave garbage (variance up to 3e31): splits * rows outrun
# the rows there, so the last blocks of kernel 1 own no row at all.
@pytest.mark.parametrize("shape, dtype", [((100352, 64), "float16"), ((3136, 2048), "float32"),
                                          ((16, 14, 14, 32), "float16")])
def test_channels_last_zeroes_every_partial_before_the_row_guard(shape, dtype):
    problem = tf.make_problem("bn_stats", shape, dtype, layout="NHWC")
    cand, rows = registry.get("bn_stats_channels_last"), problem.shape[0]
    knobs = cand.default_for(problem, CUDA)  # an even split now: more splits until a block owns no row

    def empty_block(k):
        per_step = k.splits * k.rows * k.unroll
        steps = -(-rows // per_step)
        return per_step * steps - rows >= steps * k.rows * k.unroll

    knobs = next(k for k in (dataclasses.replace(knobs, splits=s) for s in range(knobs.splits, 4 * rows))
                 if empty_block(k))
    kernel = build_kernel(problem, CUDA, "bn_stats_channels_last", knobs)
    source = kernel.device_source()
    body = source[source.index("{", source.index("void __launch_bounds__", source.index("void __launch_bounds__") + 1)):]
    first_kernel = body[: body.index("extern \"C\"")]
    assert "_init" in first_kernel
    assert first_kernel.index("_init") < first_kernel.index("if ("), "partials are zeroed only under the row guard"


def first_kernel(source: str) -> str:
    """The body of the first kernel (the source declares every kernel, then defines them)."""
    start = source.index("{", source.index("void __launch_bounds__", source.index("void __launch_bounds__") + 1))
    end = source.find('extern "C"', start)
    return source[start : end if end >= 0 else len(source)]


# Few rows per lane: the row loop of one step vanished and TVM moved the row guard
# over the partials' write-back, so lanes past the last row left stale workspace for
# the finalize kernel (the H200 sweep: (8, 32) fp16 right on the first call only).
@pytest.mark.parametrize("rows", [4, 5, 8, 9, 31, 64, 200, 1000])
def test_channels_last_writes_every_partial_for_every_config(rows):
    import random

    problem = tf.make_problem("bn_stats", (rows, 32), "float16", layout="NHWC")
    cand = registry.get("bn_stats_channels_last")
    configs = cand.all_configs(problem, CUDA)
    for knobs in [cand.default_for(problem, CUDA)] + random.Random(rows).sample(configs, min(6, len(configs))):
        if knobs.channel_lanes * knobs.rows > 1024:
            continue
        body = first_kernel(build_kernel(problem, CUDA, cand.name, knobs).device_source())
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        # With rows and splits > 1 the lanes write a shared tile and one thread a
        # channel stores the block's sums (rows_through_shared): check the lanes'.
        tile = "_shared" if "_rf_shared_ptr" in body else ""
        lanes = rf"(?:\*\(float[24]\*\)\()?moments_v[01]_rf{tile}_ptr[\[ ]"
        stores = [i for i, line in enumerate(lines) if re.match(lanes, line)]
        assert stores, body
        for i in stores:  # a channel guard (lanes past C) is fine, a row guard is not
            guard = lines[i - 1]
            assert not (guard.startswith("if (") and "threadIdx.y" in guard), f"{knobs}: partials under {guard}"


def test_channels_last_leaves_fewer_than_four_rows_to_the_fallback():
    for rows in (1, 2, 3):
        problem = tf.make_problem("bn_stats", (rows, 64), "float32", layout="NHWC")
        names = [c.name for c in registry.applicable(problem, CUDA)]
        assert "bn_stats_channels_last" not in names and "bn_stats_block_per_channel" in names


def barriers_under_a_guard(source: str) -> list[str]:
    """The ``if`` lines that enclose a ``__syncthreads()``: a barrier that only some
    threads reach deadlocks the block (a GPU hang, not an error). The last block's
    guard of a merged kernel (single_launch) is not one: every thread of the block
    reads that one shared flag after a barrier."""
    def guard(line: str) -> bool:
        return line.startswith("if") and not line.startswith(LAST_BLOCK_GUARD)

    return [next(o for o in reversed(opened) if guard(o)) for text, opened in scoped_lines(source)
            if "__syncthreads" in text and any(guard(o) for o in opened)]


LAST_BLOCK_GUARD = "if (launch_is_last_ptr[0] != 0) {"


def scoped_lines(source: str):
    """Each stripped line of CUDA ``source`` with the lines that opened the braces
    around it (outermost first)."""
    opened: list[str] = []
    for line in source.splitlines():
        text = line.strip()
        yield text, list(opened)
        for char in text:
            if char == "{":
                opened.append(text)
            elif char == "}" and opened:
                opened.pop()


def shared_stores_by_every_thread(source: str) -> list[str]:
    """Stores into a ``__shared__`` buffer that no one-thread guard (``threadIdx.x ==
    0``, ``< 1``, a warp's lane 0) encloses: every thread writing a buffer the others
    read. A multi-warp allreduce leaves its result in shared memory (``red_result``),
    and StorageRewrite, which runs before that lowering, once gave a one-float
    register born where the statistic died to the statistic's buffer: every thread
    of cross_entropy_grad's row kernel then stored its coefficient there while others
    still read the row's sum. Stores indexed by the thread are each thread's own slot."""
    shared = set(re.findall(r"__shared__ alignas\(\d+\) \w+ (\w+)\[", source))
    found = []
    for text, opened in scoped_lines(source):
        store = re.match(r"(?:\(\(volatile \w+\*\))?(\w+)\)?\[([^\]]*)\] = ", text)
        # A slot indexed by the thread (a channels-last block's tile of partials) is
        # each thread's own: only a slot every thread shares is the hazard.
        if store and store.group(1) in shared and "threadIdx" not in store.group(2):
            guards = " ".join(o for o in opened if o.startswith("if"))
            if not re.search(r"threadIdx\.x\) == 0|% 32\) == 0|threadIdx\.x\) < 1\)", guards):
                found.append(text)
    return found


def knob_cases():
    """Every CUDA candidate over shapes whose tails leave threads idle, with its
    default and a few seeded configurations of its space."""
    shapes = [("cross_entropy", (24, 724), "float32", {"weight": True, "reduction": "sum"}),
              ("cross_entropy", (3, 1000), "bfloat16", {"label_smoothing": 0.1}),
              ("cross_entropy", (5, 50257), "float16", {}),
              ("bn_stats", (4, 16, 23), "bfloat16", {}), ("bn_stats", (3, 7, 5, 96), "float16", {"layout": "NHWC"}),
              ("bn_stats", (8, 3, 1009), "float32", {})]
    yield from candidate_params([tf.make_problem(op, shape, dtype, **options) for op, shape, dtype, options in shapes],
                                CUDA, 5)  # with the default: 6 builds a case (9 took 93 s of CI)


@pytest.mark.parametrize("problem, candidate, configs", list(knob_cases()))
def test_no_barrier_under_a_thread_guard(problem, candidate, configs):
    for knobs in configs:
        try:
            kernel = build_kernel(problem, CUDA, candidate, knobs)
        except Exception as err:  # noqa: BLE001 - a config the space allows but TVM rejects is not this test's
            if "launch_bounds" in str(err) or "threads" in str(err):
                continue
            raise
        source = kernel.device_source()
        assert not barriers_under_a_guard(source), f"{knobs}: {barriers_under_a_guard(source)[:2]}"
        assert not shared_stores_by_every_thread(source), f"{knobs}: {shared_stores_by_every_thread(source)[:2]}"


# Warp-level candidates hand values between lanes by shuffles only: shared memory
# written by lane 0 and read by the others raced (no __syncwarp between).
@pytest.mark.parametrize("problem, candidate", [
    (tf.make_problem("cross_entropy", (44, 37), "bfloat16", label_smoothing=0.3), "cross_entropy_warp_per_row"),
    (tf.make_problem("cross_entropy", (64, 1000), "float16"), "cross_entropy_warp_per_row"),
    (tf.make_problem("bn_stats", (4, 16, 23), "bfloat16"), "bn_stats_warp_per_channel"),
    (tf.make_problem("bn_stats", (8, 4096, 49), "float16"), "bn_stats_warp_per_channel"),
], ids=lambda v: getattr(v, "key", lambda: v)())
def test_warp_candidates_use_no_shared_memory_in_the_row_kernel(problem, candidate):
    assert "__shared__" not in first_kernel(build_kernel(problem, CUDA, candidate).device_source())


@pytest.mark.parametrize("shape", [(4, 1000), (15, 1000), (7, 3072), (4, 4096)])
def test_channels_last_defaults_build_for_wide_rows(shape):
    problem = tf.make_problem("bn_stats", shape, "float32", layout="NHWC")
    kernel = build_kernel(problem, CUDA, "bn_stats_channels_last")
    assert kernel.knobs.splits * kernel.knobs.rows >= 2


SIZES = {"float": 4, "half": 2, "nv_bfloat16": 2, "int": 4, "uint": 4, "double": 8}


def static_shared_bytes(source: str) -> int:
    """The largest sum of ``__shared__`` arrays over the kernels of ``source``."""
    most = 0
    for body in source.split("extern \"C\" __global__")[1:]:
        most = max(most, sum(SIZES.get(t, 4) * int(n) for t, n in
                             re.findall(r"__shared__ alignas\(\d+\) (\w+) \w+\[(\d+)\]", body)))
    return most


# Static shared memory is capped at 48 KB a block: past it NVRTC refuses the kernel
# (a channels-last tile of rows=4 x 256 lanes x 8 channels x two sums was 64 KB).
@pytest.mark.parametrize("op, shape, dtype, layout", [
    ("bn_stats", (64, 56, 56, 256), "bfloat16", "NHWC"), ("bn_forward", (64, 56, 56, 256), "float16", "NHWC"),
    ("bn_backward", (32, 28, 28, 512), "float32", "NHWC"), ("bn_forward", (256, 2048, 7, 7), "float16", "NCHW"),
    ("bn_backward", (64, 512, 7, 7), "bfloat16", "NCHW")])
def test_sampled_configs_fit_static_shared_memory(op, shape, dtype, layout):
    import random

    problem = tf.make_problem(op, shape, dtype, layout=layout)
    for cand in registry.applicable(problem, CUDA):
        if not cand.name.endswith(("channels_last", "small_plane")):
            continue
        configs = cand.all_configs(problem, CUDA)
        for knobs in random.Random(7).sample(configs, min(12, len(configs))):
            if knobs.channel_lanes * knobs.rows > 1024:
                continue
            source = build_kernel(problem, CUDA, cand.name, knobs).device_source()
            assert static_shared_bytes(source) <= 48 * 1024, (cand.name, knobs)


def test_rows_go_through_shared_memory_only_when_rows_divide_the_vector():
    """rows_through_shared deals a block's channels to its threads ``vector / rows``
    each; with rows > vector the spare threads, guarded only by the tensor's channel
    bound, overwrote the next block's partials (13 sampled configurations on the H200)."""
    problem = tf.make_problem("bn_stats", (200704, 256), "float16", layout="NHWC")
    cand = registry.get("bn_stats_channels_last")
    cases = [dict(rows=8, vector=8, channel_lanes=32, shared=True), dict(rows=4, vector=2, channel_lanes=64, shared=False),
             dict(rows=8, vector=4, channel_lanes=32, shared=False), dict(rows=2, vector=8, channel_lanes=16, shared=True)]
    for case in cases:
        shared = case.pop("shared")
        knobs = cand.knobs(**dict(cand.default_for(problem, CUDA).__dict__, **case))
        source = build_kernel(problem, CUDA, cand.name, knobs).device_source()
        assert ("_rf_shared_ptr" in source) == shared, knobs


def _row_kernel_ptx(ptx: str) -> str:
    """The PTX of ``main_kernel`` (the row kernel) alone."""
    start = ptx.index(".entry main_kernel(")
    end = ptx.find(".entry", start + 1)
    return ptx[start:] if end < 0 else ptx[start:end]


V4_LOAD = r"ld\.global(?:\.nc)?(?:\.L\d::\w+)*\.v4\.(?:u|b|f)32"


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, per_lane", [((65536, 1000), "float16", 4), ((64, 4096), "bfloat16", 16),
                                                    ((512, 1000), "float32", 8), ((1000, 8), "float16", 1)])
def test_padded_warp_rows_load_each_granule_once_and_unguarded(shape, dtype, per_lane):
    """``cross_entropy_warp_per_row_padded`` (default knobs): a lane's 16-byte loads in
    the row kernel's PTX are exactly its granules (Gp / 32), none predicated. nvcc
    keeps the row in registers for the second pass, so the row is read once; the
    unpadded ``cross_entropy_warp_per_row`` guards every load, and its second pass
    loads the row again."""
    problem = tf.make_problem("cross_entropy", shape, dtype)
    ptx = _row_kernel_ptx(cuda_report(build_kernel(problem, CUDA, "cross_entropy_warp_per_row_padded")).ptx)
    assert len(re.findall(V4_LOAD, ptx)) == per_lane
    assert not re.findall(r"@%p\d+\s+" + V4_LOAD, ptx), "a granule load is predicated"
    if shape == (65536, 1000):
        plain = _row_kernel_ptx(cuda_report(build_kernel(problem, CUDA, "cross_entropy_warp_per_row")).ptx)
        assert len(re.findall(V4_LOAD, plain)) > per_lane  # its second pass loads the row again


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_padded_block_per_channel_loads_every_granule_unguarded():
    """``bn_stats_block_per_channel_padded`` on 16x512x28x28 bf16 (default knobs, 256
    threads): a lane's 8 steps unrolled, 16-byte loads none predicated and no branch
    between them (7 in the PTX: the last step is all pads, every lane's granule the
    channel's last one); ``bn_stats_block_per_channel`` keeps one load in a loop of
    guarded steps."""
    problem = tf.make_problem("bn_stats", (16, 512, 28, 28), "bfloat16")
    ptx = cuda_report(build_kernel(problem, CUDA, "bn_stats_block_per_channel_padded")).ptx
    assert len(re.findall(V4_LOAD, ptx)) >= 7
    assert not re.findall(r"@%p\d+\s+" + V4_LOAD, ptx)
    loads = [m.start() for m in re.finditer(V4_LOAD, ptx)]
    assert not re.search(r"@%p\d+\s+bra", ptx[loads[0]:loads[-1]]), "a branch between the granule loads"
    assert len(re.findall(V4_LOAD, cuda_report(build_kernel(problem, CUDA, "bn_stats_block_per_channel")).ptx)) == 1


@pytest.mark.parametrize("op, shape, options, candidate, chunks", [
    ("cross_entropy", (65536, 1000), {}, "cross_entropy_warp_per_row_padded", 64),
    ("cross_entropy", (50000, 1000), {"reduction": "none"}, "cross_entropy_warp_per_row_padded", 50),
    ("cross_entropy", (50000, 4096), {"reduction": "sum", "weight": True}, "cross_entropy_online", 50),
    ("cross_entropy_grad", (50000, 1000), {}, "cross_entropy_grad_warp_per_row_padded", 50),
    ("cross_entropy", (65537, 1000), {}, "cross_entropy_warp_per_row_padded", 1),
    ("cross_entropy", (16383, 1000), {}, "cross_entropy_warp_per_row_padded", 1),
])
def test_two_level_batch_stage_reduces_across_lanes(op, shape, options, candidate, chunks):
    """From 16384 rows a batch stage is cut into chunks that divide the rows (an uneven
    cut made TVM drop the cross-thread lowering: every lane read-modify-wrote the
    partial), one block each: each kernel that writes chunk partials reduces across its
    lanes with shuffles first, and the final block, which that kernel's last block runs
    (single_launch: after its fence), reads exactly ``chunks`` of them. A prime row
    count, or fewer than 16384 rows, keeps one block."""
    from test_bn_channels_last_cuda import kernel_bodies
    from tvm_fusion.schedules.cuda.common import batch_chunks

    assert batch_chunks(shape[0]) == chunks
    problem = tf.make_problem(op, shape, "bfloat16", **options)
    source = build_kernel(problem, CUDA, candidate).device_source()
    bodies = [body for _, _, body in kernel_bodies(source)]
    writers = [body for body in bodies if re.search(r"\w+_rf_ptr\[[^\]]*\] = ", body)]
    if chunks == 1:
        assert not writers and "_rf_ptr" not in source
        return
    assert writers, "no kernel writes chunk partials"
    readers = []
    for body in writers:
        own, merged, last_block = body.partition("__threadfence();")
        assert merged, "the final block is not merged into the partials' kernel"
        assert "__shfl_down_sync" in own, "a chunk's partial is written without a cross-lane reduction"
        assert f"blockIdx.x) * {shape[0] // chunks})" in own  # a block per chunk of rows
        readers.append(last_block)
    assert all(f"threadIdx.x) < {chunks})" in body for body in readers)  # 256 lanes, a partial each


@pytest.mark.parametrize("op, candidate, splits", [("bn_stats", "bn_stats_split_plane", 50), ("bn_stats", "bn_stats_split_plane", 25),
                                                  ("bn_forward", "bn_forward_split_plane", 50),
                                                  ("bn_backward", "bn_backward_split_plane", 50)])
def test_a_split_plane_configuration_builds_exactly_where_the_candidate_says(op, candidate, splits):
    """``Candidate.builds`` (what keeps the cost model from ranking a configuration)
    against TVM's lowering, on 32x96x40x40 bf16 (a run of 6400 vectors a channel): at
    50 splits the run is 128 vectors, at 25 it is 256, so both threads = run and
    threads != run occur with every batch."""
    problem = tf.make_problem(op, (32, 96, 40, 40), "bfloat16")
    cand = registry.get(candidate)
    default = cand.default_for(problem, CUDA)
    outcomes = set()
    for threads in (128, 256, 512):
        for unroll in (1, 2, 4):
            knobs = cand.knobs(**{**default.as_dict(), "splits": splits, "threads": threads, "unroll": unroll})
            assert knobs in cand.all_configs(problem, CUDA)
            try:
                build_kernel(problem, CUDA, candidate, knobs).device_source()
                built = True
            except Exception as err:  # noqa: BLE001 - the lowering's InternalError
                assert "Divide by zero" in str(err), err
                built = False
            assert cand.builds(problem, knobs) == built, knobs
            assert cost_model.launches(problem, candidate, knobs, CUDA) == built
            outcomes.add(built)
    assert outcomes == {True, False}


def test_tvm_compiles_a_grid_wide_barrier_for_a_cooperative_launch():
    """What a grid-wide persistent BatchNorm would stand on (bn_forward_persistent's
    docstring): TVM 0.27 compiles a kernel marked for a cooperative launch, and
    ``T.cuda.grid_sync()`` becomes ``cooperative_groups::this_grid().sync()`` between a
    block's write of its partial and its read of another block's."""
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def neighbours(a: T.Buffer((128, 256), "float32"), partial: T.Buffer((128,), "float32"),
                   b: T.Buffer((128, 256), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.kernel_launch_params": ["tirx.use_cooperative_launch"]})
        bx = T.launch_thread("blockIdx.x", 128)
        tx = T.launch_thread("threadIdx.x", 256)
        if tx == 0:
            partial[bx] = a[bx, 0]
        T.cuda.grid_sync()
        b[bx, tx] = a[bx, tx] + partial[(bx + 1) % 128]

    executable = tvm.compile(tvm.IRModule({"main": neighbours}), target=CUDA)
    source = "\n".join(m.inspect_source() for m in executable.mod.imports)
    assert "#include <cooperative_groups.h>" in source
    assert re.search(r"void tvm_builtin_cuda_grid_sync\(\) \{\s*namespace cg = cooperative_groups;\s*"
                     r"cg::this_grid\(\)\.sync\(\);", source), source
    body = source[source.rindex("neighbours_kernel("):]  # the definition, after the declaration
    write, sync, read = (body.index(s) for s in ("partial_ptr[((int)blockIdx.x)] =", "tvm_builtin_cuda_grid_sync();",
                                                 "partial_ptr[((((int)blockIdx.x) + 1) & 127)]"))
    assert write < sync < read


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
def test_online_batch_puts_a_lanes_loads_in_straight_line_code():
    """cross_entropy_online's ``batch``: CE 128x32000 fp16 at 1024 lanes is 4 steps a lane.
    Compiled as TVM compiles (``cuda_report``: nvcc with fast math), batch 1's loop is
    unrolled but each step's 16-byte load sits behind its own branch, after the previous
    step's exps; at batch 4 the first three steps' loads have no branch between them, so
    they can be in flight together (the module's docstring)."""
    online = registry.get("cross_entropy_online")
    problem = tf.make_problem("cross_entropy", (128, 32000), "float16")

    def ptx(batch):
        return cuda_report(build_kernel(problem, CUDA, online.name, online.knobs(threads=1024, unroll=16, batch=batch))).ptx

    loads = r"ld\.global\.nc\.v4\.u32"
    rolled, batched = ptx(1), ptx(4)
    starts = [m.start() for m in re.finditer(loads, rolled)]
    assert len(starts) == 4
    assert all("bra" in rolled[a:b] for a, b in zip(starts, starts[1:])), "batch 1: a branch before each next load"
    assert len(re.findall(loads, batched)) == 4
    first, *_, third = [m.start() for m in re.finditer(loads, batched)][:3]
    assert "bra" not in batched[first:third], "no branch between the first three steps' loads"
