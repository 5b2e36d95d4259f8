"""The training bench's correctness gate (CPU): ``check`` against float64 torch, and the
status a peer's row gets when its result is wrong (timed anyway); the bench's CPU path
end to end on tiny shapes, by itself and as ``tvm-fusion bench --train only --device cpu``."""

import csv

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from tvm_fusion.bench import Case  # noqa: E402
from tvm_fusion.bench_train import OP, check, peer_status  # noqa: E402


def _step(x: "torch.Tensor", t: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    x = x.detach().requires_grad_()
    loss = F.cross_entropy(x, t)
    return loss, torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_passes_torch_in_full_precision(dtype: "torch.dtype") -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(300, 97, generator=gen) * 3).to(dtype)
    target = torch.randint(0, 97, (300,), generator=gen)
    loss, grad = _step(logits, target)
    assert check(Case(OP, (300, 97), "float32"), loss, grad, logits, target) is None


def test_check_names_a_wrong_gradient_and_a_wrong_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=gen)
    target = torch.randint(0, 50, (64,), generator=gen)
    loss, grad = _step(logits, target)
    case = Case(OP, (64, 50), "float32")
    off = grad.clone()
    off[5, int(target[5])] = 0.0  # one target entry lost, as torch's float16 mean over 65536 rows loses them all
    assert check(case, loss, off, logits, target).startswith("wrong: gradient off by")
    assert check(case, loss * 1.01, grad, logits, target).startswith("wrong: loss")


def test_torch_float16_mean_over_65536_rows_is_flagged_and_the_peer_still_timed() -> None:
    # The mean's total weight (65536 rows) overflows float16: torch's gradient loses its
    # target entries. A peer's wrong result keeps its time, its row says what is off.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(65536, 8, generator=gen).half()
    target = torch.randint(0, 8, (65536,), generator=gen)
    loss, grad = _step(logits, target)
    wrong = check(Case(OP, (65536, 8), "float16"), loss, grad, logits, target)
    assert wrong is not None and wrong.startswith("wrong:")
    assert peer_status(wrong) == f"{wrong}; timed anyway (a peer)"
    assert peer_status(None) == "ok"


def test_the_in_place_step_overwrites_non_leaf_logits_and_gives_the_gradient() -> None:
    # tvm_fusion.torch refuses to overwrite a leaf that requires grad (torch's rule); the
    # bench's in-place steps take their logits from a stand-in layer, as training does.
    from tvm_fusion.bench_train import providers

    case = Case(OP, (64, 100), "float32")
    steps = {step.name: step for step in providers(case)}
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 100, generator=gen)
    target = torch.randint(0, 100, (64,), generator=gen)
    for name in ("tvm_fusion.torch", "tvm_fusion.torch (inplace_backward)"):
        given = logits.clone()
        loss, grad = steps[name].run(given, target)
        assert check(case, loss.detach(), grad.detach(), logits, target) is None, name
        assert steps[name].in_place == (not torch.equal(given, logits)), name


# Tiny, so the CPU path runs end to end in seconds: 64x100 as a row of a few vectors,
# 16x37 as an odd V (no vector width divides a row, as GPT-2's 50257).
TINY = [Case(OP, (64, 100), "float32"), Case(OP, (16, 37), "float32")]
CPU_PROVIDERS = {"tvm_fusion.torch", "tvm_fusion.torch (check_targets=False)", "tvm_fusion.torch (inplace_backward)",
                 "torch eager"}


def read_rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_cpu_bench_checks_and_times_every_provider_and_writes_the_csv(tmp_path) -> None:
    from tvm_fusion import bench
    from tvm_fusion.bench_train import FLOOR, run

    path = tmp_path / "benchmarks.csv"
    results = run(TINY, str(path), log=lambda *_: None, copy_gb_s=10.0, device="cpu")
    for case in TINY:
        rows = {r.provider: r for r in results if r.case == case}
        assert CPU_PROVIDERS | {FLOOR, "tvm_fusion (default)"} <= set(rows), case
        assert any(name.startswith("tvm_fusion:") for name in rows), case  # a CPU candidate's kernel alone
        assert not {"torch.compile", "Liger (grad in forward)", "Quack"} & set(rows), case  # GPU-only peers
        for r in rows.values():
            assert r.status == "ok" and r.median_ms > 0, (r.provider, r.status)
            assert r.method == "copy bandwidth" or "perf_counter" in r.method, (r.provider, r.method)
    written = read_rows(path)
    assert [(r["provider"], r["shape"]) for r in written] == [
        (r.provider, "x".join(map(str, r.case.shape))) for r in results]
    assert {r["hardware"] for r in written} == {bench.hardware_name(False)}
    assert all(r["op"] == OP and r["status"] == "ok" and float(r["median_ms"]) > 0 for r in written)


def test_cli_train_only_runs_both_training_benches_on_the_cpu(tmp_path, monkeypatch) -> None:
    # The CLI's wiring, with the CPU lists cut to tiny shapes and the copy ceiling given
    # (numpy's 512 MiB copy would dominate the test).
    from tvm_fusion import bench_bn, bench_train, cli, timing

    monkeypatch.setattr(bench_train, "CPU_TRAIN_CASES", TINY[1:])
    monkeypatch.setattr(bench_bn, "CPU_SHAPES", [((2, 4, 3, 3), "float32", "NCHW")])
    monkeypatch.setattr(bench_bn, "CPU_RESNET", {"width": 4, "num_classes": 5, "batch": 2, "image": 4})
    monkeypatch.setattr(timing, "copy_bandwidth_cpu", lambda: 10.0)
    assert cli.main(["bench", "--device", "cpu", "--train", "only", "--results", str(tmp_path)]) == 0
    written = read_rows(tmp_path / "benchmarks.csv")
    assert {r["op"] for r in written} == {OP, bench_bn.FORWARD, bench_bn.TRAIN, bench_bn.STEP}
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in written)
