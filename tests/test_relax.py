"""Relax integration: the passes on whole models and on the graphs they must leave alone.

Checked by what the graph must guarantee: the compiled model equals PyTorch (eval
and train, running statistics included, with and without label smoothing), the
training graph holds exactly one fused call per BatchNorm and one for the loss,
the folded graph holds no batch_norm, and every BN the contract does not allow is
left unchanged with a reason. Sizes are small: each case compiles in about a
second on the CPU.

Tolerances: against torch in float32 the difference is float32 rounding of
convolutions and reductions over a few hundred values (~1e-6 relative); folding
moves the BN's rounding into the weights. rtol 1e-4 / atol 1e-5 leaves a margin of
10x and still catches a wrong statistic, eps or bias (errors of 1e-2 and up).
"""

import argparse
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
import tvm_ffi
from torch import nn
from tvm import relax
from tvm.relax import op as R
from tvm.relax.type import TensorType

import tvm_fusion as tf
from helpers import assert_close, rng
from tvm_fusion import records, targets
from tvm_fusion.compute import prim_func
from tvm_fusion.contracts import cross_entropy as ce_ref
from tvm_fusion.kernel import schedule_for
from tvm_fusion.relax import FoldBatchNorm, FuseReductions, compile_exported, count_ops, import_exported
from tvm_fusion.relax import model as M

CPU = targets.resolve("llvm")
RTOL, ATOL = 1e-4, 1e-5


def torch_reference(model, inputs, mode):
    """Outputs of a copy of ``model`` run once in ``mode``, and its state afterwards."""
    ref = copy.deepcopy(model).train(mode == "train")
    with torch.no_grad():
        logits, loss = ref(*inputs)
    return logits.numpy(), loss.numpy(), {k: v.numpy() for k, v in ref.state_dict().items()}


def run_module(mod, *inputs):
    vm = relax.VirtualMachine(tvm.compile(mod, CPU), tvm.cpu())
    result = vm["main"](*[tvm.runtime.tensor(np.asarray(x)) for x in inputs])
    return [r.numpy() for r in result] if isinstance(result, tvm.ir.Array) else [result.numpy()]


# -- the model, end to end ----------------------------------------------------------------
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_small_resnet_matches_torch(mode, label_smoothing):
    """torch.export -> import -> passes -> llvm; logits, loss (and in train mode the
    new running statistics of all four BNs) equal torch's."""
    model, inputs = M.small_resnet(label_smoothing=label_smoothing), M.example_inputs()
    logits, loss, state = torch_reference(model, inputs, mode)
    compiled = M.compile_model(model, inputs, "llvm", mode)
    out = compiled.run(*inputs)
    assert_close(out[compiled.outputs[0]], logits, RTOL, ATOL, "logits")
    assert_close(out[compiled.outputs[1]], loss, RTOL, ATOL, "loss")
    stats = compiled.outputs[2:]
    assert len(stats) == (8 if mode == "train" else 0)
    for name in stats:
        assert_close(out[name], state[name], RTOL, ATOL, name)


def test_training_graph_has_one_fused_kernel_per_bn_and_one_for_the_loss():
    model, inputs = M.small_resnet(label_smoothing=0.1), M.example_inputs()
    compiled = M.compile_model(model, inputs, "llvm", "train")
    before, after = count_ops(compiled.imported), count_ops(compiled.mod)
    assert before["relax.nn.batch_norm"] == 4 and before["relax.nn.nll_loss"] == 1
    assert after["tvm_fusion.bn_stats"] == 4
    assert after["tvm_fusion.cross_entropy"] == 1
    for gone in ("relax.nn.batch_norm", "relax.nn.nll_loss", "relax.nn.log_softmax", "relax.where"):
        assert after[gone] == 0, gone
    assert [d.action for d in compiled.report] == ["fused"] * 5
    assert "label_smoothing=0.1" in compiled.report[-1].reason


def test_folded_inference_graph_has_no_batch_norm():
    model, inputs = M.small_resnet(), M.example_inputs()
    compiled = M.compile_model(model, inputs, "llvm", "eval")
    after = count_ops(compiled.mod)
    assert after["relax.nn.batch_norm"] == 0
    assert after["tvm_fusion.cross_entropy"] == 1
    folded = [d for d in compiled.report if d.action == "folded"]
    assert len(folded) == 4  # stem conv (bias), conv, grouped conv, linear (bias)
    assert any("relax.matmul" in d.reason for d in folded)


def test_compile_exported_from_a_saved_program(tmp_path):
    model, inputs = M.small_resnet(), M.example_inputs()
    path = tmp_path / "model.pt2"
    torch.export.save(M.export(model, inputs, "eval"), path)
    compiled = compile_exported(path, "llvm", mode="eval")
    logits, loss, _ = torch_reference(model, inputs, "eval")
    assert_close(compiled.run(*inputs)[compiled.outputs[1]], loss, RTOL, ATOL, "loss")
    with pytest.raises(FileNotFoundError, match="no exported program"):
        compile_exported(tmp_path / "missing.pt2", "llvm")
    with pytest.raises(ValueError, match="mode must be one of"):
        compile_exported(path, "llvm", mode="inference")
    with pytest.raises(ValueError, match="target"):
        compile_exported(path, "vulkan")


def test_model_builds_for_cuda_here():
    """Code generation only (no GPU needed): our kernels are in the CUDA source."""
    compiled = M.compile_model(M.small_resnet(), M.example_inputs(), "cuda", "train")
    source = "\n".join(cuda_sources(compiled.executable.mod))
    assert "tvm_fusion_bn_stats_ncl_4x8x64_float32_kernel" in source
    assert "tvm_fusion_cross_entropy_4x10_float32_mean_int64_kernel" in source


def test_eval_graph_for_cuda_schedules_no_conv_as_a_block_per_output():
    """Code generation only. Folded into a grouped conv, a BN's bias add made DLight give
    that conv a thread block per output element (red_result is its cross-thread
    reduction buffer): 4.817 ms against 0.823 ms unfolded on the H200."""
    compiled = M.compile_model(M.small_resnet(), M.example_inputs(), "cuda", "eval")
    source = "\n".join(cuda_sources(compiled.executable.mod))
    convs = list(re.finditer(r"__global__ void __launch_bounds__\(\d+\) (\w*conv\w*)\([^)]*\) \{", source))
    assert len(convs) == 3
    for conv in convs:
        assert "red_result" not in source[conv.end() : source.index("\n}\n", conv.end())], conv.group(1)
    kept = [d.reason for d in compiled.report if d.action == "kept"]
    assert len(kept) == 1 and kept[0].startswith("grouped relax.nn.conv2d on CUDA")


def test_fold_batchnorm_after_a_grouped_conv_stays_only_on_cuda():
    x = relax.Var("x", TensorType((2, 4, 5, 5), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(R.nn.conv2d(x, relax.const(np.ones((4, 2, 3, 3), "float32")), padding=1, groups=2))
            stats = [relax.const(np.full(4, v, "float32")) for v in (1, 0, 0, 1)]
            bn = bb.emit(R.nn.batch_norm(conv, *stats, axis=1, training=False))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    mod = bb.get()
    for target, action in ((None, "folded"), ("llvm", "folded"), ("cuda", "kept")):
        fold = FoldBatchNorm(target)
        result = fold(mod)
        assert [d.action for d in fold.report] == [action], (target, fold.report)
        assert (count_ops(result)["relax.nn.batch_norm"] == 1) == (action == "kept")


def cuda_sources(module):
    found = []
    for inner in module.imports:
        if inner.kind == "cuda":
            found.append(inner.inspect_source())
        found += cuda_sources(inner)
    return found


# -- FoldBatchNorm on single layers ---------------------------------------------------------
class LayerBN(nn.Module):
    def __init__(self, layer, bn):
        super().__init__()
        self.layer, self.bn = layer, bn

    def forward(self, x):
        return self.bn(self.layer(x))


# Why these layers: conv1d (BN1d over (N, C, L)), a grouped conv2d without bias (the
# output channel is still W's axis 0), and a linear layer (W's last axis after the
# importer's transpose; the bias comes as add(matmul, b)).
FOLD_CASES = {
    "conv1d_bias": (lambda: nn.Conv1d(4, 6, 3, padding=1), lambda: nn.BatchNorm1d(6), (2, 4, 9)),
    "conv2d_groups4_no_bias": (
        lambda: nn.Conv2d(8, 8, 3, groups=4, bias=False), lambda: nn.BatchNorm2d(8), (2, 8, 6, 6)
    ),
    "linear_bias": (lambda: nn.Linear(5, 7), lambda: nn.BatchNorm1d(7), (3, 5)),
}


@pytest.mark.parametrize("case", list(FOLD_CASES))
def test_fold_batchnorm_layers_against_float64(case):
    make_layer, make_bn, shape = FOLD_CASES[case]
    torch.manual_seed(0)
    model = LayerBN(make_layer(), make_bn()).eval()
    with torch.no_grad():
        model.bn.weight.normal_()
        model.bn.bias.normal_()
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.2, 3.0)
    x = torch.randn(shape)
    mod = import_exported(torch.export.export(model, (x,))).mod
    fold = FoldBatchNorm()
    folded = fold(mod)
    assert [d.action for d in fold.report] == ["folded"], fold.report
    assert count_ops(folded)["relax.nn.batch_norm"] == 0
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x.double()).numpy()
    assert_close(run_module(folded, x.numpy())[0], expected, RTOL, ATOL, case)


def bn_graph(producer=lambda conv, x: conv, stats_as_params=False, running_var=None):
    """main(x) = batch_norm(producer(conv2d(x), x), ...) in inference mode, one output."""
    gen = np.random.default_rng(0)
    x = relax.Var("x", TensorType((2, 4, 5, 5), "float32"))
    rm = relax.Var("running_mean", TensorType((4,), "float32"))
    rv = relax.Var("running_var", TensorType((4,), "float32"))
    variance = np.ones(4, "float32") if running_var is None else np.asarray(running_var, "float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, rm, rv] if stats_as_params else [x]):
        with bb.dataflow():
            weight = relax.const(gen.standard_normal((4, 4, 3, 3)).astype("float32"))
            conv = bb.emit(R.nn.conv2d(x, weight, padding=1))
            z = producer(conv, x)
            z = z if isinstance(z, relax.Var) else bb.emit(z)
            stats = (rm, rv) if stats_as_params else (relax.const(np.zeros(4, "float32")), relax.const(variance))
            ones, zeros = relax.const(np.ones(4, "float32")), relax.const(np.zeros(4, "float32"))
            bn = bb.emit(R.nn.batch_norm(z, ones, zeros, *stats, axis=1, training=False))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    return bb.get()


# Each BN must stay, and the reason must say why.
KEPT_CASES = {
    "after_relu": ({"producer": lambda conv, x: R.nn.relu(conv)}, "relax.nn.relu, not conv1d / conv2d / matmul"),
    "after_residual_add": ({"producer": lambda conv, x: R.add(conv, x)}, "relax.add, not conv1d / conv2d / matmul"),
    "statistics_are_parameters": ({"stats_as_params": True}, "running_mean is a function parameter, not a constant"),
    "negative_variance": ({"running_var": [1, -0.5, 1, 1]}, r"running_var\[1\] = -0.5 is not finite"),
    "infinite_variance": ({"running_var": [1, 1, np.inf, 1]}, r"running_var\[2\] = inf is not finite"),
}


@pytest.mark.parametrize("case", list(KEPT_CASES))
def test_fold_batchnorm_keeps_what_the_contract_rejects(case, caplog):
    options, reason = KEPT_CASES[case]
    mod = bn_graph(**options)
    fold = FoldBatchNorm()
    with caplog.at_level("WARNING", logger="tvm_fusion.relax"):
        result = fold(mod)
    tvm.ir.assert_structural_equal(result, mod)
    (decision,) = fold.report
    assert decision.action == "kept"
    assert re.search(reason, decision.reason), decision.reason
    assert decision.reason in caplog.text


def test_fold_batchnorm_keeps_a_conv_whose_output_has_another_user():
    """main returns the conv output too: folding would change it."""
    x = relax.Var("x", TensorType((2, 4, 5, 5), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(R.nn.conv2d(x, relax.const(np.ones((4, 4, 3, 3), "float32")), padding=1))
            stats = [relax.const(np.full(4, v, "float32")) for v in (1, 0, 0, 1)]
            bn = bb.emit(R.nn.batch_norm(conv, *stats, axis=1, training=False))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(bn, 0), conv]))
        bb.emit_func_output(out)
    mod = bb.get()
    fold = FoldBatchNorm()
    tvm.ir.assert_structural_equal(fold(mod), mod)
    assert fold.report[0].action == "kept" and "2 users" in fold.report[0].reason


# -- FuseReductions on single operators -------------------------------------------------------
class Loss(nn.Module):
    def __init__(self, weight, **options):
        super().__init__()
        self.options = options
        self.register_buffer("weight", weight)

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, weight=self.weight, **self.options)


# Why: every reduction, with and without weight and smoothing, and an ignore_index
# that is not the default (the importer used to drop positional options).
CE_CASES = [
    ("mean", False, 0.0, -100),
    ("sum", True, 0.1, 3),
    ("none", True, 0.2, -100),
    ("mean", True, 0.1, 3),
]


@pytest.mark.parametrize("reduction, weighted, smoothing, ignore_index", CE_CASES)
def test_cross_entropy_options_against_float64(reduction, weighted, smoothing, ignore_index):
    gen = rng()
    logits = gen.standard_normal((7, 11)).astype(np.float32) * 3
    target = gen.integers(0, 11, 7)
    target[[1, 4]] = ignore_index
    weight = (gen.random(11) + 0.1).astype(np.float32) if weighted else None
    module = Loss(None if weight is None else torch.from_numpy(weight), reduction=reduction,
                  ignore_index=ignore_index, label_smoothing=smoothing)
    program = torch.export.export(module, (torch.from_numpy(logits), torch.from_numpy(target)))
    fuse = FuseReductions("llvm")
    mod = fuse(import_exported(program).mod)
    assert count_ops(mod)["tvm_fusion.cross_entropy"] == 1 and count_ops(mod)["relax.nn.nll_loss"] == 0
    expected = ce_ref.reference(logits, target, weight, ignore_index, reduction, smoothing)
    assert_close(run_module(mod, logits, target)[0], expected, 2e-5, 2e-5, "loss")


def test_cross_entropy_decomposed_by_torch_is_reported():
    """TVM's importer by default lets torch decompose the loss: we say so, not fuse it."""
    from tvm.relax.frontend.torch import from_exported_program

    logits, target = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    mod = from_exported_program(torch.export.export(Loss(None), (logits, target)))
    fuse = FuseReductions("llvm")
    tvm.ir.assert_structural_equal(fuse(mod), mod)
    assert "decomposed by torch.export" in fuse.report[0].reason, fuse.report


def f32(value: float) -> relax.Expr:
    return relax.prim_value(tvm.tirx.FloatImm("float32", value))


def with_logits_graph(predictions, labels, classes=6, batch=5):
    """main(x, t) = cross_entropy_with_logits(predictions(x), labels(t))."""
    x = relax.Var("x", TensorType((batch, classes), "float32"))
    t = relax.Var("t", TensorType((batch,), "int64"))
    soft = relax.Var("soft", TensorType((batch, classes), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, t, soft]):
        with bb.dataflow():
            loss = bb.emit(R.nn.cross_entropy_with_logits(bb.emit(predictions(x)), bb.emit(labels(t, soft))))
            out = bb.emit_output(loss)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_with_logits_of_log_softmax_and_one_hot_is_fused(smoothing):
    classes = 6
    on, off = 1 - smoothing + smoothing / classes, smoothing / classes
    mod = with_logits_graph(lambda x: R.nn.log_softmax(x), lambda t, _: R.one_hot(t, f32(on), f32(off), classes))
    fuse = FuseReductions("llvm")
    fused = fuse(mod)
    assert count_ops(fused)["tvm_fusion.cross_entropy"] == 1, fuse.report
    gen = rng()
    logits = gen.standard_normal((5, classes)).astype(np.float32)
    target = gen.integers(0, classes, 5)
    soft = np.zeros((5, classes), np.float32)
    expected = ce_ref.reference(logits, target, label_smoothing=smoothing)
    assert_close(run_module(fused, logits, target, soft)[0], expected, 2e-5, 2e-5, "loss")
    assert_close(run_module(mod, logits, target, soft)[0], expected, 2e-5, 2e-5, "TVM's own meaning")


@pytest.mark.parametrize(
    "predictions, labels, reason",
    [
        (lambda x: x, lambda t, _: R.one_hot(t, f32(1.0), f32(0.0), 6), "predictions are not log_softmax"),
        (lambda x: R.nn.log_softmax(x), lambda t, soft: R.nn.softmax(soft), "labels are soft"),
        (lambda x: R.nn.log_softmax(x), lambda t, _: R.one_hot(t, f32(1.0), f32(0.5), 6), "rows sum to 3.5"),
    ],
    ids=["raw_logits", "soft_labels", "not_a_distribution"],
)
def test_cross_entropy_with_logits_kept_when_not_equivalent(predictions, labels, reason):
    mod = with_logits_graph(predictions, labels)
    fuse = FuseReductions("llvm")
    tvm.ir.assert_structural_equal(fuse(mod), mod)
    (decision,) = fuse.report
    assert decision.action == "kept" and reason in decision.reason, decision.reason


def test_nll_loss_of_anything_but_log_softmax_is_kept():
    """nll_loss alone is a gather: with no log_softmax there is no log-sum-exp to fuse."""
    logp = relax.Var("logp", TensorType((5, 6), "float32"))
    t = relax.Var("t", TensorType((5,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [logp, t]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.nll_loss(logp, t))
        bb.emit_func_output(out)
    mod = bb.get()
    fuse = FuseReductions("llvm")
    tvm.ir.assert_structural_equal(fuse(mod), mod)
    assert "not log_softmax" in fuse.report[0].reason


def training_bn_module(shape, axis=1, dtype="float32", stats=None, eps=1e-5, momentum=0.1):
    """main(x) = batch_norm(x, gamma, beta, rm, rv, training=True), all three outputs."""
    ones, zeros = np.ones(shape[axis], dtype), np.zeros(shape[axis], dtype)
    data = relax.Var("x", TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [data]):
        with bb.dataflow():
            consts = [relax.const(v) for v in (stats or (ones, zeros, zeros, ones))]
            bn = R.nn.batch_norm(data, *consts, axis=axis, epsilon=eps, momentum=momentum, training=True)
            out = bb.emit_output(bn)
        bb.emit_func_output(out)
    return bb.get()


# Why: NCHW (the (N, C, L) view), NHWC float16 (axis 3: the (M, C) view and casts),
# BN1d on (N, C) and a (N, C, L) input whose L is odd.
BN_CASES = [
    ((3, 4, 5, 6), 1, "float32"),
    ((2, 5, 3, 4), 3, "float16"),
    ((6, 5), 1, "float32"),
    ((2, 3, 7), 1, "float32"),
]


@pytest.mark.parametrize("shape, axis, dtype", BN_CASES)
def test_training_batch_norm_against_float64(shape, axis, dtype):
    gen = rng()
    channels = shape[axis]
    x = (gen.standard_normal(shape) * 2 + 0.5).astype(dtype)
    gamma, beta, rm = (gen.standard_normal(channels).astype(dtype) for _ in range(3))
    rv = (gen.random(channels) + 0.5).astype(dtype)
    eps, momentum = 1e-3, 0.3
    fuse = FuseReductions("llvm")
    mod = fuse(training_bn_module(shape, axis, dtype, (gamma, beta, rm, rv), eps, momentum))
    assert count_ops(mod)["tvm_fusion.bn_stats"] == 1 and count_ops(mod)["relax.nn.batch_norm"] == 0
    y, new_mean, new_var = run_module(mod, x)

    axes = tuple(i for i in range(len(shape)) if i != axis)
    per_channel = [channels if i == axis else 1 for i in range(len(shape))]
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=axes), x64.var(axis=axes)
    count = x.size // channels
    expected_y = (x64 - mean.reshape(per_channel)) / np.sqrt(var.reshape(per_channel) + eps)
    expected_y = expected_y * gamma.reshape(per_channel) + beta.reshape(per_channel)
    tol = 1e-5 if dtype == "float32" else 2e-3  # float16: the output's own rounding
    assert_close(y, expected_y, tol, tol, "y")
    assert_close(new_mean, (1 - momentum) * rm + momentum * mean, tol, tol, "running_mean")
    unbiased = var * count / (count - 1)
    assert_close(new_var, (1 - momentum) * rv + momentum * unbiased, tol, tol, "running_var")


def test_training_batch_norm_with_one_value_per_channel_is_kept():
    mod = training_bn_module((1, 4))
    fuse = FuseReductions("llvm")
    tvm.ir.assert_structural_equal(fuse(mod), mod)
    assert "one value per channel" in fuse.report[0].reason


def test_log_dir_tuning_record_wins_over_the_heuristic(tmp_path):
    """A record (here: non-default knobs) in log_dir/<target key>/ is the kernel used."""
    from tvm.s_tir import meta_schedule as ms

    problem = tf.make_problem("bn_stats", (4, 8, 64), "float32")
    candidate = tf.registry.default_candidate(problem, CPU)
    knobs = next(k for k in candidate.all_configs(problem, CPU) if k != candidate.default_for(problem, CPU))
    sch, _ = schedule_for(problem, CPU, candidate.name, knobs)
    database = records.json_database(records.folder(tmp_path, CPU))
    workload = database.commit_workload(tvm.IRModule({"main": prim_func(problem, candidate.algorithm)}))
    database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-5], CPU))

    fuse = FuseReductions(CPU, log_dir=tmp_path)
    mod = fuse(training_bn_module((4, 8, 8, 8)))
    (decision,) = fuse.report
    assert f"[{knobs}] (record)" in decision.reason, decision.reason
    (kernel,) = [f for f in mod.functions.values() if "tvm_fusion.op" in (f.attrs or {})]
    assert tvm_ffi.structural_equal(kernel.body, sch.mod["main"].body)
    with pytest.raises(ValueError, match="log_dir"):
        FuseReductions(CPU, log_dir=tmp_path / "missing")


# -- the CLI ----------------------------------------------------------------------------------
def run_cli(argv):
    from tvm_fusion.relax.cli import add_subcommand

    parser = argparse.ArgumentParser(prog="tvm-fusion")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prints_the_report_and_counts(tmp_path, capsys):
    model, inputs = M.small_resnet(), M.example_inputs()
    path = tmp_path / "model.pt2"
    torch.export.save(M.export(model, inputs, "eval"), path)
    assert run_cli(["relax", str(path), "--target", "llvm", "--mode", "eval"]) == 0
    out = capsys.readouterr().out
    assert out.count(": folded: ") == 4
    assert "relax.nn.batch_norm" in out and "tvm_fusion.cross_entropy" in out


@pytest.mark.parametrize("argv, message", [
    (["relax", "missing.pt2"], "no such file"),
    (["relax", __file__, "--target", "vulkan"], "target must be"),
    (["relax", __file__], "is not a torch.export program"),
])
def test_cli_usage_errors(argv, message):
    from tvm_fusion.cli import UsageError

    with pytest.raises(UsageError, match=message) as err:
        run_cli(argv)
    assert "\n" not in str(err.value)


# -- GPU (run on the GPU host) -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_small_resnet_on_the_gpu_matches_torch_cuda(mode):
    model, inputs = M.small_resnet(width=32, label_smoothing=0.1), M.example_inputs(batch=16, image=16)
    compiled = M.compile_model(model, inputs, "cuda", mode)
    reference = copy.deepcopy(model).cuda().train(mode == "train")
    with torch.no_grad():
        logits, loss = reference(*(t.cuda() for t in inputs))
    out = compiled.run(*inputs)
    assert_close(out[compiled.outputs[0]], logits.cpu().numpy(), 1e-3, 1e-4, "logits")
    assert_close(out[compiled.outputs[1]], loss.cpu().numpy(), 1e-3, 1e-4, "loss")
    state = reference.state_dict()
    for name in compiled.outputs[2:]:
        assert_close(out[name], state[name].cpu().numpy(), 1e-3, 1e-4, name)


@pytest.mark.gpu
def test_measure_times_every_variant_on_the_gpu():
    times = M.measure("cuda", repeat=10)
    assert set(times) == {"eval_folded", "eval_unfolded", "train_fused", "train_tvm", "train_torch_eager"}
    assert all(t > 0 for t in times.values())
    print(times)
