"""CPU (LLVM) path: every candidate and knob config, and the public API, against float64.

Shapes are drawn by hypothesis over odd sizes on purpose: 1 (a single channel,
class, row or value), primes (no vector width divides them), and sizes that do
divide the vector widths (the vectorized path)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tvm_fusion as tf
from helpers import TOLERANCES, assert_close, bn_atol, random_floats, rng, run_poisoned, torch_or_none
from tvm_fusion import registry, targets
from tvm_fusion.contracts import bn_stats as bn_ref
from tvm_fusion.contracts import cross_entropy as ce_ref
from tvm_fusion.kernel import build_kernel

CPU = targets.resolve("llvm")
DTYPES = ["float32", "float16", "bfloat16"]
SIZES = st.sampled_from([1, 2, 3, 5, 7, 8, 13, 16, 31, 32, 64])
SETTINGS = settings(max_examples=25, deadline=None)


def check_bn(x, layout, outputs, dtype):
    ref_mean, ref_var = bn_ref.reference(x, layout)
    count = x.size // ref_mean.size
    atol = bn_atol(dtype, count)
    std = np.sqrt(ref_var.max()) if ref_var.size else 1.0
    assert_close(outputs[0], ref_mean, TOLERANCES[dtype]["rtol"], atol * max(std, 1e-3), "mean")
    assert_close(outputs[1], ref_var, TOLERANCES[dtype]["rtol"], 2 * atol * max(ref_var.max(), 1e-6), "var")


@SETTINGS
@given(
    dims=st.lists(SIZES, min_size=2, max_size=4),
    layout=st.sampled_from(["NCHW", "NHWC"]),
    dtype=st.sampled_from(DTYPES),
)
def test_bn_stats_candidates_random_shapes(dims, layout, dtype):
    x = random_floats(rng(), tuple(dims), dtype, loc=0.3, scale=1.7)
    problem = tf.make_problem("bn_stats", x.shape, dtype, layout=layout)
    for cand in registry.applicable(problem, CPU):
        kernel = build_kernel(problem, CPU, cand.name)
        check_bn(x, layout, run_poisoned(kernel, [x]), dtype)


@pytest.mark.parametrize("shape, layout", [((4, 6, 8, 8), "NCHW"), ((2, 8, 8, 32), "NHWC"), ((5, 7, 13), "NCHW")])
def test_bn_stats_every_knob_config(shape, layout):
    x = random_floats(rng(), shape, "float32")
    problem = tf.make_problem("bn_stats", shape, "float32", layout=layout)
    for cand in registry.applicable(problem, CPU):
        for knobs in cand.all_configs(problem, CPU):
            kernel = build_kernel(problem, CPU, cand.name, knobs)
            check_bn(x, layout, run_poisoned(kernel, [x]), "float32")


def test_bn_stats_cancellation_case():
    """mean 1000, std 0.01 in float32: the default candidates use shifted sums."""
    x = random_floats(rng(), (16, 8, 28, 28), "float32", loc=1000.0, scale=0.01)
    mean, var = tf.bn_stats(x)
    ref_mean, ref_var = bn_ref.reference(x)
    assert_close(mean, ref_mean, 1e-6, 0, "mean")
    assert_close(var, ref_var, 1e-3, 0, "var")


def ce_case(gen, batch, classes, dtype, target_dtype, weighted, ignored_fraction, scale=3.0):
    logits = random_floats(gen, (batch, classes), dtype, scale=scale)
    target = gen.integers(0, classes, batch).astype(target_dtype)
    target[gen.random(batch) < ignored_fraction] = -100
    weight = (gen.random(classes) + 0.05).astype(np.float32) if weighted else None
    return logits, target, weight


def check_ce(outs, logits, target, weight, reduction, smoothing, dtype, ignore_index=-100):
    ref = ce_ref.reference(logits, target, weight, ignore_index, reduction, smoothing)
    loss, first_bad = outs[-2], outs[-1]
    tol = TOLERANCES[dtype]
    assert_close(loss.reshape(ref.shape), ref, tol["rtol"], tol["atol"], f"loss ({reduction})")
    assert first_bad[0] == logits.shape[0]


@SETTINGS
@given(
    batch=st.sampled_from([1, 2, 3, 7, 16, 33]),
    classes=st.sampled_from([1, 2, 3, 7, 16, 31, 64, 100, 257, 1000]),
    dtype=st.sampled_from(DTYPES),
    target_dtype=st.sampled_from(["int32", "int64"]),
    weighted=st.booleans(),
    reduction=st.sampled_from(["none", "mean", "sum"]),
    smoothing=st.sampled_from([0.0, 0.1, 1.0]),
    ignored=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_cross_entropy_candidates_random(batch, classes, dtype, target_dtype, weighted, reduction, smoothing, ignored):
    gen = rng()
    logits, target, weight = ce_case(gen, batch, classes, dtype, target_dtype, weighted, ignored)
    problem = tf.make_problem(
        "cross_entropy", logits.shape, dtype, target_dtype=target_dtype, weight=weighted,
        reduction=reduction, label_smoothing=smoothing,
    )
    inputs = [logits, target] + ([weight] if weighted else [])
    for cand in registry.applicable(problem, CPU):
        kernel = build_kernel(problem, CPU, cand.name)
        check_ce(run_poisoned(kernel, inputs), logits, target, weight, reduction, smoothing, dtype)


def test_cross_entropy_every_knob_config():
    gen = rng()
    logits, target, weight = ce_case(gen, 12, 64, "float32", "int64", True, 0.2)
    problem = tf.make_problem("cross_entropy", logits.shape, "float32", weight=True, label_smoothing=0.1)
    for cand in registry.applicable(problem, CPU):
        for knobs in cand.all_configs(problem, CPU):
            outs = run_poisoned(build_kernel(problem, CPU, cand.name, knobs), [logits, target, weight])
            check_ce(outs, logits, target, weight, "mean", 0.1, "float32")


def test_mean_over_all_ignored_rows_is_nan_like_torch(poisoned):
    gen = rng()
    logits = random_floats(gen, (5, 11), "float32")
    target = np.full(5, -100)
    assert np.isnan(tf.cross_entropy(logits, target))
    assert tf.cross_entropy(logits, target, reduction="sum") == 0.0
    assert (tf.cross_entropy(logits, target, reduction="none") == 0.0).all()


def test_nan_and_inf_propagate_like_torch():
    gen = rng()
    logits = random_floats(gen, (5, 9), "float32")
    logits[1, 3] = np.nan
    logits[2, 4] = np.inf
    logits[3, :] = -np.inf
    target = np.array([0, 1, 2, 3, 4])
    ours = tf.cross_entropy(logits, target, reduction="none")
    ref = ce_ref.reference(logits, target, reduction="none")
    assert_close(ours, ref, 1e-5, 1e-5, "loss with nan/inf")
    assert np.isnan(ours[1:4]).all() and np.isfinite(ours[[0, 4]]).all()
    torch = torch_or_none()
    if torch is not None:
        expected = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(target), reduction="none")
        assert_close(ours, expected.numpy(), 1e-5, 1e-5, "vs torch")


def test_empty_batch_matches_torch():
    logits = np.zeros((0, 5), np.float32)
    target = np.zeros(0, np.int64)
    assert tf.cross_entropy(logits, target, reduction="none").shape == (0,)
    assert tf.cross_entropy(logits, target, reduction="sum") == 0.0
    assert np.isnan(tf.cross_entropy(logits, target))


@pytest.mark.parametrize("dtype", DTYPES)
def test_api_with_torch_cpu_tensors_matches_torch(dtype):
    torch = torch_or_none()
    if torch is None:
        pytest.skip("torch not installed")
    gen = rng()
    x = torch.from_numpy(random_floats(gen, (4, 6, 5, 7), "float32")).to(getattr(torch, dtype))
    mean, var = tf.bn_stats(x)
    assert isinstance(mean, torch.Tensor) and mean.dtype == torch.float32
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(0, 2, 3), unbiased=False)
    assert_close(mean.numpy(), ref_mean.numpy(), 1e-5, 1e-5, "mean vs torch")
    assert_close(var.numpy(), ref_var.numpy(), 1e-5, 1e-5, "var vs torch")

    logits, target, weight = ce_case(gen, 16, 50, "float32", "int64", True, 0.25)
    lt = torch.from_numpy(logits).to(getattr(torch, dtype))
    for reduction in ("none", "mean", "sum"):
        for smoothing in (0.0, 0.3):
            ours = tf.cross_entropy(lt, torch.from_numpy(target), torch.from_numpy(weight), reduction=reduction, label_smoothing=smoothing)
            theirs = torch.nn.functional.cross_entropy(
                lt.double(), torch.from_numpy(target), torch.from_numpy(weight).double(), reduction=reduction,
                label_smoothing=smoothing,
            )
            assert isinstance(ours, torch.Tensor) and ours.shape == theirs.shape
            assert_close(ours.numpy(), theirs.numpy(), 2e-5, 2e-5, f"ce {reduction} {smoothing}")


def test_api_with_tvm_tensors_and_noncontiguous_numpy():
    import tvm

    gen = rng()
    x = random_floats(gen, (3, 4, 10), "float32")
    mean, var = tf.bn_stats(tvm.runtime.tensor(x))
    assert isinstance(mean, tvm.runtime.Tensor)
    check_bn(x, "NCHW", [mean.numpy(), var.numpy()], "float32")
    strided = random_floats(gen, (6, 20), "float32")[:, ::2]  # not contiguous: copied once
    target = np.arange(6) % 10
    assert_close(tf.cross_entropy(strided, target), ce_ref.reference(strided, target), 1e-5, 1e-5, "strided")


def test_second_call_does_not_compile_again():
    from tvm_fusion import kernel as kernel_mod

    x = random_floats(rng(), (2, 3, 17), "float32")
    tf.bn_stats(x)
    size = kernel_mod.cache_size()
    tf.bn_stats(random_floats(rng(), (2, 3, 17), "float32"))
    assert kernel_mod.cache_size() == size
    tf.bn_stats(random_floats(rng(), (2, 3, 18), "float32"))
    assert kernel_mod.cache_size() == size + 1


def test_build_returns_kernel_for_shape():
    kernel = tf.build("cross_entropy", shape=(8, 100), dtype="bfloat16", target="llvm", reduction="sum")
    assert kernel.problem.shape == (8, 100) and kernel.candidate == "cross_entropy_parallel"
    assert "define" in kernel.device_source()


@pytest.mark.parametrize("rows, channels", [(999_999, 24), (1_000_000, 3), (999_999, 3)])
def test_bn_stats_long_channels_last_bf16_stays_accurate(rows, channels):
    """Float32 sums of a million same-sign squares drift: one partial over 1M bf16 rows
    put the variance 1.9e-3 off; partial sums keep it near 3e-4 (M odd with scalar
    partials, and M a multiple of 4 with C < 4, where the partials are vector lanes).
    The sums drift with the shift's distance from the mean too: a first value 3 std
    off put a variance 4.3e-3 off (seed 13); the mean of the first 64 values keeps
    every variance within 1.2e-4 and every mean within 1.3e-4 std (40 seeds each)."""
    gen = rng()
    x = random_floats(gen, (rows, channels), "bfloat16", loc=2.0, scale=0.7)
    ref_mean, ref_var = bn_ref.reference(x, "NHWC")
    kernel = build_kernel(tf.make_problem("bn_stats", x.shape, "bfloat16", layout="NHWC"), CPU, "bn_stats_parallel")
    mean, var = run_poisoned(kernel, [x])
    assert_close(var, ref_var, 3e-4, 0.0, "var")
    assert_close(mean, ref_mean, 1e-5, 2.5e-4 * float(np.sqrt(ref_var.max())), "mean")


@pytest.mark.skipif(torch_or_none() is None, reason="needs torch")
@pytest.mark.parametrize("shape", [
    (16, 2, 256, 256),  # 2^20 values a channel, in 16-lane partials a plane
    (64, 2, 127, 127),  # odd planes: one partial a plane
])
def test_long_nchw_channels_keep_float32_accuracy(poisoned, shape):
    """One float32 accumulator a lane over a whole channel drifted with its length:
    bn_forward_parallel (no partials) put y 1.4e-3 off on 16x2x256x256 and bn_stats
    the variance 1e-5 (torch: 3e-7 and 1e-7; the audit of 2026-12-05). A partial a
    (plane, lane) keeps both near torch's."""
    torch = torch_or_none()
    import torch.nn.functional as F

    import tvm_fusion.torch as tft

    torch.manual_seed(int(rng().integers(2**31)))
    x = torch.randn(shape) * 1.5 + 3.0
    channels = shape[1]
    rm, rv = torch.zeros(channels), torch.ones(channels)
    y = tft.batch_norm(x, rm, rv, training=True, momentum=1.0)
    ref_rm, ref_rv = torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64)
    ref_y = F.batch_norm(x.double(), ref_rm, ref_rv, training=True, momentum=1.0)
    assert float((y.double() - ref_y).abs().max()) < 5e-6
    torch.testing.assert_close(rv.double(), ref_rv, rtol=2e-6, atol=0)
    mean, var = tf.bn_stats(x)
    ref_var = x.double().var((0, 2, 3), unbiased=False)
    torch.testing.assert_close(var.double(), ref_var, rtol=2e-6, atol=0)
    torch.testing.assert_close(mean.double(), x.double().mean((0, 2, 3)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("op", ["cross_entropy", "cross_entropy_grad"])
@pytest.mark.parametrize("batch", [1_000_000, 999_983])  # sqrt(B) chunks dividing B, and a prime B (last chunk short)
def test_a_mean_over_a_million_rows_keeps_float32_accuracy(op, batch):
    """One float32 accumulator over the row losses drifted with B: a mean over 1M rows
    1.1e-4 off, over 4M 2.6e-3 (the audit of 2026-12-05); chunks of about sqrt(B)
    rows keep it near 1e-6."""
    gen = rng()
    logits, target, _ = ce_case(gen, batch, 4, "float32", "int64", False, 0.0)
    options = {"mode": "fused"} if op == "cross_entropy_grad" else {}
    problem = tf.make_problem(op, logits.shape, "float32", reduction="mean", **options)
    (cand,) = registry.applicable(problem, CPU)
    kernel = build_kernel(problem, CPU, cand.name)
    outs = dict(zip([name for name, _, _ in kernel.outputs], run_poisoned(kernel, [logits, target])))
    ref = ce_ref.reference(logits, target, None, -100, "mean", 0.0)
    assert_close(outs["loss"], ref, 2e-6, 0.0, "mean loss")


@pytest.mark.parametrize("op", ["cross_entropy", "cross_entropy_grad"])
def test_a_long_odd_row_keeps_its_log_sum_exp(op):
    """V = 50257 (no vector width divides it): one float32 accumulator over the whole
    row put a row loss 1.5e-4 off (seed 707343578, and 5e-5 to 1.5e-4 on every row
    tried); the row's body in 16 lanes and its tail apart keep 4096 rows within 1e-5."""
    gen = rng()
    logits, target, _ = ce_case(gen, 32, 50257, "float32", "int64", False, 0.0)
    options = {"mode": "fused"} if op == "cross_entropy_grad" else {}
    problem = tf.make_problem(op, logits.shape, "float32", reduction="none", **options)
    (cand,) = registry.applicable(problem, CPU)
    kernel = build_kernel(problem, CPU, cand.name)
    outs = dict(zip([name for name, _, _ in kernel.outputs], run_poisoned(kernel, [logits, target])))
    loss = outs["loss"]
    ref = ce_ref.reference(logits, target, None, -100, "none", 0.0)
    assert_close(loss, ref, 0.0, 2.5e-5, "row losses")
