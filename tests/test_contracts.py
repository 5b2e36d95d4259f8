"""Every bad input gets a clear error that names the argument and the value."""

import numpy as np
import pytest

import tvm_fusion as tf
from helpers import has_gpu, torch_or_none
from tvm_fusion.contracts import cross_entropy as ce

X = np.zeros((2, 3, 4, 4), np.float32)
LOGITS = np.zeros((4, 10), np.float32)
TARGET = np.array([0, 1, 2, 3], np.int64)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: tf.bn_stats(np.zeros((2, 3, 4, 4, 5), np.float32)), ValueError, ["rank 5", "x must"]),
        (lambda: tf.bn_stats(np.zeros(7, np.float32)), ValueError, ["rank 1"]),
        (lambda: tf.bn_stats(X.astype(np.int32)), TypeError, ["x dtype", "int32"]),
        (lambda: tf.bn_stats(X.astype(np.float64)), TypeError, ["float64"]),
        (lambda: tf.bn_stats(X, layout="NCWH"), ValueError, ["layout", "'NCWH'"]),
        (lambda: tf.bn_stats(np.zeros((0, 3, 4, 4), np.float32)), ValueError, ["empty", "(0, 3, 4, 4)"]),
        (lambda: tf.bn_stats([1.0, 2.0]), TypeError, ["x must be", "list"]),
        (lambda: tf.cross_entropy(np.zeros((4, 0), np.float32), TARGET), ValueError, ["V > 0", "(4, 0)"]),
        (lambda: tf.cross_entropy(np.zeros((4, 3, 2), np.float32), TARGET), ValueError, ["rank 2"]),
        (lambda: tf.cross_entropy(LOGITS.astype(np.int64), TARGET), TypeError, ["logits dtype", "int64"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET.astype(np.float32)), TypeError, ["integer class indices", "float32"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET[:3]), ValueError, ["target.shape", "(3,)"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, weight=np.ones(9, np.float32)), ValueError, ["weight.shape", "(9,)"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, weight=np.ones(10, np.int32)), TypeError, ["weight dtype"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, label_smoothing=1.5), ValueError, ["label_smoothing", "1.5"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, label_smoothing=-0.1), ValueError, ["label_smoothing", "-0.1"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, label_smoothing=float("nan")), ValueError, ["label_smoothing", "nan"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, label_smoothing="0.1"), TypeError, ["label_smoothing"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, reduction="avg"), ValueError, ["reduction", "'avg'"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, ignore_index=1.5), TypeError, ["ignore_index", "1.5"]),
        # int() truncated a float array (and a float tensor) to 3; operator.index refuses it, as torch does
        (lambda: tf.cross_entropy(LOGITS, TARGET, ignore_index=np.array(3.5)), TypeError,
         ["ignore_index must be an int", "3.5"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, ignore_index=np.array([3])), TypeError,
         ["ignore_index must be an int"]),
        # torch's ignore_index is an int64 (torch raises "Overflow when unpacking long long")
        (lambda: tf.cross_entropy(LOGITS, TARGET, ignore_index=2**64), ValueError, ["ignore_index", "int64", str(2**64)]),
        (lambda: tf.build("cross_entropy", shape=(2, 3), target="llvm", ignore_index=-(2**63) - 1), ValueError,
         ["ignore_index", "int64"]),
        (lambda: tf.cross_entropy(LOGITS, TARGET, check_targets="yes"), TypeError, ["check_targets"]),
        (lambda: tf.build("softmax", shape=(2, 3)), ValueError, ["op", "'softmax'"]),
        (lambda: tf.build("bn_stats", shape=(2, 3, 4), target="metal"), ValueError, ["target", "'metal'"]),
        (lambda: tf.build("bn_stats", shape=(2, 3, 4), dtype="float8"), TypeError, ["float8"]),
        (lambda: tf.build("bn_stats", shape="2x3"), TypeError, ["x.shape"]),
        (lambda: tf.build("bn_stats", shape=(2, -3, 4)), ValueError, ["negative"]),
        (lambda: tf.build("cross_entropy", shape=(2, 3), smoothing=0.1), TypeError, ["smoothing"]),
        # TVM's own "Literal value ... exceeds range of int32 / int64", naming no argument
        (lambda: tf.build("cross_entropy", shape=(2**31, 4), target="llvm"), ValueError,
         ["at most 2**31 - 1 rows", str((2**31, 4))]),
        (lambda: tf.build("cross_entropy", shape=(4, 2**62), target="llvm"), ValueError,
         ["logits.shape", "more than an int64 index"]),
        (lambda: tf.build("bn_stats", shape=(2**33, 2**31, 4), target="llvm"), ValueError,
         ["x.shape", "more than an int64 index"]),
        # the calls answer B = 0 without a kernel; build failed in TVM's rfactor
        (lambda: tf.build("cross_entropy", shape=(0, 10), target="llvm"), ValueError, ["B > 0", "(0, 10)"]),
        (lambda: tf.build("cross_entropy_grad", shape=(0, 10), target="llvm"), ValueError, ["B > 0", "(0, 10)"]),
    ],
)
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value!s}"


@pytest.mark.parametrize("target_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad", [10, -1, 2**31 - 1])
def test_out_of_range_target_names_first_bad_row_cpu(target_dtype, bad):
    target = np.array([0, 1, -100, bad, bad, 2], target_dtype)
    logits = np.random.default_rng().standard_normal((6, 10)).astype(np.float32)
    with pytest.raises(tf.TargetOutOfRangeError) as info:
        tf.cross_entropy(logits, target)
    assert info.value.row == 3 and f"target[3] = {bad}" in str(info.value)
    with pytest.raises(tf.TargetOutOfRangeError):
        ce.reference(logits, target)
    # Skipping the check returns a loss, computed without reading out of bounds.
    loss = tf.cross_entropy(logits, target, check_targets=False, reduction="none")
    assert loss[3] == 0.0 and loss[4] == 0.0 and np.isfinite(loss).all()


def test_ignore_index_is_not_out_of_range():
    logits = np.random.default_rng().standard_normal((3, 5)).astype(np.float32)
    loss = tf.cross_entropy(logits, np.array([-5, 2, -5]), ignore_index=-5, reduction="none")
    assert loss[0] == 0.0 and loss[2] == 0.0 and loss[1] > 0


def test_devices_must_match():
    torch = torch_or_none()
    if torch is None:
        pytest.skip("torch not installed")
    with pytest.raises(TypeError, match="target must be"):
        tf.cross_entropy(torch.zeros(2, 3), [0, 1])


@pytest.mark.gpu
def test_out_of_range_target_on_gpu_is_flagged_not_read():
    torch = torch_or_none()
    if torch is None or not has_gpu():
        pytest.skip("needs torch with CUDA")
    logits = torch.randn(64, 1000, device="cuda", dtype=torch.float16)
    target = torch.randint(0, 1000, (64,), device="cuda")
    target[17] = 1000
    target[40] = -3
    tf.check_targets()  # nothing pending from earlier tests
    with pytest.raises(tf.TargetOutOfRangeError) as info:
        tf.cross_entropy(logits, target)
        tf.check_targets()  # on CUDA the flag is read once the kernel has run
    assert info.value.row == 17 and "target[17] = 1000" in str(info.value)
    loss = tf.cross_entropy(logits, target, check_targets=False, reduction="none")
    torch.cuda.synchronize()
    assert loss[17].item() == 0.0 and torch.isfinite(loss).all()
