"""GPU: every CUDA candidate whose predicate says it applies is correct there.

Each candidate runs on the bench's table shapes (`bench.GPU_CASES`) and on awkward ones, with
outputs poisoned (NaN) first, against a float64 reference computed by torch on the
device. Why each awkward shape is here:

* C=3 (8x3x224x224): fewer channels than SMs, huge planes (grid-reduction candidates).
* H*W prime (8x32x1009): no vector width divides the plane.
* NHWC: channels-last candidates, consecutive lanes on consecutive channels.
* V=50257 (GPT-2) and V=151936 (Qwen): odd and huge rows; 50257 allows no 16-byte vector.
* B=1: one row, one block busy (split-row candidates).
* all targets ignored: the mean is NaN, as in torch.
* 16384x151936 bf16: 2.5e9 elements, past 2^31: 64-bit offsets.
* (M, C) 100352x64, 3136x2048 and NHWC 128x56x56x256: channels-last splits whose
  last blocks own no row (their partials were once left unset: garbage variance).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import tvm_fusion as tf
from helpers import TOLERANCES, has_gpu, torch_or_none
from tvm_fusion import bench, registry, targets
from tvm_fusion.kernel import build_kernel

pytestmark = pytest.mark.gpu
torch = torch_or_none()

BN_SHAPES = [
    ((64, 256, 56, 56), "NCHW"), ((32, 64, 112, 112), "NCHW"), ((256, 2048, 7, 7), "NCHW"),
    ((8, 3, 224, 224), "NCHW"), ((8, 32, 1009), "NCHW"), ((32, 56, 56, 64), "NHWC"),
    ((64, 7, 7, 2048), "NHWC"), ((1, 3, 5, 5), "NCHW"), ((1000, 3), "NCHW"),
    ((100352, 64), "NHWC"), ((3136, 2048), "NHWC"), ((16, 14, 14, 32), "NHWC"),
    ((16, 512, 28, 28), "NCHW"),  # latency-bound: 28x28 planes of whole granules (the padded block per channel)
]
BIG_BN_SHAPES = [((128, 56, 56, 256), "NHWC"), ((32, 56, 56, 256), "NHWC")]  # bf16 only
CE_SHAPES = [
    ((4096, 32000), {}), ((8192, 128256), {}), ((65536, 1000), {}), ((16384, 50257), {}),
    ((128, 32000), {}), ((1, 151936), {}), ((3, 50257), {"reduction": "none"}),
    ((257, 1000), {"weight": True, "label_smoothing": 0.1, "target_dtype": "int32"}),
    ((64, 32000), {"reduction": "sum", "label_smoothing": 0.2}),
    # padded rows: 16 granules a lane for 16-bit V = 4096; one real granule and 31 pads for V = 8
    ((33, 4096), {"reduction": "none"}), ((1000, 8), {"weight": True, "label_smoothing": 0.1}),
    # two-level batch stages: 50 chunks of 1000 rows (weights and smoothing), 20 of 1000 ("none")
    ((50000, 1000), {"weight": True, "label_smoothing": 0.1}), ((20000, 512), {"reduction": "none"}),
]
DTYPES = ["float16", "bfloat16", "float32"]


def cuda_target():
    return targets.resolve("cuda")


def bn_cases():
    cases = [(shape, layout, dtype) for shape, layout in BN_SHAPES for dtype in DTYPES]
    cases += [(shape, layout, "bfloat16") for shape, layout in BIG_BN_SHAPES]
    for shape, layout, dtype in cases:
        problem = tf.make_problem("bn_stats", shape, dtype, layout=layout)
        for cand in registry.applicable(problem, targets.resolve({"kind": "cuda", "arch": "sm_90"})):
            yield pytest.param(shape, layout, dtype, cand.name, id=f"{cand.name}-{problem.key()}")


def ce_cases():
    for shape, options in CE_SHAPES:
        for dtype in DTYPES:
            if shape[0] * shape[1] > 2**28 and dtype != "bfloat16":
                continue  # the big rows once, in the dtype the table uses
            problem = tf.make_problem("cross_entropy", shape, dtype, **options)
            for cand in registry.applicable(problem, targets.resolve({"kind": "cuda", "arch": "sm_90"})):
                yield pytest.param(shape, tuple(sorted(options.items())), dtype, cand.name, id=f"{cand.name}-{problem.key()}")


@functools.lru_cache(maxsize=4)
def bn_data(shape, layout, dtype):
    x = (torch.randn(shape, device="cuda") * 1.5 + 0.3).to(getattr(torch, dtype))
    problem = tf.make_problem("bn_stats", shape, dtype, layout=layout)
    view = x.double().reshape(problem.shape)
    var, mean = torch.var_mean(view, dim=(0,) if problem.channels_last else (0, 2), correction=0)
    return x, mean.cpu().numpy(), var.cpu().numpy()


@functools.lru_cache(maxsize=2)
def ce_data(shape, options, dtype):
    o = dict(options)
    batch, classes = shape
    logits = (torch.randn(shape, device="cuda") * 2).to(getattr(torch, dtype))
    target = torch.randint(0, classes, (batch,), device="cuda", dtype=getattr(torch, o.get("target_dtype", "int64")))
    target[torch.rand(batch, device="cuda") < 0.1] = -100
    weight = torch.rand(classes, device="cuda") + 0.5 if o.get("weight") else None
    ref = ce_reference_float64(logits, target, weight, o.get("reduction", "mean"), o.get("label_smoothing", 0.0))
    return logits, target, weight, ref


def ce_reference_float64(logits, target, weight, reduction, smoothing, rows=1024):
    """torch's cross entropy in float64, a block of rows at a time (the big shapes
    would need tens of GB at once)."""
    F = torch.nn.functional
    w = None if weight is None else weight.double()
    parts = [
        F.cross_entropy(logits[i : i + rows].double(), target[i : i + rows].long(), w,
                        reduction="none", label_smoothing=smoothing)
        for i in range(0, logits.shape[0], rows)
    ]
    loss = torch.cat(parts)
    if reduction == "none":
        return loss.cpu().numpy()
    if reduction == "sum":
        return loss.sum().reshape(1).cpu().numpy()
    valid = target.long() != -100
    denom = valid.double().sum() if w is None else w[target.long().clamp(min=0)][valid].sum()
    return (loss.sum() / denom).reshape(1).cpu().numpy()


def run_kernel(kernel, inputs):
    """Launch with NaN-poisoned outputs (first_bad_row poisoned with -7777)."""
    import tvm_ffi

    args = [tvm_ffi.from_dlpack(t)._create_view(shape) for t, (_, shape, _) in zip(inputs, kernel.params)]
    outs = []
    for _, shape, dtype in kernel.outputs:
        fill = -7777 if dtype.startswith("int") else float("nan")
        outs.append(torch.full(shape, fill, dtype=getattr(torch, dtype), device="cuda"))
    with tvm_ffi.use_torch_stream():
        kernel(*args, *(tvm_ffi.from_dlpack(o) for o in outs))
    torch.cuda.synchronize()
    return [o.cpu().numpy() for o in outs]


def rel_err(actual, expected, scale):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.array_equal(np.isnan(actual), np.isnan(expected)), (actual[:8], expected[:8])
    mask = ~np.isnan(expected)
    return float(np.max(np.abs(actual[mask] - expected[mask]) / scale, initial=0.0))


def assert_bn_kernel_correct(kernel, shape, layout, dtype):
    x, ref_mean, ref_var = bn_data(shape, layout, dtype)
    mean, var = run_kernel(kernel, [x])
    std = float(np.sqrt(ref_var.max()))
    tol = 4 * TOLERANCES[dtype]["atol"]
    assert rel_err(mean, ref_mean, std) < tol
    assert rel_err(var, ref_var, ref_var.max()) < tol


def assert_ce_kernel_correct(kernel, shape, options, dtype):
    logits, target, weight, ref = ce_data(shape, options, dtype)
    outs = run_kernel(kernel, [logits, target] + ([weight] if weight is not None else []))
    loss, first_bad = outs[-2], outs[-1]
    assert first_bad[0] == shape[0]
    scale = max(1.0, float(np.nanmax(np.abs(ref))))
    assert rel_err(loss.reshape(-1), ref, scale) < 4 * TOLERANCES[dtype]["rtol"] * np.log2(shape[1] + 2)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, layout, dtype, candidate", list(bn_cases()))
def test_bn_stats_candidate_on_gpu(shape, layout, dtype, candidate):
    problem = tf.make_problem("bn_stats", shape, dtype, layout=layout)
    assert_bn_kernel_correct(build_kernel(problem, cuda_target(), candidate), shape, layout, dtype)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, options, dtype, candidate", list(ce_cases()))
def test_cross_entropy_candidate_on_gpu(shape, options, dtype, candidate):
    problem = tf.make_problem("cross_entropy", shape, dtype, **dict(options))
    assert_ce_kernel_correct(build_kernel(problem, cuda_target(), candidate), shape, options, dtype)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("case", bench.GPU_CASES, ids=lambda c: c.label().replace(" ", "-"))
def test_shipped_tuning_record_kernels_are_correct(case):
    """The tuned knobs of tuning_logs/cuda_sm_90, which dispatch uses for the table shapes."""
    from tvm_fusion import dispatch

    problem = case.problem
    assert dispatch.choose(problem, cuda_target()).source == "record"
    kernel = dispatch.kernel_for(problem, cuda_target())
    if case.op == "bn_stats":
        assert_bn_kernel_correct(kernel, case.shape, "NCHW", case.dtype)
    else:
        assert_ce_kernel_correct(kernel, case.shape, (), case.dtype)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_past_two_to_the_31_elements_bf16():
    shape = (16384, 151936)
    logits, target, _, ref = ce_data(shape, (), "bfloat16")
    loss = tf.cross_entropy(logits, target)
    assert abs(loss.item() - ref[0]) / abs(ref[0]) < 1e-4


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_all_rows_ignored_mean_is_nan_on_gpu():
    logits = torch.randn(64, 1000, device="cuda")
    target = torch.full((64,), -100, device="cuda")
    assert torch.isnan(tf.cross_entropy(logits, target)).item()
    assert tf.cross_entropy(logits, target, reduction="sum").item() == 0.0


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("dtype", DTYPES)
def test_api_with_torch_cuda_tensors_equals_torch(dtype):
    F = torch.nn.functional
    x = (torch.randn(16, 32, 14, 14, device="cuda") + 0.5).to(getattr(torch, dtype))
    mean, var = tf.bn_stats(x)
    assert mean.device.type == "cuda" and mean.dtype == torch.float32
    ref_var, ref_mean = torch.var_mean(x.float(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-5)
    xl = x.permute(0, 2, 3, 1).contiguous()
    mean_l, var_l = tf.bn_stats(xl, layout="NHWC")
    torch.testing.assert_close(mean_l, ref_mean, rtol=1e-4, atol=1e-5)

    logits = torch.randn(512, 32000, device="cuda").to(getattr(torch, dtype))
    target = torch.randint(0, 32000, (512,), device="cuda")
    target[::7] = -100
    weight = torch.rand(32000, device="cuda")
    for reduction in ("none", "mean", "sum"):
        for smoothing in (0.0, 0.1):
            ours = tf.cross_entropy(logits, target, weight, reduction=reduction, label_smoothing=smoothing)
            theirs = F.cross_entropy(logits.float(), target, weight, reduction=reduction, label_smoothing=smoothing)
            assert ours.device.type == "cuda" and ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_runs_on_torch_current_stream():
    stream = torch.cuda.Stream()
    logits = torch.randn(4096, 32000, device="cuda", dtype=torch.float16)
    target = torch.randint(0, 32000, (4096,), device="cuda")
    with torch.cuda.stream(stream):
        loss = tf.cross_entropy(logits, target, check_targets=False)
    stream.synchronize()
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.float(), target), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_small_cuda_tune_records_dispatch_and_a_correct_kernel(tmp_path):
    from tvm_fusion import dispatch

    shape = (512, 4096)
    result = tf.tune("cross_entropy", shape=shape, dtype="float16", target="cuda", trials=4, log_dir=str(tmp_path))
    assert result.best, "the CUDA tune measured nothing"
    problem = tf.make_problem("cross_entropy", shape, "float16")
    choice = dispatch.choose(problem, cuda_target(), str(tmp_path))
    assert choice.source == "record" and choice.mod is not None
    kernel = dispatch.kernel_for(problem, cuda_target(), str(tmp_path))
    logits = torch.randn(*shape, device="cuda").half()
    target = torch.randint(0, shape[1], (shape[0],), device="cuda")
    target[::9] = -100
    loss, first_bad = run_kernel(kernel, [logits, target])[-2:]
    ref = torch.nn.functional.cross_entropy(logits.double(), target).item()
    assert first_bad[0] == shape[0]  # no bad target flagged
    assert abs(float(loss.reshape(-1)[0]) - ref) < 1e-4 * abs(ref)


def bad_target_batch(classes=1000, batch=256, bad_row=77):
    logits = torch.randn(batch, classes, device="cuda")
    target = torch.randint(0, classes, (batch,), device="cuda")
    bad = target.clone()
    bad[bad_row] = classes + 5
    return logits, target, bad


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_bad_target_on_cuda_raises_at_the_next_call_and_the_context_lives():
    logits, target, bad = bad_target_batch()
    tf.check_targets()  # nothing pending from earlier tests
    tf.cross_entropy(logits, bad)  # returns at once: the flag is read later
    torch.cuda.synchronize()
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[77\] = 1005 is outside \[0, 1000\)"):
        tf.cross_entropy(logits, target)
    loss = tf.cross_entropy(logits, target)  # the context is alive and the next call right
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, target), rtol=1e-5, atol=1e-5)
    tf.check_targets()


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_first_bad_row_across_the_chunks_of_a_two_level_batch_stage(reduction):
    """50000 rows: 50 chunk partials. Bad targets in chunks 12 and 40: the error names
    the first, whichever chunk's block finishes first."""
    logits, target, bad = bad_target_batch(classes=1000, batch=50000, bad_row=40001)
    bad[12345] = -3
    tf.check_targets()  # nothing pending from earlier tests
    tf.cross_entropy(logits, bad, reduction=reduction)  # the flag is read by the next call
    torch.cuda.synchronize()
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[12345\] = -3 is outside \[0, 1000\)"):
        tf.cross_entropy(logits, target, reduction=reduction)
    torch.testing.assert_close(tf.cross_entropy(logits, target, reduction=reduction),
                               torch.nn.functional.cross_entropy(logits, target, reduction=reduction),
                               rtol=1e-5, atol=1e-5)
    tf.check_targets()


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_check_targets_waits_and_raises_and_many_good_calls_pass():
    logits, target, bad = bad_target_batch(bad_row=3)
    for _ in range(3000):  # past the ring of pinned slots
        tf.cross_entropy(logits, target)
    tf.check_targets()
    tf.cross_entropy(logits, bad)
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[3\]"):
        tf.check_targets()
    tf.check_targets()  # reported once


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_default_check_launches_on_torch_current_stream():
    stream = torch.cuda.Stream()
    logits = torch.randn(4096, 32000, device="cuda", dtype=torch.float16)
    target = torch.randint(0, 32000, (4096,), device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        loss = tf.cross_entropy(logits, target)
        mean, var = tf.bn_stats(logits.view(4096, 32000, 1))
    stream.synchronize()
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.float(), target), rtol=1e-4, atol=1e-4)
    ref_var, ref_mean = torch.var_mean(logits.float(), dim=0, correction=0)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-4, atol=1e-4)
    tf.check_targets()


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_public_calls_replay_in_a_cuda_graph_on_new_data(dtype):
    F = torch.nn.functional
    dt = getattr(torch, dtype)
    logits = torch.randn(512, 32000, device="cuda").to(dt)
    target = torch.randint(0, 32000, (512,), device="cuda")
    x = torch.randn(32, 64, 28, 28, device="cuda").to(dt)
    xl = torch.randn(32, 28, 28, 64, device="cuda").to(dt)
    for _ in range(2):  # warm up: build and compile outside the capture
        tf.cross_entropy(logits, target, check_targets=False)
        tf.bn_stats(x)
        tf.bn_stats(xl, layout="NHWC")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = tf.cross_entropy(logits, target, check_targets=False)
        loss_none = tf.cross_entropy(logits, target, reduction="none", check_targets=False)
        mean, var = tf.bn_stats(x)
        mean_l, var_l = tf.bn_stats(xl, layout="NHWC")
    for _ in range(3):
        logits.copy_(torch.randn(512, 32000, device="cuda").to(dt) * 3)
        target.copy_(torch.randint(0, 32000, (512,), device="cuda"))
        x.copy_(torch.randn(32, 64, 28, 28, device="cuda").to(dt) + 2)
        xl.copy_(torch.randn(32, 28, 28, 64, device="cuda").to(dt) - 1)
        for out in (loss, loss_none, mean, var, mean_l, var_l):
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(loss, F.cross_entropy(logits.double(), target).float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss_none, F.cross_entropy(logits.double(), target, reduction="none").float(),
                                   rtol=1e-5, atol=1e-5)
        for (m, v), data, dims in (((mean, var), x, (0, 2, 3)), ((mean_l, var_l), xl, (0, 1, 2))):
            ref_var, ref_mean = torch.var_mean(data.double(), dim=dims, correction=0)
            torch.testing.assert_close(m, ref_mean.float(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, ref_var.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_default_check_inside_graph_capture_is_a_clear_error():
    logits = torch.randn(64, 1000, device="cuda")
    target = torch.randint(0, 1000, (64,), device="cuda")
    tf.cross_entropy(logits, target)
    tf.check_targets()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="check_targets=False"):
        with torch.cuda.graph(graph):
            tf.cross_entropy(logits, target)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_mean_row_scratch_is_per_stream_and_every_loss_is_the_callers():
    """A mean's row losses are one reused buffer per stream: two streams at once,
    and a graph replayed between eager calls, each keep their own right answer."""
    F = torch.nn.functional
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    data = [(torch.randn(2048, 8192, device="cuda") * (k + 1), torch.randint(0, 8192, (2048,), device="cuda"))
            for k in range(2)]
    refs = [F.cross_entropy(l.double(), t).float() for l, t in data]
    torch.cuda.synchronize()
    losses = [[], []]
    for _ in range(20):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                losses[k].append(tf.cross_entropy(*data[k], check_targets=False))
    torch.cuda.synchronize()
    for k in range(2):
        for loss in losses[k]:  # every earlier loss is still the one its call made
            torch.testing.assert_close(loss, refs[k], rtol=1e-5, atol=1e-5)
    logits, target = data[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tf.cross_entropy(logits, target, check_targets=False)
    eager = tf.cross_entropy(*data[1], check_targets=False)
    graph.replay()
    again = tf.cross_entropy(*data[1], check_targets=False)
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, refs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, refs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, refs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("call", ["bn_stats", "batch_norm"])
def test_split_plane_partials_are_per_stream_and_per_captured_graph(call):
    """A split-plane kernel's cross-block partials are a workspace its launcher
    passes (kernel.compiled_form), not TVM's pool: two streams at once, and a graph
    replayed between eager calls, each keep their own right answer."""
    from tvm_fusion.torch import batch_norm

    shape = (32, 64, 112, 112)  # 64 channels of 12544: each plane split over blocks
    op = "bn_stats" if call == "bn_stats" else "bn_forward"
    options = {} if call == "bn_stats" else {"affine": False, "track_running": False}
    kernel = tf.build(op, shape, "float16", **options)
    assert kernel.workspace and "TVMBackendAllocWorkspace" not in kernel.executable.mod.inspect_source(), kernel

    def run(x):
        if call == "bn_stats":
            return tf.bn_stats(x)
        return (batch_norm(x, None, None, training=True),)

    def reference(x):
        x64 = x.double()
        if call == "bn_stats":
            return x64.mean((0, 2, 3)).float(), x64.var((0, 2, 3), unbiased=False).float()
        return (torch.nn.functional.batch_norm(x64, None, None, training=True).half(),)

    def check(got, want):
        for g, w in zip(got, want):
            tol = 2e-3 if g.dtype == torch.float16 else 1e-4
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)

    gen = torch.Generator(device="cuda").manual_seed(31)
    xs = [(torch.randn(shape, device="cuda", generator=gen) * (k + 1) + 3 * k).half() for k in range(2)]
    refs = [reference(x) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    results = [[], []]
    for _ in range(10):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[k].append(run(xs[k]))
    torch.cuda.synchronize()
    for k in range(2):
        for got in results[k]:
            check(got, refs[k])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(xs[0])
    eager = run(xs[1])
    graph.replay()
    again = run(xs[1])
    torch.cuda.synchronize()
    check(captured, refs[0])
    check(eager, refs[1])
    check(again, refs[1])


@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_bad_target_on_a_side_stream_is_flagged_in_pinned_memory():
    """The kernel writes its flag straight into pinned host memory: a bad target
    on a side stream is found once that stream is done, with no copy or sync."""
    logits, target, bad = bad_target_batch(bad_row=200)
    tf.check_targets()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tf.cross_entropy(logits, bad, reduction="sum")
    stream.synchronize()
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[200\] = 1005"):
        tf.cross_entropy(logits, target, reduction="sum")
    tf.check_targets()
