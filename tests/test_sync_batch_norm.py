"""tvm_fusion.torch.SyncBatchNorm: the global batch's BatchNorm over torch.distributed.

Every rank's output, input gradient and running statistics, and the sum over ranks
of its weight and bias gradients, are compared with one float64 ``nn.BatchNorm2d``
over the concatenated batch (the same float32-rounded values), over two training
steps. The groups are real: processes spawned on this host with Gloo
(``tvm_fusion.torch.processes``, which ends every rank and fails with the traceback
when one fails, and terminates them after a time-out instead of hanging). Outputs
are float32 through our kernels; the tolerance is ``3e-5 * max|reference| *
sqrt(values summed) + 1e-6``, the float32 error of a sum of that length, as in
test_torch_batch_norm. The collectives' cost model is checked on synthetic numbers
(exact recovery) and its byte counts."""

import copy
import math

import pytest

from helpers import BN_LAYOUTS, has_gpu, on_gpu, rng, torch_or_none

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None, reason="needs torch")
if torch is not None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import tvm_fusion.torch as tft
    from tvm_fusion.torch import processes, sync_cost

GPU = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")]
CHANNELS, PLANE = 6, (5, 7)
TIMEOUT_S = 150  # a group's whole run: spawn, import, CPU kernels' compile (about 10 s a rank here)


def seeded():
    torch.manual_seed(int(rng().integers(2**31)))


def assert_near(got, want, what, sums_over=1):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach()
    assert not torch.isnan(got).any(), f"{what}: an element is unwritten or NaN"
    scale = float(want.abs().max()) if want.numel() else 1.0
    tol = 3e-5 * (scale or 1.0) * math.sqrt(sums_over) + 1e-6
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"{what}: off by {err:.3g} (tolerance {tol:.3g}, largest {scale:.3g})"


# -- the spawned groups -------------------------------------------------------------------
# Why each case: unequal slices (the counts weigh the combination), an empty rank (it
# joins both collectives, launches nothing), channels-last (the (M, C) kernels),
# momentum=None (1 / num_batches_tracked on the device), no affine and no running
# statistics (torch's other forms), |mean| >> std (Chan's combination keeps the
# variance where sum / sum of squares would lose it: with a mean of 1000 their float32
# cancellation errs by about 1000^2 * 2^-24 = 0.06, against a variance of 4e-4).
CASES = {
    2: {
        "nchw-3-5": dict(sizes=[3, 5], options={}),
        "channels-last-3-5": dict(sizes=[3, 5], options={}, channels_last=True),
        "large-mean-3-5": dict(sizes=[3, 5], options={}, loc=1000.0, spread=0.02),
    },
    3: {
        "nchw-empty-rank-momentum-none": dict(sizes=[4, 0, 2], options={"momentum": None}),
        "plain-no-running-empty-rank": dict(sizes=[4, 0, 2], options={"affine": False, "track_running_stats": False}),
    },
}
STEPS = 2


def make_case(spec):
    """The float64 reference module and the steps' global batches and upstream gradients."""
    reference = nn.BatchNorm2d(CHANNELS, **spec["options"]).double()
    if reference.affine:
        with torch.no_grad():
            reference.weight.copy_(torch.rand(CHANNELS) + 0.5)
            reference.bias.copy_(torch.randn(CHANNELS))
    if reference.track_running_stats and "loc" not in spec:
        with torch.no_grad():
            reference.running_mean.copy_(torch.randn(CHANNELS))
            reference.running_var.copy_(torch.rand(CHANNELS) + 0.5)
    elif reference.track_running_stats:  # from 0: the running variance is the batches' alone (4e-4 here)
        with torch.no_grad():
            reference.running_var.zero_()
    batch = sum(spec["sizes"])
    loc, spread = spec.get("loc", 3.0), spec.get("spread", 2.0)
    xs = [(torch.randn(batch, CHANNELS, *PLANE) * spread + loc).float().double() for _ in range(STEPS)]
    grads = [torch.randn(batch, CHANNELS, *PLANE).float().double() for _ in range(STEPS)]
    return reference, xs, grads


def train_ranks(rank, world_size, cases):
    """A rank's side of every case: its slice of each step through our SyncBatchNorm."""
    results = {}
    for name, (spec, state, xs, grads) in cases.items():
        bn = tft.SyncBatchNorm(CHANNELS, **spec["options"])
        bn.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        start, size = sum(spec["sizes"][:rank]), spec["sizes"][rank]
        steps = []
        for x, grad in zip(xs, grads):
            local = x[start:start + size].float()
            upstream = grad[start:start + size].float()
            if spec.get("channels_last"):
                local, upstream = (t.to(memory_format=torch.channels_last) for t in (local, upstream))
            local.requires_grad_()
            y = bn(local)
            y.backward(upstream)
            steps.append({"y": y.detach(), "dx": local.grad, "channels_last":
                          y.is_contiguous(memory_format=torch.channels_last) and y.dim() == 4 and size > 0,
                          **{k: None if p is None else p.grad.clone() for k, p in (("dweight", bn.weight),
                                                                                    ("dbias", bn.bias))}})
            for p in (bn.weight, bn.bias):
                if p is not None:
                    p.grad = None
        results[name] = {"steps": steps, "state": {k: v.clone() for k, v in bn.state_dict().items()}}
    return results


def group_main(rank, world_size, cases):
    """Every case on this rank, then (world size 2) the too-few-values check."""
    return train_ranks(rank, world_size, cases), too_few_values(rank, world_size) if world_size == 2 else None


def run_cases(world_size):
    seeded()
    built = {name: (spec, *make_case(spec)) for name, spec in CASES[world_size].items()}
    args = {name: (spec, ref.state_dict(), xs, grads) for name, (spec, ref, xs, grads) in built.items()}
    ranks = processes.run(group_main, world_size, "gloo", (args,), TIMEOUT_S)
    return built, [cases for cases, _ in ranks], [message for _, message in ranks]


@pytest.fixture(scope="module")
def group_results():
    """Both groups run once for the module's tests: world size 2, then 3."""
    return {world: run_cases(world) for world in CASES}


@pytest.mark.parametrize("world_size, case", [(w, c) for w in CASES for c in CASES[w]])
def test_ranks_equal_one_float64_batch_norm_over_the_whole_batch(group_results, world_size, case):
    built, ranks, _ = group_results[world_size]
    spec, reference, xs, grads = built[case]
    count = sum(spec["sizes"]) * math.prod(PLANE)
    for step, (x, grad) in enumerate(zip(xs, grads)):
        x = x.clone().requires_grad_()
        want = reference(x)
        want.backward(grad)
        bounds = torch.tensor([0, *spec["sizes"]]).cumsum(0).tolist()
        for rank, result in enumerate(ranks):
            got, part = result[case]["steps"][step], slice(bounds[rank], bounds[rank + 1])
            what = f"{case} step {step} rank {rank}"
            if "loc" in spec:  # |mean| >> std: y within four float32 roundings of the mean (see below)
                assert_large_mean_output(got["y"], want[part], x, reference, what)
            else:
                assert_near(got["y"], want[part], f"{what} y")
                assert_near(got["dx"], x.grad[part], f"{what} dx")
            assert got["channels_last"] == (spec.get("channels_last", False) and spec["sizes"][rank] > 0)
        if reference.affine and "loc" not in spec:
            for name, param in (("dweight", reference.weight), ("dbias", reference.bias)):
                summed = sum(result[case]["steps"][step][name].double() for result in ranks)
                assert_near(summed, param.grad, f"{case} step {step} {name} summed over ranks", count)
                param.grad = None
    for rank, result in enumerate(ranks):
        state = result[case]["state"]
        for name, want in reference.state_dict().items():
            if name == "num_batches_tracked":
                assert int(state[name]) == int(want) == STEPS
            elif name == "running_var":
                assert_near(state[name], want, f"{case} rank {rank} running_var", count)
            elif name == "running_mean":
                assert_near(state[name], want, f"{case} rank {rank} running_mean")


def assert_large_mean_output(got, want, x, reference, what):
    """A float32 mean of 1000 is off by half an ulp, 3e-5, times ``invstd * weight`` in
    y: no float32 kernel meets the usual tolerance there (test_torch_batch_norm's
    large-mean test says more); y must be within four such roundings per channel."""
    x64 = x.detach()
    mean, var = x64.mean(dim=(0, 2, 3)), x64.var(dim=(0, 2, 3), unbiased=False)
    per_channel = 4 * 2.0**-24 * mean.abs() * (reference.weight.detach().abs() / (var + reference.eps).sqrt())
    err = (got.double() - want.detach()).abs().amax(dim=(0, 2, 3)) if got.numel() else torch.zeros(CHANNELS)
    assert (err <= per_channel + 1e-5).all(), f"{what} y off by {err.tolist()} against {per_channel.tolist()}"


def too_few_values(rank, world_size):
    """One value per channel over the whole group: (1, C) on rank 0, (0, C) on rank 1."""
    bn = tft.SyncBatchNorm(CHANNELS)
    try:
        bn(torch.randn(1 if rank == 0 else 0, CHANNELS))
    except ValueError as err:
        return str(err)
    return None


def test_one_value_per_channel_over_the_group_is_a_value_error_on_every_rank(group_results):
    messages = group_results[2][2]
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} raised nothing"
        assert "more than 1 value per channel over the 2 ranks" in message and "got 1" in message
    assert "input size (1, 6)" in messages[0] and "input size (0, 6)" in messages[1]


def failing_rank(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()  # rank 0 waits for a rank that never comes


def test_a_failing_rank_ends_the_group_with_its_traceback_instead_of_hanging():
    with pytest.raises(RuntimeError, match=r"(?s)failed:.*rank 1 \(exit code 1\).*rank 1 gives up"):
        processes.run(failing_rank, 2, "gloo", (), TIMEOUT_S)


# -- one rank, in this process --------------------------------------------------------------
@pytest.fixture
def group_of_one(tmp_path, request):
    """A group of one rank (file store) in this process, Gloo on the CPU, NCCL on a GPU:
    the synchronized path with its two collectives, against torch on one batch."""
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device", "cpu") if callspec else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield device
    dist.destroy_process_group()


LAYOUTS = BN_LAYOUTS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_synchronized_path_on_one_rank_equals_float64_torch(poisoned, group_of_one, device, layout):
    seeded()
    x = LAYOUTS[layout](torch.randn(4, CHANNELS, *PLANE, device=device) * 2 + 3)
    c = x.shape[1]
    weight, bias = torch.rand(c, device=device) + 0.5, torch.randn(c, device=device)
    rm, rv = torch.randn(c, device=device), torch.rand(c, device=device) + 0.5
    ours_rm, ours_rv = rm.clone(), rv.clone()
    leaf, w, b = (t.clone().requires_grad_() for t in (x, weight, bias))
    y = tft.sync_batch_norm(leaf, ours_rm, ours_rv, w, b, 0.1, 1e-5)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, weight, bias))
    ref_rm, ref_rv = rm.double(), rv.double()
    y64 = F.batch_norm(x64, ref_rm, ref_rv, w64, b64, True, 0.1, 1e-5)
    count = x.numel() // c
    assert_near(y, y64, "y")
    assert_near(ours_rm, ref_rm, "running_mean")
    assert_near(ours_rv, ref_rv, "running_var", count)
    upstream = torch.randn_like(y64)
    y.backward(upstream.float())
    y64.backward(upstream)
    assert_near(leaf.grad, x64.grad, "dx")
    assert_near(w.grad, w64.grad, "dweight", count)
    assert_near(b.grad, b64.grad, "dbias", count)


def test_a_second_derivative_through_the_synchronized_path_is_a_clear_error(group_of_one):
    seeded()
    leaf = (torch.randn(4, CHANNELS, *PLANE) + 1).requires_grad_()
    y = tft.sync_batch_norm(leaf, None, None, torch.rand(CHANNELS) + 0.5, None, 0.1, 1e-5)
    (dx,) = torch.autograd.grad(y.pow(3).sum(), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="tvm_fusion.torch.sync_batch_norm has no second derivative"):
        dx.sum().backward()


# -- the module and convert_sync_batchnorm --------------------------------------------------
def test_convert_replaces_every_batch_norm_keeping_tensors_options_and_mode():
    from tvm_fusion.relax.model import small_resnet

    model = small_resnet()
    model.block.bn2 = tft.BatchNorm2d(8, momentum=None)  # ours is converted too
    model.bn_hidden.eval()
    before = {name: (type(m), m.training, m.momentum, [id(t) for t in m.state_dict(keep_vars=True).values()])
              for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    state = copy.deepcopy(model.state_dict())
    converted = tft.convert_sync_batchnorm(model)
    assert converted is model and converted.state_dict().keys() == state.keys()
    for name, (_, training, momentum, ids) in before.items():
        module = converted.get_submodule(name)
        assert type(module) is tft.SyncBatchNorm and isinstance(module, nn.SyncBatchNorm)
        assert (module.training, module.momentum) == (training, momentum)
        assert [id(t) for t in module.state_dict(keep_vars=True).values()] == ids, f"{name}: tensors replaced"
    single = tft.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(5, eps=1e-3, affine=False))
    assert type(single) is tft.SyncBatchNorm and single.eps == 1e-3 and not single.affine
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got NoneType"):  # not an AttributeError
        tft.convert_sync_batchnorm(None)


def test_without_a_group_the_module_is_our_batch_norm():
    """Not initialized (and eval, or a group of one): our BatchNorm, torch's meaning,
    momentum=None's cumulative average included."""
    seeded()
    ours, theirs = tft.SyncBatchNorm(CHANNELS, momentum=None), nn.BatchNorm2d(CHANNELS, momentum=None).double()
    assert ours.state_dict().keys() == nn.SyncBatchNorm(CHANNELS).state_dict().keys()
    assert ours.extra_repr() == nn.SyncBatchNorm(CHANNELS, momentum=None).extra_repr()
    for step in range(3):
        x = torch.randn(4, CHANNELS, *PLANE) + 3
        if step == 2:
            ours.eval()
            theirs.eval()
        assert_near(ours(x), theirs(x.double()), f"step {step} y")
    assert_near(ours.running_var, theirs.running_var, "running_var", 4 * math.prod(PLANE))
    assert int(ours.num_batches_tracked) == 2


# -- the collectives' cost -----------------------------------------------------------------
def test_the_cost_fit_recovers_latency_and_bandwidth_exactly():
    sizes = [64, 1024, 65536, 1 << 20]
    cost = sync_cost.fit(sizes, [40e-6 + b / 3e9 for b in sizes])
    assert cost.latency_s == pytest.approx(40e-6, rel=1e-9) and cost.bandwidth == pytest.approx(3e9, rel=1e-9)
    assert sync_cost.fit([64, 128], [1e-5, 1e-5]).bandwidth == math.inf  # flat times: no bandwidth term
    with pytest.raises(ValueError, match="two sizes at least"):
        sync_cost.fit([64, 64], [1e-5, 2e-5])


def test_the_bytes_per_layer_and_the_prediction_for_a_model():
    assert sync_cost.collective_bytes(64, 8) == {"all_gather": 8 * 129 * 4, "all_reduce": 512}
    from tvm_fusion.relax.model import small_resnet

    layers = sync_cost.bn_layers(small_resnet(width=16))
    assert layers == [("bn", 16), ("block.bn1", 16), ("block.bn2", 16), ("bn_hidden", 16)]
    costs = {kind: sync_cost.Cost(10e-6, 1e9) for kind in sync_cost.KINDS}
    rows = sync_cost.predict(layers, 4, costs)
    assert [r.forward_bytes for r in rows] == [4 * 33 * 4] * 4 and rows[0].backward_bytes == 128
    assert rows[0].total_s == pytest.approx(20e-6 + (528 + 128) / 1e9)
    assert all(math.isfinite(c.latency_s) and c.bandwidth > 0 for c in sync_cost.DEFAULT_COSTS.values())


def test_the_cli_prints_a_table_per_layer_and_the_total(capsys):
    from tvm_fusion.cli import main

    assert main(["syncbn-cost", "--channels", "64x256", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "bn0" in out and "bn1" in out and "total" in out and "4 collectives" in out


def test_measure_times_both_collectives_in_a_group(group_of_one):
    found = sync_cost.measure(sizes=(16, 256), calls=2, batches=1)
    assert set(found) == set(sync_cost.KINDS)
    assert [b for b, _ in found["all_gather"]] == [64, 1024] and all(s > 0 for _, s in found["all_reduce"])
    assert set(sync_cost.fit_measured(found)) == set(sync_cost.KINDS)


# -- the bn_backward_dx kernels (SyncBatchNorm's dx from the global sums) --------------------
# Why each shape: NCHW (the (N, C, L) candidates), NHWC and (N, C) (the (M, C) ones),
# an odd plane (no 16-byte vector fits), and one value per channel (a rank's slice
# may be that small: the global count decides).
DX_SHAPES = [((4, 6, 5, 8), "NCHW"), ((3, 6, 5, 7), "NCHW"), ((4, 5, 7, 16), "NHWC"), ((16, 6), "NCHW"),
             ((1, 6), "NCHW")]
DX_ROUNDING = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}  # the final store, relative


def dx_problems(dtypes, shapes=DX_SHAPES, affines=(True, False)):
    import tvm_fusion as tf

    return [tf.make_problem("bn_backward_dx", shape, dtype, layout=layout, affine=affine)
            for shape, layout in shapes for dtype in dtypes for affine in affines]


def dx_inputs(problem):
    import numpy as np

    from helpers import random_floats

    gen = rng()
    shape, c = problem.input_shape, problem.channels
    x, dy = random_floats(gen, shape, problem.dtype, loc=3.0), random_floats(gen, shape, problem.dtype)
    mean, weight, mean_dy, mean_dy_xhat = (gen.standard_normal(c).astype(np.float32) for _ in range(4))
    invstd = (gen.random(c) + 0.5).astype(np.float32)
    return [x, dy, mean + 3, invstd] + ([weight] if problem.affine else []) + [mean_dy, mean_dy_xhat]


def check_dx_kernel(kernel, problem, device=None):
    import numpy as np

    from helpers import assert_close, run_poisoned
    from tvm_fusion.contracts.bn_backward_dx import reference

    inputs = dx_inputs(problem)
    (dx,) = run_poisoned(kernel, inputs, device)
    weight = inputs[4] if problem.affine else None
    want = reference(*inputs[:4], weight, *inputs[-2:], problem.layout)
    scale = float(np.abs(want).max())
    assert_close(dx.reshape(want.shape), want, DX_ROUNDING[problem.dtype], 2e-6 * scale, kernel.candidate)


def dx_params(target_name, dtypes, count=2, **which):
    from helpers import candidate_params
    from tvm_fusion import targets

    target = targets.resolve(target_name)
    return list(candidate_params(dx_problems(dtypes, **which), target, count))


@pytest.mark.parametrize("problem, candidate, configs", dx_params("llvm", ["float32", "bfloat16"], count=1))
def test_bn_backward_dx_cpu_kernel_equals_the_float64_reference(poisoned, problem, candidate, configs):
    from tvm_fusion import targets
    from tvm_fusion.kernel import build_kernel

    for knobs in configs:
        check_dx_kernel(build_kernel(problem, targets.resolve("llvm"), candidate, knobs), problem)


CUDA_TARGET = {"kind": "cuda", "arch": "sm_90"}


# nvcc takes about 1 s a kernel here: the four shapes that differ for the candidates.
CUDA_SHAPES = [DX_SHAPES[i] for i in (0, 1, 2, 4)]


@pytest.mark.parametrize("problem, candidate, configs",
                         dx_params(CUDA_TARGET, ["float16"], count=1, shapes=CUDA_SHAPES, affines=(True,)))
def test_bn_backward_dx_cuda_code_is_a_map_with_16_byte_accesses(problem, candidate, configs):
    """Structure, not golden code: no shuffles or atomics (nothing is reduced), no
    buffer beyond the parameters, 16-byte loads of x where the vector knob says 16
    bytes, and 16-byte stores of dx where the lanes also split the channel's
    vectors evenly (``store_vectors`` says why not otherwise); nvcc compiles it
    without spills."""
    from test_cuda_codegen import kernel_params

    from tvm_fusion import targets
    from tvm_fusion.codegen import cuda_report, nvcc_path
    from tvm_fusion.contracts.common import DTYPE_BYTES
    from tvm_fusion.kernel import build_kernel

    for index, knobs in enumerate(configs):
        kernel = build_kernel(problem, targets.resolve(CUDA_TARGET), candidate, knobs)
        source = kernel.device_source()
        assert "__shfl" not in source and "atomic" not in source.lower()
        assert kernel_params(source) <= {name for name, _, _ in kernel.params}
        contiguous = problem.channels if problem.channels_last else problem.shape[2]
        sixteen = knobs.vector * DTYPE_BYTES[problem.dtype] == 16 and contiguous % knobs.vector == 0
        even = problem.channels_last or (problem.count // knobs.vector) % knobs.threads == 0
        assert ("*(uint4*)(x_ptr" in source) == sixteen, knobs
        assert ("*(uint4*)(dx_ptr" in source) == (sixteen and even), knobs
        if index == 0 and nvcc_path() is not None:  # the default knobs
            report = cuda_report(kernel)
            assert not any(report.spill_bytes.values()) and (report.vector_loads > 0) == sixteen, report


@on_gpu
@pytest.mark.parametrize("problem, candidate, configs", dx_params(CUDA_TARGET, ["float32", "bfloat16"]))
def test_bn_backward_dx_cuda_kernel_equals_the_float64_reference(problem, candidate, configs):
    from tvm_fusion import targets
    from tvm_fusion.kernel import build_kernel

    for knobs in configs:
        check_dx_kernel(build_kernel(problem, targets.resolve(CUDA_TARGET), candidate, knobs), problem)
