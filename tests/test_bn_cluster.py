"""bn_forward_cluster (and its smaller parts, bn_forward_cluster_half and _quarter) and
bn_backward_cluster: the grid-wide BatchNorm kernels without rounds, a channel's parts
one thread-block cluster, a cluster barrier between the partial sums and the map
(tvm_fusion.grid_barrier.before_cluster).

Where they apply (at most 8 parts a channel: a portable cluster), what their CUDA code
must show (one cluster barrier between the partials' stores and their loads, no fence
beside it, under no condition; a block a task; no grid barrier), that the kernel with
the barrier alone is launched in clusters of P (no cooperative launch), and that a grid
which is no whole number of clusters is refused. Their spills, trace replays and GPU
checks (every knob sample against the float64 reference, |mean| >> std included,
outputs poisoned) are tests/test_bn_grid_persistent.py's, over every grid-wide
candidate."""

import re

import pytest
import tvm

from helpers import check_cluster_barrier
from test_bn_grid_persistent import backward_problem, kernel_bodies, lowered, problem
from tvm_fusion import grid_barrier, registry, targets
from tvm_fusion.compute import bn_stats
from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
FORWARD = registry.get("bn_forward_cluster")
BACKWARD = registry.get("bn_backward_cluster")
HALF = registry.get("bn_forward_cluster_half")
QUARTER = registry.get("bn_forward_cluster_quarter")
ONE_LAUNCH = registry.get("bn_forward_cluster_half_one_launch")

# (shape, dtype, parts): 401 KB fp16 channels in 2 parts (x) and 4 (x and dy), 802 KB
# bf16 channels in 4 and 8, 256 KB fp32 ones, odd 15x15 planes (scalar loads).
FORWARD_APPLIES = [((64, 256, 56, 56), "float16", 2), ((32, 64, 112, 112), "bfloat16", 4),
                   ((16, 8, 64, 64), "float32", 2), ((1024, 3, 15, 15), "float16", 4)]
BACKWARD_APPLIES = [((64, 256, 56, 56), "float16", 4), ((32, 64, 112, 112), "bfloat16", 8),
                    ((16, 8, 64, 64), "float32", 4), ((1024, 3, 15, 15), "float16", 8)]
# The forward's smaller parts: twice (the parts of two copies, as x and dy take) and four
# times the parts, where that is at most 8.
HALF_APPLIES = BACKWARD_APPLIES
QUARTER_APPLIES = [((64, 256, 56, 56), "float16", 8), ((16, 8, 64, 64), "float32", 8)]


@pytest.mark.parametrize("cand, make, copies, shape, dtype, parts",
                         [(FORWARD, problem, 1, *case) for case in FORWARD_APPLIES]
                         + [(HALF, problem, 2, *case) for case in HALF_APPLIES]
                         + [(QUARTER, problem, 4, *case) for case in QUARTER_APPLIES]
                         + [(BACKWARD, backward_problem, 2, *case) for case in BACKWARD_APPLIES],
                         ids=lambda v: getattr(v, "name", None))
def test_applies_in_parts_of_at_most_a_portable_cluster(cand, make, copies, shape, dtype, parts):
    p = make(shape, dtype)
    assert cand.applies(p) and bn_stats.parts(p, copies) == parts == cand.cluster(p)
    assert "grid" not in cand.choices(p, CUDA) and cand.grid(cand.default_for(p, CUDA)) is None
    assert not cand.applies(make(shape, dtype, training=False))


def test_default_lanes_keep_the_bytes_a_lane():
    """A part of half (a quarter of) the bytes: half (a quarter of) the lanes by default,
    the largest choice under 1024 / 2 (/ 4); the plain cluster candidates keep the
    grid-wide default."""
    p = problem((64, 256, 56, 56), "float16")
    assert FORWARD.default_for(p, CUDA).threads == registry.get("bn_forward_grid_persistent").default_for(p, CUDA).threads == 896
    assert HALF.default_for(p, CUDA).threads == 448 and QUARTER.default_for(p, CUDA).threads == 224
    b = backward_problem((64, 256, 56, 56), "float16")
    assert BACKWARD.default_for(b, CUDA).threads == registry.get("bn_backward_grid_persistent").default_for(b, CUDA).threads


@pytest.mark.parametrize("shape, dtype, half, one", [
    ((64, 256, 56, 56), "float16", True, True), ((64, 256, 56, 56), "bfloat16", True, True),
    ((64, 256, 56, 56), "float32", True, True),
    # 512 tasks, 3.9 an SM: the H100 timed cluster_half 4% slower than grid-wide, one launch 5% faster
    ((32, 64, 112, 112), "float16", False, True),
    ((8, 64, 112, 112), "float16", False, False),   # 64 channels: the grid-wide kernel's largest grid is not the SMs
])
def test_the_one_launch_forward_is_preferred_where_it_was_faster(shape, dtype, half, one):
    """bn_forward_cluster_half_one_launch where the grid-wide forward would be and each SM
    gets three tasks or more, bn_forward_cluster_half (four or more) after it, both ahead of
    the grid-wide kernel in dispatch order (their docstrings' H100 tables); the other
    cluster candidates never."""
    p, b = problem(shape, dtype), backward_problem(shape, dtype)
    assert HALF.prefers(p, CUDA) == half and ONE_LAUNCH.prefers(p, CUDA) == one
    assert not any(c.prefers(p, CUDA) for c in (FORWARD, QUARTER)) and not BACKWARD.prefers(b, CUDA)
    assert (registry.default_candidate(p, CUDA).name == ONE_LAUNCH.name) == one


@pytest.mark.parametrize("cand, make", [(FORWARD, problem), (BACKWARD, backward_problem)], ids=["forward", "backward"])
def test_does_not_apply_past_eight_parts(cand, make):
    """32x64x112x112 fp32: 1.6 MB a channel, 8 parts of x and 16 of x and dy; the
    backward's are no portable cluster, while its grid-wide kernel takes them."""
    p = make((32, 64, 112, 112), "float32")
    parts = bn_stats.parts(p, cand.copies)
    assert cand.applies(p) == (parts <= 8) and registry.get(cand.name.replace("cluster", "grid_persistent")).applies(p)


def check_cluster_source(kernel, partials: str, parts: int) -> str:
    """A block a (channel, part) task, no rounds; one cluster barrier (no fence beside
    it), after the partials' stores and before their loads, under no condition; no
    grid barrier. Returns the first kernel's source."""
    first, outputs = kernel_bodies(kernel.device_source())
    assert "cluster_sync" not in outputs and "grid_sync" not in first + outputs
    assert not re.search(r"for \(int c_p_fused", first), "no rounds"
    assert first.count(grid_barrier.CLUSTER_SYNC_CALL) == 1
    at = first.index(grid_barrier.CLUSTER_SYNC_CALL)
    check_cluster_barrier(kernel.device_source(), first)
    stored = [m.start() for m in re.finditer(rf"\b{partials}_v[01]_ptr\[[^\]]*\] =", first)]
    loaded = [m.start() for m in re.finditer(rf"= \([^;]*\b{partials}_v[01]_ptr\[", first)]
    assert stored and loaded and max(stored) < at < min(loaded)
    assert first[:at].count("{") - first[:at].count("}") == 1, "the barrier under a condition"
    # A channel's parts are consecutive blocks: the part is blockIdx.x % P.
    assert f"((int)blockIdx.x) & {parts - 1}" in first or f"((int)blockIdx.x) % {parts}" in first
    return first


@pytest.mark.parametrize("cand, shape, dtype, parts", [(FORWARD, *case) for case in FORWARD_APPLIES]
                         + [(HALF, *case) for case in HALF_APPLIES] + [(QUARTER, *case) for case in QUARTER_APPLIES],
                         ids=lambda v: getattr(v, "name", None))
def test_forward_cuda_source_has_the_cluster_barrier(cand, shape, dtype, parts):
    kernel = build_kernel(problem(shape, dtype), CUDA, cand.name)
    first = check_cluster_source(kernel, "part_moments", parts)
    assert "running_mean_out_ptr" not in first and "save_mean_ptr" not in first


@pytest.mark.parametrize("shape, dtype, parts", BACKWARD_APPLIES)
def test_backward_cuda_source_has_the_cluster_barrier(shape, dtype, parts):
    kernel = build_kernel(backward_problem(shape, dtype), CUDA, BACKWARD.name)
    first = check_cluster_source(kernel, "part_grad_sums", parts)
    at = first.index(grid_barrier.CLUSTER_SYNC_CALL)
    assert not re.search(r"\b(x|dy)_ptr\b", first[at:]), "dx from the copies only"


@pytest.mark.parametrize("shape, dtype, parts", HALF_APPLIES)
@pytest.mark.parametrize("affine, track", [(True, True), (False, False)])
def test_one_launch_writes_each_channels_outputs_from_its_first_block(shape, dtype, parts, affine, track):
    """bn_forward_cluster_half_one_launch: one kernel, half's cluster barrier; each
    per-channel output stored once, after the barrier, by thread 0 of the channel's
    first block (part 0); the running statistics (updated in place by the torch op)
    read in that same guarded statement only."""
    p = problem(shape, dtype, affine=affine, track_running=track)
    kernel = build_kernel(p, CUDA, ONE_LAUNCH.name)
    source = kernel.device_source()
    assert source.count('extern "C" __global__') == 2, "one kernel (its declaration and its definition)"
    body = source.split('extern "C" __global__')[-1]
    at = body.index(grid_barrier.CLUSTER_SYNC_CALL)
    assert ONE_LAUNCH.cluster(p) == parts and body.count(grid_barrier.CLUSTER_SYNC_CALL) == 1
    guard = re.compile(rf"if \(+\(int\)blockIdx\.x\) (& {parts - 1}|% {parts})\) < 1\) && \(\(\(int\)threadIdx\.x\) < 1\)\) \{{")
    for name in channel_outputs(p):
        stores = [m.start() for m in re.finditer(rf"\b{name}_ptr\[[^\]]*\] =", body)]
        assert len(stores) == 1 and stores[0] > at, name
        assert guard.match(body[body.rindex("if (", 0, stores[0]):stores[0]]), name
    for name in ("running_mean", "running_var") if track else ():
        reads = [m.start() for m in re.finditer(rf"\b{name}_ptr\[", body)]
        assert len(reads) == 1 and body.rindex("if (", 0, reads[0]) == body.rindex("if (", 0, body.index(f"{name}_out_ptr["))
    # The rest is bn_forward_cluster_half's kernel: the same barrier, loads and stores of x and y.
    half = build_kernel(p, CUDA, HALF.name).device_source().split('extern "C" __global__')[-2]
    for pattern in (r"\*\(uint4\*\)\(x_ptr", r"\*\(uint4\*\)\(y_ptr", "cluster_sync"):
        assert len(re.findall(pattern, body)) == len(re.findall(pattern, half)), pattern
    assert ONE_LAUNCH.applies(p) == HALF.applies(p)


def test_one_launch_builds_as_the_tuner_builds_with_its_partials_on_the_host():
    """The tuner builds a trial without workspace parameters. The one-launch kernel's
    cross-block partials are then used by that kernel alone, and TVM placed their
    allocation inside it, which CUDA code generation refuses; launch_order.host_scratch
    allocates them on the host before the launch, as it does for two kernels."""
    from tvm_fusion.compute import prim_func
    from tvm_fusion.tuner import build_module

    p = problem((64, 256, 56, 56), "float16")
    for cand, kernels in ((HALF, 2), (ONE_LAUNCH, 1)):
        built = build_module(cand.apply(prim_func(p, cand.algorithm), CUDA, tunable=True).mod, CUDA)
        assert built.imports[0].inspect_source().count('extern "C" __global__') == 2 * kernels
        assert "TVMBackendAllocWorkspace" in built.inspect_source("ll")


def lowered_launches(kernel, p):
    """The ``blockIdx.x`` and ``clusterCtaIdx.x`` launch dimensions (name, extent) of the
    kernel's functions after launch_order's pipeline, in order, and that pipeline's TIR."""
    text = "".join(f.script() for f in lowered(kernel, p).functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    return re.findall(r'T.launch_thread\("(blockIdx.x|clusterCtaIdx.x)", (\d+)\)', text), text


@pytest.mark.parametrize("cand, make", [(FORWARD, problem), (BACKWARD, backward_problem)], ids=["forward", "backward"])
def test_only_the_kernel_with_the_barrier_is_launched_in_clusters(cand, make, tmp_path):
    """launch_order's pipeline gives the first kernel a ``clusterCtaIdx.x`` launch
    dimension of P inside its ``blockIdx.x`` one, not the per-channel outputs' kernel,
    and no cooperative tag; the compiled library carries that launch dimension once (TVM's
    CUDA runtime launches such a kernel with cuLaunchKernelEx and that cluster size)."""
    p = make((64, 256, 56, 56), "float16")
    kernel = build_kernel(p, CUDA, cand.name)
    launches, text = lowered_launches(kernel, p)
    blocks = p.channels * cand.cluster(p)
    assert launches[:2] == [("blockIdx.x", str(blocks)), ("clusterCtaIdx.x", str(cand.cluster(p)))], launches
    assert [name for name, _ in launches].count("clusterCtaIdx.x") == 1 and grid_barrier.COOPERATIVE not in text
    kernel.executable.export_library(str(tmp_path / "k.so"))
    assert (tmp_path / "k.so").read_bytes().count(b"clusterCtaIdx.x") == 1


def test_a_grid_that_is_no_whole_number_of_clusters_is_refused():
    bx = tvm.tirx.IterVar(tvm.ir.Range(0, 6), tvm.tirx.Var("bx", "int32"), 1, "blockIdx.x")
    marked = tvm.tirx.AttrStmt(0, grid_barrier.CLUSTER_KEY, 4, tvm.tirx.Evaluate(0))
    func = tvm.tirx.PrimFunc([], tvm.tirx.AttrStmt(bx, "thread_extent", 6, marked))
    with pytest.raises(ValueError, match="no whole number of clusters of 4"):
        grid_barrier.with_barriers(func)
    ok = tvm.tirx.PrimFunc([], tvm.tirx.AttrStmt(bx, "thread_extent", 8, marked))
    assert 'T.launch_thread("clusterCtaIdx.x", 4)' in grid_barrier.with_barriers(ok).script()


def test_no_cluster_candidate_on_an_arch_without_clusters():
    """sm_80 has no thread-block clusters: the candidates decline (the tuner's space skips
    them, a build by name names the arch), and the half-part forward is not preferred."""
    sm80 = targets.resolve({"kind": "cuda", "arch": "sm_80"})
    assert targets.has_clusters(CUDA) and not targets.has_clusters(sm80) and not targets.has_clusters("llvm")
    p = problem((64, 256, 56, 56), "float16")
    assert HALF.prefers(p, CUDA) and not HALF.prefers(p, sm80)
    assert registry.default_candidate(p, sm80).name != HALF.name
    for cand, make in ((FORWARD, problem), (HALF, problem), (QUARTER, problem), (BACKWARD, backward_problem)):
        with pytest.raises(ValueError, match="clusters need sm_90 or later"):
            build_kernel(make((64, 256, 56, 56), "float16"), sm80, cand.name)


ROUNDS = [(registry.get("bn_forward_cluster_rounds"), problem, "part_moments", 4, 256),
          (registry.get("bn_backward_cluster_rounds"), backward_problem, "part_grad_sums", 4, 128)]


@pytest.mark.parametrize("cand, make, partials, parts, grid", ROUNDS, ids=["forward", "backward"])
def test_the_rounds_candidates_wait_at_a_cluster_barrier_each_round(cand, make, partials, parts, grid):
    """64x256x56x56 fp16: G blocks (a multiple of P that divides the 1024 tasks, as many as
    fit the SMs' shared memory: two 100 KB forward blocks an SM, one 200 KB backward
    block) walk the tasks in rounds; in the round loop one cluster barrier between
    the partials' stores and loads; launched in clusters of P, not cooperatively."""
    p = make((64, 256, 56, 56), "float16")
    knobs = cand.default_for(p, CUDA)
    assert cand.cluster(p) == parts and knobs.grid == grid == max(cand.choices(p, CUDA)["grid"])
    assert all(g % parts == 0 and 1024 % g == 0 for g in cand.choices(p, CUDA)["grid"])
    assert not cand.prefers(p, CUDA), "unmeasured: the tuner chooses it, not the heuristic"
    kernel = build_kernel(p, CUDA, cand.name)
    first, outputs = kernel_bodies(kernel.device_source())
    assert "cluster_sync" not in outputs and "grid_sync" not in first + outputs
    rounds = re.search(r"for \(int c_p_fused_0\w* = 0; c_p_fused_0\w* < (\d+);", first)
    assert rounds and int(rounds.group(1)) == 1024 // grid, "the rounds"
    assert first.count(grid_barrier.CLUSTER_SYNC_CALL) == 1
    at = first.index(grid_barrier.CLUSTER_SYNC_CALL)
    assert at > rounds.start()
    check_cluster_barrier(kernel.device_source(), first)
    stored = [m.start() for m in re.finditer(rf"\b{partials}_v[01]_ptr\[[^\]]*\] =", first)]
    loaded = [m.start() for m in re.finditer(rf"= \([^;]*\b{partials}_v[01]_ptr\[", first)]
    assert stored and loaded and max(stored) < at < min(loaded)
    launches, text = lowered_launches(kernel, p)
    assert launches[:2] == [("blockIdx.x", str(grid)), ("clusterCtaIdx.x", str(parts))], launches
    assert grid_barrier.COOPERATIVE not in text
