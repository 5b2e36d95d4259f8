"""tvm_fusion.verify: a kernel against its operator's float64 reference, and the tuner's
check of each problem's best record (a wrong one rejected, dispatch skipping it).

On the CPU: every operator's kernels pass; a kernel that leaves its outputs unwritten,
or gets one value wrong, fails with the output named; a tune whose best record is made
to fail rejects it, and dispatch then takes the next. On the GPU: dispatch's CUDA kernels
of a few shapes pass."""

import numpy as np
import pytest

import tvm_fusion as tf
from helpers import has_gpu
from tvm_fusion import dispatch, records, registry, targets, tuner, verify
from tvm_fusion.kernel import build_kernel

CPU = targets.resolve("llvm")
CASES = [
    ("cross_entropy", (16, 1000), "float32", {}),
    ("cross_entropy", (16, 1000), "float16", {"reduction": "none", "weight": True, "label_smoothing": 0.1}),
    ("cross_entropy", (8, 3001), "bfloat16", {"reduction": "sum"}),
    ("cross_entropy_grad", (16, 1000), "float32", {"mode": "fused"}),
    ("cross_entropy_grad", (16, 1000), "bfloat16", {"mode": "from_lse", "reduction": "none"}),
    ("cross_entropy_grad", (16, 1000), "float16", {"mode": "fused", "weight": True, "label_smoothing": 0.2}),
    ("bn_stats", (4, 8, 6, 6), "float32", {}),
    ("bn_stats", (4, 6, 6, 8), "float16", {"layout": "NHWC"}),
    ("bn_forward", (4, 8, 6, 6), "float32", {}),
    ("bn_forward", (4, 8, 6, 6), "bfloat16", {"training": False}),
    ("bn_forward", (4, 6, 6, 8), "float16", {"layout": "NHWC", "affine": False}),
    ("bn_backward", (4, 8, 6, 6), "float32", {}),
    ("bn_backward", (4, 6, 6, 8), "float16", {"layout": "NHWC"}),
    ("bn_backward_dx", (4, 8, 6, 6), "float32", {}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_every_operators_cpu_kernels_match_the_reference(case):
    op, shape, dtype, options = case
    problem = tf.make_problem(op, shape, dtype, **options)
    for cand in registry.applicable(problem, CPU):
        assert verify.check(build_kernel(problem, CPU, cand.name)) is None


class Broken:
    """A kernel that runs the real one, then spoils one output: ``unwritten`` refills it
    with the poison, else one value is moved by 1% of the output's largest."""

    def __init__(self, kernel, output, unwritten):
        self.kernel, self.output, self.unwritten = kernel, output, unwritten

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *tensors):
        self.kernel(*tensors)
        at = self.kernel.num_inputs + [n for n, _, _ in self.kernel.outputs].index(self.output)
        values = tensors[at].numpy()
        flat = values.reshape(-1)
        if self.unwritten:
            flat[-1] = np.nan
        else:
            flat[len(flat) // 2] += 0.01 * np.abs(flat.astype(np.float64)).max() + 0.01
        tensors[at].copyfrom(values)


@pytest.mark.parametrize("op, shape, dtype, options, output", [
    ("cross_entropy", (16, 1000), "float32", {}, "loss"),
    ("cross_entropy_grad", (16, 1000), "float16", {"mode": "fused"}, "dlogits"),
    ("bn_forward", (4, 8, 6, 6), "float32", {}, "running_var_out"),
    ("bn_backward", (4, 8, 6, 6), "float32", {}, "dweight"),
])
@pytest.mark.parametrize("unwritten", [True, False])
def test_an_unwritten_or_a_wrong_value_fails_naming_the_output(op, shape, dtype, options, output, unwritten):
    problem = tf.make_problem(op, shape, dtype, **options)
    kernel = build_kernel(problem, CPU, registry.applicable(problem, CPU)[0].name)
    assert verify.check(kernel) is None
    wrong = verify.check(Broken(kernel, output, unwritten))
    assert wrong is not None and f": {output} " in wrong and problem.key() in wrong
    assert ("NaN" in wrong) == unwritten


def test_a_tune_rejects_a_best_record_with_wrong_outputs_and_dispatch_takes_the_next(tmp_path, monkeypatch):
    """The tuner checks the best record's kernel, as dispatch builds it: made to fail
    once, the record is rejected in the log folder, the result names it, and dispatch
    (here and in a fresh reading of the folder) skips it for the next best, which the
    tuner checked too."""
    problem = tf.make_problem("cross_entropy", (16, 256), "float32")
    checked, real = [], verify.check

    def fails_first(kernel, *args, **kwargs):
        checked.append((kernel.candidate, str(kernel.knobs)))
        return "made to fail" if len(checked) == 1 else real(kernel, *args, **kwargs)

    monkeypatch.setattr(verify, "check", fails_first)
    result = tuner.tune([problem], CPU, trials=3, log_dir=tmp_path)
    key = problem.key()
    assert result.rejected == {key: ["made to fail"]} and len(checked) == 2 and checked[0] != checked[1]
    assert result.best[key][0] == checked[1][0]
    rejected = records.rejected(tmp_path, CPU)
    assert (key, *checked[0]) in rejected
    records.invalidate()
    choice = dispatch.choose(problem, CPU, tmp_path)
    assert (choice.candidate, str(choice.knobs)) == checked[1] and choice.source == "record"
    found = dispatch.records_of(problem, CPU, tmp_path)
    assert found and all((f.candidate, str(f.knobs)) != checked[0] for f in found)
    records.invalidate()


def test_a_problem_too_large_for_the_reference_is_reported_unchecked(tmp_path, monkeypatch):
    monkeypatch.setattr(tuner, "CHECK_MAX_ELEMENTS", 100)
    monkeypatch.setattr(verify, "check", lambda *a, **k: pytest.fail("checked a problem over the limit"))
    problem = tf.make_problem("cross_entropy", (16, 256), "float32")
    result = tuner.tune([problem], CPU, trials=1, log_dir=tmp_path)
    assert list(result.unchecked) == [problem.key()] and "too large" in result.unchecked[problem.key()]
    assert problem.key() in result.best and not result.rejected
    records.invalidate()


def test_a_malformed_rejection_file_is_an_error_naming_it(tmp_path):
    path = records.folder(tmp_path, CPU)
    path.mkdir(parents=True)
    (path / records.REJECTED).write_text("[1, 2]")
    records.invalidate()
    with pytest.raises(records.LogLineError, match="rejected.json"):
        records.rejected(tmp_path, CPU)
    records.invalidate()


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op, shape, dtype, options", [
    ("cross_entropy", (128, 32000), "float16", {}), ("cross_entropy", (16, 128256), "bfloat16", {}),
    ("cross_entropy_grad", (64, 50257), "bfloat16", {"mode": "fused"}),
    ("bn_forward", (8, 64, 28, 28), "float16", {}), ("bn_backward", (8, 28, 28, 64), "bfloat16", {"layout": "NHWC"}),
])
def test_dispatchs_cuda_kernels_pass_the_check(op, shape, dtype, options):
    problem = tf.make_problem(op, shape, dtype, **options)
    target = targets.for_device("cuda")
    assert verify.check(dispatch.kernel_for(problem, target)) is None
